"""dp x pp x tp at once (strategies/mesh/mesh_parallel.py) against one context: a small transformer, two
steps of SGD with momentum, parameters to 1e-5 of the largest (float32 sums of micro-batches and
shards in another order; the tolerance of every layout in tests/test_models.py). Adam is not used:
it turns the rounding noise of a gradient that is zero in exact arithmetic (the key bias: softmax
ignores a constant added to every key) into whole steps."""
import json

import numpy as np
import pytest

from conftest import batch, cpus, run_main
from manual_dp import DataParallel, models
from manual_dp.strategies.mesh.mesh_parallel import MeshParallel
from manual_dp.strategies.tensor.tensor_layout import shard

TOL = 1e-5


def steps(strategy, n=2):
    X, y = batch(16, 0)
    metrics = [strategy.step(X, y, 0.05) for _ in range(n)]
    return strategy.state_dict(), metrics


@pytest.fixture(scope="module")
def reference():
    net = models.build("transformer", layers=4, d_model=16, heads=4)
    P = net.init_params(0)
    return net, P, steps(DataParallel(P, cpus(1), "momentum", lesson=True, model=net))


@pytest.mark.parametrize("n,S,T,schedule,V,sp", [
    (4, 2, 2, "1f1b", 1, False), (4, 2, 2, "gpipe", 1, True), (8, 2, 2, "1f1b", 1, False),
    (8, 2, 2, "interleaved", 2, True), (6, 3, 2, "1f1b", 1, False), (2, 2, 1, "1f1b", 1, False),
    (2, 1, 2, "gpipe", 1, True), (4, 4, 1, "interleaved", 1, False)])
def test_3d_equals_one_context(reference, n, S, T, schedule, V, sp):
    net, P, (want, want_metrics) = reference
    strategy = MeshParallel(P, cpus(n), "momentum", S, T, 4, schedule, V, model=net, sequence_parallel=sp)
    got, metrics = steps(strategy)
    scale = max(float(np.abs(w).max()) for w in want["params"])
    assert max(float(np.abs(g - w).max()) for g, w in zip(got["params"], want["params"])) <= TOL * scale
    for G, W in zip(got["opt_state"], want["opt_state"]):
        for g, w in zip(G, W):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=TOL * scale)
    loss = sum(float(l.asscalar()) for l, _ in metrics[0])
    assert abs(loss - sum(float(l.asscalar()) for l, _ in want_metrics[0])) <= 1e-4 * loss
    mesh = strategy.mesh
    for r, row in enumerate(strategy.params):
        for k, stage in enumerate(row):
            for j, shards in enumerate(stage):
                c = cpus(n)[mesh.rank(dp=r, pp=k % S, tp=j)]
                assert all(p.context == c and p.grad.context == c for p in shards)


def test_3d_checkpoints_move_to_sync_and_back(reference):
    net, P, _ = reference
    mesh = MeshParallel(P, cpus(4), "momentum", 2, 2, 2, model=net)
    steps(mesh, 1)
    sync = DataParallel(P, cpus(1), "momentum", model=net)
    sync.load_state_dict(mesh.state_dict())
    again = MeshParallel(P, cpus(8), "momentum", 2, 2, 4, "1f1b", model=net, sequence_parallel=True)
    again.load_state_dict(sync.state_dict())
    for a, b in zip(again.state_dict()["params"], mesh.state_dict()["params"]):
        np.testing.assert_array_equal(a, b)
    X, y = batch(16, 3)
    from mxnet import nd
    assert float(again.correct(nd.array(X), nd.array(y)).asscalar()) == \
        float(sync.correct(nd.array(X), nd.array(y)).asscalar())


