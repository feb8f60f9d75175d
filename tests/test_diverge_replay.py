"""`python -m manual_dp.diverge A B --replay` (issue 24, item 3): the capture of every layer's output
and output gradient in row order, checked against one context's forward and an analytic gradient;
then real runs: 1 against 2 contexts, --deterministic on 1 and 2, another --lr, and bad input."""
import json
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest
from mxnet import nd

from jobs import run_job, train_cmd
from manual_dp.models import as_model
from manual_dp.replay.capture import Recorder, assemble, find_rows
from manual_dp.strategies.data.data_parallel import DataParallel

TINY = ["--train-size", 64, "--test-size", 32, "--batch-size", 32, "--epochs", 1]


def diverge(*args):
    done = subprocess.run([sys.executable, "-m", "manual_dp.diverge", *map(str, args)], capture_output=True,
                          text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr


def lenet_step(ctx, rec=None, net=None):
    """A LeNet DataParallel step on a batch of 10 (3 contexts: shards 4, 3, 3); (params, X, y)."""
    net = net or as_model(None)
    params = net.init_params(seed=1)
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((10, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 10).astype(np.float32)
    model = DataParallel(params, ctx, "sgd", graph=False, model=net)
    if rec:
        with rec.capturing():
            model.step(X, y, 0.1)
    else:
        model.step(X, y, 0.1)
    return model.state_dict()["params"], X, y


def test_capture_gives_every_layer_in_row_order_and_leaves_the_step_unchanged():
    net, rec = as_model(None), Recorder()
    ctx, own = [mx.cpu(i) for i in range(3)], net.layers
    with rec.installed(net):
        after, X, y = lenet_step(ctx, rec, net)
    outputs, grads, notes = rec.whole(X, len(net.layers))
    assert notes == [None] * 4 and [o.shape for o in outputs] == [(10, 20, 13, 13), (10, 50, 4, 4), (10, 128), (10, 10)]
    params = net.init_params(seed=1)
    scores = net.forward(nd.array(X), params).asnumpy()
    np.testing.assert_allclose(outputs[3], scores, rtol=1e-5, atol=1e-6)
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(grads[3], p - np.eye(10)[y.astype(int)], rtol=1e-5, atol=1e-6)   # d(loss sum)/d(scores)
    assert all(g is not None and g.shape == o.shape for g, o in zip(grads, outputs))
    assert rec.calls == {0: 3, 1: 3, 2: 3, 3: 3}                # one call per context's shard
    plain, _, _ = lenet_step(ctx)                               # the Taps are identities: the same bits
    assert all(a.tobytes() == b.tobytes() for a, b in zip(after, plain)) and net.layers is own


def test_rows_are_found_by_content_and_pieces_assembled():
    X = np.arange(24, dtype=np.float32).reshape(6, 2, 2)
    assert find_rows(X[2:5], X) == (2, 5) and find_rows(X[[1, 3]], X) is None
    pieces, rows = [X[3:], X[:3], X[:3] + 100], [(3, 6), (0, 3), (0, 3)]   # a repeated row: the first copy
    assert np.array_equal(assemble(pieces, rows, 6), X)
    assert assemble([X[:3]], [(0, 3)], 6) is None and assemble([None], [(0, 6)], 6) is None


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir):
    """Digest files of tiny LeNet runs (2 updates each), made by the command line."""
    out = tmp_path_factory.mktemp("runs")
    for name, extra in (("one", ["--cpus", 1]), ("two", ["--cpus", 2]), ("det1", ["--cpus", 1, "--deterministic"]),
                        ("det2", ["--cpus", 2, "--deterministic"]), ("lr", ["--cpus", 1, "--lr", 0.2]),
                        ("ck", ["--cpus", 1, "--deterministic", "--checkpoint-dir", out / "ck"]),
                        ("det2x2", ["--cpus", 2, "--deterministic", "--epochs", 2])):
        code, text = run_job(train_cmd("--data-dir", data_dir, *TINY, *extra, "--digests", out / f"{name}.jsonl"),
                             out / f"{name}.txt")
        assert code == 0, text
    return out


def test_one_against_two_contexts_replay_names_the_first_layer_that_differs(runs):
    code, out, _ = diverge(runs / "one.jsonl", runs / "two.jsonl")
    assert code == 1 and "part at update 1: grad" in out
    code, out, err = diverge(runs / "one.jsonl", runs / "two.jsonl", "--replay")
    lines = out.strip().splitlines()
    assert code == 1, (out, err)
    assert lines[0] == "replaying update 1 (32 rows) from the initial parameters"
    assert "A (--mode sync, 1 cpus): the replayed update gives the run's digests" in lines
    assert "B (--mode sync, 2 cpus): the replayed update gives the run's digests" in lines
    assert "cached graph runs the layers as one symbol" in out         # LeNet's graph: captured with --no-graph
    verdict = lines[-1]
    assert "the runs part at update 1 " in verdict, verdict      # where depends on the threads per op
    names = ("conv1", "conv2", "dense1", "dense2")
    assert (" in the forward: " in verdict and any(f"{n}'s output is the first" in verdict for n in names)) or \
        (" in the backward: " in verdict and any(f"gradient of {n}'s output is" in verdict for n in names)) or \
        (" after the backward, in layer " in verdict and ": grad " in verdict), verdict


def test_deterministic_runs_on_one_and_two_contexts_replay_identical(runs):
    code, out, err = diverge(runs / "det1.jsonl", runs / "det2.jsonl", "--replay")
    assert code == 0, (out, err)
    assert out.strip().splitlines()[-1] == ("identical: update 1 replayed in both layouts: every layer output and "
                                            "output gradient compared is identical (8), and every digest of the "
                                            "update equal")


def test_an_update_that_opens_an_epoch_starts_from_as_checkpoint(runs):
    code, out, err = diverge(runs / "ck.jsonl", runs / "det2x2.jsonl", "--replay", "--update", 3)
    assert code == 0, (out, err)
    assert out.startswith(f"replaying update 3 (32 rows) from A's checkpoint in {runs / 'ck'} (epoch 1, update 2)\n")
    assert "A (--mode sync, 1 cpus, --deterministic): the replayed update cannot be checked (its file holds no " \
           "update 3)" in out and "B (--mode sync, 2 cpus, --deterministic): the replayed update gives the run's " \
           "digests" in out and out.strip().splitlines()[-1].startswith("identical: update 3")


def test_another_lr_parts_after_the_backward_at_the_first_parameter(runs):
    code, out, err = diverge(runs / "one.jsonl", runs / "lr.jsonl", "--replay")
    assert code == 1, (out, err)
    assert out.strip().splitlines()[-1].startswith(
        "every layer output and output gradient compared is identical (8); the runs part at update 1 after the "
        "backward, in layer conv1's parameters: param W1 is the first tensor that differs")
    code, out, err = diverge(runs / "one.jsonl", runs / "lr.jsonl", "--replay", "--update", 2)
    assert code == 1 and "from A retrained from its start for 1 updates" in out, (out, err)
    assert "B (--mode sync, 1 cpus): the replayed update does not give the run's digests (its state before " \
           "update 2 was not A's: the runs parted at update 1)" in out


def with_lines(path, source, head=None, records=None):
    """A digest file of `source`'s header (changed by `head`) and records (or `records`)."""
    first, *rest = source.read_text().splitlines()
    run = json.loads(first)
    run["run"].update(head or {})
    body = [json.dumps(r) for r in records] if records is not None else rest
    path.write_text("\n".join([json.dumps(run)] + body) + "\n")
    return path


def test_bad_input_exits_2_with_one_line(runs, tmp_path):
    one = runs / "one.jsonl"
    headless = tmp_path / "old.jsonl"
    headless.write_text("".join(one.read_text().splitlines(True)[1:]))
    line = json.loads(one.read_text().splitlines()[1])
    far = [dict(line, update=u) for u in range(1, 251)]
    far_b = [dict(r) for r in far]
    far_b[-1] = dict(line, update=250, tensors=[[k, n, "0" * 16, s, m] for k, n, _, s, m in line["tensors"]])
    cases = [((headless, one), "has no header saying how its run was made"),
             ((one, with_lines(tmp_path / "t.jsonl", one, {"model": "transformer"})), "the runs differ in model"),
             ((one, with_lines(tmp_path / "p.jsonl", one, {"processes": 2, "backend": "horovod"})),
              "rebuilds runs of one process only"),
             ((with_lines(tmp_path / "fa.jsonl", one, records=far),
               with_lines(tmp_path / "fb.jsonl", one, records=far_b)),
              "A would be retrained for 249 updates here (at most 200); run A with --checkpoint-dir"),
             ((one, one, "--update", 0), "updates count from 1"),
             ((one, one, "--update", 9), "update 9: B's file holds no such update"),
             ((one, tmp_path / "missing"), "cannot read")]
    for args, message in cases:
        code, out, err = diverge(*args, "--replay")
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, (args, out, err)


def test_a_gpt_replays_through_the_data_contract(tmp_path):
    """The replay reads the run's data as the run did (--data fortunes: windows of bytes), not images."""
    gpt = ["--model", "gpt", "--data", "fortunes", "--seq-len", 16, "--layers", 1, "--d-model", 16, "--heads", 2,
           "--train-size", 64, "--test-size", 32, "--batch-size", 32, "--epochs", 1, "--deterministic"]
    for cpus in (1, 2):
        code, text = run_job(train_cmd(*gpt, "--cpus", cpus, "--digests", tmp_path / f"{cpus}.jsonl"),
                             tmp_path / f"{cpus}.txt")
        assert code == 0, text
    code, out, err = diverge(tmp_path / "1.jsonl", tmp_path / "2.jsonl", "--replay")
    assert code == 0 and out.strip().splitlines()[-1].startswith("identical: update 1 replayed in both layouts"), (out, err)
