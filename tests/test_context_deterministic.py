"""--deterministic --mode context: dp x cp, ring or Ulysses, with the bits of one context's
--deterministic step under the same --sequence-pieces K, for every C dividing K, and across
processes (issue 22).

Bit-identity holds when every process runs its ops with the same thread count: the in-process tests
run in one process (one thread count for every layout), the command-line ones start every process
with one thread per op (jobs.PINNED, and what the command line sets for --deterministic).
"""
import numpy as np
import pytest
from mxnet import autograd, nd

from conftest import batch, cpus, run_main
from jobs import assert_same_run, launch_cmd, train_cmd
from manual_dp import models
from manual_dp.fast.attention import full
from manual_dp.strategies.context.context import ContextParallel
from manual_dp.strategies.context.sequence_pieces import Lanes
from manual_dp.strategies.sums.fixed_sums import FixedSums
from test_deterministic import data, run  # noqa: F401 (the data fixture; a logged, checkpointed run)


def fixed(params, ctx, optimizer, C, attention="ring", pieces=4, model=None):
    """ContextParallel under --deterministic: the sequence in `pieces` lanes, groups of C contexts."""
    return ContextParallel(params, ctx, optimizer, C, attention, model=model, sums=FixedSums(), sequence_pieces=pieces)


def steps(strategy, n=2):
    """The losses of n adam steps on 150 rows (batch pieces 64, 64, 22), and the parameters after."""
    X, y = batch(150, 0)
    losses = [strategy.step(X, y, 0.01)[0][0].asnumpy() for _ in range(n)]
    return losses, strategy.state_dict()["params"]


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1]))


@pytest.fixture(scope="module")
def net():
    return models.build("transformer", layers=1, d_model=16, heads=4)


@pytest.fixture(scope="module")
def reference(net):
    """One context's step with the sequence in 4 pieces (what --mode sync --sequence-pieces 4 runs)."""
    return steps(fixed(net.init_params(0), cpus(1), "adam", 1, pieces=4, model=net))


# The pieces of the sequence ---------------------------------------------------------------------

