"""--deterministic --mode zero: ZeRO stages 1-3 with the one fixed tree, the same bits on 1, 2, 3 and
4 contexts, on 2 processes, and as --deterministic --mode sync (issue 12, item 1).

Bit-identity holds when every process runs its ops with the same thread count: the in-process tests
run in one process (one thread count for every model compared); the command-line runs each get one
thread per op from --deterministic (manual_dp.train), as every process of a job does.
"""
import hashlib

import numpy as np
import pytest

from conftest import batch, cpus, write_dataset
from jobs import assert_same_run, horovod_cmd, launch_cmd, read_log, run_job, saved_arrays, train_cmd
from manual_dp import DataParallel, GradAccum, ZeroRedundancy, init_lenet_params
from manual_dp.strategies.sums.fixed_sums import FixedSums, Fold, cover, root_of, spans, tree_sum
from test_distributed import needs_horovod


def bits(model):
    """sha256 of the parameters and the optimiser state (full, unsharded: state_dict)."""
    state = model.state_dict()
    arrays = state["params"] + [s for st in state["opt_state"] for s in st]
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


def three_steps(model):
    """(loss, correct, the model's bits after it) of 3 steps on batches of 100 (pieces 32, 32, 32, 4)."""
    out = []
    for s in range(3):
        (loss, correct), = model.step(*batch(100, seed=s), 0.05)
        out.append((loss.asscalar(), correct.asscalar(), bits(model)))
    return out


# The fold: the cover's subtrees, made as the leaves arrive -----------------------------------------

@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13])
def test_the_fold_makes_exactly_the_cover_nodes_with_tree_sums_bits(m):
    rng = np.random.RandomState(m)
    leaves = {(0, j): rng.randn(300).astype(np.float32) * 10 ** rng.randint(-3, 4) for j in range(m)}
    for k in (1, 2, 3, 4, 7):
        for lo, hi in spans(m, k):
            fold = Fold(lo, hi, m, np.add)
            for j in range(lo, hi):
                fold.put(j, leaves[(0, j)])
            assert sorted(fold.done) == sorted(cover(lo, hi, m))
            for node, value in fold.done.items():
                np.testing.assert_array_equal(value, tree_sum(node, m, leaves, np.add))
    assert cover(0, m, m) == [root_of(m)]           # one context: its fold is the whole tree


# One process, any number of contexts, any stage ----------------------------------------------------

@pytest.mark.parametrize("optimizer,counts", [("momentum", (1, 2, 3, 4)), ("adam", (1, 3)), ("sgd", (2, 4))])
def test_the_same_bits_on_every_stage_and_context_count_as_deterministic_sync(optimizer, counts):
    """Parameters and optimiser state after each of 3 steps, losses and correct counts: the bits of
    DataParallel given FixedSums on one context, for stages 1, 2, 3 on each count."""
    want = three_steps(DataParallel(init_lenet_params(seed=2), cpus(1), optimizer, sums=FixedSums(piece=32)))
    for stage in (1, 2, 3):
        for k in counts:
            model = ZeroRedundancy(init_lenet_params(seed=2), cpus(k), optimizer, stage, sums=FixedSums(piece=32))
            assert three_steps(model) == want, (stage, k)
            assert [s.context for s in model.shards] == cpus(k)
            assert [g.context for g in model.grad_shards] == cpus(k)


def test_grad_accumulation_and_the_imperative_pass_are_deterministic_too():
    for graph in (True, False):
        seen = set()
        for k, stage in ((1, 2), (3, 3), (2, 1)):
            model = GradAccum(ZeroRedundancy(init_lenet_params(seed=1), cpus(k), "momentum", stage,
                                             graph=graph, sums=FixedSums(piece=8)), 2)
            for s in range(4):
                model.step(*batch(20, seed=s), 0.05)
            seen.add(bits(model))
        ref = GradAccum(DataParallel(init_lenet_params(seed=1), cpus(1), "momentum",
                                     graph=graph, sums=FixedSums(piece=8)), 2)
        for s in range(4):
            ref.step(*batch(20, seed=s), 0.05)
        assert seen == {bits(ref)}


