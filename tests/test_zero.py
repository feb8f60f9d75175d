"""ZeRO (manual_dp.strategies.zero.zero): every stage on 1..4 contexts is the one-device lesson step; each
context holds only what its stage leaves it; checkpoints move between context counts and modes;
the command line trains it, alone and across dist_sync workers.

Tolerances as in test_contract.py: the k-context runs add the same float32 gradients in another
order (adam magnifies that near zero gradients: 1e-3 absolute)."""
import importlib.util
import re

import numpy as np
import pytest

from jobs import assert_same_run, horovod_cmd, launch_cmd, read_log, run_job, train_cmd
from manual_dp import DataParallel, ZeroRedundancy, checkpoint, init_lenet_params
from manual_dp.fast.collectives import chunk_bounds
from manual_dp.memory import per_context
N_LAYERS = 4          # LeNet: conv1, conv2, dense1, dense2 (models.lenet)
from manual_dp.train import main
from test_contract import batch, cpus, run

N = 129068          # the lesson's LeNet, flat; 129068 = 3 * 43022 + 2


def lesson(seed, optimizer, width=1):
    return DataParallel(init_lenet_params(seed=seed, width=width), cpus(1), optimizer, lesson=True)


def assert_same_state(got, want, optimizer):
    atol = 1e-3 if optimizer == "adam" else 1e-6
    for a, b in zip(got["params"] + sum(got["opt_state"], []), want["params"] + sum(want["opt_state"], [])):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_stage_equals_the_one_device_step(stage, k, optimizer):
    model, ref = ZeroRedundancy(init_lenet_params(seed=3), cpus(k), optimizer, stage), lesson(3, optimizer)
    got, want = run(model, steps=4), run(ref, steps=4)
    np.testing.assert_allclose([l for l, _ in got], [l for l, _ in want], rtol=1e-5)
    assert [c for _, c in got] == [c for _, c in want] and model.t == 4
    assert_same_state(model.state_dict(), ref.state_dict(), optimizer)


def sizes_by_context(arrays):
    out = {}
    for a in arrays:
        out.setdefault(str(a.context), []).append(a.size)
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_context_holds_only_what_its_stage_leaves_it(stage):
    """Between steps (uneven shards: 129068 over 3 contexts), by the arrays the strategy reports."""
    ctx = cpus(3)
    model = ZeroRedundancy(init_lenet_params(seed=0), ctx, "adam", stage)
    run(model, steps=2)
    shard = np.diff(chunk_bounds(N, 3))
    assert sorted(set(shard)) == [43022, 43023]
    held = model.arrays()
    params, grads, state = (sizes_by_context(held[kind]) for kind in ("param", "grad", "state"))
    for i, c in enumerate(ctx):
        want_params = [shard[i]] if stage == 3 else [N]
        want_grads = [N] if stage == 1 else [shard[i]]
        assert params[str(c)] == want_params
        assert grads[str(c)] == want_grads and state[str(c)] == [shard[i], shard[i]]   # Adam's m and v
    assert {a.context for a in held["param"] + held["grad"] + held["state"]} == set(ctx)


def test_stage3_peak_holds_its_shards_and_one_layers_parameters():
    """peak_arrays(): at the step's largest moment each context holds its shards and the largest
    layer (W3, b3) gathered: 1/k of what sync holds plus one layer's parameters (the layer's
    gradient is made a shard's part at a time, after its parameters are let go)."""
    ctx = cpus(3)
    model = ZeroRedundancy(init_lenet_params(seed=0), ctx, "adam", 3)
    run(model, steps=1)
    start, end, _ = model.layer_range(2)
    assert end - start == 800 * 128 + 128 == max(model.layer_range(l)[1] - model.layer_range(l)[0]
                                                 for l in range(N_LAYERS))
    report = per_context(type("Peak", (), {"ctx": ctx, "arrays": model.peak_arrays,
                                           "layout": lambda self, n: []})(), 0)
    shard = np.diff(chunk_bounds(N, 3))
    for i, c in enumerate(ctx):
        assert report[str(c)]["param_bytes"] == 4 * (shard[i] + end - start)
        assert report[str(c)]["grad_bytes"] == 4 * shard[i]
        assert report[str(c)]["state_bytes"] == 4 * 2 * shard[i]          # Adam's m and v


