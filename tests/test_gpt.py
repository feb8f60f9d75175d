"""The GPT (manual_dp/models/gpt.py): one forward and backward against PyTorch on the same weights,
its causal attention, every layout against one context, its command line and sampling.

Tolerance: against PyTorch 1e-5 of the largest value (float32 sums in another order); layouts as
tests/test_models.py, 1e-5 of the largest parameter after 2 momentum steps; --deterministic bit
for bit."""
import hashlib

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, nd

from conftest import assert_trained_as, cpus, params_after_steps, run_main
from manual_dp import models
from manual_dp.datasets import Spec
from manual_dp.models.contract import example_loss
from manual_dp.strategies.context.context import ContextParallel
from manual_dp.strategies.context.context_tensor import ContextTensorParallel
from manual_dp.strategies.data.async_dp import AsyncDataParallel
from manual_dp.strategies.data.data_parallel import DataParallel
from manual_dp.strategies.data.local_sgd import LocalSGD
from manual_dp.strategies.mesh.mesh_parallel import MeshParallel
from manual_dp.strategies.pipeline.pipeline import PipelineParallel
from manual_dp.strategies.sums.fixed_sums import FixedSums
from manual_dp.strategies.tensor.tensor import TensorParallel
from manual_dp.strategies.wrappers.accum import GradAccum
from manual_dp.strategies.zero.zero import ZeroRedundancy

TOL = 1e-5
SPEC = Spec((8,), 11, 11, task="next-token")


def small(layers=2):
    return models.build("gpt", layers=layers, d_model=8, heads=2, spec=SPEC)


