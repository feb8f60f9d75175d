"""--deterministic on grids: the sequence in K pieces and every split layer in Q pieces at once
(cp x tp, strategies/context/grid_sums.py; Megatron-SP, strategies/tensor/sequence_sums.py), and
the sequence's pieces in pipelines (pp x cp, strategies/mesh/lane_sums.py), with the bits of one
context's --deterministic step given the same --sequence-pieces K (and --tensor-pieces Q).

Bit-identity holds when every process runs its ops with the same thread count: the in-process tests
run in one process (one thread count for every layout), the command-line ones start every process
with one thread per op (jobs.PINNED, and what the command line sets for --deterministic).
"""
import numpy as np
import pytest
from mxnet import nd

from conftest import batch, cpus, run_main
from jobs import assert_same_run, train_cmd
from manual_dp.strategies.context.context_tensor import ContextTensorParallel
from manual_dp.strategies.mesh.mesh_parallel import MeshParallel
from manual_dp.strategies.sums.fixed_sums import FixedSums
from manual_dp.strategies.tensor.tensor import TensorParallel
from test_context_deterministic import MODEL, TINY, net, reference, same, steps  # noqa: F401 (fixtures)
from test_deterministic import data, run  # noqa: F401 (the data fixture; a logged, checkpointed run)


def fixed_grid(net, n, C, T, attention="ring", seed=0, pieces=4, tensor_pieces=2):
    """ContextTensorParallel under --deterministic: dp x cp x tp on n contexts, the sequence in
    `pieces` lanes, every split layer in `tensor_pieces`."""
    return ContextTensorParallel(net.init_params(seed), cpus(n), "adam", C, T, attention, model=net,
                                 sums=FixedSums(tensor_pieces=tensor_pieces), sequence_pieces=pieces)


def grid(net, n, C=1, T=1, attention="ring", seed=0):
    """dp x cp x tp on n contexts, the sequence in 4 pieces, every split layer in 2."""
    return fixed_grid(net, n, C, T, attention, seed)


@pytest.fixture(scope="module")
def one(net):
    """One context, K = 4 lanes each with its split layers in Q = 2 pieces: --mode sync's step."""
    return steps(grid(net, 1))


# cp x tp ---------------------------------------------------------------------------------------------

GRIDS = {"tp2": (2, 1, 2, "ring"), "cp2 x tp2 ring": (4, 2, 2, "ring"),
         "cp2 x tp2 ulysses": (4, 2, 2, "ulysses"), "dp2 x cp2 x tp2": (8, 2, 2, "ring")}


@pytest.mark.parametrize("layout", list(GRIDS))
def test_every_grid_has_one_contexts_bits(net, one, layout):
    """Both losses and every parameter after 2 adam steps: exactly one context's."""
    assert same(steps(grid(net, *GRIDS[layout])), one)


def test_plain_cp_x_tp_does_not(net, one):
    """ContextTensorParallel on the same 2 x 2 grid: other bits (the equalities are not vacuous), though close."""
    plain = steps(ContextTensorParallel(net.init_params(0), cpus(4), "adam", 2, 2, model=net))
    assert not same(plain, one)
    np.testing.assert_allclose(plain[0], one[0], rtol=1e-4)


def test_every_array_lives_on_its_grid_cell_and_a_checkpoint_moves_to_one_context(net, one):
    """cp2 x tp2: each cell's pieces, state and tree totals on it, lanes 2 a row; its checkpoint after
    one step, loaded into one context, gives the reference's second step."""
    s, (X, y) = grid(net, 4, 2, 2), batch(150, 0)
    s.backward(X, y)
    assert [[h.context for h in row] for row in s.held] == s.grid == [cpus(4)[:2], cpus(4)[2:]]
    s.update(0.01, 150)
    for row, P_row, S_row in zip(s.grid, s.shards, s.states):
        for c, P, S in zip(row, P_row, S_row):
            assert {p.context for p in P} | {p.grad.context for p in P} | {x.context for st in S for x in st} == {c}
    assert s.lanes[0].where == [cpus(4)[0]] * 2 + [cpus(4)[2]] * 2
    moved = grid(net, 1, seed=1)
    moved.load_state_dict(s.state_dict())
    assert np.array_equal(moved.step(X, y, 0.01)[0][0].asnumpy(), one[0][1])
    assert all(np.array_equal(a, b) for a, b in zip(moved.state_dict()["params"], one[1]))


def test_what_the_grid_refuses(net):
    with pytest.raises(ValueError, match="cp=2 x tp=2 must divide the 6 contexts"):
        grid(net, 6, 2, 2)
    with pytest.raises(ValueError, match="Ulysses needs cp=4 to divide the 2 heads of each of the tp=2 ranks"):
        fixed_grid(net, 4, 4, 1, "ulysses")


