"""--deterministic --mode mesh: dp x pp x tp with the bits of one context's --deterministic step under
the same --tensor-pieces, on any mesh whose tp divides the pieces, on GPipe, 1F1B and interleaved,
and across processes (issue 22).

Bit-identity holds when every process runs its ops with the same thread count: the in-process tests
run in one process (one thread count for every layout), the command-line ones start every process
with one thread per op (jobs.PINNED, and what the command line sets for --deterministic).
"""
import hashlib

import pytest

from conftest import batch, cpus, run_main
from jobs import assert_same_run, launch_cmd, train_cmd
from manual_dp import models
from manual_dp.strategies.data.data_parallel import DataParallel
from manual_dp.strategies.sums.fixed_sums import FixedSums
from manual_dp.strategies.mesh.mesh_parallel import MeshParallel
from manual_dp.strategies.pipeline.pipeline import PipelineParallel
from manual_dp.strategies.tensor.tensor import TensorParallel
from test_deterministic import data, run  # noqa: F401 (the data fixture; a logged, checkpointed run)


def mesh(n, S, T, micro, schedule="gpipe", V=1):
    return lambda P, net, opt: MeshParallel(P, cpus(n), opt, S, T, micro, schedule, V,
                                            sums=FixedSums(tensor_pieces=4), model=net)


LAYOUTS = {     # name: a function (params, net, optimiser) -> the strategy
    "pp2 x tp2, gpipe x1": mesh(4, 2, 2, 1),
    "pp2 x tp2, 1f1b x3": mesh(4, 2, 2, 3, "1f1b"),
    "dp2 x pp2 x tp2, gpipe x2": mesh(8, 2, 2, 2),
    "dp2 x pp2 x tp2, 1f1b x2": mesh(8, 2, 2, 2, "1f1b"),
    "pp2 x 2 chunks x tp2, interleaved x4": mesh(4, 2, 2, 4, "interleaved", 2),
    "pp2 x tp4, 1f1b x2": mesh(8, 2, 4, 2, "1f1b"),
    "dp2 x pp2 x tp1, gpipe x2": mesh(4, 2, 1, 2),
}


def digest(strategy, steps=2):
    """The SHA-256 of the parameters and optimiser state after `steps` steps on 150 rows (3 pieces:
    64, 64, 22), and the losses."""
    X, y = batch(150, 0)
    losses = [float(strategy.step(X, y, 0.05)[0][0].asscalar()) for _ in range(steps)]
    state = strategy.state_dict()
    arrays = state["params"] + [s for st in state["opt_state"] for s in st]
    return hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest(), losses


@pytest.fixture(scope="module")
def net():
    return models.build("transformer", layers=2, d_model=16, heads=4)


