"""ZeRO stages 1 and 2 over a mesh's data dimension (strategies/dp_zero.py, `--zero-stage 1|2` with
tensor, context and mesh modes) against the same layout without it: the same per-element arithmetic
(a sum over the copies, then the update), so the parameters agree to float32 rounding of the sum's
order (1e-5 of the largest, with momentum; Adam would turn the rounding noise of a gradient that is
zero in exact arithmetic into whole steps), and each context holds 1/D of the optimiser state (and,
in stage 2, of the summed gradient).

Stage 2 against stage 1: where a step is one backward (tensor, context) stage 2 adds the copies'
gradients in stage 1's order (add_n over the copies, into a zero chunk), so the bits are equal; in
a pipeline stage 2 sums each micro-batch's gradient into the chunks as it is made (so that no copy
keeps a whole gradient between backwards), replica by replica, while stage 1 adds a copy's
micro-batches first and then the copies: another order of the same float32 sum, so 1e-6 of the
largest parameter after two momentum steps (measured: 1e-7)."""
import functools
import json

import numpy as np
import pytest

from conftest import batch, cpus, run_main, straight_and_resumed
from manual_dp import DataParallel, memory, models
from manual_dp.strategies.context import ContextParallel
from manual_dp.strategies.mesh_parallel import MeshParallel
from manual_dp.strategies.tensor import TensorParallel

TOL = 1e-5
LAYOUTS = {
    "tensor dp2 x tp2": lambda P, net, z: TensorParallel(P, cpus(4), "momentum", 2, model=net, zero_stage=z),
    "tensor dp3 x tp2 +sp": lambda P, net, z: TensorParallel(P, cpus(6), "momentum", 2, model=net,
                                                            sequence_parallel=True, zero_stage=z),
    "context dp2 x cp2": lambda P, net, z: ContextParallel(P, cpus(4), "momentum", 2, model=net, zero_stage=z),
    "mesh dp2 x pp2 x tp2": lambda P, net, z: MeshParallel(P, cpus(8), "momentum", 2, 2, 2, "1f1b", model=net,
                                                           zero_stage=z),
    "mesh dp2 x pp2 x cp2": lambda P, net, z: MeshParallel(P, cpus(8), "momentum", 2, 1, 2, "gpipe", model=net,
                                                           context_parallel=2, zero_stage=z),
}


def steps(strategy, n=2):
    X, y = batch(16, 0)
    for _ in range(n):
        strategy.step(X, y, 0.05)
    return strategy.state_dict()


@pytest.fixture(scope="module")
def net_and_params():
    net = models.build("transformer", layers=4, d_model=16, heads=4)
    return net, net.init_params(0)


@functools.lru_cache(maxsize=None)
def stepped(layout, stage):
    """(strategy, its state_dict after `steps`) of `layout` under ZeRO `stage` (0: none), made once."""
    net = models.build("transformer", layers=4, d_model=16, heads=4)
    strategy = LAYOUTS[layout](net.init_params(0), net, stage)
    return strategy, steps(strategy)


def largest(state):
    return max(float(np.abs(w).max()) for w in state["params"])


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero_over_dp_equals_the_layout_without_it(layout, stage):
    (plain, want), (sharded, got) = stepped(layout, 0), stepped(layout, stage)
    scale = largest(want)
    assert max(float(np.abs(g - w).max()) for g, w in zip(got["params"], want["params"])) <= TOL * scale
    for G, W in zip(got["opt_state"], want["opt_state"]):
        for g, w in zip(G, W):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=TOL * scale)
    copies = sum(p.size for p in plain.arrays()["param"])        # momentum: one state element per parameter copy
    chunks = sharded.zero.state_arrays()
    assert 2 * sum(a.size for a in chunks) <= copies + len(chunks)   # every copy group spans D >= 2 contexts
    assert {a.context for a in chunks} <= set(sharded.ctx)
    if stage == 2:          # chunk r of a copy group's gradient on copy r's context; no whole .grad attached
        zero = sharded.zero
        for group, grads in zip(zero.groups, zero.grad_chunks):
            assert all(g is None or g.context == p.context for p, g in zip(group, grads))
            assert all(p.grad.size == 1 for p in group)
        assert sum(g.size for g in zero.grad_arrays()) == sum(len(group[0].reshape((-1,))) for group in zero.groups)


