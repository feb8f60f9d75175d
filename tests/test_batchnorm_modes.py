"""ZeRO and local SGD on a model with BatchNorm (strategies/running.py). Under ZeRO the running
statistics stay whole on every context while parameters, gradients and optimiser state are sharded,
and every stage computes what data parallelism computes. Under local SGD each replica keeps running
statistics of its own between syncs, and a sync averages them as it averages the parameters.

Tolerance, as tests/test_models.py: after 2 momentum steps the parameters and running statistics
differ from the reference only by the order of float32 additions (1e-5 of the largest value); a
statistic taken from one shard instead of the batch, or folded twice, moves them by more than 1e-3
(asserted for the per-context statistics below, so the comparison can fail). Resuming local SGD's
own checkpoint is exact (bit for bit)."""
import numpy as np
import pytest

from conftest import after, batch, close, cpus, evaluates_alike, run_main, statistics_alike, straight_and_resumed
from manual_dp import models
from manual_dp.errors import CheckpointError
from manual_dp.strategies.data.data_parallel import DataParallel
from manual_dp.strategies.data.local_sgd import LocalSGD
from manual_dp.strategies.pipeline.pipeline import PipelineParallel
from manual_dp.strategies.zero.zero import ZeroRedundancy

TINY = ["--train-size", "96", "--test-size", "32", "--batch-size", "32", "--no-progress", "--epochs", "1"]


@pytest.fixture(scope="module")
def resnet():
    net = models.build("resnet")
    P = net.init_params(0)
    return net, P, after(DataParallel(P, cpus(1), "momentum", lesson=True, model=net))


@pytest.mark.parametrize("stage,k", [(1, 2), (2, 2), (3, 2), (3, 3)])
def test_zero_with_sync_batchnorm_equals_one_context(resnet, stage, k):
    net, P, want = resnet
    model = ZeroRedundancy(P, cpus(k), "momentum", stage, model=net, sync_batchnorm=True)
    got = after(model)
    assert close(got["params"], want["params"])
    assert close(got["extra"]["running"], want["extra"]["running"])
    assert statistics_alike(model, k)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_with_per_context_statistics_equals_sync(resnet, stage):
    """Each context normalises its shard with its own statistics, as DataParallel does (Gluon's
    default): the same parameters and running statistics, and they differ from one context's."""
    net, P, whole = resnet
    want = after(DataParallel(P, cpus(2), "momentum", model=net))
    got = after(ZeroRedundancy(P, cpus(2), "momentum", stage, model=net))
    assert close(got["params"], want["params"]) and close(got["extra"]["running"], want["extra"]["running"])
    assert not close(got["params"], whole["params"], 1e-3)


@pytest.mark.parametrize("k", [1, 2])
def test_the_cached_graph_normalises_per_context_as_the_imperative_step(resnet, k):
    """The fast step's cached graph (fast.graph) with per-context statistics: its BatchNorms
    inside the graph, their batch statistics out of it and folded, equal the imperative step's
    (1e-5: the graph may fuse or order float additions its own way); --sync-batchnorm keeps the
    imperative step (its statistics cross contexts mid-forward)."""
    net, P, _ = resnet
    fast = DataParallel(P, cpus(k), "momentum", model=net)
    assert fast.graph is not None and fast.graph.stats
    assert DataParallel(P, cpus(k), "momentum", model=net, sync_batchnorm=True).graph is None
    got, want = after(fast), after(DataParallel(P, cpus(k), "momentum", model=net, graph=False))
    assert close(got["params"], want["params"]) and close(got["extra"]["running"], want["extra"]["running"])
    moved = [np.abs(r - r0).max() for r, r0 in zip(got["extra"]["running"], [s.asnumpy() for s in net.init_stats()])]
    assert min(moved) > 0                                       # every statistic was folded


@pytest.mark.parametrize("contexts,stages,micro,schedule,recompute", [
    (2, 2, 2, "gpipe", False), (2, 2, 3, "1f1b", False), (3, 3, 2, "zb-h1", False), (4, 2, 2, "1f1b", False),
    (2, 1, 2, "gpipe", False), (2, 2, 4, "interleaved", False), (2, 2, 2, "gpipe", True), (3, 3, 3, "1f1b", True),
    (2, 2, 2, "zb-h1", True), (2, 2, 4, "interleaved", True)])
