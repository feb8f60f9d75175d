"""Issue 25 (faults round three), the training command's part: output paths that collide, flag
combinations that used to raise deep inside, thread variables MXNet aborts on, and SIGTERM/SIGHUP
ending a run with one line and a kept checkpoint."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from manual_dp import checkpoint
from manual_dp.fast.runtime import environment_problem
from conftest import run_main

TINY = ["--train-size", "100", "--test-size", "64", "--batch-size", "32", "--no-progress", "--epochs", "1"]


def run(capsys, argv):
    code, _, lines = run_main(capsys, argv)
    return code, lines


@pytest.mark.parametrize("argv,message", [
    (["--compress", "2bit", "--bucket-mb", "0.1"], "not with --bucket-mb"),
    (["--compress", "2bit", "--trace", "{t}/trace.json"], "not with --trace"),
    (["--log-json", "{t}/same.json", "--trace", "{t}/same.json"], "--trace {t}/same.json is also --log-json's file"),
    (["--checkpoint-dir", "{t}/ck", "--trace", "{t}/ck/checkpoint.npz"], "would overwrite the checkpoint's own files"),
    (["--checkpoint-dir", "{t}/ck", "--trace", "{t}/ck/.lock"], "would overwrite the checkpoint's own files"),
])
def test_collisions_and_combinations_end_in_one_line(capsys, data_dir, tmp_path, argv, message):
    argv = [a.format(t=tmp_path) for a in argv]
    code, lines = run(capsys, ["--data-dir", str(data_dir), *TINY, *argv])
    assert code == 2 and len(lines) == 1 and message.format(t=tmp_path) in lines[0], lines
    assert not (tmp_path / "ck" / "checkpoint.npz").exists()


@pytest.mark.parametrize("name,value", [("OMP_NUM_THREADS", "abc"), ("MXNET_CPU_TEMP_COPY", "abc"),
                                        ("OPENBLAS_NUM_THREADS", "0"), ("OMP_NUM_THREADS", "-2"),
                                        ("OMP_NUM_THREADS", "100000")])
def test_thread_variables_mxnet_would_abort_on_are_refused(name, value):
    assert name in environment_problem({name: value})
    assert environment_problem({name: "4"}) is None and environment_problem({}) is None


@pytest.mark.parametrize("env,problem", [
    ({"MXNET_ENGINE_TYPE": "ThreadedEnginePooled"}, "names no engine of MXNet"),
    ({"MXNET_EXEC_BULK_EXEC_INFERENCE": "yes"}, "must be 0, 1, true or false"),
    ({"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "127.0.0.1"}, "DMLC_PS_ROOT_PORT, DMLC_NUM_WORKER, DMLC_NUM_SERVER are unset"),
    ({"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "h", "DMLC_PS_ROOT_PORT": "9", "DMLC_NUM_WORKER": "two",
      "DMLC_NUM_SERVER": "1"}, "DMLC_NUM_WORKER='two' must be a whole number"),
])
def test_engine_and_role_variables_mxnet_would_fail_on_are_refused(env, problem):
    assert problem in environment_problem(env)


@pytest.mark.parametrize("env", [{"MXNET_ENGINE_TYPE": "NaiveEngine", "MXNET_EXEC_BULK_EXEC_TRAIN": "False"},
                                 {"DMLC_ROLE": "worker"},
                                 {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "h", "DMLC_PS_ROOT_PORT": "9",
                                  "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1"}])   # as the launcher gives it
def test_engine_and_role_variables_that_work_pass(env):
    assert environment_problem(env) is None


@pytest.mark.parametrize("command", [["manual_dp.train"], ["manual_dp.plan", "--devices", "2", "--memory-per-device", "1G"]])
def test_a_bad_thread_variable_ends_each_command_with_one_line(data_dir, command):
    env = dict(os.environ, OMP_NUM_THREADS="abc")
    done = subprocess.run([sys.executable, "-m", *command], env=env, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "OMP_NUM_THREADS='abc'" in lines[0], done.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_end_a_run_with_one_line_and_the_checkpoint_kept(data_dir, tmp_path, sig):
    ck = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "manual_dp.train", "--data-dir", str(data_dir), "--cpus", "1",
                             "--train-size", "600", "--batch-size", "16", "--epochs", "200", "--no-progress",
                             "--checkpoint-dir", str(ck)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (ck / checkpoint.NAME).exists() and time.monotonic() < deadline:   # an epoch is saved
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    lines = [l for l in err.strip().splitlines() if not l.startswith("[")]    # MXNet's own log lines start with [
    assert proc.returncode == 128 + sig and lines == [f"manual_dp.train: error: stopped by {sig.name}"], (proc.returncode, err)
    checkpoint.load(ck)                                        # whole and readable
    assert not list(ck.glob(checkpoint.TMP_PREFIX + "*"))


# Local SGD across processes resumes exactly (item 1) -----------------------------------------------

from jobs import launch_cmd, read_log, run_job   # noqa: E402  (the multi-process helpers)


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_local_sgd_across_processes_resumes_to_the_uninterrupted_bits(data_dir, tmp_path, optimizer):
    """2 dist_sync workers, local SGD H=3 (epochs end between syncs): 2 epochs straight against 1
    epoch, a checkpoint and --resume. Each process's inner optimiser state and replica are saved."""
    common = ["--cpus", 1, "--data-dir", data_dir, "--train-size", 320, "--test-size", 64, "--batch-size", 32,
              "--mode", "local", "--sync-every", 3, "--optimizer", optimizer]
    straight = tmp_path / "straight.jsonl"
    code, out = run_job(launch_cmd(2, "dist_sync", *common, "--epochs", 2, "--log-json", straight,
                                   "--checkpoint-dir", tmp_path / "ck_a"), tmp_path / "a.txt")
    assert code == 0, out
    resumed, ck = tmp_path / "resumed.jsonl", tmp_path / "ck_b"
    for epochs in (1, 2):
        code, out = run_job(launch_cmd(2, "dist_sync", *common, "--epochs", epochs, "--log-json", resumed,
                                       "--checkpoint-dir", ck, "--resume"), tmp_path / f"b{epochs}.txt")
        assert code == 0, out
    keys = ("train_loss", "train_acc", "test_acc")
    assert [[r[k] for k in keys] for r in read_log(straight)] == [[r[k] for k in keys] for r in read_log(resumed)]
    code, out = run_job(launch_cmd(3, "dist_sync", *common, "--epochs", 3, "--checkpoint-dir", ck, "--resume"),
                        tmp_path / "c.txt")
    assert code != 0 and "resume it with 2, not 3" in out, out


