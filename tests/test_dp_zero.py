"""ZeRO stage 1 over a mesh's data dimension (strategies/dp_zero.py, `--zero-stage 1` with tensor,
context and mesh modes) against the same layout without it: the same per-element arithmetic (a sum
over the copies, then the update), so the parameters agree to float32 rounding of the sum's order
(1e-5 of the largest, with momentum; Adam would turn the rounding noise of a gradient that is zero
in exact arithmetic into whole steps), and each context holds 1/D of the optimiser state."""
import json

import numpy as np
import pytest

from conftest import batch, cpus, run_main
from manual_dp import DataParallel, models
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


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero_over_dp_equals_the_layout_without_it(net_and_params, layout):
    net, P = net_and_params
    plain, sharded = LAYOUTS[layout](P, net, 0), LAYOUTS[layout](P, net, 1)
    want, got = steps(plain), steps(sharded)
    scale = max(float(np.abs(w).max()) for w in want["params"])
    assert max(float(np.abs(g - w).max()) for g, w in zip(got["params"], want["params"])) <= TOL * scale
    for G, W in zip(got["opt_state"], want["opt_state"]):
        for g, w in zip(G, W):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=TOL * scale)
    copies = sum(p.size for p in plain.arrays()["param"])        # momentum: one state element per parameter copy
    chunks = sharded.zero.state_arrays()
    assert 2 * sum(a.size for a in chunks) <= copies + len(chunks)   # every copy group spans D >= 2 contexts
    assert {a.context for a in chunks} <= set(sharded.ctx)


def test_each_context_holds_a_1_over_d_chunk_of_the_state(net_and_params):
    net, P = net_and_params
    model = ContextParallel(P, cpus(4), "momentum", 2, model=net, zero_stage=1)     # every parameter on 4 contexts
    per = {}
    for a in model.zero.state_arrays():
        per[str(a.context)] = per.get(str(a.context), 0) + a.size
    assert sum(per.values()) == net.n_params()                     # each element's state once in the job
    assert max(per.values()) - min(per.values()) <= len(net.param_table())   # chunks differ by one at most


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


def test_cli_zero_stage_over_the_data_dimension(capsys, data_dir, tmp_path):
    losses = {}
    for name, argv in (("one", ["--cpus", "1"]), ("mesh", ["--cpus", "8", "--mesh", "dp=2,pp=2,tp=2", "--zero-stage", "1",
                                                          "--micro-batches", "2"])):
        log = tmp_path / f"{name}.jsonl"
        code, out, err = run_main(capsys, [*SMALL, "--data-dir", str(data_dir), "--log-json", str(log), *argv])
        assert code == 0, err
        losses[name] = json.loads(log.read_text().splitlines()[0])["train_loss"]
    assert "optimiser state sharded over the data dimension (ZeRO-1)" in out
    assert abs(losses["mesh"] - losses["one"]) <= 1e-4 * losses["one"]


@pytest.mark.parametrize("argv,message", [
    (["--cpus", "4", "--mesh", "dp=2,tp=2", "--zero-stage", "2"], "only stage 1"),
    (["--cpus", "2", "--zero-stage", "1"], "--zero-stage applies only to --mode zero or tensor or context or mesh"),
])
def test_bad_zero_over_dp_is_one_line(capsys, data_dir, argv, message):
    code, _, err = run_main(capsys, [*SMALL, "--data-dir", str(data_dir), *argv])
    assert code == 2 and len(err) == 1 and message in err[0], err
