"""ZeRO stages 1-3 over a mesh's data dimension (strategies/zero/dp_zero.py, `--zero-stage 1|2|3` with
tensor, context and mesh modes) against the same layout without it: the same per-element arithmetic
(a sum over the copies, then the update), so the parameters agree to float32 rounding of the sum's
order (1e-5 of the largest, with momentum; Adam would turn the rounding noise of a gradient that is
zero in exact arithmetic into whole steps), and each context holds 1/D of the optimiser state (and,
in stage 2, of the summed gradient; in stage 3, between steps, of the parameters).

Stage 2 against stage 1: where a step is one backward (tensor, context) stage 2 adds the copies'
gradients in stage 1's order (add_n over the copies, into a zero chunk), so the bits are equal; in
a pipeline stage 2 sums each micro-batch's gradient into the chunks as it is made (so that no copy
keeps a whole gradient between backwards), replica by replica, while stage 1 adds a copy's
micro-batches first and then the copies: another order of the same float32 sum, so 1e-6 of the
largest parameter after two momentum steps (measured: 1e-7).

Stage 3 against stage 2: the gradients are scattered into the chunks as in stage 2 (the same sum
in the same order) and the update is the same rule on the same chunk (stage 2 steps a view of the
flat parameter, stage 3 the kept chunk); the all-gather only copies. So the bits are equal, in a
pipeline too."""
import functools
import json

import numpy as np
import pytest

from conftest import batch, cpus, run_main, straight_and_resumed
from manual_dp import DataParallel, memory, models
from manual_dp.strategies.context.context import ContextParallel
from manual_dp.strategies.context.context_tensor import ContextTensorParallel
from manual_dp.strategies.zero.dp_zero import gathered
from manual_dp.strategies.mesh.mesh_parallel import MeshParallel
from manual_dp.strategies.tensor.tensor import TensorParallel

