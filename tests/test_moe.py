"""The GPT's mixture-of-experts MLP (manual_dp/models/moe.py): routing against a numpy reference
(top-k, ties to the lower index, capacity, slots in GShard's order, drops), the experts' output
against a numpy MoE, the aux loss in the gradient, every data/ZeRO/pipeline layout against one
context (1e-5 of the largest parameter after 2 momentum steps; --deterministic bit for bit), the
same tokens dropped in every split of a batch by rows, the cached graph against the eager forward,
the token ledger and the refusals of the command line."""
import hashlib
import json

import numpy as np
import pytest
from mxnet import autograd, nd

from conftest import assert_trained_as, cpus, params_after_steps, run_main
from manual_dp import models
from manual_dp.datasets import Spec
from manual_dp.ledger import arrays_of, balance
from manual_dp.models.contract import example_loss
from manual_dp.models.moe import Experts, choices, dispatch_combine, experts_forward, routing
from manual_dp.strategies.data.async_dp import AsyncDataParallel
from manual_dp.strategies.data.data_parallel import DataParallel
from manual_dp.strategies.pipeline.pipeline import PipelineParallel
from manual_dp.strategies.sums.fixed_sums import FixedSums
from manual_dp.strategies.zero.zero import ZeroRedundancy

TOL = 1e-5
SPEC = Spec((8,), 11, 11, task="next-token")


def small(E=4, K=2, factor=1.0, coef=0.01, layers=1):
    return models.build("gpt", layers=layers, d_model=16, heads=2, spec=SPEC,
                        experts=Experts(E, K, factor, coef) if E is not None else None)


def tokens(n, seed=0):
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, SPEC.vocab, size=(n, SPEC.shape[0] + 1))
    return ids[:, :-1].astype(np.float32), ids[:, 1:].astype(np.int32)


def reference_routing(probs, K, C):
    """(expert, slot, kept) (B, T, K) of probabilities (B, T, E), written as loops: choice k the
    largest p not chosen yet (np.argmax: the lowest index of ties); slots per expert counted over
    every first choice in position order, then, after the first choices it kept, every second."""
    B, T, E = probs.shape
    expert, slot, kept = (np.zeros((B, T, K), dtype=int) for _ in range(3))
    for b in range(B):
        chosen, offset = np.zeros((T, E), dtype=bool), np.zeros(E, dtype=int)
        for k in range(K):
            seen = np.zeros(E, dtype=int)
            for t in range(T):
                e = int(np.where(chosen[t], -np.inf, probs[b, t]).argmax())
                chosen[t, e] = True
                expert[b, t, k], slot[b, t, k] = e, offset[e] + seen[e]
                kept[b, t, k] = slot[b, t, k] < C
                seen[e] += 1
            offset += np.minimum(seen, C - offset)
    return expert, slot, kept


def tied_probs(B=3, T=8, E=4, seed=0):
    """Probabilities with forced ties: whole rows equal, pairs equal at the top, and random rows."""
    rng = np.random.RandomState(seed)
    p = rng.dirichlet(np.ones(E), size=(B, T))
    p[0, :4] = 1.0 / E                                            # every expert tied
    p[1, ::2] = [0.4, 0.1, 0.4, 0.1]                              # the top two tied: 0 then 2
    p[1, 1::2] = [0.1, 0.3, 0.3, 0.3]                             # three tied for first
    return p.astype(np.float32)


@pytest.mark.parametrize("K, factor", [(1, 1.0), (2, 1.0), (1, 0.5), (2, 0.5), (2, None)])
def test_routing_equals_the_reference(K, factor):
    p = tied_probs()
    cfg = Experts(4, K, factor)
    C = cfg.capacity(8)
    picked = choices(nd.array(p), cfg, 8, 4, nd)
    got = [np.stack([v.asnumpy() for v in vs], axis=-1)
           for vs in zip(*[(m.argmax(axis=-1), s, k) for m, s, k in picked])]
    want = reference_routing(p, K, C)
    for g, w, what in zip(got, want, ("expert", "slot", "kept")):
        assert np.array_equal(g.astype(int), w), what
    assert np.array_equal(picked[0][0].asnumpy().sum(-1), np.ones((3, 8)))   # one-hot: one expert per choice
    if factor == 0.5:
        assert not want[2].all()                                  # the case drops tokens


