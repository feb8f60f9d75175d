"""--deterministic on a model with BatchNorm (strategies/sums/fixed_sums.py, stats_width): every
piece normalises with its own statistics, carried in its leaf, summed in the fixed tree and folded
into the running statistics, so the parameters, optimiser state and running statistics are the
same bits on any context count, ZeRO stage, pipeline (strategies/pipeline/pipeline_sums.py) and process count.

Bit-identity holds when every process runs its ops with the same thread count: the in-process
tests run in one process, the command-line ones start every process the same way (--deterministic
gives one thread per op). The reference for what a piece computes is data parallelism over as
many contexts as pieces, each normalising its shard with its own statistics: the same arithmetic
in another order of float additions (1e-5 of the largest value after 2 momentum steps at lr 0.01,
as tests/test_batchnorm_modes.py); one context's whole-batch statistics differ by more than 1e-3.
"""
import hashlib

import numpy as np
import pytest

from conftest import batch, close, cpus, statistics_alike, straight_and_resumed, write_dataset
from jobs import launch_cmd, read_log, run_job, saved_arrays, train_cmd
from manual_dp import models
from manual_dp.strategies.data.data_parallel import DataParallel
from manual_dp.strategies.sums.fixed_sums import FixedSums
from manual_dp.strategies.pipeline.pipeline import PipelineParallel
from manual_dp.strategies.zero.zero import ZeroRedundancy

PIECE = 8                      # batches of 24: three pieces


@pytest.fixture(scope="module")
def resnet():
    net = models.build("resnet")
    return net, net.init_params(0)


def trained(model, steps=2, lr=0.01):
    X, y = batch(24, 0)
    losses = [float(model.step(X, y, lr)[0][0].asscalar()) for _ in range(steps)]
    return model.state_dict(), losses


def bits(state):
    """A digest of a state_dict's parameters, optimiser state and running statistics."""
    arrays = [*state["params"], *[s for st in state.get("opt_state", []) for s in st], *state["extra"]["running"]]
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