def test_stage3_gathers_each_layer_before_its_forward_and_again_before_its_backward():
    ctx = cpus(3)
    model = ZeroRedundancy(init_lenet_params(seed=0), ctx, "sgd", 3)
    gathered, real = [], model.all_gather

    def counting(outs, shards=None, bounds=None):
        assert [o.context for o in outs] == ctx
        gathered.append(outs[0].size)
        real(outs, shards, bounds)
    model.all_gather = counting
    run(model, steps=1)
    layer = [model.layer_range(l)[1] - model.layer_range(l)[0] for l in range(N_LAYERS)]
    assert gathered == layer[:3] + layer[::-1]     # forward 0, 1, 2; backward 3 (its only gather), 2, 1, 0


@pytest.mark.parametrize("stage", [2, 3])
def test_backward_adds_into_the_gradient_shards(stage):
    """Two backward calls then one update == one step on both batches (what GradAccum builds on)."""
    (X1, y1), (X2, y2) = batch(6, 0), batch(7, 1)
    two = ZeroRedundancy(init_lenet_params(seed=2), cpus(3), "momentum", stage)
    one = ZeroRedundancy(init_lenet_params(seed=2), cpus(3), "momentum", stage)
    two.backward(X1, y1), two.backward(X2, y2)
    two.update(0.1, 13)
    one.step(np.concatenate([X1, X2]), np.concatenate([y1, y2]), 0.1)
    assert_same_state(two.state_dict(), one.state_dict(), "momentum")


@pytest.mark.parametrize("first,then", [
    (lambda p: ZeroRedundancy(p, cpus(3), "adam", 3), lambda p: ZeroRedundancy(p, cpus(2), "adam", 1)),
    (lambda p: ZeroRedundancy(p, cpus(3), "adam", 2), lambda p: DataParallel(p, cpus(2), "adam")),
    (lambda p: DataParallel(p, cpus(2), "adam"), lambda p: ZeroRedundancy(p, cpus(3), "adam", 3)),
], ids=["zero3x3_to_zero1x2", "zero2x3_to_sync", "sync_to_zero3x3"])
def test_a_checkpoint_moves_to_another_context_count_and_mode(first, then):
    """state_dict is the full, unsharded state: loaded elsewhere, the run goes on as on one device."""
    a, ref = first(init_lenet_params(seed=1)), lesson(1, "adam")
    run(a, steps=2), run(ref, steps=2)
    b = then(init_lenet_params(seed=9))
    b.load_state_dict(a.state_dict())
    assert b.t == 2
    got = b.step(*batch(13, seed=5), 0.05)
    want = ref.step(*batch(13, seed=5), 0.05)
    np.testing.assert_allclose(sum(l.asscalar() for l, _ in got), sum(l.asscalar() for l, _ in want), rtol=1e-5)
    assert_same_state(b.state_dict(), ref.state_dict(), "adam")


def test_a_checkpoint_of_another_shape_is_refused():
    from manual_dp.errors import CheckpointError
    state = lesson(0, "momentum").state_dict()
    model = ZeroRedundancy(init_lenet_params(seed=0, width=2), cpus(2), "momentum", 3)
    with pytest.raises(CheckpointError, match="do not fit"):
        model.load_state_dict(state)
    with pytest.raises(CheckpointError, match="do not fit"):
        ZeroRedundancy(init_lenet_params(seed=0), cpus(2), "adam", 1).load_state_dict(state)