def test_dispatch_and_combine_are_the_references():
    p, K, E, T = tied_probs(), 2, 4, 8
    cfg = Experts(E, K, 1.0)
    C = cfg.capacity(T)
    dispatch, combine = (x.asnumpy().reshape(3, T, E, C) for x in dispatch_combine(nd.array(p), cfg, T, E, nd))
    expert, slot, kept = reference_routing(p, K, C)
    want_d, want_c = np.zeros_like(dispatch), np.zeros_like(combine)
    for b, t, k in zip(*np.nonzero(kept)):
        e = expert[b, t, k]
        total = sum(p[b, t, expert[b, t, j]] for j in range(K))   # GShard: renormalised over the two
        want_d[b, t, e, slot[b, t, k]] = 1
        want_c[b, t, e, slot[b, t, k]] = p[b, t, e] / total
    assert np.array_equal(dispatch, want_d)
    assert np.allclose(combine, want_c, atol=1e-6)


def numpy_experts(x, p, K, C):
    """The MoE's output (B, T, d) and aux loss (B,) of x, written per token from the reference routing."""
    wr, w1, b1, w2, b2 = (a.asnumpy().astype(np.float64) for a in p)
    logits = x @ wr.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expert, slot, kept = reference_routing(probs.astype(np.float32), K, C)
    out = np.zeros_like(x)
    for b, t in np.ndindex(*x.shape[:2]):
        es = expert[b, t]
        gates = probs[b, t, es] / (probs[b, t, es].sum() if K == 2 else 1)
        for k in range(K):
            if kept[b, t, k]:
                e = es[k]
                out[b, t] += gates[k] * (np.maximum(x[b, t] @ w1[e].T + b1[e], 0) @ w2[e].T + b2[e])
    E = wr.shape[0]
    share = np.eye(E)[expert[..., 0]].mean(1)
    return out, E * (share * probs.mean(1)).sum(-1)


@pytest.mark.parametrize("K, factor", [(1, 1.0), (2, 0.5)])
def test_the_experts_output_is_the_per_token_reference(K, factor):
    net = small(K=K, factor=factor)
    P = net.init_params(1)[-9:-4]                                  # the router and the experts' weights
    for i in (2, 4):
        P[i] = nd.array(np.random.RandomState(i).normal(0, 0.5, P[i].shape))   # biases not zero
    x = np.random.RandomState(2).normal(size=(3, 8, 16)).astype(np.float32)
    cfg = Experts(4, K, factor)
    out, aux = experts_forward(nd.array(x), P, cfg, 8, 4, nd)
    want, want_aux = numpy_experts(x.astype(np.float64), P, K, cfg.capacity(8))
    assert np.allclose(out.asnumpy(), want, atol=1e-5) and np.allclose(aux.asnumpy(), want_aux, atol=1e-6)


def test_no_experts_is_todays_gpt_bit_for_bit():
    X, y = tokens(6)
    dense, zero = small(E=None), small(E=0)
    assert dense.describe() == zero.describe() and not zero.aux
    P = dense.init_params(0)
    a, b = (net.forward(nd.array(X), P).asnumpy() for net in (dense, zero))
    assert a.shape == (6, 8, 11) and np.array_equal(a, b)


def router_grad_and_loss(coef, X, y):
    net = small(coef=coef)
    P = net.init_params(0)
    for p in P:
        p.attach_grad()
    with autograd.record():
        loss = example_loss(net.forward(nd.array(X), P), nd.array(y)).sum()
    loss.backward()
    return P[net.names().index("block0_router")].grad.asnumpy(), float(loss.asscalar())


def test_the_aux_loss_reaches_the_router_s_gradient():
    X, y = tokens(6)
    (g0, l0), (g1, l1), (g2, l2) = (router_grad_and_loss(c, X, y) for c in (0.0, 0.5, 1.0))
    net = small()
    P = net.init_params(0)
    h = net.layers[0].forward(nd.array(X), P[:2])
    x = routing_input(net, h, P)
    _, aux = experts_forward(x, P[14:19], net.experts, 8, 4, nd)
    assert abs((l1 - l0) - 0.5 * float(aux.sum().asscalar())) <= 1e-5 * l0   # the loss gains coef * aux
    assert np.abs(g1 - g0).max() > 1e-3 * np.abs(g0).max()                 # the coefficient moves the gradient
    assert np.allclose(g2 - g0, 2 * (g1 - g0), atol=1e-6)                  # linearly