def test_the_same_bits_on_1_2_and_3_contexts(resnet):
    """Imperatively (no cached graph: its BatchNorm gives other bits than a pipeline stage's pass)."""
    net, P = resnet
    seen = {}
    for k in (1, 2, 3):
        model = DataParallel(P, cpus(k), "momentum", model=net, sums=FixedSums(piece=PIECE))
        assert model.graph is None
        state, losses = trained(model)
        assert statistics_alike(model, k)
        seen[k] = (bits(state), losses)
    assert len(set(map(repr, seen.values()))) == 1, seen
    moved = [np.abs(r - r0).max() for r, r0 in zip(state["extra"]["running"], [s.asnumpy() for s in net.init_stats()])]
    assert min(moved) > 0                                                      # every statistic folded


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_give_the_bits_of_sync(resnet, stage):
    net, P = resnet
    want, want_losses = trained(DataParallel(P, cpus(1), "momentum", model=net, sums=FixedSums(piece=PIECE)))
    got, losses = trained(ZeroRedundancy(P, cpus(2), "momentum", stage, model=net, sums=FixedSums(piece=PIECE)))
    assert losses == want_losses
    for a, b in zip([*got["params"], *got["extra"]["running"]], [*want["params"], *want["extra"]["running"]]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("contexts,stages,micro,schedule,recompute", [
    (2, 2, 2, "gpipe", False), (3, 3, 3, "1f1b", True), (4, 2, 1, "gpipe", False), (2, 2, 2, "zb-h1", False)])
def test_pipelines_give_the_bits_of_sync(resnet, contexts, stages, micro, schedule, recompute):
    """Model, pipeline and hybrid parallelism: each stage's leaf of a piece ends with its BatchNorms'
    statistics on the piece; after the tree the stages' sums are the model's, folded as sync's."""
    net, P = resnet
    want, want_losses = trained(DataParallel(P, cpus(1), "momentum", model=net, sums=FixedSums(piece=PIECE)))
    pipe = PipelineParallel(P, cpus(contexts), "momentum", micro, stages=stages, schedule=schedule, model=net,
                            recompute=recompute, sums=FixedSums(PIECE))
    got, losses = trained(pipe)
    assert losses == want_losses
    for a, b in zip([*got["params"], *got["extra"]["running"]], [*want["params"], *want["extra"]["running"]],
                    strict=True):
        np.testing.assert_array_equal(a, b)
    assert statistics_alike(pipe, contexts)


def test_each_piece_normalises_with_its_own_statistics(resnet):
    """One context in pieces of 8 computes what data parallelism over 3 contexts of 8 rows computes,
    each with its own statistics, and not what one context computes with the batch's."""
    net, P = resnet
    got, _ = trained(DataParallel(P, cpus(1), "momentum", model=net, sums=FixedSums(piece=PIECE)))
    want, _ = trained(DataParallel(P, cpus(3), "momentum", model=net, graph=False))
    whole, _ = trained(DataParallel(P, cpus(1), "momentum", model=net, graph=False))
    assert close(got["params"], want["params"]) and close(got["extra"]["running"], want["extra"]["running"])
    assert not close(got["params"], whole["params"], 1e-3)


def test_a_resume_on_another_context_count_is_bit_identical(resnet):
    net, P = resnet
    X, y = batch(24, 0)
    straight, resumed, state = straight_and_resumed(
        lambda: DataParallel(P, cpus(3), "momentum", model=net, sums=FixedSums(piece=PIECE)),
        DataParallel(P, cpus(2), "momentum", model=net, sums=FixedSums(piece=PIECE)), X, y)
    assert "running" in state["extra"]
    assert bits(straight.state_dict()) == bits(resumed.state_dict())


def test_tensor_pieces_are_refused(resnet):
    net, P = resnet
    with pytest.raises(ValueError, match="--tensor-pieces 2 cuts the split layers of the transformer"):
        DataParallel(P, cpus(1), "momentum", model=net, sums=FixedSums(tensor_pieces=2))


def test_sync_batchnorm_is_refused_in_sync_and_zero(resnet):
    """Each piece normalises with its own statistics: statistics across contexts are refused."""
    net, P = resnet
    for make in (lambda: DataParallel(P, cpus(2), "momentum", model=net, sync_batchnorm=True, sums=FixedSums()),
                 lambda: ZeroRedundancy(P, cpus(2), "momentum", 1, model=net, sync_batchnorm=True, sums=FixedSums())):
        with pytest.raises(ValueError, match="each piece with its own statistics, not --sync-batchnorm"):
            make()


SMALL = ["--model", "resnet", "--train-size", "96", "--batch-size", "24", "--test-size", "40", "--epochs", "1",
         "--optimizer", "momentum", "--lr", "0.01", "--deterministic"]


def test_cli_the_same_bits_on_1_and_2_contexts_in_a_pipeline_and_on_2_dist_sync_workers(tmp_path):
    """The logged losses and accuracies and every saved array (running statistics included) the same
    bits; evaluation normalises with those running statistics."""
    data = write_dataset(tmp_path / "data", n_train=96, n_test=40)
    runs = {}
    for name, cmd in (("one", train_cmd("--cpus", 1)), ("two", train_cmd("--cpus", 2)),
                      ("pipe", train_cmd("--cpus", 2, "--mode", "pipeline", "--micro-batches", 2)),
                      ("kv", launch_cmd(2, "dist_sync", "--cpus", 1))):
        log, ck = tmp_path / f"{name}.jsonl", tmp_path / f"{name}_ck"
        code, out = run_job([*cmd, "--data-dir", str(data), *SMALL, "--log-json", str(log),
                             "--checkpoint-dir", str(ck)], tmp_path / f"{name}.txt")
        assert code == 0, out
        keys = ("train_loss", "train_acc", "test_acc")
        runs[name] = ([[r[k] for k in keys] for r in read_log(log)], saved_arrays(ck))
    (want_log, want_arrays) = runs.pop("one")
    assert len(want_arrays) > len(models.build("resnet").init_params(0))      # the running statistics too
    for log, arrays in runs.values():
        assert log == want_log
        for a, b in zip(arrays, want_arrays, strict=True):
            np.testing.assert_array_equal(a, b)