# A job's processes agree on their settings (item 3) -------------------------------------------------

from manual_dp.multiprocess.agree import PER_PROCESS, settings   # noqa: E402


def per_worker(flag, first, second, *argv):
    """A command for the launcher whose worker 0 passes `flag first` and every other `flag second`."""
    cmd = " ".join(map(str, [sys.executable, "-m", "manual_dp.train", "--no-progress", "--backend", "dist_sync", *argv]))
    return [sys.executable, "-m", "manual_dp.launch", "--workers", "2", "--", "bash", "-c",
            f'if [ "$MANUAL_DP_WORKER" = "worker 0" ]; then v={first}; else v={second}; fi; exec {cmd} {flag} $v']


@pytest.mark.parametrize("flag,first,second", [("--lr", "0.05", "0.1"), ("--epochs", "1", "2")])
def test_workers_with_different_settings_end_the_job_before_training(data_dir, tmp_path, flag, first, second):
    code, out = run_job(per_worker(flag, first, second, "--cpus", 1, "--data-dir", data_dir, *TINY[:6],
                                   "--log-json", tmp_path / "log.jsonl"), tmp_path / "out.txt", timeout=120)
    assert code != 0, out
    # which worker the servers make rank 0 is theirs to choose: the other names both values
    mine, theirs = re.search(rf"rank 1 runs with other settings than rank 0: {flag} (\S+) here, (\S+) on rank 0", out).groups()
    assert {mine, theirs} == {first, second}, out
    assert "rank(s) 1 of 2 run with other settings" in out and "epoch 1/" not in out, out
    assert not (tmp_path / "log.jsonl").exists()


def test_what_may_differ_per_process_is_only_paths_and_the_terminal():
    from manual_dp.config import RunConfig
    cfg = RunConfig()
    assert set(settings(cfg)) | set(PER_PROCESS) == set(vars(cfg))
    assert {"lr", "epochs", "model", "mode", "optimizer", "seed", "batch_size", "cpus"} <= set(settings(cfg))


# Small refusals of issue 25, items 6-8: one row a case, extend it -------------------------------------