def routing_input(net, h, P):
    """The MoE's input LN2(x + attention(LN1(x))) of block 0 (no dropout)."""
    from manual_dp.models.moe import attended
    from manual_dp.models.transformer import layer_norm
    x, _ = attended(h, P[2:19], nd, [p.shape for p in P[2:19]], 8, 1, 8)
    return layer_norm(x, P[12], P[13], nd)


def test_a_batch_split_by_rows_routes_and_drops_the_same_tokens():
    net, (X, _) = small(factor=1.0), tokens(12)
    P = net.init_params(0)
    h = net.layers[0].forward(nd.array(X), P[:2])
    p = P[2:19]                                                   # block 0's parameters
    whole = routing(h, p, 8, net.experts, 8)
    assert not whole[2].all()                                     # capacity 1.0 drops some tokens
    for parts in ((6, 6), (3, 3, 3, 3), (5, 7), (1,) * 12):      # 2 and 4 contexts, uneven, micro-batches of 1
        ends = np.cumsum((0,) + parts)
        pieces = [routing(h[a:b], p, 8, net.experts, 8) for a, b in zip(ends, ends[1:])]
        for got, want in zip(zip(*pieces), whole):
            assert np.array_equal(np.concatenate(got), want)


def test_the_cached_graph_computes_the_eager_loss():
    from manual_dp.fast.graph import ModelGraph
    net, (X, y) = small(), tokens(6)
    P = net.init_params(0)
    loss, correct = ModelGraph(model=net)(nd.array(X), nd.array(y), P)
    scores = net.forward(nd.array(X), P)
    want = example_loss(scores, nd.array(y)).sum()
    assert abs(float(loss.asscalar()) - float(want.asscalar())) <= TOL * float(want.asscalar())
    right = (scores.asnumpy()[:, :8].argmax(-1) == y).sum() / 8
    assert abs(float(correct.asscalar()) - right) <= 1e-6


LAYOUTS = {
    "sync fast 2 (graph)": lambda P, m: DataParallel(P, cpus(2), "momentum", model=m),
    "sync fast 4": lambda P, m: DataParallel(P, cpus(4), "momentum", model=m),
    "zero3 2": lambda P, m: ZeroRedundancy(P, cpus(2), "momentum", 3, model=m),
    "pipeline 2 1f1b": lambda P, m: PipelineParallel(P, cpus(2), "momentum", 4, stages=2, schedule="1f1b", model=m),
    "pipeline 4 gpipe recompute": lambda P, m: PipelineParallel(P, cpus(4), "momentum", 3, stages=4, recompute=True,
                                                                model=m),
    "sync lesson 3": lambda P, m: DataParallel(P, cpus(3), "momentum", lesson=True, model=m),
    "async S=0 2": lambda P, m: AsyncDataParallel(P, cpus(2), "momentum", 0, model=m),
}


def after(strategy, steps=2, n=24):
    X, y = tokens(n)
    first = strategy.step(X, y, 0.05)
    return params_after_steps(strategy, X, y, steps - 1), first


@pytest.fixture(scope="module")
def reference():
    net = small(layers=2)
    P = net.init_params(0)
    return net, P, after(DataParallel(P, cpus(1), "momentum", lesson=True, model=net))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_equals_one_context(reference, layout):
    net, P, (want, first) = reference
    got, metrics = after(LAYOUTS[layout](P, net))
    assert_trained_as(got, want, P, TOL)
    loss, want_loss = (sum(float(m[0].asscalar()) for m in ms) for ms in (metrics, first))
    assert abs(loss - want_loss) <= 1e-4 * want_loss


def digest(params):
    return hashlib.sha256(b"".join(np.ascontiguousarray(p).tobytes() for p in params)).hexdigest()


