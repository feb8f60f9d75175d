"""dp x cp x tp (strategies/context/context_tensor.py): each context of a C x T grid holds a block of tokens
and a tensor shard; against one context on a small transformer (1e-5 of the largest parameter,
momentum: float32 sums in another order), with uneven blocks, both attentions, ZeRO-1 over dp, and
the command line's --mesh."""
import json

import numpy as np
import pytest
from mxnet import nd

from conftest import batch, cpus, run_main
from manual_dp import DataParallel, models
from manual_dp.strategies.context.context_tensor import ContextTensorParallel

TOL = 1e-5


def steps(strategy, n=2):
    X, y = batch(16, 0)
    for _ in range(n):
        strategy.step(X, y, 0.05)
    return strategy.state_dict()


@pytest.fixture(scope="module")
def reference():
    net = models.build("transformer", layers=2, d_model=16, heads=4)
    P = net.init_params(0)
    return net, P, steps(DataParallel(P, cpus(1), "momentum", lesson=True, model=net))


@pytest.mark.parametrize("n,C,T,attention,zero", [(4, 2, 2, "ring", 0), (4, 2, 2, "ulysses", 0), (8, 2, 2, "ring", 1),
                                                  (6, 3, 2, "ring", 0), (8, 2, 4, "ring", 0)])
def test_context_x_tensor_equals_one_context(reference, n, C, T, attention, zero):
    net, P, want = reference
    strategy = ContextTensorParallel(P, cpus(n), "momentum", C, T, attention, model=net, zero_stage=zero)
    got = steps(strategy)
    scale = max(float(np.abs(w).max()) for w in want["params"])
    assert max(float(np.abs(g - w).max()) for g, w in zip(got["params"], want["params"])) <= TOL * scale
    for G, W in zip(got["opt_state"], want["opt_state"]):
        for g, w in zip(G, W):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=TOL * scale)
    for r, grid in enumerate(strategy.params):
        for c, row in enumerate(grid):
            for t, shards in enumerate(row):
                where = cpus(n)[strategy.mesh.rank(dp=r, cp=c, tp=t)]
                assert all(p.context == where and p.grad.context == where for p in shards)
    for grid, shards in zip(strategy.grids, strategy.params):     # every cell computes on its own context
        scores = strategy.scores(grid, shards, nd.array(batch(8, 1)[0], ctx=grid[0][0]))
        assert [[s.context for s in row] for row in scores] == grid
    again = ContextTensorParallel(P, cpus(n), "momentum", C, T, attention, model=net, zero_stage=zero)
    again.load_state_dict(got)
    for a, b in zip(again.state_dict()["params"], got["params"]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("n,C,T,attention,message", [
    (6, 2, 2, "ring", "cp=2 x tp=2 does not divide the 6 contexts"),
    (8, 4, 2, "ulysses", "Ulysses needs cp=4 to divide the 2 heads of each of the tp=2 ranks"),
    (6, 2, 3, "ring", "3 does not divide the transformer's 4 heads"),
])
def test_bad_grids_are_refused(reference, n, C, T, attention, message):
    net, P, _ = reference
    with pytest.raises(ValueError, match=message):
        ContextTensorParallel(P, cpus(n), "momentum", C, T, attention, model=net)


def test_cli_dp_cp_tp_equals_one(capsys, data_dir, tmp_path):
    small = ["--train-size", "96", "--test-size", "40", "--batch-size", "32", "--epochs", "1", "--no-progress",
             "--optimizer", "sgd", "--model", "transformer", "--layers", "2", "--d-model", "16", "--heads", "4",
             "--data-dir", str(data_dir)]
    losses = {}
    for name, argv in (("one", ["--cpus", "1"]), ("grid", ["--cpus", "8", "--mesh", "dp=2,cp=2,tp=2", "--attention", "ulysses"])):
        log = tmp_path / f"{name}.jsonl"
        code, out, err = run_main(capsys, [*small, "--log-json", str(log), *argv])
        assert code == 0, err
        losses[name] = json.loads(log.read_text().splitlines()[0])
    assert losses["grid"]["mode"] == "context"
    assert "mesh dp=2 x cp=2 x tp=2 over 8 contexts" in out
    assert abs(losses["grid"]["train_loss"] - losses["one"]["train_loss"]) <= 1e-4 * losses["one"]["train_loss"]