@pytest.mark.parametrize("kw,message", [
    (dict(n=6, S=2, T=2), "pp=2 x tp=2 does not divide the 6 contexts"),
    (dict(n=4, S=2, T=2, schedule="zb-h1"), "zb-h1 with tp: not yet"),
    (dict(n=4, S=4, T=1, V=2, schedule="interleaved"), "4 stages x 2 virtual stages need 8 layers"),
    (dict(n=6, S=2, T=3), "3 does not divide the transformer's 4 heads"),
    (dict(n=4, S=2, T=2, model="lenet"), "lenet splits as a whole model"),
])
def test_bad_3d_layouts_are_refused(reference, kw, message):
    net, P, _ = reference
    if kw.get("model") == "lenet":
        net = models.build("lenet")
        P = net.init_params(0)
    with pytest.raises(ValueError, match=message):
        MeshParallel(P, cpus(kw["n"]), "momentum", kw["S"], kw["T"], 4, kw.get("schedule", "1f1b"), kw.get("V", 1),
                     model=net)


DATA = ["--train-size", "96", "--test-size", "40", "--batch-size", "32", "--epochs", "1", "--no-progress",
        "--optimizer", "sgd"]
SMALL = [*DATA, "--model", "transformer", "--layers", "4", "--d-model", "16", "--heads", "4"]


def test_cli_8_contexts_dp_pp_tp_equal_one(capsys, data_dir, tmp_path):
    def first(name, *argv):
        log = tmp_path / f"{name}.jsonl"
        code, out, err = run_main(capsys, [*SMALL, "--data-dir", str(data_dir), "--log-json", str(log), *argv])
        assert code == 0, err
        return out, json.loads(log.read_text().splitlines()[0])
    _, one = first("one", "--cpus", "1")
    out, got = first("mesh", "--cpus", "8", "--mesh", "dp=2,pp=2,tp=2", "--micro-batches", "4", "--schedule", "1f1b",
                     "--sequence-parallel")
    assert got["mode"] == "mesh" and abs(got["train_loss"] - one["train_loss"]) <= 1e-4 * one["train_loss"]
    assert "mesh dp=2 x pp=2 x tp=2 over 8 contexts" in out
    assert "  tp groups [cpu(0) cpu(1)] [cpu(2) cpu(3)] [cpu(4) cpu(5)] [cpu(6) cpu(7)]" in out


@pytest.mark.parametrize("argv,message", [
    (["--cpus", "8", "--mesh", "pp=2,cp=2,tp=2", "--sequence-parallel"], "cp with --sequence-parallel inside a pipeline"),
    (["--cpus", "4", "--mode", "mesh", "--context-parallel", "2", "--tensor-parallel", "2"],
     "needs a multiple of --stages 2 x --context-parallel x --tensor-parallel 4 contexts, got 4"),
    (["--cpus", "4", "--mesh", "pp=2,tp=2", "--model", "mlp"], "--mode mesh (tp x pp) needs layers that split"),
    (["--cpus", "4", "--mesh", "pp=2,tp=2", "--schedule", "zb-h1"], "zb-h1 with tp: not yet"),
    (["--cpus", "6", "--mode", "mesh"], "needs a multiple of --stages 2 x --tensor-parallel 2 contexts, got 6"),
])
def test_bad_3d_meshes_end_in_one_line(capsys, data_dir, argv, message):
    base = DATA if "mlp" in argv else SMALL
    code, _, err = run_main(capsys, [*base, "--data-dir", str(data_dir), *argv])
    assert code == 2 and len(err) == 1 and message in err[0], err


# dp x pp x cp: each pipeline stage a context-parallel group ----------------------------------------

@pytest.mark.parametrize("n,S,C,schedule,V,attention", [
    (4, 2, 2, "1f1b", 1, "ring"), (4, 2, 2, "gpipe", 1, "ulysses"), (8, 2, 2, "interleaved", 2, "ring"),
    (6, 2, 3, "1f1b", 1, "ring"), (8, 2, 4, "1f1b", 1, "ulysses")])