def test_deterministic_bits_in_every_layout(reference):
    net, P, _ = reference
    want = digest(after(DataParallel(P, cpus(1), "momentum", model=net, sums=FixedSums()), n=70)[0])
    for make in (lambda: DataParallel(P, cpus(2), "momentum", model=net, sums=FixedSums()),
                 lambda: DataParallel(P, cpus(4), "momentum", model=net, sums=FixedSums()),
                 lambda: ZeroRedundancy(P, cpus(2), "momentum", 3, model=net, sums=FixedSums()),
                 lambda: PipelineParallel(P, cpus(2), "momentum", 2, stages=2, schedule="1f1b", model=net,
                                          sums=FixedSums())):
        assert digest(after(make(), n=70)[0]) == want


# -- the command line: layouts, the ledger, refusals ------------------------------------------------
def corpus(tmp_path):
    """A small text file (a few kB of bytes, its own, no download)."""
    words = np.random.RandomState(0).choice(["the ", "moe ", "routes ", "tokens ", "per ", "window. ", "\n"], 1500)
    path = tmp_path / "corpus.txt"
    path.write_text("".join(words))
    return path


def moe_run(capsys, tmp_path, name, flags):
    """(stdout, ledger path, digests path) of a short MoE GPT run on the corpus."""
    ledger, digests = tmp_path / f"{name}.ledger", tmp_path / f"{name}.digests"
    argv = ["--model", "gpt", "--data", f"text:{corpus(tmp_path)}", "--layers", "1", "--d-model", "16", "--heads", "2",
            "--seq-len", "8", "--experts", "4", "--top-k", "2", "--capacity-factor", "1.0", "--train-size", "64",
            "--test-size", "16", "--batch-size", "32", "--epochs", "1", "--no-progress", "--ledger", str(ledger),
            "--digests", str(digests)] + flags
    code, out, err = run_main(capsys, argv)
    assert code == 0, err
    return out, ledger, digests


def diverge(capsys, a, b):
    from manual_dp.diverge import main
    with pytest.raises(SystemExit) as e:
        main([str(a), str(b)])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err.strip().splitlines()


def test_deterministic_layouts_write_the_same_ledger_and_digests(capsys, tmp_path):
    _, ledger, digests = moe_run(capsys, tmp_path, "one", ["--cpus", "1", "--deterministic"])
    lines = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert lines[0]["ledger"]["capacity"] == 4 and [r["update"] for r in lines[1:]] == [1, 2]
    assert sum(layer["dropped"] for r in lines[1:] for layer in r["layers"]) > 0     # capacity 1.0 drops some
    first = lines[1]["layers"][0]
    expert, slot, kept = arrays_of(first, (-1, 8, 2))
    assert expert.shape == (32, 8, 2) and first["dropped"] == int((kept == 0).sum())
    assert first["load"] == np.bincount(expert[..., 0].ravel(), minlength=4).tolist()
    assert balance(ledger)[0][1] == max(first["load"]) / 256
    for name, flags in (("sync2", ["--cpus", "2"]), ("sync4", ["--cpus", "4"]),
                        ("zero3", ["--cpus", "2", "--mode", "zero", "--zero-stage", "3"]),
                        ("1f1b", ["--cpus", "2", "--mode", "pipeline", "--schedule", "1f1b"])):
        _, other, other_digests = moe_run(capsys, tmp_path, name, flags + ["--deterministic"])
        assert diverge(capsys, ledger, other)[0] == 0, name
        assert diverge(capsys, digests, other_digests)[0] == 0, name


def test_diverge_names_the_first_token_routed_differently(capsys, tmp_path):
    _, a, _ = moe_run(capsys, tmp_path, "a", ["--cpus", "1"])
    _, b, _ = moe_run(capsys, tmp_path, "b", ["--cpus", "1", "--aux-loss-coef", "1", "--lr", "0.1"])
    code, out, _ = diverge(capsys, a, b)
    assert code == 1 and "the ledgers part at update 2: block" in out and "example" in out, out


def test_a_truncated_ledger_is_refused_in_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.ledger"
    bad.write_text('{"ledger": {"experts": 4}}\nnot json\n{"update": 1}\n')
    from manual_dp.diverge import main
    with pytest.raises(SystemExit) as e:
        main([str(bad), str(bad)])
    assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


