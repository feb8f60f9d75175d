"""--digests and `python -m manual_dp.diverge` (issue 24, items 2 and 3): a digest line per update
for every layout, exact after a kill -9 and a resume, and diverge's verdicts and exit codes on
hand-made files and on real runs."""
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import run_main
from jobs import Job, run_job, train_cmd
from manual_dp.config import RunConfig
from manual_dp.digests import DigestFile, config_of, header, read_header, read_lines, record, summary
from manual_dp.diverge import compare

PYTHON = sys.executable


def diverge(*paths):
    done = subprocess.run([PYTHON, "-m", "manual_dp.diverge", *map(str, paths)], capture_output=True, text=True,
                          timeout=60)
    return done.returncode, done.stdout, done.stderr


def fake(path, updates, differ_at=None, tensor=None, names=("W1", "b1", "W2", "b2"), torn=False):
    """A digest file of `updates` updates of a made-up model; from update `differ_at` on, the
    tensor `tensor` (kind, name) holds other values."""
    lines = []
    for t in range(1, updates + 1):
        rng = np.random.default_rng(t)
        grads = [rng.standard_normal(3).astype(np.float32) for _ in names]
        state = {"params": [rng.standard_normal(3).astype(np.float32) for _ in names],
                 "opt_state": [[rng.standard_normal(3).astype(np.float32)] for _ in names]}
        r = record(t, list(names), [(3,)] * len(names), grads, state)
        if differ_at and t >= differ_at:
            i = next(k for k, x in enumerate(r["tensors"]) if tuple(x[:2]) == tensor)
            r["tensors"][i] = summary(tensor[0], tensor[1], np.arange(3, dtype=np.float32) + 0.5)
        lines.append(json.dumps(r))
    text = "\n".join(lines) + "\n" + ('{"update": 99, "tens' if torn else "")
    path.write_text(text)
    return path


def test_a_record_lists_gradients_last_layer_first_then_each_parameter_and_its_state():
    r = record(5, ["W1", "b1"], [(2,), (1,)], [np.ones(3)], {"params": [np.ones(2), np.ones(1)],
                                                              "opt_state": [[np.zeros(2)], [np.zeros(1)]]})
    assert r["update"] == 5 and [tuple(x[:2]) for x in r["tensors"]] == [
        ("grad", "b1"), ("grad", "W1"), ("param", "W1"), ("state0", "W1"), ("param", "b1"), ("state0", "b1")]
    assert r["tensors"][0][3:] == [1.0, 1.0] and r["tensors"][1][4] == pytest.approx(np.sqrt(2))
    with pytest.raises(ValueError, match="reduced gradient holds 2 values, the model 3"):
        record(1, ["W1", "b1"], [(2,), (1,)], [np.ones(2)], {"params": [], "opt_state": []})


def test_the_header_says_how_the_run_was_made_and_readers_skip_it(tmp_path):
    cfg = RunConfig(cpus=2, mode="pipeline", stages=2, micro_batches=4, seed=3, lr=0.1, log_json="x.json")
    head = header(cfg, processes=1)
    assert {"cpus": 2, "mode": "pipeline", "stages": 2, "micro_batches": 4, "seed": 3, "lr": 0.1,
            "processes": 1}.items() <= head["run"].items() and "log_json" not in head["run"]
    assert config_of(head["run"]) == RunConfig(cpus=2, mode="pipeline", stages=2, micro_batches=4, seed=3, lr=0.1)
    path = tmp_path / "d.jsonl"
    out = DigestFile(path, head).resume(0)
    out.write(record(1, ["W"], [(2,)], [np.ones(2)], {"params": [np.ones(2)], "opt_state": [[]]}))
    out.close()
    assert read_header(path) == head["run"] and [r["update"] for r in read_lines(path)] == [1]
    DigestFile(path, head).resume(1).close()        # a resume keeps the header and update 1
    assert read_header(path) == head["run"] and len(read_lines(path)) == 1
    assert read_header(fake(tmp_path / "old", 2)) is None and len(read_lines(tmp_path / "old")) == 2


def test_diverge_identical_files_exit_0(tmp_path):
    a, b = fake(tmp_path / "a", 4), fake(tmp_path / "b", 6)
    code, out, _ = diverge(a, b)
    assert code == 0 and "identical: 4 updates in common" in out and "B 2 more" in out


@pytest.mark.parametrize("update, tensor", [(1, ("grad", "b2")), (3, ("grad", "W1")), (2, ("state0", "b1"))])
def test_diverge_names_the_first_update_and_tensor_that_differ(tmp_path, update, tensor):
    a, b = fake(tmp_path / "a", 4), fake(tmp_path / "b", 4, update, tensor)
    code, out, _ = diverge(a, b)
    assert code == 1 and f"part at update {update}: {tensor[0]} {tensor[1]} is the first tensor" in out, out