@pytest.mark.parametrize("layout", ["tensor dp2 x tp2", "context dp2 x cp2", "mesh dp2 x pp2 x tp2"])
def test_stage_2_equals_stage_1_and_one_context(net_and_params, layout):
    net, P = net_and_params
    one, (_, first), (_, second) = steps(DataParallel(P, cpus(1), "momentum", model=net)), stepped(layout, 1), \
        stepped(layout, 2)
    exact = not layout.startswith("mesh")          # one backward a step: stage 1's order of the sum
    for a, b in zip(second["params"] + [s for S in second["opt_state"] for s in S],
                    first["params"] + [s for S in first["opt_state"] for s in S]):
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            assert float(np.abs(a - b).max()) <= 1e-6 * largest(first)
    for a, b in zip(second["params"], one["params"]):
        assert float(np.abs(a - b).max()) <= TOL * largest(one)


@pytest.mark.parametrize("stage", [1, 2])
def test_each_context_holds_a_1_over_d_chunk_of_the_state(net_and_params, stage):
    net, P = net_and_params
    model = ContextParallel(P, cpus(4), "momentum", 2, model=net, zero_stage=stage)   # every parameter on 4 contexts
    kinds = [model.zero.state_arrays()] + ([model.zero.grad_arrays()] if stage == 2 else [])
    for arrays in kinds:
        per = {}
        for a in arrays:
            per[str(a.context)] = per.get(str(a.context), 0) + a.size
        assert sum(per.values()) == net.n_params()                  # each element once in the job
        assert max(per.values()) - min(per.values()) <= len(net.param_table())   # chunks differ by one at most


def test_stage_2_gradient_bytes_are_1_over_d_of_stage_1s(net_and_params):
    """The memory report's gradient bytes (memory.held_bytes: Strategy.arrays) per context of dp2 x
    tp2: stage 1 every copy's whole .grad, stage 2 a half of it (chunks of uneven groups differ by
    one element, 4 bytes, at most)."""
    net, P = net_and_params
    held = {z: memory.held_bytes(TensorParallel(P, cpus(4), "momentum", 2, model=net, zero_stage=z)) for z in (1, 2)}
    slack = 4 * len(net.param_table())
    for c, one in held[1].items():
        assert one["grad_bytes"] > 0 and abs(held[2][c]["grad_bytes"] - one["grad_bytes"] / 2) <= slack, (c, held)
        assert held[2][c]["state_bytes"] == one["state_bytes"] and held[2][c]["param_bytes"] == one["param_bytes"]


def test_stage_2_resumes_as_if_never_stopped(net_and_params):
    """A checkpoint (the optimiser state whole) taken after a step of the mesh under stage 2, loaded
    into a fresh one: two more steps give the bits of three uninterrupted ones (gradients are zero
    between steps: nothing of them to save)."""
    net, P = net_and_params
    X, y = batch(16, 3)
    straight, resumed, state = straight_and_resumed(lambda: LAYOUTS["mesh dp2 x pp2 x tp2"](P, net, 2),
                                                    LAYOUTS["mesh dp2 x pp2 x tp2"](P, net, 2), X, y)
    assert all(np.asarray(s).shape == np.shape(p) for p, S in zip(state["params"], state["opt_state"]) for s in S)
    for a, b in zip(resumed.state_dict()["params"], straight.state_dict()["params"]):
        np.testing.assert_array_equal(a, b)


def test_zero_checkpoints_move_to_sync_and_back(net_and_params):
    net, P = net_and_params
    mesh = LAYOUTS["mesh dp2 x pp2 x tp2"](P, net, 1)
    steps(mesh, 1)
    sync = DataParallel(P, cpus(1), "momentum", model=net)
    sync.load_state_dict(mesh.state_dict())
    again = LAYOUTS["tensor dp3 x tp2 +sp"](P, net, 1)
    again.load_state_dict(sync.state_dict())
    X, y = batch(16, 5)
    sync.step(X, y, 0.05)
    again.step(X, y, 0.05)
    scale = max(float(np.abs(w).max()) for w in sync.state_dict()["params"])
    for a, b in zip(again.state_dict()["params"], sync.state_dict()["params"]):
        assert float(np.abs(a - b).max()) <= TOL * scale