GPT = ["--model", "gpt", "--data", "fortunes", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "8",
       "--cpus", "2", "--experts", "4", "--train-size", "64", "--test-size", "16"]


@pytest.mark.parametrize("argv, message", [
    (["--mode", "tensor"], "--experts with --mode tensor"),
    (["--mode", "tensor", "--sequence-parallel"], "--experts with --mode tensor"),
    (["--mode", "context"], "--experts with --mode context"),
    (["--mesh", "dp=1,tp=2"], "--experts with --mode tensor"),
    (["--cpus", "4", "--mesh", "dp=2,pp=1,tp=2"], "--experts with"),
    (["--mesh", "cp=2"], "--experts with --mode context"),
    (["--capacity-factor", "abc"], "--capacity-factor must be a positive number or none"),
    (["--capacity-factor", "-1"], "--capacity-factor must be a positive number or none"),
    (["--top-k", "3"], "--top-k"),
    (["--experts", "-1"], "--experts must be >= 0"),
    (["--experts", "1", "--top-k", "2"], "--experts must be >= 0 and at least --top-k 2"),
    (["--aux-loss-coef", "nan"], "--aux-loss-coef must be >= 0"),
    (["--ledger", "{tmp}/missing/l.jsonl"], "--ledger {tmp}/missing/l.jsonl: the directory"),
    (["--ledger", "/tmp"], "--ledger /tmp is a directory"),
    (["--ledger", "l.jsonl", "--dropout", "0.1"], "--ledger recomputes the routing"),
    (["--experts", "0", "--ledger", "l.jsonl"], "--ledger records an MoE's routing: give --experts too"),
])
def test_bad_moe_flags_and_layouts_are_refused_in_one_line(capsys, tmp_path, argv, message):
    code, _, err = run_main(capsys, GPT + [a.format(tmp=tmp_path) for a in argv])
    assert code == 2 and len(err) == 1 and message.format(tmp=tmp_path) in err[0], err


def test_experts_on_another_model_are_refused(capsys):
    code, _, err = run_main(capsys, ["--model", "transformer", "--experts", "4", "--cpus", "1"])
    assert code == 2 and err == ["manual_dp.train: error: --experts: --model gpt only, not --model transformer"]


def test_the_validation_loss_is_the_task_s_without_the_aux_term():
    from manual_dp.loop import validation_loss
    net, (X, y) = small(coef=1.0), tokens(6)
    P = net.init_params(0)
    scores = net.forward(nd.array(X), P)
    task = float(example_loss(scores[:, :8], nd.array(y)).mean().asscalar())
    with_aux = float(example_loss(scores, nd.array(y)).mean().asscalar())
    got = validation_loss(DataParallel(P, cpus(1), "momentum", model=net), X, y, 4)
    assert abs(got - task) <= 1e-6 * task and with_aux > task + 0.1


@pytest.mark.parametrize("second", ['{"update": 1}\n', '{"update": 1, "digest": "x", "layers": [{"name": "b"}]}\n',
                                    "[" * 100000 + "]" * 100000 + "\n"])
def test_damaged_ledgers_are_refused_in_one_line(capsys, tmp_path, second):
    head = '{"ledger": {"experts": 4, "top_k": 1, "capacity": 2, "tokens": 8, "layers": ["block0"]}}\n'
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text(head + '{"update": 1, "digest": "y", "examples": 1, "layers": [{"name": "b", "expert": "!"}]}\n')
    b.write_text(head + second)
    code, _, err = diverge(capsys, a, b)
    assert code == 2 and len(err) == 1 and err[0].startswith("manual_dp.diverge: error:"), err


def test_the_model_refuses_split_layouts_of_an_moe_and_not_of_the_dense_gpt():
    moe, dense = small(), small(E=None)
    assert "--experts" in moe.tensor_refusal(2) and "--experts" in moe.sequence_refusal(2, "ring")
    assert "--experts" in moe.grid_refusal(2, 2, "ring")
    assert dense.tensor_refusal(2) is None and dense.sequence_refusal(2, "ring") is None
    assert dense.grid_refusal(2, 2, "ring") is None