def test_zero_memory_table_orders_the_stages():
    """python -m manual_dp.bench.zero_memory's table, at width 1 (x16 in docs/design.md): every
    stage holds less than the one before; stage 3 a quarter of sync plus one layer's parameters;
    over the contexts ZeRO-3 keeps fp32 Adam's 4 + 4 + 8 bytes a parameter, in bf16 2 + 2 + 12."""
    from manual_dp.bench.zero_memory import format_table, table
    rows, n = table(1, 4, "adam", "bf16")
    peaks = {(r["name"], r["precision"]): r["arrays"] for r in rows}
    assert peaks["sync", "fp32"] == 4 * 4 * n                # parameters, gradients, Adam's m and v
    assert peaks["sync", "fp32"] > peaks["zero1", "fp32"] > peaks["zero2", "fp32"] > peaks["zero3", "fp32"]
    assert peaks["zero3", "fp32"] == 4 * (4 * 32267 + 800 * 128 + 128)        # 129068 / 4 = 32267
    kept = {(r["name"], r["precision"]): r["all"] for r in rows}
    assert kept["zero3", "fp32"] == [4 * n, 4 * n, 8 * n] and kept["zero3", "bf16"] == [2 * n, 2 * n, 12 * n]
    assert kept["sync", "bf16"] == kept["sync", "fp32"] == [16 * n, 16 * n, 32 * n]    # 4 copies, float32
    assert "2 + 2 + 12 = 16" in format_table(rows, n, 1, 4, "adam")


TINY = ["--train-size", "96", "--test-size", "64", "--batch-size", "32", "--no-progress"]


def test_cli_trains_zero3_wide_and_resumes_on_two_contexts_as_stage_1(data_dir, tmp_path, capsys):
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    main(["--data-dir", str(data_dir), *TINY, "--cpus", "3", "--mode", "zero", "--zero-stage", "3",
          "--width", "2", "--epochs", "1", "--checkpoint-dir", str(ck), "--log-json", str(log)])
    out = capsys.readouterr().out
    assert "mode zero: ZeRO stage 3, optimiser state, gradients and parameters sharded" in out
    assert re.search(r"epoch 1/1 .* loss \d", out)
    state, meta = checkpoint.load(ck)
    assert [p.shape for p in state["params"]][2] == (100, 40, 5, 5)      # full, unsharded, width 2
    main(["--data-dir", str(data_dir), *TINY, "--cpus", "2", "--mode", "zero", "--zero-stage", "1",
          "--width", "2", "--epochs", "2", "--checkpoint-dir", str(ck), "--log-json", str(log), "--resume"])
    assert "resumed from" in capsys.readouterr().out
    assert [r["epoch"] for r in read_log(log)] == [1, 2]


ACROSS = ["--train-size", "200", "--test-size", "64", "--batch-size", "50", "--epochs", "2",
          "--mode", "zero", "--optimizer", "adam", "--lr", "0.01"]


def across_processes(cmd, data_dir, tmp_path, stage, per_process):
    """A job of 2 processes x `per_process` contexts against one process with all of them: the
    same run, up to the order of the float sums; every rank's copy compared every update."""
    args = ["--data-dir", data_dir, *ACROSS, "--zero-stage", stage]
    ref_log, ref_ck = tmp_path / "local.jsonl", tmp_path / "local_ck"
    code, out = run_job(train_cmd("--cpus", 2 * per_process, *args, "--log-json", ref_log,
                                  "--checkpoint-dir", ref_ck), tmp_path / "local.txt")
    assert code == 0, out
    log, ck = tmp_path / "job.jsonl", tmp_path / "job_ck"
    code, out = run_job(cmd("--cpus", per_process, *args, "--check-replicas", 1, "--log-json", log,
                            "--checkpoint-dir", ck), tmp_path / "out.txt")
    assert code == 0, out
    assert_same_run(ref_log, ref_ck, log, ck, exact=False)


def test_two_dist_sync_workers_of_two_contexts_equal_one_process_of_four(data_dir, tmp_path):
    """ZeRO-3 inside each worker, the owned gradient shards summed across the workers."""
    across_processes(lambda *argv: launch_cmd(2, "dist_sync", *argv), data_dir, tmp_path, 3, 2)


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None or
                    importlib.util.find_spec("horovod.mxnet") is None, reason="horovod.mxnet is not importable")
def test_two_horovod_processes_equal_one_process_of_their_contexts(data_dir, tmp_path):
    """ZeRO-2 inside each process, the owned gradient shards summed by Horovod."""
    across_processes(lambda *argv: horovod_cmd(2, *argv), data_dir, tmp_path, 2, 2)