def test_a_pipeline_normalises_each_micro_batch_as_data_parallelism_each_context(resnet, contexts, stages, micro,
                                                                                  schedule, recompute):
    """Model, pipeline and hybrid parallelism: each micro-batch normalised with its own statistics,
    their mean folded once a step (torchgpipe's deferred BatchNorm), is data parallelism over as
    many contexts as the step has micro-batches, each with its own statistics: the same parameters,
    running statistics (on every context alike) and evaluation. With --recompute a stage runs its
    BatchNorms twice (forward, then again in the backward) and its statistics count once."""
    net, P, whole = resnet
    pipe = PipelineParallel(P, cpus(contexts), "momentum", micro, stages=stages, schedule=schedule, model=net,
                            virtual_stages=2 if schedule == "interleaved" else 1, recompute=recompute)
    replicas = contexts // stages
    want_model = DataParallel(P, cpus(replicas * micro), "momentum", model=net)
    got, want = after(pipe), after(want_model)
    assert close(got["params"], want["params"]) and close(got["extra"]["running"], want["extra"]["running"])
    assert not close(got["params"], whole["params"], 1e-3)          # not one context's statistics
    norms = len(net.stats()) // 2                                   # each BatchNorm's statistics once
    assert [len(M.batch) for row in pipe.batch_moments for M in row] == [norms] * (replicas * micro)
    assert statistics_alike(pipe, contexts)
    assert [r[0].context for r in pipe.running] == cpus(contexts)
    assert evaluates_alike(pipe, want_model)


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_evaluates_with_the_running_statistics(resnet, stage):
    net, P, _ = resnet
    sync, zero = DataParallel(P, cpus(2), "momentum", model=net), ZeroRedundancy(P, cpus(2), "momentum", stage, model=net)
    after(sync), after(zero)
    assert evaluates_alike(zero, sync, (40, 1))


def test_zero_checkpoint_keeps_the_running_statistics_and_resumes_in_sync(resnet):
    """ZeRO-3's checkpoint holds the running statistics; data parallelism resumes from it and
    continues as an uninterrupted run; a checkpoint without them is refused."""
    net, P, _ = resnet
    straight, resumed, state = straight_and_resumed(
        lambda: DataParallel(P, cpus(2), "momentum", model=net, sync_batchnorm=True),
        ZeroRedundancy(P, cpus(2), "momentum", 3, model=net, sync_batchnorm=True), *batch(24, 0))
    assert close(resumed.state_dict()["params"], straight.state_dict()["params"])
    assert close(resumed.state_dict()["extra"]["running"], straight.state_dict()["extra"]["running"])
    back = ZeroRedundancy(P, cpus(3), "momentum", 2, model=net)
    back.load_state_dict(state)
    assert all(np.array_equal(a, b) for a, b in zip(back.state_dict()["extra"]["running"], state["extra"]["running"]))
    with pytest.raises(CheckpointError, match="running statistics"):
        ZeroRedundancy(P, cpus(2), "momentum", 1, model=net).load_state_dict(dict(state, extra={}))


def test_zero_memory_counts_the_whole_running_statistics(resnet):
    net, P, _ = resnet
    model = ZeroRedundancy(P, cpus(2), "momentum", 3, model=net)
    stats = sum(p.size for p in net.stats())
    kept = [a for a in model.arrays()["state"] if a.context == cpus(2)[1]]
    assert sum(a.size for a in kept) == stats + model.shards[1].size      # momentum's shard, whole statistics


def test_cli_resnet_under_zero_and_the_planner(capsys, data_dir):
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--model", "resnet", "--mode", "zero",
                                       "--zero-stage", "3", "--cpus", "2", "--sync-batchnorm"])
    assert code == 0 and "BatchNorm statistics over every context" in out, err


def test_two_dist_sync_workers_train_resnet_under_zero_as_one_process(data_dir, tmp_path):
    """2 workers x 1 context of ZeRO-2 with --sync-batchnorm against one process with 2 contexts:
    the statistics' sums and counts cross the processes (to float rounding)."""
    from jobs import two_workers_as_one_process
    one, two = two_workers_as_one_process(tmp_path, 1, "--model", "resnet", "--mode", "zero", "--zero-stage", "2",
                                          "--sync-batchnorm", "--data-dir", data_dir, "--train-size", 128,
                                          "--test-size", 64, "--batch-size", 64, "--epochs", 1, "--lr", 0.01)
    assert one["test_acc"] == pytest.approx(two["test_acc"], abs=1e-6)


# Local SGD ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_local_sgd_at_h1_equals_sync_with_per_context_statistics(resnet, optimizer):
    """At H = 1 (outer sgd, lr 1) the averaged replicas take sync's step, and the averaged running
    statistics are sync's fold of every context's batch statistics."""
    net, P, _ = resnet
    want = after(DataParallel(P, cpus(2), optimizer, model=net))
    local = LocalSGD(P, cpus(2), optimizer, sync_every=1, model=net)
    got = after(local)
    assert close(got["params"], want["params"]) and close(got["extra"]["running"], want["extra"]["running"])
    assert not close(got["extra"]["running"], [s.asnumpy() for s in net.init_stats()], 1e-3)   # they moved
    sync = DataParallel(P, cpus(2), optimizer, model=net)
    after(sync)
    assert evaluates_alike(local, sync)


def test_replicas_keep_their_own_statistics_until_a_sync(resnet):
    """H = 2: after one step the replicas' statistics differ and the global ones have not moved;
    after the second step's sync every replica holds the examples-weighted average."""
    net, P, _ = resnet
    local = LocalSGD(P, cpus(2), "sgd", sync_every=2, model=net)
    X, y = batch(24, 0)
    local.step(X, y, 0.01)
    first = [r.asnumpy() for r in local.running[0]]
    assert not close([r.asnumpy() for r in local.running[1]], first, 1e-3)
    assert all(np.array_equal(g.asnumpy(), s.asnumpy()) for g, s in zip(local.global_running[0], net.init_stats()))
    before = [[r.asnumpy() for r in R] for R in local.running]
    local.step(X, y, 0.01)
    for R in local.running + local.global_running:
        assert all(np.array_equal(r.asnumpy(), local.global_running[0][i].asnumpy()) for i, r in enumerate(R))
    assert not close([g.asnumpy() for g in local.global_running[0]], before[0], 1e-3)