def tokens(n, seed=0):
    """n windows of SPEC's tokens (float ids) and the next token at each position."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, SPEC.vocab, size=(n, SPEC.shape[0] + 1))
    return ids[:, :-1].astype(np.float32), ids[:, 1:].astype(np.int32)


def torch_loss_and_grads(P, X, y, d=8, heads=2, layers=2):
    """nanoGPT's forward, written in PyTorch on the same weights (MLP with ReLU, a head of its own):
    the mean cross-entropy over every token, and each parameter's gradient."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    W = [torch.tensor(p.asnumpy(), dtype=torch.float64, requires_grad=True) for p in P]
    B, T = X.shape
    h = W[0][torch.tensor(X, dtype=torch.long)] + W[1]
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    for l in range(layers):
        g1, b1, wq, bq, wk, bk, wv, bv, wo, bo, g2, b2, w1, c1, w2, c2 = W[2 + 16 * l: 18 + 16 * l]
        a = F.layer_norm(h, (d,), g1, b1, 1e-5)
        q, k, v = ((a @ w.T + b).view(B, T, heads, -1).transpose(1, 2) for w, b in ((wq, bq), (wk, bk), (wv, bv)))
        s = (q @ k.transpose(-1, -2)) / (d // heads) ** 0.5
        o = torch.softmax(s.masked_fill(mask, float("-inf")), -1) @ v
        h = h + o.transpose(1, 2).reshape(B, T, d) @ wo.T + bo
        h = h + torch.relu(F.layer_norm(h, (d,), g2, b2, 1e-5) @ w1.T + c1) @ w2.T + c2
    scores = F.layer_norm(h, (d,), W[-4], W[-3], 1e-5) @ W[-2].T + W[-1]
    loss = F.cross_entropy(scores.reshape(B * T, -1), torch.tensor(y, dtype=torch.long).reshape(-1))
    loss.backward()
    return float(loss), [w.grad.numpy() for w in W]


def test_forward_and_backward_equal_pytorchs():
    net = small()
    P = net.init_params(3)
    for p in P:
        p.attach_grad()
    X, y = tokens(5)
    with autograd.record():
        loss = example_loss(net.forward(nd.array(X), P), nd.array(y)).mean()
    loss.backward()
    want, grads = torch_loss_and_grads(P, X, y)
    assert abs(float(loss.asscalar()) - want) <= TOL * want
    scale = max(float(np.abs(g).max()) for g in grads)
    assert max(float(np.abs(p.grad.asnumpy() - g).max()) for p, g in zip(P, grads)) <= TOL * scale


def test_a_token_never_reads_the_tokens_after_it():
    net, X = small(), tokens(2)[0]
    P = net.init_params(0)
    later = X.copy()
    later[:, 5:] = (later[:, 5:] + 1) % SPEC.vocab          # tokens 5.. changed
    a, b = (net.forward(nd.array(x), P).asnumpy() for x in (X, later))
    assert np.array_equal(a[:, :5], b[:, :5]) and not np.allclose(a[:, 5:], b[:, 5:])


def test_the_cached_graph_computes_the_imperative_loss():
    net, (X, y) = small(), tokens(6)
    P = net.init_params(0)
    from manual_dp.fast.graph import ModelGraph
    loss, correct = ModelGraph(model=net)(nd.array(X), nd.array(y), P)
    want = example_loss(net.forward(nd.array(X), P), nd.array(y)).sum()
    assert abs(float(loss.asscalar()) - float(want.asscalar())) <= TOL * float(want.asscalar())
    right = (net.forward(nd.array(X), P).asnumpy().argmax(-1) == y).sum() / SPEC.shape[0]
    assert abs(float(correct.asscalar()) - right) <= 1e-6


LAYOUTS = {
    "sync fast 2": lambda P, m: DataParallel(P, cpus(2), "momentum", model=m),
    "sync lesson 3": lambda P, m: DataParallel(P, cpus(3), "momentum", lesson=True, model=m),
    "async S=0 2": lambda P, m: AsyncDataParallel(P, cpus(2), "momentum", 0, model=m),
    "local H=1 2": lambda P, m: LocalSGD(P, cpus(2), "momentum", 1, model=m),
    "zero1 3": lambda P, m: ZeroRedundancy(P, cpus(3), "momentum", 1, model=m),
    "zero2 2": lambda P, m: ZeroRedundancy(P, cpus(2), "momentum", 2, model=m),
    "zero3 2": lambda P, m: ZeroRedundancy(P, cpus(2), "momentum", 3, model=m),
    "pipeline 4 gpipe": lambda P, m: PipelineParallel(P, cpus(4), "momentum", 4, stages=4, model=m),
    "pipeline 2 1f1b recompute": lambda P, m: PipelineParallel(P, cpus(2), "momentum", 3, stages=2,
                                                               schedule="1f1b", recompute=True, model=m),
    "pipeline 2 interleaved": lambda P, m: PipelineParallel(P, cpus(2), "momentum", 4, stages=2, virtual_stages=2,
                                                            schedule="interleaved", model=m),
    "pipeline 2 zb-h1": lambda P, m: PipelineParallel(P, cpus(2), "momentum", 4, stages=2, schedule="zb-h1", model=m),
    "tensor 2": lambda P, m: TensorParallel(P, cpus(2), "momentum", 2, model=m),
    "tensor 2 sequence parallel": lambda P, m: TensorParallel(P, cpus(2), "momentum", 2, model=m,
                                                              sequence_parallel=True),
    "tensor 2 x data 2, zero 3": lambda P, m: TensorParallel(P, cpus(4), "momentum", 2, model=m, zero_stage=3),
    "mesh dp 1 x pp 2 x tp 2": lambda P, m: MeshParallel(P, cpus(4), "momentum", 2, 2, 2, model=m),
    "grad accum 2 x sync 2": lambda P, m: GradAccum(DataParallel(P, cpus(2), "momentum", model=m), 2),
}


def after(strategy, accum=False, steps=2, n=24):
    return params_after_steps(strategy, *tokens(n), steps, accum)


@pytest.fixture(scope="module")
def reference():
    net = small()
    P = net.init_params(0)
    return net, P, after(DataParallel(P, cpus(1), "momentum", lesson=True, model=net))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_equals_one_context(reference, layout):
    net, P, want = reference
    assert_trained_as(after(LAYOUTS[layout](P, net), accum=layout.startswith("grad accum")), want, P, TOL)


def digest(params):
    return hashlib.sha256(b"".join(np.ascontiguousarray(p).tobytes() for p in params)).hexdigest()


def test_deterministic_bits_in_every_layout(reference):
    net, P, _ = reference
    want = digest(after(DataParallel(P, cpus(1), "momentum", model=net, sums=FixedSums()), n=70))
    for make in (lambda: DataParallel(P, cpus(3), "momentum", model=net, sums=FixedSums()),
                 lambda: ZeroRedundancy(P, cpus(2), "momentum", 3, model=net, sums=FixedSums()),
                 lambda: PipelineParallel(P, cpus(2), "momentum", 2, stages=2, model=net, sums=FixedSums())):
        assert digest(after(make(), n=70)) == want


CONTEXT = {
    "context 2 ring": lambda P, m: ContextParallel(P, cpus(2), "momentum", 2, "ring", model=m),
    "context 2 ulysses": lambda P, m: ContextParallel(P, cpus(2), "momentum", 2, "ulysses", model=m),
    "context 2 x data 2, zero 2": lambda P, m: ContextParallel(P, cpus(4), "momentum", 2, "ring", model=m, zero_stage=2),
    "context 2 x tensor 2 ring": lambda P, m: ContextTensorParallel(P, cpus(4), "momentum", 2, 2, "ring", model=m),
    "context 2 x data 2 ulysses": lambda P, m: ContextParallel(P, cpus(4), "momentum", 2, "ulysses", model=m),
}


@pytest.mark.parametrize("layout", list(CONTEXT))
def test_causal_context_parallelism_equals_one_context(reference, layout):
    net, P, want = reference
    got = after(CONTEXT[layout](P, net))
    scale = max(float(np.abs(w).max()) for w in want)
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, want)) <= TOL * scale