SMALL = ["--train-size", "96", "--test-size", "40", "--batch-size", "32", "--epochs", "1", "--no-progress",
         "--optimizer", "momentum", "--model", "transformer", "--layers", "4", "--d-model", "16", "--heads", "4"]


def losses(capsys, data_dir, log, argv):
    """(train losses by epoch, stdout) of a CLI run on SMALL."""
    code, out, err = run_main(capsys, [*SMALL, "--data-dir", str(data_dir), "--log-json", str(log), *argv])
    assert code == 0, err
    return [json.loads(line)["train_loss"] for line in log.read_text().splitlines()], out


@pytest.fixture(scope="module")
def one_context_loss(data_dir, tmp_path_factory):
    from manual_dp.train import main
    log = tmp_path_factory.mktemp("one") / "one.jsonl"
    main([*SMALL, "--data-dir", str(data_dir), "--log-json", str(log), "--cpus", "1"])
    return json.loads(log.read_text().splitlines()[0])["train_loss"]


@pytest.mark.parametrize("stage", [1, 2])
def test_cli_zero_stage_over_the_data_dimension(capsys, data_dir, tmp_path, one_context_loss, stage):
    """First-epoch loss within 1e-4 of one context's: float32 sums in other orders over 3 batches."""
    (mesh, *_), out = losses(capsys, data_dir, tmp_path / "mesh.jsonl", ["--cpus", "8", "--mesh", "dp=2,pp=2,tp=2",
                                                                       "--zero-stage", str(stage), "--micro-batches", "2"])
    held = {1: "optimiser state", 2: "optimiser state and gradients"}[stage]
    assert f"{held} sharded over the data dimension (ZeRO-{stage})" in out
    assert abs(mesh - one_context_loss) <= 1e-4 * one_context_loss


def test_cli_zero_stage_2_checkpoint_resumes(capsys, data_dir, tmp_path):
    """--mode tensor --zero-stage 2, stopped after an epoch and resumed: the losses of a straight run."""
    argv, ck = ["--cpus", "4", "--mode", "tensor", "--tensor-parallel", "2", "--zero-stage", "2"], tmp_path / "ck"
    straight, _ = losses(capsys, data_dir, tmp_path / "straight.jsonl", [*argv, "--epochs", "2"])
    losses(capsys, data_dir, tmp_path / "first.jsonl", [*argv, "--checkpoint-dir", str(ck)])
    resumed, out = losses(capsys, data_dir, tmp_path / "resumed.jsonl",
                          [*argv, "--epochs", "2", "--checkpoint-dir", str(ck), "--resume"])
    assert "resumed from" in out and resumed == straight           # the log carries epoch 1 from the checkpoint


@pytest.mark.parametrize("argv,message", [
    (["--cpus", "4", "--mesh", "dp=2,tp=2", "--zero-stage", "3"], "only stages 1 and 2"),
    (["--cpus", "2", "--zero-stage", "1"], "--zero-stage applies only to --mode zero or tensor or context or mesh"),
])
def test_bad_zero_over_dp_is_one_line(capsys, data_dir, argv, message):
    code, _, err = run_main(capsys, [*SMALL, "--data-dir", str(data_dir), *argv])
    assert code == 2 and len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_over_dp_across_processes_is_refused_in_one_line(stage):
    """Every process would shard over its own contexts only: refused before anything is built (the
    trainer prints the UsageError as one line and exits 2)."""
    from manual_dp.cli.build import build_model
    from manual_dp.config import RunConfig, resolve
    from manual_dp.errors import UsageError
    from manual_dp.multiprocess.world import World

    class TwoProcesses(World):
        size = 2
    cfg = resolve(RunConfig(mode="tensor", tensor_parallel=2, zero_stage=stage, model="transformer", layers=4,
                            d_model=16, heads=4))
    net = models.build("transformer", layers=4, d_model=16, heads=4)
    with pytest.raises(UsageError) as e:
        build_model(cfg, net.init_params(0), cpus(4), TwoProcesses())
    assert str(e.value).splitlines() == [f"--zero-stage with --mode tensor shards over this process's contexts only: "
                                         f"not yet across 2 processes"]
