"""--deterministic: the same bits on 1, 2, 3 or 4 contexts and across processes (issue 12, item 1).

Bit-identity holds when every process runs its ops with the same thread count: the tests run in
one process (one thread count), and the multi-process ones start every process the same way.
"""
import hashlib

import mxnet as mx
import numpy as np
import pytest

from conftest import batch, cpus, write_dataset
from jobs import assert_same_run, horovod_cmd, launch_cmd, read_log, run_job, train_cmd
from manual_dp import DataParallel, GradAccum, init_lenet_params
from manual_dp.lesson import lenet
from manual_dp.loop import evaluate
from manual_dp.strategies.sums.fixed_sums import FixedSums, cover, pieces, spans, tree_sum
from test_distributed import needs_horovod


def digest(model):
    return hashlib.sha256(b"".join(p.tobytes() for p in model.state_dict()["params"])).hexdigest()


# The tree -------------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13])
def test_each_context_covers_exactly_its_run_of_pieces(m):
    for k in (1, 2, 3, 4, 7):
        covered = []
        for lo, hi in spans(m, k):
            for level, i in cover(lo, hi, m):
                covered += range(i << level, min((i + 1) << level, m))
        assert covered == list(range(m))


@pytest.mark.parametrize("m", [1, 2, 3, 6, 7, 11])
def test_the_tree_sum_is_the_same_bits_however_the_pieces_are_placed(m):
    """Leaves of float32 noise: summing every owner's whole subtrees first, then the rest, gives the
    bits of one owner's sum, whatever the number of owners; a plain left-to-right sum does not
    (in general): this is the property the strategy needs."""
    rng = np.random.RandomState(m)
    leaves = {(0, j): rng.randn(1000).astype(np.float32) * 10 ** rng.randint(-3, 4) for j in range(m)}
    root = (int(np.ceil(np.log2(m))) if m > 1 else 0, 0)
    one = tree_sum(root, m, leaves, np.add)
    for k in (2, 3, 4):
        have = {node: tree_sum(node, m, leaves, np.add)
                for lo, hi in spans(m, k) for node in cover(lo, hi, m)}
        np.testing.assert_array_equal(tree_sum(root, m, have, np.add), one)
    np.testing.assert_allclose(one, sum(leaves[(0, j)] for j in range(m)), rtol=1e-4, atol=1e-2)


def test_pieces_cut_the_batch_in_order():
    assert pieces(100, 32) == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert pieces(5, 32) == [(0, 5)]


# One process, any number of contexts ----------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("graph", [True, False], ids=["graph", "imperative"])
def test_the_same_bits_on_1_2_3_and_4_contexts(optimizer, graph):
    """Three updates on batches of 100 (pieces 32, 32, 32, 4): parameters, optimiser state, every
    replica and every reported loss the same bits on every context count."""
    seen = {}
    for k in (1, 2, 3, 4):
        model = DataParallel(init_lenet_params(seed=2), cpus(k), optimizer, graph=graph, sums=FixedSums(piece=32))
        losses = [model.step(*batch(100, seed=s), 0.05)[0][0].asscalar() for s in range(3)]
        replicas = {hashlib.sha256(f.flat.asnumpy().tobytes()).hexdigest() for f in model.flat}
        assert len(replicas) == 1 and {a.context for a in model.flat[-1].params} == {mx.cpu(k - 1)}
        state = b"".join(s.tobytes() for st in model.state_dict()["opt_state"] for s in st)
        seen[k] = (digest(model), hashlib.sha256(state).hexdigest(), losses)
    assert len({repr(v) for v in seen.values()}) == 1, seen


def test_grad_accumulation_is_deterministic_too():
    digests = set()
    for k in (1, 3):
        model = GradAccum(DataParallel(init_lenet_params(seed=1), cpus(k), "momentum", sums=FixedSums(piece=8)), 2)
        for s in range(4):
            model.step(*batch(20, seed=s), 0.05)
        digests.add(digest(model))
    assert len(digests) == 1


def test_buckets_and_the_lessons_step_are_refused():
    for kw in (dict(bucket_mb=0), dict(lesson=True)):
        with pytest.raises(ValueError, match="fixed tree takes the fused step"):
            DataParallel(init_lenet_params(seed=0), cpus(2), "sgd", sums=FixedSums(), **kw)