def test_deterministic_context_parallelism_has_the_bits_of_one_context(reference):
    net, P, _ = reference
    want = digest(after(ContextParallel(P, cpus(1), "momentum", 1, "ring", model=net,
                                        sums=FixedSums(), sequence_pieces=4), n=70))
    for C, attention in ((2, "ring"), (4, "ring"), (2, "ulysses")):
        got = after(ContextParallel(P, cpus(C), "momentum", C, attention, model=net, sums=FixedSums(),
                                    sequence_pieces=4), n=70)
        assert digest(got) == want, (C, attention)
    grid = ContextTensorParallel(P, cpus(4), "momentum", 2, 2, "ring", model=net, sums=FixedSums(tensor_pieces=2),
                                 sequence_pieces=4)
    one = ContextTensorParallel(P, cpus(1), "momentum", 1, 1, "ring", model=net, sums=FixedSums(tensor_pieces=2),
                                sequence_pieces=4)
    assert digest(after(grid, n=70)) == digest(after(one, n=70))


@pytest.mark.parametrize("C, balanced, attention", [(2, False, "ring"), (3, True, "ring"), (2, True, "ulysses")])
def test_causal_ring_and_ulysses_equal_causal_attention_on_one_context(C, balanced, attention):
    from manual_dp.fast.causal_attention import CAUSAL, causal_full, chunks_of
    B, T, H, D = 2, 12, 4, 3
    rng = np.random.RandomState(0)
    q, k, v, dout = (nd.array(rng.randn(B, T, H, D)) for _ in range(4))
    for x in (q, k, v):
        x.attach_grad()
    with autograd.record():
        o = causal_full(q, k, v)
    o.backward(dout)
    chunks = chunks_of(T, C, balanced)

    def cut(x):
        return [nd.concat(*[x[:, a:b] for a, b in row], dim=1).copyto(c) for row, c in zip(chunks, cpus(C))]

    def whole(xs):
        return np.concatenate([x.asnumpy() for x in xs], axis=1)[:, np.argsort([a for row in chunks for a, b in row
                                                                                for a in range(a, b)])]
    qs, ks, vs = cut(q), cut(k), cut(v)
    for x in qs + ks + vs:
        x.attach_grad()
    with autograd.record():
        outs = CAUSAL[attention](qs, ks, vs, chunks)
    autograd.backward(outs, cut(dout))
    assert [x.context for x in outs] == cpus(C)
    for got, want in ((outs, o), ([x.grad for x in qs], q.grad), ([x.grad for x in ks], k.grad), ([x.grad for x in vs], v.grad)):
        assert np.abs(whole(got) - want.asnumpy()).max() <= 1e-5 * np.abs(want.asnumpy()).max()


def test_the_balanced_cut_evens_causal_attentions_work():
    from manual_dp.fast.causal_attention import chunks_of, work
    for C in (2, 4, 8):
        even, contiguous = work(chunks_of(1024, C, True)), work(chunks_of(1024, C, False))
        assert max(even) <= 1.1 * min(even) and sum(even) == sum(contiguous) == 1024 * 1025 // 2
        assert max(contiguous) >= (2 * C - 1) * min(contiguous) * 0.99     # the last context's C chunks against one