CASES = [   # (command, expected exit status, expected text in the output)
    (["manual_dp.plan", "--devices", "100000", "--memory-per-device", "1G", "--batch-size", "1000000"], 2,
     "--devices 100000: the planner lays out at most 4,096"),
    (["manual_dp.plan", "--devices", "4", "--memory-per-device", "1G", "--batch-size", "1" + "0" * 9], 2,
     "the planner lays out at most"),
    (["manual_dp.plan", "--devices", "4", "--memory-per-device", "1G", "--top", "5"], 2,
     "--top and --steps choose what --verify runs: add --verify"),
    (["manual_dp.launch", "--help"], 0, "usage: python -m manual_dp.launch [options] -- COMMAND..."),
    (["manual_dp.launch", "--grace", "1e-9", "--", "true"], 2, "at least 0.5"),
    (["manual_dp.timeline", "trace.json", "-o", "NAME"], 2, "the drawing is a PNG, name it NAME.png"),
    (["manual_dp.plan", "--devices", "2", "--memory-per-device", "1G", "--verify", "--plot", "missing/dir/p.png"], 2,
     "--plot missing/dir/p.png: cannot write in missing/dir"),
    (["manual_dp.bench", "--tiny", "--timeout", "0"], 2, "--timeout must be a positive number of seconds"),
    (["manual_dp.bench", "--memory", "--out", "trace.json"], 2, "--out trace.json is a file, not a directory"),
    (["manual_dp.bench", "--width", "2"], 2, "--width applies only with --memory"),
    (["manual_dp.bench", "--local-sgd", "--compress"], 2, "--local-sgd and --compress are separate runs"),
    (["manual_dp.bench", "--tiny", "--only", "train", "--data-dir", "missing"], 2, "--data-dir missing: no such directory"),
    (["manual_dp.bench", "--wait-for-cores", "100"], 2, "--wait-for-cores 100.0: this machine has"),
    # the sweep of issue 25's case kinds (item 4): tracebacks and a hang it found
    (["manual_dp.bench.stages", "--micro-batches", "0"], 2, "argument --micro-batches: invalid positive value: '0'"),
    (["manual_dp.bench.tensor", "--widths", "0"], 2, "argument --widths: invalid positive value: '0'"),
    (["manual_dp.bench.tensor", "--contexts", "3"], 2, "--contexts must be even (tensor groups of 2), got 3"),
    (["manual_dp.bench.zero_memory", "--width", "-1"], 2, "argument --width: invalid positive value: '-1'"),
    (["manual_dp.bench.kvstore_compress", "--workers", "0"], 2, "unrecognized arguments: --workers 0"),
    (["manual_dp.train", "--cpus", "1"], 2, "MANUAL_DP_CONV_PAD='100000' must be a whole number from 1 to 64",
     {"MANUAL_DP_CONV_PAD": "100000"}),
    (["manual_dp.train"], 2, "DMLC_ROLE='server' makes this process a parameter server's server, but "
     "DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, DMLC_NUM_WORKER, DMLC_NUM_SERVER are unset", {"DMLC_ROLE": "server"}),
    (["manual_dp.train"], 2, "MXNET_ENGINE_TYPE='Bogus' names no engine of MXNet", {"MXNET_ENGINE_TYPE": "Bogus"}),
    (["manual_dp.train"], 2, "MXNET_EXEC_BULK_EXEC_TRAIN='x' must be 0, 1, true or false",
     {"MXNET_EXEC_BULK_EXEC_TRAIN": "x"}),
    (["manual_dp.plan", "--devices", "2", "--memory-per-device", "1G"], 2,
     "OMP_NUM_THREADS='100000' must be a whole number from 1 to 1024", {"OMP_NUM_THREADS": "100000"}),
]


@pytest.mark.parametrize("argv,code,text,env", [c if len(c) == 4 else (*c, {}) for c in CASES],
                         ids=[" ".join(c[0][:2]) + f" {i}" for i, c in enumerate(CASES)])
def test_case_table(data_dir, tmp_path, argv, code, text, env):
    (tmp_path / "trace.json").write_text("{}")
    argv = argv + ["--data-dir", str(data_dir), *TINY] if argv[0] == "manual_dp.train" else argv
    done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=dict(os.environ, **env))
    assert done.returncode == code and text in done.stdout + done.stderr, (done.returncode, done.stdout, done.stderr)
    if code:
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_hosts_files_with_a_byte_order_mark_or_mpi_slots(tmp_path):
    from manual_dp.errors import UsageError
    from manual_dp.multiprocess.launcher import read_hosts
    (tmp_path / "bom").write_bytes("\ufeff127.0.0.1\n127.0.0.2 # second\n".encode("utf-8"))
    assert read_hosts(tmp_path / "bom") == ["127.0.0.1", "127.0.0.2"]
    (tmp_path / "slots").write_text("127.0.0.1 slots=2\n")
    with pytest.raises(UsageError, match="a line names one host, not '127.0.0.1 slots=2'"):
        read_hosts(tmp_path / "slots")


def test_local_sgd_divergence_names_the_outer_lr(capsys, data_dir):
    code, lines = run(capsys, ["--data-dir", str(data_dir), *TINY, "--mode", "local", "--outer-lr", "1e30", "--sync-every", "1", "--cpus", "2"])
    assert code == 3 and len(lines) == 1 and "or --outer-lr than 1e+30" in lines[0], lines


@pytest.mark.parametrize("command", [["manual_dp.plan", "--devices", "2", "--memory-per-device", "1G", "--verify",
                                      "--steps", "50"],
                                     ["manual_dp.bench", "--tiny", "--only", "train"]], ids=["plan --verify", "bench"])
def test_ctrl_c_in_a_long_command_is_one_line_and_130(tmp_path, command):
    proc = subprocess.Popen([sys.executable, "-m", *command, *(["--out", str(tmp_path)] if "bench" in command[0] else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    time.sleep(8)                                   # past the start-up, inside the measurements
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    lines = [l for l in err.strip().splitlines() if not l.startswith("[")]
    assert proc.returncode == 130 and lines == [f"{command[0]}: error: interrupted"], (proc.returncode, err)