def test_deterministic_computes_the_one_device_step():
    """Another order of the same sums: equal to the lesson's step to float32 rounding (loss sums
    of ~300 to 1e-5 relative, parameters to 1e-5 absolute after 3 SGD steps)."""
    ref = DataParallel(init_lenet_params(seed=3), cpus(1), "sgd", lesson=True)
    model = DataParallel(init_lenet_params(seed=3), cpus(3), "sgd", sums=FixedSums(piece=16))
    for s in range(3):
        want = ref.step(*batch(100, seed=s), 0.05)[0][0].asscalar()
        got = model.step(*batch(100, seed=s), 0.05)[0][0].asscalar()
        assert got == pytest.approx(want, rel=1e-5)
    for a, b in zip(model.state_dict()["params"], ref.state_dict()["params"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


# Evaluation covers the test set exactly once (issue 12, item 6) -------------------------------

def test_evaluation_counts_every_test_image_once_on_any_context_count():
    """97 test images (a prime) in batches of 10: the last batch of 7 is smaller than some context
    counts; the accuracy is the same count on 1..4 contexts and equals a count on one device."""
    X, y = batch(97, seed=11)
    params = init_lenet_params(seed=0)
    want = int((lenet(mx.nd.array(X), params).asnumpy().argmax(axis=1) == y).sum())
    for k in (1, 2, 3, 4):
        other = DataParallel(init_lenet_params(seed=0), cpus(k), "sgd")
        assert evaluate(other, X, y, 10) * 97 == pytest.approx(want, abs=1e-9)


# The command line, across processes ------------------------------------------------------------

SMALL = ["--train-size", "537", "--batch-size", "67", "--optimizer", "momentum", "--lr", "0.002",
         "--epochs", "2", "--test-size", "199", "--deterministic"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("det_data"))


def run(tmp_path, name, cmd):
    log, ck = tmp_path / f"{name}.jsonl", tmp_path / f"{name}_ck"
    code, out = run_job([*cmd, "--log-json", log, "--checkpoint-dir", ck], tmp_path / f"{name}.txt")
    assert code == 0, out
    return log, ck


def test_cli_the_same_bits_on_1_and_3_contexts_and_on_2_dist_sync_workers_x_2(data, tmp_path):
    """Batches of 67 in pieces of 64 (64, 3): 1 context, 3 contexts, and 2 dist_sync workers
    x 2 contexts log the same losses and accuracies and save the same bits."""
    one = run(tmp_path, "one", train_cmd("--cpus", 1, "--data-dir", data, *SMALL))
    three = run(tmp_path, "three", train_cmd("--cpus", 3, "--data-dir", data, *SMALL))
    workers = run(tmp_path, "kv", launch_cmd(2, "dist_sync", "--cpus", 2, "--data-dir", data, *SMALL))
    assert_same_run(*one, *three, exact=True)
    assert_same_run(*one, *workers, exact=True)
    assert read_log(one[0])[0]["test_acc"] < 1


@needs_horovod
def test_cli_the_same_bits_under_horovod_2_processes(data, tmp_path):
    one = run(tmp_path, "one", train_cmd("--cpus", 1, "--data-dir", data, *SMALL))
    hvd = run(tmp_path, "hvd", horovod_cmd(2, "--cpus", 1, "--data-dir", data, *SMALL))
    assert_same_run(*one, *hvd, exact=True)


def test_cli_resume_on_another_context_count_ends_bit_identical(data, tmp_path):
    """Epoch 1 on 3 contexts, epoch 2 resumed on 2: the bits of 2 epochs on 1 context (issue 12,
    item 3: the checkpoint holds the unsharded state, and the sums do not depend on the count)."""
    one = run(tmp_path, "one", train_cmd("--cpus", 1, "--data-dir", data, *SMALL))
    log, ck = tmp_path / "moved.jsonl", tmp_path / "moved_ck"
    first = SMALL[:SMALL.index("--epochs")] + ["--epochs", "1", "--test-size", "199", "--deterministic"]
    for cpus, argv in ((3, first), (2, [*SMALL, "--resume"])):
        code, out = run_job(train_cmd("--cpus", cpus, "--data-dir", data, *argv, "--log-json", log,
                                      "--checkpoint-dir", ck), tmp_path / f"moved{cpus}.txt")
        assert code == 0, out
    assert "resumed from" in out
    assert_same_run(*one, log, ck, exact=True)