def test_diverge_refuses_other_tensors_missing_and_malformed_files_with_exit_2(tmp_path):
    a = fake(tmp_path / "a", 3)
    cases = [(fake(tmp_path / "b", 3, names=("W1", "b1", "W3", "b3")), "hold different tensors"),
             (tmp_path / "missing", "cannot read"),
             (fake(tmp_path / "c", 0), "no update in common")]
    garbage = tmp_path / "g"
    garbage.write_text(a.read_text().replace('{"update": 2', 'nonsense {"update": 2', 1))
    cases.append((garbage, "line 2 is not a digest record"))
    for b, message in cases:
        code, out, err = diverge(a, b)
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, (b, out, err)


def test_diverge_drops_a_torn_last_line_and_says_so(tmp_path):
    a, b = fake(tmp_path / "a", 3), fake(tmp_path / "b", 3, torn=True)
    assert len(read_lines(b)) == 3
    code, out, _ = diverge(a, b)
    assert code == 0 and "its last line is torn" in out


def test_compare_on_records_directly():
    a = [record(1, ["W"], [(2,)], [np.ones(2)], {"params": [np.ones(2)], "opt_state": [[]]})]
    b = [record(1, ["W"], [(2,)], [np.ones(2) * 1.0000001], {"params": [np.ones(2)], "opt_state": [[]]})]
    status, message = compare(a, b)
    assert status == 1 and "grad W" in message


TINY = ["--train-size", "256", "--test-size", "64", "--batch-size", "32", "--epochs", "1"]


@pytest.mark.parametrize("mode", [[], ["--mode", "zero", "--zero-stage", "3"], ["--mode", "pipeline"],
                                  ["--mode", "hybrid", "--cpus", "4"], ["--mode", "tensor"], ["--mode", "model"],
                                  ["--mode", "sync", "--grad-accum", "2"], ["--mode", "local"], ["--mode", "async"]],
                         ids=["sync", "zero3", "pipeline", "hybrid", "tensor", "model", "accum", "local", "async"])
def test_every_mode_writes_a_line_per_update(capsys, data_dir, tmp_path, mode):
    path = tmp_path / "d.jsonl"
    argv = ["--data-dir", str(data_dir), *TINY, "--digests", str(path), "--no-progress", *mode]
    if "--cpus" not in mode:
        argv += ["--cpus", "2"]
    code, out, err = run_main(capsys, argv)
    assert code == 0, err
    lines = read_lines(path)
    updates = 256 // 32 // (2 if "--grad-accum" in mode else 1)
    assert [r["update"] for r in lines] == list(range(1, updates + 1))
    kinds = {x[0] for x in lines[0]["tensors"]}
    assert ("grad" in kinds) == (mode[-1:] not in (["local"], ["async"])) and "param" in kinds and "state0" in kinds


def test_runs_with_and_without_deterministic_part_at_update_1_at_a_gradient(capsys, data_dir, tmp_path):
    paths = {}
    for name, extra in (("det1", ["--cpus", "1", "--deterministic"]), ("det2", ["--cpus", "2", "--deterministic"]),
                        ("fast2", ["--cpus", "2"])):
        paths[name] = tmp_path / f"{name}.jsonl"
        code, _, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--digests", str(paths[name]), *extra])
        assert code == 0, err
    code, out, _ = diverge(paths["det1"], paths["det2"])
    assert code == 0 and "identical: 8 updates" in out
    code, out, _ = diverge(paths["det1"], paths["fast2"])
    assert code == 1 and "part at update 1: grad" in out


def test_an_output_path_taken_twice_is_refused(capsys, data_dir, tmp_path):
    log = tmp_path / "x"
    code, _, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--digests", str(log), "--log-json", str(log)])
    assert code == 2 and len(err) == 1 and "give each output its own path" in err[0]


def test_after_a_kill_and_a_resume_the_file_equals_an_uninterrupted_runs(data_dir, tmp_path):
    args = ["--data-dir", data_dir, "--train-size", 600, "--test-size", 64, "--batch-size", 4, "--epochs", 2,
            "--cpus", 2]
    code, out = run_job(train_cmd(*args, "--digests", tmp_path / "whole.jsonl"), tmp_path / "whole.txt")
    assert code == 0, out
    per_epoch = len(read_lines(tmp_path / "whole.jsonl")) // 2
    part, ck = tmp_path / "part.jsonl", tmp_path / "ck"
    job = Job(train_cmd(*args, "--digests", part, "--checkpoint-dir", ck), tmp_path / "part.txt")
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and (not part.exists() or part.read_text().count("\n") < per_epoch + 20):
            time.sleep(0.01)                         # into epoch 2
    finally:
        job.kill()
    assert per_epoch < len(read_lines(part)) < 2 * per_epoch    # killed in epoch 2, past its checkpoint
    code, out = run_job(train_cmd(*args, "--digests", part, "--checkpoint-dir", ck, "--resume"), tmp_path / "r.txt")
    assert code == 0 and "resumed" in out, out
    part_head, *part_lines = part.read_text().splitlines()       # the headers differ in --checkpoint-dir only
    whole_head, *whole_lines = (tmp_path / "whole.jsonl").read_text().splitlines()
    assert part_lines == whole_lines and json.loads(part_head)["run"] == dict(
        json.loads(whole_head)["run"], checkpoint_dir=str(ck))