def test_stage_3_holds_full_parameters_only_during_a_step():
    """Between steps each context keeps its shard; the step's peak counts the gathered (N,)
    parameters and (N,) gradients of every context (Peak, via peak_arrays)."""
    model = ZeroRedundancy(init_lenet_params(seed=0), cpus(3), "sgd", stage=3, sums=FixedSums(piece=16))
    model.step(*batch(64, seed=0), 0.05)
    n = model.n
    shard_sizes = [b - a for a, b in zip(model.bounds, model.bounds[1:])]
    assert [a.size for a in model.arrays()["param"]] == shard_sizes and max(shard_sizes) < n
    peak = model.peak_arrays()
    assert sorted(str(h.context) for h in peak["param"] if h.size == n) == [str(c) for c in cpus(3)]
    assert len([h for h in peak["state"] if h.size == n]) >= 3


# The command line: contexts, processes, sync, resume -------------------------------------------

SMALL = ["--train-size", "268", "--batch-size", "67", "--optimizer", "momentum", "--lr", "0.002",
         "--test-size", "99", "--deterministic"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("detzero_data"))


@pytest.fixture(scope="module")
def one(data, tmp_path_factory):
    """2 epochs of --mode zero --zero-stage 2 on 1 context: the reference run."""
    return run(tmp_path_factory.mktemp("one"), "one", train_cmd(
        "--cpus", 1, "--data-dir", data, "--mode", "zero", "--zero-stage", 2, "--epochs", 2, *SMALL))


def run(tmp_path, name, cmd):
    log, ck = tmp_path / f"{name}.jsonl", tmp_path / f"{name}_ck"
    code, out = run_job([*cmd, "--log-json", log, "--checkpoint-dir", ck], tmp_path / f"{name}.txt")
    assert code == 0, out
    return log, ck


def checksum(ck):
    return hashlib.sha256(b"".join(a.tobytes() for a in saved_arrays(ck))).hexdigest()[:16]


def test_cli_zero_stage_2_the_same_bits_on_1_and_3_contexts_and_as_sync(one, data, tmp_path):
    """Batches of 67 in pieces of 64 (64, 3): stage 2 on 3 contexts and --mode sync on 2 log
    the same losses and accuracies and save the same bits as stage 2 on 1 context."""
    three = run(tmp_path, "three", train_cmd("--cpus", 3, "--data-dir", data, "--mode", "zero",
                                             "--zero-stage", 2, "--epochs", 2, *SMALL))
    sync = run(tmp_path, "sync", train_cmd("--cpus", 2, "--data-dir", data, "--epochs", 2, *SMALL))
    print("checksums: zero2 x1", checksum(one[1]), "zero2 x3", checksum(three[1]),
          "sync x2", checksum(sync[1]))
    assert_same_run(*one, *three, exact=True)
    assert_same_run(*one, *sync, exact=True)
    assert read_log(one[0])[-1]["test_acc"] < 1


def test_cli_2_dist_sync_workers_equal_1_process(one, data, tmp_path):
    """Stage 3, 2 dist_sync workers x 2 contexts: the bits of stage 2 on 1 context."""
    workers = run(tmp_path, "kv", launch_cmd(2, "dist_sync", "--cpus", 2, "--data-dir", data,
                                             "--mode", "zero", "--zero-stage", 3, "--epochs", 2, *SMALL))
    print("checksums: zero2 x1", checksum(one[1]), "zero3 2 dist_sync workers x2", checksum(workers[1]))
    assert_same_run(*one, *workers, exact=True)


@needs_horovod
def test_cli_2_horovod_processes_equal_1_process(one, data, tmp_path):
    hvd = run(tmp_path, "hvd", horovod_cmd(2, "--cpus", 1, "--data-dir", data, "--mode", "zero",
                                           "--zero-stage", 1, "--epochs", 2, *SMALL))
    print("checksums: zero2 x1", checksum(one[1]), "zero1 2 horovod x1", checksum(hvd[1]))
    assert_same_run(*one, *hvd, exact=True)


def test_cli_resume_on_another_count_and_stage_ends_bit_identical(one, data, tmp_path):
    """Epoch 1 at stage 3 on 3 contexts, epoch 2 resumed at stage 1 on 2: the checkpoint holds the
    unsharded state, resharded on load, and the sums do not depend on the count or stage."""
    log, ck = tmp_path / "moved.jsonl", tmp_path / "moved_ck"
    for cpus, stage, epochs in ((3, 3, ["--epochs", 1]), (2, 1, ["--epochs", 2, "--resume"])):
        code, out = run_job(train_cmd("--cpus", cpus, "--data-dir", data, "--mode", "zero", "--zero-stage",
                                      stage, *epochs, *SMALL, "--log-json", log, "--checkpoint-dir", ck),
                            tmp_path / f"moved{cpus}.txt")
        assert code == 0, out
    assert "resumed from" in out
    assert_same_run(*one, log, ck, exact=True)