@pytest.fixture(scope="module")
def reference(net):
    """One context's --deterministic --tensor-pieces 4 step, per optimiser."""
    return {opt: digest(DataParallel(net.init_params(0), cpus(1), opt, model=net, sums=FixedSums(tensor_pieces=4)))
            for opt in ("sgd", "adam")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_mesh_has_one_contexts_bits(net, reference, layout):
    """Parameters, adam's state and both reported losses: exactly one context's."""
    assert digest(LAYOUTS[layout](net.init_params(0), net, "adam")) == reference["adam"]


def test_the_tensor_and_pipeline_layouts_have_them_too(net, reference):
    """The other deterministic layouts of the same pieces, beside a mesh, on sgd."""
    for make in (lambda P: TensorParallel(P, cpus(2), "sgd", 2, model=net, sums=FixedSums(tensor_pieces=4)),
                 lambda P: PipelineParallel(P, cpus(2), "sgd", 2, stages=2, schedule="1f1b", model=net,
                                            sums=FixedSums(tensor_pieces=4)),
                 lambda P: mesh(8, 2, 2, 2, "1f1b")(P, net, "sgd")):
        assert digest(make(net.init_params(0))) == reference["sgd"]


def test_the_plain_mesh_does_not(net, reference):
    """Without the pieces and the tree a mesh adds its micro-batches and partial products as they
    come: other bits (so the equalities above are not vacuous)."""
    plain = MeshParallel(net.init_params(0), cpus(4), "adam", 2, 2, 3, "1f1b", model=net)
    assert digest(plain)[0] != reference["adam"][0]


def test_every_shard_lives_on_its_mesh_context_and_copies_agree(net):
    """Context mesh.rank(dp=r, pp=k, tp=j) holds replica r's stage k shard j, its gradient and state;
    the tree's totals end on replica 0's context of each stage and shard; every replica's copy of a
    shard has the same checksums after a step."""
    model = mesh(8, 2, 2, 2, "1f1b")(net.init_params(0), net, "adam")
    ctx = cpus(8)
    model.backward(*batch(150, 0))
    for k, held_k in enumerate(model.held):
        assert [t.context for t in held_k] == [ctx[model.mesh.rank(dp=0, pp=k, tp=j)] for j in range(2)]
    model.update(0.05, 150)
    for r, row in enumerate(model.params):
        for k, stage in enumerate(row):
            for j, P in enumerate(stage):
                c = ctx[model.mesh.rank(dp=r, pp=k, tp=j)]
                assert {p.context for p in P} | {p.grad.context for p in P} == {c}
                assert {s.context for st in model.states[r][k][j] for s in st} == {c}
    for copies in model.fingerprints().values():
        assert len(copies) == 2 and len({repr(sums) for _, sums in copies}) == 1


def test_a_checkpoint_moves_between_a_mesh_one_context_and_tensor_mode(net, reference):
    """One step on dp2 x pp2 x tp2, its checkpoint resumed on one context and on tensor mode (T = 4)
    for the second step: one context's bits after two steps, both ways."""
    X, y = batch(150, 0)
    first = mesh(8, 2, 2, 2)(net.init_params(0), net, "adam")
    first.step(X, y, 0.05)
    for other in (DataParallel(net.init_params(5), cpus(1), "adam", model=net, sums=FixedSums(tensor_pieces=4)),
                  TensorParallel(net.init_params(5), cpus(4), "adam", 4, model=net, sums=FixedSums(tensor_pieces=4))):
        other.load_state_dict(first.state_dict())
        other.step(X, y, 0.05)
        back = mesh(4, 2, 2, 1, "1f1b")(net.init_params(7), net, "adam")
        back.load_state_dict(other.state_dict())
        state = back.state_dict()
        assert back.t == 2
        got = hashlib.sha256(b"".join(a.tobytes() for a in state["params"] + sum(state["opt_state"], []))).hexdigest()
        assert got == reference["adam"][0]


@pytest.mark.parametrize("kw, match", [
    (dict(n=4, S=2, T=2, micro=2, schedule="zb-h1"), "zb-h1 with tp: not yet"),
    (dict(n=8, S=1, T=8, micro=1), "tp=8 the 4 pieces"),
])
def test_what_the_strategy_refuses(net, kw, match):
    with pytest.raises(ValueError, match=match):
        mesh(**kw)(net.init_params(0), net, "sgd")


# The command line ------------------------------------------------------------------------------------

TINY = ["--train-size", "300", "--batch-size", "100", "--optimizer", "adam", "--lr", "0.002", "--epochs", "2",
        "--test-size", "64", "--deterministic", "--model", "transformer", "--layers", "1", "--d-model", "16",
        "--heads", "4", "--tensor-pieces", "4"]


def test_cli_a_mesh_and_two_dist_sync_workers_of_meshes_have_one_contexts_bits(data, tmp_path):
    """--cpus 1 against pp=2 x tp=2 on 1F1B, and 2 dist_sync workers of dp=2 x pp=2 x tp=2 each (the
    data dimension over the processes): the same losses, accuracies and checkpoints, bit for bit."""
    one = run(tmp_path, "one", train_cmd("--cpus", 1, "--data-dir", data, *TINY))
    pp_tp = run(tmp_path, "mesh", train_cmd("--cpus", 4, "--mesh", "pp=2,tp=2", "--micro-batches", 2,
                                            "--schedule", "1f1b", "--data-dir", data, *TINY))
    assert_same_run(*one, *pp_tp, exact=True)
    workers = run(tmp_path, "kv", launch_cmd(2, "dist_sync", "--cpus", 8, "--mesh", "dp=2,pp=2,tp=2",
                                             "--micro-batches", 2, "--data-dir", data, *TINY))
    assert_same_run(*one, *workers, exact=True)


MODEL = ["--model", "transformer", "--layers", "1", "--d-model", "16", "--heads", "4", "--deterministic",
         "--epochs", "0"]


@pytest.mark.parametrize("argv, match", [
    (["--cpus", "4", "--mesh", "pp=2,cp=2", "--tensor-pieces", "2"], "--deterministic --mode mesh: dp x pp x tp or "
                                                                      "dp x pp x cp only: not cp with tp"),
    (["--cpus", "4", "--mesh", "pp=2,tp=2", "--sequence-parallel"], "--sequence-parallel --deterministic: --mode "
                                                                     "tensor only, not --mode mesh"),
    (["--cpus", "8", "--mesh", "pp=2,tp=4", "--tensor-pieces", "2"], "--deterministic --mode mesh cuts every "
                                                                      "split layer into 2 pieces"),
    (["--cpus", "4", "--mesh", "pp=2,tp=2", "--schedule", "zb-h1", "--micro-batches", "2"], "zb-h1 with tp"),
])
def test_cli_refusals_are_one_line(capsys, data_dir, argv, match):
    code, _, err = run_main(capsys, [*argv, *MODEL, "--data-dir", str(data_dir)])
    assert code == 2 and len(err) == 1 and match in err[0], err