def test_pipelines_of_context_groups_equal_one_context(reference, n, S, C, schedule, V, attention):
    net, P, (want, _) = reference
    strategy = MeshParallel(P, cpus(n), "momentum", S, 1, 4, schedule, V, model=net, context_parallel=C,
                            attention=attention)
    got, _ = steps(strategy)
    scale = max(float(np.abs(w).max()) for w in want["params"])
    assert max(float(np.abs(g - w).max()) for g, w in zip(got["params"], want["params"])) <= TOL * scale
    for r, row in enumerate(strategy.params):
        for k, stage in enumerate(row):
            for j, copy in enumerate(stage):
                c = cpus(n)[strategy.mesh.rank(dp=r, pp=k % S, cp=j)]
                assert all(p.context == c and p.grad.context == c for p in copy)


def test_cli_dp_pp_cp_equals_one(capsys, data_dir, tmp_path):
    logs = {}
    for name, argv in (("one", ["--cpus", "1"]),
                       ("mesh", ["--cpus", "8", "--mesh", "dp=2,pp=2,cp=2", "--micro-batches", "2",
                                 "--attention", "ulysses"])):
        log = tmp_path / f"{name}.jsonl"
        code, out, err = run_main(capsys, [*SMALL, "--data-dir", str(data_dir), "--log-json", str(log), *argv])
        assert code == 0, err
        logs[name] = json.loads(log.read_text().splitlines()[0])
    assert logs["mesh"]["mode"] == "mesh"
    assert abs(logs["mesh"]["train_loss"] - logs["one"]["train_loss"]) <= 1e-4 * logs["one"]["train_loss"]


# dp x pp x cp x tp: each pipeline stage a C x T grid -------------------------------------------------

@pytest.mark.parametrize("n,S,C,T,schedule,V,attention", [
    (8, 2, 2, 2, "1f1b", 1, "ring"), (8, 2, 2, 2, "interleaved", 2, "ulysses"), (8, 1, 2, 2, "gpipe", 1, "ring")])
def test_pipelines_of_grids_equal_one_context(reference, n, S, C, T, schedule, V, attention):
    """Each stage's grid: rank c T + t on mesh.rank(dp, pp, cp=c, tp=t), holding tensor shard t."""
    net, P, (want, want_metrics) = reference
    strategy = MeshParallel(P, cpus(n), "momentum", S, T, 4, schedule, V, model=net, context_parallel=C,
                            attention=attention)
    got, metrics = steps(strategy)
    scale = max(float(np.abs(w).max()) for w in want["params"])
    assert max(float(np.abs(g - w).max()) for g, w in zip(got["params"], want["params"])) <= TOL * scale
    loss = sum(float(l.asscalar()) for l, _ in metrics[0])
    assert abs(loss - sum(float(l.asscalar()) for l, _ in want_metrics[0])) <= 1e-4 * loss
    for r, row in enumerate(strategy.params):
        for k, stage in enumerate(row):
            for j, shards in enumerate(stage):
                c = cpus(n)[strategy.mesh.rank(dp=r, pp=k % S, cp=j // T, tp=j % T)]
                assert all(p.context == c and p.grad.context == c for p in shards)
                whole = [P[g] for g in range(strategy.own[k].start, strategy.own[k].stop)]
                assert [p.shape for p in shards] == [shard(w.asnumpy(), a, j % T, T).shape for w, a in
                                                     zip(whole, strategy.split[strategy.own[k]])]


def test_cli_dp_pp_cp_tp_equals_one(capsys, data_dir, tmp_path):
    logs = {}
    for name, argv in (("one", ["--cpus", "1"]),
                       ("mesh", ["--cpus", "8", "--mesh", "pp=2,cp=2,tp=2", "--micro-batches", "2"])):
        log = tmp_path / f"{name}.jsonl"
        code, out, err = run_main(capsys, [*SMALL, "--data-dir", str(data_dir), "--log-json", str(log), *argv])
        assert code == 0, err
        logs[name] = json.loads(log.read_text().splitlines()[0])
    assert logs["mesh"]["mode"] == "mesh" and "mesh pp=2 x cp=2 x tp=2 over 8 contexts" in out
    assert abs(logs["mesh"]["train_loss"] - logs["one"]["train_loss"]) <= 1e-4 * logs["one"]["train_loss"]
