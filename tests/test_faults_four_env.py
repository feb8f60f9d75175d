"""Issue 41, item 6: environment variables and launcher flags no run can use are refused up front,
with one line and exit 2: a worker thread count of 0 (MXNet hangs), OMP_NUM_THREADS=abc given to
the launcher, MANUAL_DP_CONV_PAD=abc where no cached graph would read it, an ssh client string
with an unbalanced quote."""
import os
import subprocess
import sys

import pytest

from manual_dp.fast.runtime import environment_problem

TINY = ["--train-size", "100", "--test-size", "64", "--batch-size", "32", "--no-progress", "--epochs", "1"]


def command(*argv, **env):
    """(exit status, stdout, stderr lines) of `python -m *argv` with `env` added, in at most 60 s."""
    done = subprocess.run([sys.executable, "-m", *map(str, argv)], env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, done.stderr.strip().splitlines()


@pytest.mark.parametrize("name", ["MXNET_CPU_WORKER_NTHREADS", "MXNET_CPU_PRIORITY_NTHREADS",
                                  "MXNET_GPU_WORKER_NTHREADS", "MXNET_GPU_COPY_NTHREADS"])
def test_a_worker_thread_count_of_zero_is_refused(name):
    assert f"{name}='0' must be a whole number from 1" in (environment_problem({name: "0"}) or "")
    assert environment_problem({name: "2"}) is None


def test_a_bad_conv_pad_is_refused_where_no_cached_graph_reads_it(data_dir):
    code, out, err = command("manual_dp.train", "--data-dir", data_dir, *TINY, "--deterministic", "--mode", "zero",
                             MANUAL_DP_CONV_PAD="abc")
    assert code == 2 and len(err) == 1 and "MANUAL_DP_CONV_PAD='abc' must be a whole number" in err[0], err
    assert "epoch 1" not in out


def test_the_launcher_refuses_a_thread_variable_its_processes_would_abort_on(tmp_path):
    code, out, err = command("manual_dp.launch", "--", sys.executable, "-c", f"open({str(tmp_path / 'ran')!r}, 'w')",
                             OMP_NUM_THREADS="abc")
    assert code == 2 and len(err) == 1 and "OMP_NUM_THREADS='abc'" in err[0], err
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("ssh", ["ssh -o 'BatchMode=yes", ""])
def test_the_launcher_refuses_an_ssh_that_is_no_command_line(tmp_path, ssh):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\n")
    code, out, err = command("manual_dp.launch", "--hosts", hosts, "--ssh", ssh, "--", "true")
    assert code == 2 and len(err) == 1 and f"--ssh {ssh!r} is not a command line" in err[0], err