@pytest.fixture(scope="module")
def one_cli(data, tmp_path_factory):
    """(log, checkpoint) of --mode sync --cpus 1 --deterministic --sequence-pieces 4 --tensor-pieces 2."""
    return run(tmp_path_factory.mktemp("one"), "one", train_cmd("--cpus", 1, *TINY, "--tensor-pieces", 2,
                                                                "--data-dir", data))


def test_cli_cp_x_tp_has_one_contexts_bits(data, one_cli, tmp_path):
    """--mode context cp=2 x tp=2 against --mode sync --cpus 1, K = 4, Q = 2: the same losses,
    accuracies and checkpoints."""
    grid = run(tmp_path, "grid", train_cmd("--cpus", 4, "--mode", "context", "--context-parallel", 2,
                                           "--tensor-parallel", 2, *TINY, "--tensor-pieces", 2, "--data-dir", data))
    assert_same_run(*one_cli, *grid, exact=True)


# What is still refused -----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, match", [
    (["--cpus", "4", "--mesh", "cp=2,tp=2", "--deterministic", "--tensor-pieces", "3"],
     "--deterministic --mode context cuts every split layer into 3 pieces (--tensor-pieces): --tensor-parallel 2"),
    (["--cpus", "4", "--mesh", "cp=2,tp=2", "--deterministic", "--zero-stage", "1"],
     "--deterministic --mode context: dp x cp x tp only, not --zero-stage"),
])
def test_cli_refusals_are_one_line(capsys, data_dir, argv, match):
    code, _, err = run_main(capsys, [*argv, *MODEL, "--data-dir", str(data_dir)])
    assert code == 2 and len(err) == 1 and match in err[0], err


# Megatron-SP -------------------------------------------------------------------------------------------

def sp(net, n, T, tensor_pieces=2):
    """TensorParallel --sequence-parallel under --deterministic: 4 lanes, every split layer in `tensor_pieces`."""
    return TensorParallel(net.init_params(0), cpus(n), "adam", T, model=net, sequence_parallel=True,
                          sums=FixedSums(tensor_pieces=tensor_pieces), sequence_pieces=4)


@pytest.mark.parametrize("n, T", [(2, 2), (4, 2), (4, 4)], ids=["tp2", "dp2 x tp2", "tp4"])
def test_sequence_parallel_has_one_contexts_bits(net, one, n, T):
    """--sequence-parallel in tensor groups of T (K = 4 lanes, K/T at home on each context; Q = 2
    pieces, or 4 for T = 4): both losses and every parameter after 2 adam steps are one context's
    given the same K and Q."""
    want = one if T < 4 else steps(fixed_grid(net, 1, 1, 1, tensor_pieces=4))
    assert same(steps(sp(net, n, T, tensor_pieces=max(T, 2))), want)


def test_plain_sequence_parallelism_does_not(net, one):
    plain = steps(TensorParallel(net.init_params(0), cpus(2), "adam", 2, model=net, sequence_parallel=True))
    assert not same(plain, one)
    np.testing.assert_allclose(plain[0], one[0], rtol=1e-4)


def test_each_lanes_token_wise_work_stays_home(net):
    """tp2: lanes 0, 1 at home on cpu(0), lanes 2, 3 on cpu(1): their scores (the pooling, the head,
    every layer norm before them) there; the tree's totals on every context."""
    s, (X, y) = sp(net, 2, 2), batch(64, 0)
    s.backward(X, y)
    assert [[h.context for h in row] for row in s.held] == [cpus(2)]
    assert s.homes(0) == [cpus(2)[0]] * 2 + [cpus(2)[1]] * 2
    scores = s.lane_forward(0, nd.array(X), [[P for P in s.shards[0]]] * 4)
    assert [[x.context for x in lane] for lane in scores] == [[c] for c in s.homes(0)]


def test_cli_sequence_parallel_has_one_contexts_bits(data, one_cli, tmp_path):
    """--mode tensor on 2 contexts --sequence-parallel against --mode sync --cpus 1, K = 4, Q = 2."""
    sp = run(tmp_path, "sp", train_cmd("--cpus", 2, "--mode", "tensor", "--sequence-parallel", *TINY,
                                       "--tensor-pieces", 2, "--data-dir", data))
    assert_same_run(*one_cli, *sp, exact=True)