def fixed_attention(C, attention):
    """(outputs, [dq, dk, dv]) of 4 pieces of 28 tokens (7 each), 4 heads, over C contexts, joined;
    asserts each output is on its lane's context."""
    rng, lanes = np.random.RandomState(0), Lanes(28, 4, cpus(C), attention)
    q, k, v, dout = (rng.randn(3, 28, 4, 2).astype(np.float32) for _ in range(4))

    def cut(x):
        return [nd.array(x[:, a:b], ctx=c) for a, b, c in zip(lanes.bounds, lanes.bounds[1:], lanes.where)]
    pieces = [cut(x) for x in (q, k, v)]
    for x in (x for xs in pieces for x in xs):
        x.attach_grad()
    with autograd.record():
        out = lanes.attend(*pieces)
    autograd.backward(out, cut(dout))
    assert [o.context for o in out] == lanes.where == [cpus(C)[b * C // 4] for b in range(4)]
    arrays = [out] + [[x.grad for x in xs] for xs in pieces]                  # outputs, dq, dk, dv
    joined = [np.concatenate([x.asnumpy() for x in xs], axis=1) for xs in arrays]
    np.testing.assert_allclose(joined[0], full(*(nd.array(x) for x in (q, k, v))).asnumpy(), rtol=1e-5, atol=1e-6)
    return joined


@pytest.mark.parametrize("C, attention", [(2, "ring"), (4, "ring"), (2, "ulysses"), (4, "ulysses")])
def test_the_fixed_attention_is_full_attention_with_the_same_bits_on_every_c(C, attention):
    """Close to full attention; the outputs and the gradients of q, k and v the same bits as on one
    context."""
    assert all(np.array_equal(a, b) for a, b in zip(fixed_attention(C, attention), fixed_attention(1, "ring")))


# The strategy ---------------------------------------------------------------------------------------

LAYOUTS = {     # name: (contexts, C, attention)
    "cp2 ring": (2, 2, "ring"), "cp4 ring": (4, 4, "ring"), "dp2 x cp2 ring": (4, 2, "ring"),
    "cp2 ulysses": (2, 2, "ulysses"), "cp4 ulysses": (4, 4, "ulysses"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_context_degree_has_one_contexts_bits(net, reference, layout):
    """Both losses and every parameter after 2 adam steps: exactly one context's."""
    n, C, attention = LAYOUTS[layout]
    assert same(steps(fixed(net.init_params(0), cpus(n), "adam", C, attention, 4, model=net)),
                reference)


def test_pieces_that_are_not_a_power_of_two_keep_the_bits(net):
    """K = 6 over C = 2 and 3: a context's run of lanes is then not one whole subtree of the tree."""
    one = steps(fixed(net.init_params(0), cpus(1), "adam", 1, pieces=6, model=net), 1)
    for C in (2, 3):
        assert same(steps(fixed(net.init_params(0), cpus(C), "adam", C, pieces=6, model=net), 1), one)


def test_plain_context_parallelism_does_not(net, reference):
    """Ring attention over 2 contexts without the pieces: other bits (the equalities above are not
    vacuous), though close."""
    plain = steps(ContextParallel(net.init_params(0), cpus(2), "adam", 2, model=net))
    assert not same(plain, reference)
    np.testing.assert_allclose(plain[0], reference[0], rtol=1e-4)


def test_every_array_lives_on_its_context_and_a_checkpoint_moves_to_one_context(net, reference):
    """dp2 x cp2: each context's parameters and state on it, lanes 2 a context, the tree's sums on
    the first; its checkpoint after one step, loaded into one context, gives the reference's second."""
    s = fixed(net.init_params(0), cpus(4), "adam", 2, pieces=4, model=net)
    X, y = batch(150, 0)
    s.backward(X, y)
    assert s.held.context == cpus(4)[0]
    s.update(0.01, 150)
    arrays = s.arrays()
    assert [a.context for a in arrays["param"]] == [c for c in cpus(4) for _ in net.names()]
    assert {a.context for a in arrays["state"]} == set(cpus(4))
    assert [lanes.where for lanes in s.lanes] == [[cpus(4)[0]] * 2 + [cpus(4)[1]] * 2,
                                                  [cpus(4)[2]] * 2 + [cpus(4)[3]] * 2]
    one = fixed(net.init_params(1), cpus(1), "adam", 1, pieces=4, model=net)
    one.load_state_dict(s.state_dict())
    loss = one.step(X, y, 0.01)[0][0].asnumpy()
    assert np.array_equal(loss, reference[0][1])
    assert all(np.array_equal(a, b) for a, b in zip(one.state_dict()["params"], reference[1]))


@pytest.mark.parametrize("kw, match", [
    (dict(n=4, C=4, pieces=2), "context degree 4 must divide 4 contexts and the 2 sequence pieces"),
    (dict(n=2, C=2, pieces=32), "32 sequence pieces exceed the 28 tokens"),
    (dict(n=4, C=4, pieces=4, heads=2), "Ulysses needs cp=4 to divide the transformer's 2 heads"),
])
def test_what_the_strategy_refuses(kw, match):
    net = models.build("transformer", layers=1, d_model=16, heads=kw.get("heads", 4))
    with pytest.raises(ValueError, match=match):
        fixed(net.init_params(0), cpus(kw["n"]), "sgd", kw["C"], "ulysses", kw["pieces"], model=net)


# The command line -------------------------------------------------------------------------------------

TINY = ["--train-size", "300", "--batch-size", "100", "--optimizer", "adam", "--lr", "0.002", "--epochs", "2",
        "--test-size", "64", "--deterministic", "--model", "transformer", "--layers", "1", "--d-model", "16",
        "--heads", "4", "--sequence-pieces", "4"]


def test_cli_context_parallel_and_two_dist_sync_workers_have_one_contexts_bits(data, tmp_path):
    """--mode sync --cpus 1 against dp=2 x cp=2 ring attention, and 2 dist_sync workers of cp=2
    Ulysses (the data dimension over the processes): the same losses, accuracies and checkpoints."""
    one = run(tmp_path, "one", train_cmd("--cpus", 1, "--data-dir", data, *TINY))
    ring = run(tmp_path, "ring", train_cmd("--cpus", 4, "--mode", "context", "--context-parallel", 2,
                                           "--data-dir", data, *TINY))
    assert_same_run(*one, *ring, exact=True)
    workers = run(tmp_path, "kv", launch_cmd(2, "dist_sync", "--cpus", 2, "--mode", "context", "--attention",
                                             "ulysses", "--data-dir", data, *TINY))
    assert_same_run(*one, *workers, exact=True)


MODEL = ["--model", "transformer", "--layers", "1", "--d-model", "16", "--heads", "4", "--epochs", "0"]


@pytest.mark.parametrize("argv, match", [
    (["--cpus", "4", "--mode", "context", "--deterministic", "--sequence-pieces", "2"],
     "--deterministic --mode context cuts the sequence into 2 pieces: --context-parallel 4 does not divide them"),
    (["--cpus", "8", "--mesh", "pp=2,cp=2,tp=2", "--deterministic"], "not cp with tp or --tensor-pieces in a "
                                                                      "pipeline"),
    (["--cpus", "1", "--sequence-pieces", "4"], "--sequence-pieces fixes the order of --deterministic's sums"),
    (["--cpus", "2", "--mode", "zero", "--deterministic", "--sequence-pieces", "2"],
     "--sequence-pieces applies only to --mode sync or tensor or context"),
])
def test_cli_refusals_are_one_line(capsys, data_dir, argv, match):
    code, _, err = run_main(capsys, [*argv, *MODEL, "--data-dir", str(data_dir)])
    assert code == 2 and len(err) == 1 and match in err[0], err


def test_cli_refuses_the_pieces_for_a_model_without_a_sequence(capsys, data_dir):
    code, _, err = run_main(capsys, ["--cpus", "1", "--deterministic", "--sequence-pieces", "2", "--epochs", "0",
                                     "--data-dir", str(data_dir)])
    assert code == 2 and len(err) == 1 and "--model lenet does not" in err[0], err