def test_local_checkpoint_between_syncs_resumes_exactly(resnet):
    net, P, _ = resnet
    X, y = batch(24, 0)
    straight = LocalSGD(P, cpus(2), "momentum", sync_every=2, model=net)
    for _ in range(3):
        straight.step(X, y, 0.01)
    first = LocalSGD(P, cpus(2), "momentum", sync_every=2, model=net)
    first.step(X, y, 0.01)                          # between syncs: the replicas' own statistics differ
    resumed = LocalSGD(P, cpus(2), "momentum", sync_every=2, model=net)
    resumed.load_state_dict(first.state_dict())
    for _ in range(2):
        resumed.step(X, y, 0.01)
    a, b = resumed.state_dict(), straight.state_dict()
    for key in ("running", "local_running", "local_replicas"):
        assert all(np.array_equal(u, v) for u, v in zip(a["extra"][key], b["extra"][key])), key
    sync = DataParallel(P, cpus(2), "momentum", model=net)
    sync.load_state_dict(a)                         # another mode resumes from the global statistics
    assert all(np.array_equal(r.asnumpy(), v) for r, v in zip(sync.running[1], a["extra"]["running"]))


def test_cli_resnet_under_local_sgd(capsys, data_dir):
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--model", "resnet", "--mode", "local",
                                       "--sync-every", "2", "--cpus", "2"])
    assert code == 0 and "comm rounds" in out, err
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--model", "resnet", "--mode", "local",
                                       "--sync-batchnorm"])
    assert code == 2 and len(err) == 1 and "--sync-batchnorm" in err[0], err


def test_two_dist_sync_workers_train_resnet_under_local_sgd_as_one_process(data_dir, tmp_path):
    """2 workers x 1 context against one process with 2 contexts, H = 2: the replicas' statistics
    averaged across the processes at every sync; the same losses and test accuracy, which reads the
    averaged statistics, and the same checkpoints: parameters, the mean inner state over every
    process's replicas and the global running statistics (to float rounding)."""
    from jobs import launch_cmd, read_log, run_job, saved_arrays, train_cmd
    from manual_dp import checkpoint
    argv = ["--model", "resnet", "--mode", "local", "--sync-every", 2, "--data-dir", data_dir, "--train-size", 128,
            "--test-size", 64, "--batch-size", 32, "--epochs", 2, "--lr", 0.01]
    logs = {}
    for name, cmd in (("one", train_cmd("--cpus", 2, *argv)), ("two", launch_cmd(2, "dist_sync", "--cpus", 1, *argv))):
        code, out = run_job([*cmd, "--log-json", str(tmp_path / f"{name}.jsonl"), "--checkpoint-dir",
                             str(tmp_path / name)], tmp_path / f"{name}.txt")
        assert code == 0, out
        logs[name] = read_log(tmp_path / f"{name}.jsonl")
    for a, b in zip(logs["one"], logs["two"]):
        assert a["comm_rounds"] == b["comm_rounds"] == 2
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["test_acc"] == pytest.approx(b["test_acc"], abs=1e-6)
    assert len(logs["one"]) == len(logs["two"]) == 2
    for a, b in zip(saved_arrays(tmp_path / "one"), saved_arrays(tmp_path / "two")):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    one, two = (checkpoint.load(tmp_path / name)[0]["extra"]["running"] for name in ("one", "two"))
    for a, b in zip(one, two):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec", ["2bit", "powersgd:2"])
def test_compression_sends_the_gradients_compressed_and_the_statistics_exact(resnet, spec):
    """--compress: the gradients through the compressed all-reduce, the BatchNorm statistics
    through the exact one (stats_reduce): after one step the running statistics are the bits of
    the uncompressed step's (they depend on the start and the batch alone), on every context; the
    parameters are not (the compression is lossy)."""
    from manual_dp.fast.collectives import make_allreduce
    from manual_dp.fast.compress import make_reducer
    from manual_dp.strategies.wrappers.compressed import Compressed
    net, P, _ = resnet
    reducer = make_reducer(spec, make_allreduce("reduce_bcast"), [p.shape for p in P])
    model = Compressed(DataParallel(P, cpus(2), "momentum", reducer, model=net,
                                    stats_reduce=make_allreduce("reduce_bcast")), reducer, spec)
    plain = DataParallel(P, cpus(2), "momentum", model=net)
    got, want = after(model, steps=1), after(plain, steps=1)
    for a, b in zip(got["extra"]["running"], want["extra"]["running"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert not close(got["params"], want["params"], 1e-6)
    assert statistics_alike(model.model)


def test_cli_resnet_with_compression(capsys, data_dir):
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--model", "resnet", "--cpus", "2",
                                       "--compress", "2bit"])
    assert code == 0, err