TOL = 1e-5
LAYOUTS = {
    "tensor dp2 x tp2": lambda P, net, z: TensorParallel(P, cpus(4), "momentum", 2, model=net, zero_stage=z),
    "tensor dp3 x tp2 +sp": lambda P, net, z: TensorParallel(P, cpus(6), "momentum", 2, model=net,
                                                            sequence_parallel=True, zero_stage=z),
    "context dp2 x cp2": lambda P, net, z: ContextParallel(P, cpus(4), "momentum", 2, model=net, zero_stage=z),
    "context dp2 x cp2 x tp2": lambda P, net, z: ContextTensorParallel(P, cpus(8), "momentum", 2, 2, model=net,
                                                                      zero_stage=z),
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


def per_context(arrays):
    """{context name: elements} of `arrays`."""
    out = {}
    for a in arrays:
        out[str(a.context)] = out.get(str(a.context), 0) + a.size
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
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
    if stage == 3:
        check_stage_3_holds_chunks(plain, sharded)


def check_stage_3_holds_chunks(plain, sharded):
    """Between steps every copy is a 1-element stand-in and chunk r of its group's parameter lives on
    copy r's context: every element once in the job, and on every context at most 1/D <= 1/2 of the
    parameter elements of the layout without ZeRO (D = 2 here; 4 or 6 where a copy group spans a
    context-parallel or sequence-parallel group too; a group's chunks differ by one element at most,
    and each copy adds a 1-element stand-in); inside `gathered` every copy is whole, on its own
    context, and equal to the others."""
    zero, kept, full = sharded.zero, per_context(sharded.arrays()["param"]), per_context(plain.arrays()["param"])
    for group, chunks in zip(zero.groups, zero.param_chunks):
        assert all(p.size == 1 for p in group)
        assert all(c is None or c.context == p.context for p, c in zip(group, chunks))
    assert sum(a.size for a in zero.param_arrays()) == sum(int(np.prod(shape)) for shape in zero.shapes)
    for c, n in full.items():
        assert kept[c] <= n / 2 + 2 * len(zero.groups), (c, kept, full)
    with gathered(zero):
        for group, shape in zip(zero.groups, zero.shapes):
            contexts = [p.context for p in group]
            assert all(p.shape == shape for p in group) and len(set(contexts)) == len(group)
            assert all(np.array_equal(p.asnumpy(), group[0].asnumpy()) for p in group[1:])
        assert zero.depth == 1
    assert zero.depth == 0 and all(p.size == 1 for group in zero.groups for p in group)


@pytest.fixture(scope="module")
def one_context(net_and_params):
    net, P = net_and_params
    return steps(DataParallel(P, cpus(1), "momentum", model=net))


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("layout", ["tensor dp2 x tp2", "context dp2 x cp2", "context dp2 x cp2 x tp2",
                                    "mesh dp2 x pp2 x tp2"])
def test_each_stage_equals_the_one_before_and_one_context(one_context, layout, stage):
    """Stage 2 against 1 and stage 3 against 2 (bits, or 1e-6: see the module's docstring); both
    against one context (--mode sync --cpus 1) to 1e-5 of the largest parameter."""
    one, (_, first), (_, second) = one_context, stepped(layout, stage - 1), stepped(layout, stage)
    exact = stage == 3 or not layout.startswith("mesh")      # one backward a step: stage 1's order of the sum
    for a, b in zip(second["params"] + [s for S in second["opt_state"] for s in S],
                    first["params"] + [s for S in first["opt_state"] for s in S]):
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            assert float(np.abs(a - b).max()) <= 1e-6 * largest(first)
    for a, b in zip(second["params"], one["params"]):
        assert float(np.abs(a - b).max()) <= TOL * largest(one)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_context_holds_a_1_over_d_chunk_of_the_state(net_and_params, stage):
    net, P = net_and_params
    model = ContextParallel(P, cpus(4), "momentum", 2, model=net, zero_stage=stage)   # every parameter on 4 contexts
    kinds = [model.zero.state_arrays()] + ([model.zero.grad_arrays()] if stage >= 2 else []) + \
        ([model.zero.param_arrays()] if stage == 3 else [])
    for arrays in kinds:
        per = {}
        for a in arrays:
            per[str(a.context)] = per.get(str(a.context), 0) + a.size
        assert sum(per.values()) == net.n_params()                  # each element once in the job
        assert max(per.values()) - min(per.values()) <= len(net.param_table())   # chunks differ by one at most


@pytest.mark.parametrize("stage", [2, 3])
def test_each_stage_halves_the_bytes_it_shards(net_and_params, stage):
    """The memory report's bytes (memory.held_bytes: Strategy.arrays) per context of dp2 x tp2: stage
    2's gradient bytes a half of stage 1's (every copy's whole .grad), stage 3's parameter bytes
    between steps a half of stage 2's (chunks of uneven groups differ by one element, 4 bytes, at
    most; stage 3 adds a 1-element stand-in per array); the rest equal. During a step (peak_arrays)
    stage 3 holds stage 2's parameters whole and its chunks."""
    net, P = net_and_params
    models_ = {z: TensorParallel(P, cpus(4), "momentum", 2, model=net, zero_stage=z) for z in (stage - 1, stage)}
    held = {z: memory.held_bytes(m) for z, m in models_.items()}
    kind, slack = ("grad", 4) if stage == 2 else ("param", 8)
    for c, before in held[stage - 1].items():
        after = held[stage][c]
        assert before[f"{kind}_bytes"] > 0, (c, held)
        assert abs(after[f"{kind}_bytes"] - before[f"{kind}_bytes"] / 2) <= slack * len(net.param_table()), (c, held)
        assert all(after[f"{k}_bytes"] == before[f"{k}_bytes"] for k in memory.KINDS if k != kind)
    if stage == 3:
        during = per_context(models_[3].peak_arrays()["param"])
        for c, before in held[2].items():
            assert during[c] * 4 == before["param_bytes"] + held[3][c]["param_bytes"]


@pytest.mark.parametrize("stage", [2, 3])
def test_stage_resumes_as_if_never_stopped(net_and_params, stage):
    """A checkpoint (the parameters and optimiser state whole) taken after a step of the mesh under
    stage 2 or 3, loaded into a fresh one: two more steps give the bits of three uninterrupted ones
    (gradients are zero between steps: nothing of them to save)."""
    net, P = net_and_params
    X, y = batch(16, 3)
    straight, resumed, state = straight_and_resumed(lambda: LAYOUTS["mesh dp2 x pp2 x tp2"](P, net, stage),
                                                    LAYOUTS["mesh dp2 x pp2 x tp2"](P, net, stage), X, y)
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


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cli_zero_stage_over_the_data_dimension(capsys, data_dir, tmp_path, one_context_loss, stage):
    """First-epoch loss within 1e-4 of one context's: float32 sums in other orders over 3 batches;
    every copy's checksums compared after every update (stage 3: the gathered copies)."""
    (mesh, *_), out = losses(capsys, data_dir, tmp_path / "mesh.jsonl", ["--cpus", "8", "--mesh", "dp=2,pp=2,tp=2",
                                                                       "--zero-stage", str(stage), "--micro-batches", "2",
                                                                       "--check-replicas", "1"])
    held = {1: "optimiser state", 2: "optimiser state and gradients",
            3: "optimiser state, gradients and parameters"}[stage]
    assert f"{held} sharded over the data dimension (ZeRO-{stage})" in out
    assert abs(mesh - one_context_loss) <= 1e-4 * one_context_loss


@pytest.mark.parametrize("layout", [["--cpus", "4", "--mode", "tensor", "--tensor-parallel", "2"],
                                    ["--cpus", "8", "--mesh", "dp=2,pp=2,tp=2", "--micro-batches", "2"]])
def test_cli_zero_stage_3_checkpoint_resumes(capsys, data_dir, tmp_path, layout):
    """dp2 x tp2 or dp2 x pp2 x tp2 under --zero-stage 3, stopped after an epoch and resumed: the
    losses of a straight run (stage 2's resume: test_stage_resumes_as_if_never_stopped)."""
    argv, ck = [*layout, "--zero-stage", "3"], tmp_path / "ck"
    straight, _ = losses(capsys, data_dir, tmp_path / "straight.jsonl", [*argv, "--epochs", "2"])
    losses(capsys, data_dir, tmp_path / "first.jsonl", [*argv, "--checkpoint-dir", str(ck)])
    resumed, out = losses(capsys, data_dir, tmp_path / "resumed.jsonl",
                          [*argv, "--epochs", "2", "--checkpoint-dir", str(ck), "--resume"])
    assert "resumed from" in out and resumed == straight           # the log carries epoch 1 from the checkpoint


@pytest.mark.parametrize("argv,message", [
    (["--cpus", "8", "--mesh", "dp=2,pp=2,tp=2", "--zero-stage", "3", "--deterministic"], "not --zero-stage"),
    (["--cpus", "4", "--mode", "context", "--zero-stage", "3", "--deterministic"], "not --zero-stage"),
    (["--cpus", "2", "--zero-stage", "1"], "--zero-stage applies only to --mode zero or tensor or context or mesh"),
])
def test_bad_zero_over_dp_is_one_line(capsys, data_dir, argv, message):
    code, _, err = run_main(capsys, [*SMALL, "--data-dir", str(data_dir), *argv])
    assert code == 2 and len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_over_dp_across_processes_is_refused_in_one_line(stage):
    """Every process would shard over its own contexts only: refused before anything is built (the
    trainer prints the UsageError as one line and exits 2)."""
    from manual_dp.cli.build import build_model
    from manual_dp.config import RunConfig
    from manual_dp.modes import resolve
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