@pytest.mark.parametrize("argv, match", [
    (["--cpus", "4", "--mode", "tensor", "--sequence-parallel", "--deterministic", "--sequence-pieces", "2"],
     "--deterministic --sequence-parallel cuts the sequence into 2 pieces: --tensor-parallel 4 does not divide them"),
    (["--cpus", "2", "--mode", "tensor", "--deterministic", "--sequence-pieces", "2"],
     "--sequence-pieces in --mode tensor cuts the sequence of --sequence-parallel: give it too"),
    (["--cpus", "4", "--mesh", "pp=2,tp=2", "--sequence-parallel", "--deterministic"],
     "--sequence-parallel --deterministic: --mode tensor only, not --mode mesh"),
])
def test_cli_sequence_parallel_refusals_are_one_line(capsys, data_dir, argv, match):
    code, _, err = run_main(capsys, [*argv, *MODEL, "--data-dir", str(data_dir)])
    assert code == 2 and len(err) == 1 and match in err[0], err


# cp inside pipelines --------------------------------------------------------------------------------------

PIPES = {"pp2 gpipe": (2, 1, 2, "gpipe", "ring"), "pp2 x cp2 1f1b": (4, 2, 2, "1f1b", "ring"),
         "pp2 x cp2 ulysses 3 micro": (4, 2, 3, "gpipe", "ulysses"), "dp2 x pp2 x cp2": (8, 2, 2, "1f1b", "ring")}


def pipe(net, n, C, micro, schedule, attention, seed=0):
    return MeshParallel(net.init_params(seed), cpus(n), "adam", 2, 1, micro, schedule, context_parallel=C,
                        attention=attention, model=net, sums=FixedSums(), sequence_pieces=4)


@pytest.mark.parametrize("layout", list(PIPES))
def test_every_pipeline_of_lanes_has_one_contexts_bits(net, reference, layout):
    """2 stages of K = 4 lanes over C contexts: both losses and every parameter after 2 adam steps
    are one context's given --sequence-pieces 4 (test_context_deterministic's reference)."""
    assert same(steps(pipe(net, *PIPES[layout])), reference)


def test_plain_pp_x_cp_does_not(net, reference):
    plain = steps(MeshParallel(net.init_params(0), cpus(4), "adam", 2, 1, 2, "1f1b", context_parallel=2, model=net))
    assert not same(plain, reference)
    np.testing.assert_allclose(plain[0], reference[0], rtol=1e-4)


def test_every_lanes_copy_lives_on_its_context_and_a_checkpoint_moves_to_one_context(net, reference):
    """pp2 x cp2: stage s's lanes 0, 1 on its cp0 context, 2, 3 on cp1, each copy and its state there;
    its checkpoint after one step continues on a pp2 x cp1 pipeline with the reference's bits."""
    s, (X, y) = pipe(net, 4, 2, 2, "1f1b", "ring"), batch(150, 0)
    s.step(X, y, 0.01)
    assert s.groups[0] == [[cpus(4)[0]] * 2 + [cpus(4)[1]] * 2, [cpus(4)[2]] * 2 + [cpus(4)[3]] * 2]
    for group, stage, states in zip(s.groups[0], s.params[0], s.states[0]):
        for c, P, S in zip(group, stage, states):
            assert {p.context for p in P} | {x.context for st in S for x in st} == {c}
    moved = pipe(net, 2, 1, 2, "gpipe", "ring", seed=1)
    moved.load_state_dict(s.state_dict())
    assert np.array_equal(moved.step(X, y, 0.01)[0][0].asnumpy(), reference[0][1])
    assert all(np.array_equal(a, b) for a, b in zip(moved.state_dict()["params"], reference[1]))


def test_cli_pp_x_cp_has_one_contexts_bits(data, tmp_path):
    """--mesh pp=2,cp=2 (1F1B, 2 micro-batches) against --mode sync --cpus 1, K = 4."""
    a = run(tmp_path, "one", train_cmd("--cpus", 1, *TINY, "--data-dir", data))
    b = run(tmp_path, "pp_cp", train_cmd("--cpus", 4, "--mesh", "pp=2,cp=2", "--micro-batches", 2, "--schedule",
                                         "1f1b", *TINY, "--data-dir", data))
    assert_same_run(*a, *b, exact=True)


@pytest.mark.parametrize("argv, match", [
    (["--cpus", "4", "--mesh", "pp=2,cp=2", "--deterministic", "--sequence-pieces", "3"],
     "--deterministic --mode mesh cuts the sequence into 3 pieces: --context-parallel 2 does not divide them"),
    (["--cpus", "4", "--mesh", "pp=2,tp=2", "--deterministic", "--sequence-pieces", "4"],
     "--sequence-pieces in --mode mesh cuts the sequence of cp > 1"),
])
def test_cli_pipeline_refusals_are_one_line(capsys, data_dir, argv, match):
    code, _, err = run_main(capsys, [*argv, *MODEL, "--data-dir", str(data_dir)])
    assert code == 2 and len(err) == 1 and match in err[0], err
