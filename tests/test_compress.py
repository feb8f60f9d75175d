"""--compress: each compressor against its formula in numpy, its error feedback against a numpy
reference over several steps, 2bit against MXNet's own kvstore, the residuals in checkpoints.

Tolerances: fp16, 2bit and topk compute the same float32 operations as the references (exact);
1bit's scale is a mean, summed in another order by MXNet than by numpy (rtol 1e-6); PowerSGD's
matrix products are summed in other orders (rtol 1e-4 of the largest value).
"""
import mxnet as mx
import numpy as np
import pytest
from mxnet import nd

from conftest import assert_on, batch, cpus
from manual_dp import DataParallel, init_lenet_params
from manual_dp.fast.collectives import make_allreduce
from manual_dp.fast.compress import FP16, GatherAllreduce, OneBit, TopK, TwoBit, make_reducer
from manual_dp.fast.powersgd import PowerSGDAllreduce, matrix
from manual_dp.lesson import LENET_SHAPES
from manual_dp.strategies.wrappers.compressed import Compressed

SHAPES = [s for _, s in LENET_SHAPES]


def grads(k, n, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * scale).astype(np.float32) for _ in range(k)]


# numpy references: (payload bytes or arrays, decoded) from a residual already holding grad + residual

def np_2bit(r, t):
    """MXNet's quantize_2bit, element by element (gradient_compression-inl.h), on r in place."""
    out = np.zeros(-(-r.size // 16) * 4, dtype=np.uint8)
    posbits, negbits = (0xc0, 0x30, 0x0c, 0x03), (0x80, 0x20, 0x08, 0x02)
    decoded = np.zeros_like(r)
    for i in range(r.size):
        if r[i] >= np.float32(t):
            out[i // 4] |= posbits[i & 3]
            r[i] -= np.float32(t)
            decoded[i] = t
        elif r[i] <= np.float32(-t):
            out[i // 4] |= negbits[i & 3]
            r[i] -= np.float32(-t)
            decoded[i] = -t
    return [out], decoded


def np_1bit(r, sizes=None):
    """One scale per segment (`sizes`; default the whole array)."""
    o = np.cumsum([0] + (sizes or [r.size]))
    scales = np.array([np.abs(r[a:b]).mean() for a, b in zip(o, o[1:])], np.float32)
    bits = r >= 0
    decoded = np.where(bits, np.repeat(scales, np.diff(o)), -np.repeat(scales, np.diff(o))).astype(np.float32)
    r -= decoded
    return [np.packbits(bits), scales], decoded


def np_topk(r, k):
    index = np.argsort(-np.abs(r), kind="stable")[:k]
    decoded = np.zeros_like(r)
    decoded[index] = r[index]
    r[index] = 0
    return [index, r[index] * 0 + decoded[index]], decoded


def np_fp16(r):
    half = r.astype(np.float16)
    r -= half.astype(np.float32)
    return [half], half.astype(np.float32)


CASES = {"fp16": (FP16, (), np_fp16), "2bit": (TwoBit, (0.5,), lambda r: np_2bit(r, 0.5)),
         "2bit:0.3": (TwoBit, (0.3,), lambda r: np_2bit(r, 0.3)), "1bit": (OneBit, (), np_1bit),
         "1bit per part": (lambda: OneBit([3, 10, 24]), (),
                           lambda r: np_1bit(r, [3, 10, 24] if r.size == 37 else None)),
         "topk:7": (TopK, (7,), lambda r: np_topk(r, 7)), "topk:all": (TopK, (99,), lambda r: np_topk(r, 99))}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("n", [1, 15, 37, 64])
def test_round_trip_is_the_formula(name, n):
    make, args, ref = CASES[name]
    comp = make(*args)
    grad, residual = grads(2, n, seed=n)
    r_ref = grad + residual
    payload_ref, decoded_ref = ref(r_ref)
    r = nd.array(residual, ctx=mx.cpu(1))
    payload = comp.encode(nd.array(grad, ctx=mx.cpu(1)), r)
    assert [(p.shape, np.dtype(p.dtype)) for p in payload] == [(s, np.dtype(d)) for s, d in comp.spec(n)]
    assert_on(payload + [r], mx.cpu(1))
    decoded = comp.decode(payload, n, mx.cpu(2))
    assert decoded.context == mx.cpu(2) and decoded.shape == (n,)
    tol = dict(rtol=1e-6, atol=1e-7) if name.startswith("1bit") else dict(rtol=0, atol=0)
    np.testing.assert_allclose(decoded.asnumpy(), decoded_ref, **tol)
    np.testing.assert_allclose(r.asnumpy(), r_ref, **tol)
    if name.startswith("topk"):            # the same entries, in any order
        assert sorted(payload[0].asnumpy()) == sorted(payload_ref[0])
    else:
        for got, want in zip(payload, payload_ref):
            np.testing.assert_allclose(got.asnumpy().astype(np.float64), want.astype(np.float64), **tol)


@pytest.mark.parametrize("name", sorted(CASES))
def test_error_feedback_over_steps_equals_numpy(name):
    """Three steps of 3 replicas: the sums every replica holds and every residual, as numpy's."""
    make, args, ref = CASES[name]
    reducer, k, n = GatherAllreduce(make(*args)), 3, 37
    residuals = [np.zeros(n, np.float32) for _ in range(k)]
    for step in range(3):
        g = grads(k, n, seed=10 + step)
        arrays = [nd.array(x, ctx=c) for x, c in zip(g, cpus(k))]
        reducer(arrays)
        decoded = []
        for x, r in zip(g, residuals):
            r += x
            decoded.append(ref(r)[1])
        want = nd.add_n(*map(nd.array, decoded)).asnumpy()      # MXNet's order of adding
        tol = dict(rtol=1e-6, atol=1e-6) if name.startswith("1bit") else dict(rtol=0, atol=0)
        for a, c in zip(arrays, cpus(k)):
            assert a.context == c
            np.testing.assert_allclose(a.asnumpy(), want, **tol)
        for r, r_ref, c in zip(reducer.residuals, residuals, cpus(k)):
            assert r.context == c
            np.testing.assert_allclose(r.asnumpy(), r_ref, **tol)
    assert reducer.bytes_per_replica() == sum(np.prod(s) * np.dtype(d).itemsize for s, d in reducer.compressor.spec(n))


@pytest.mark.parametrize("threshold", [0.5, 0.3])
def test_2bit_equals_mxnet_kvstore(threshold):
    """MXNet's kvstore('device') with set_gradient_compression 2bit on the same gradients, step by
    step: the same sums, exactly (the residuals live inside MXNet; the sums they yield must match)."""
    k, n = 3, 53
    kv = mx.kv.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": threshold})
    kv.init(0, nd.zeros((n,)))
    ours = GatherAllreduce(TwoBit(threshold))
    for step in range(5):
        g = grads(k, n, seed=step, scale=0.4)
        theirs = [nd.zeros((n,), ctx=c) for c in cpus(k)]
        kv.push(0, [nd.array(x, ctx=c) for x, c in zip(g, cpus(k))])
        kv.pull(0, out=theirs)
        mine = [nd.array(x, ctx=c) for x, c in zip(g, cpus(k))]
        ours(mine)
        assert np.abs(theirs[0].asnumpy()).max() > 0          # something was sent
        for a, b, c in zip(mine, theirs, cpus(k)):
            assert a.context == c
            np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())


def np_orthonormal(P, eps=1e-8):
    cols = []
    for r in range(P.shape[1]):
        v = P[:, r].copy()
        for u in cols:
            v = v - u * np.sum(u * v)
        cols.append(v / (np.linalg.norm(v) + eps))
    return np.stack(cols, axis=1)


@pytest.mark.parametrize("rank", [1, 2])
def test_powersgd_equals_numpy(rank):
    k, n = 2, sum(int(np.prod(s)) for s in SHAPES)
    reducer = PowerSGDAllreduce(rank, SHAPES, make_allreduce("reduce_bcast"))
    residuals, Q = [np.zeros(n, np.float32) for _ in range(k)], [q.copy() for q in reducer.q0]
    o = np.cumsum([0] + [int(np.prod(s)) for s in SHAPES])
    for step in range(3):
        g = grads(k, n, seed=step)
        arrays = [nd.array(x, ctx=c) for x, c in zip(g, cpus(k))]
        reducer(arrays)
        want = np.zeros(n, np.float32)
        for r, x in zip(residuals, g):
            r += x
        for j, i in enumerate(reducer.low):
            M = [r[o[i]:o[i + 1]].reshape(matrix(SHAPES[i])) for r in residuals]
            P = np_orthonormal(sum(m @ Q[j] for m in M))
            Qs = [m.T @ P for m in M]
            want[o[i]:o[i + 1]] = (P @ sum(Qs).T).ravel()
            for m, q in zip(M, Qs):
                m -= P @ q.T
            Q[j] = sum(Qs)
        for i in reducer.whole:
            want[o[i]:o[i + 1]] = sum(r[o[i]:o[i + 1]] for r in residuals)
            for r in residuals:
                r[o[i]:o[i + 1]] = 0
        scale = np.abs(want).max()
        for a, c in zip(arrays, cpus(k)):
            assert a.context == c
            np.testing.assert_allclose(a.asnumpy(), want, rtol=0, atol=1e-4 * scale)
        for r, r_ref, c in zip(reducer.residuals, residuals, cpus(k)):
            assert r.context == c
            np.testing.assert_allclose(r.asnumpy(), r_ref, rtol=0, atol=1e-4 * scale)
    assert reducer.low == [0, 2, 4, 6] and reducer.whole == [1, 3, 5, 7]


def compressed(spec, k=2, seed=3):
    params = init_lenet_params(seed=seed)
    reducer = make_reducer(spec, make_allreduce("reduce_bcast"), SHAPES)
    return Compressed(DataParallel(params, cpus(k), "momentum", reducer), reducer, spec)


@pytest.mark.parametrize("spec", ["2bit", "1bit", "topk:500", "powersgd:2", "fp16"])
def test_residuals_are_saved_and_resume_bit_for_bit(spec):
    """2 steps, state_dict, 2 more: a model loaded from the state_dict takes the same 2 more steps
    bit for bit; without the residuals (extra emptied) it does not."""
    a = compressed(spec)
    for step in range(2):
        a.step(*batch(16, step), 0.05)
    state = a.state_dict()
    assert len(state["extra"]["residual"]) == 2 and np.abs(state["extra"]["residual"][1]).max() > 0
    b, c = compressed(spec), compressed(spec)
    b.load_state_dict(state)
    c.load_state_dict(dict(state, extra={}))
    for r, ctx in zip(b.reducer.residuals, cpus(2)):
        assert r.context == ctx
    held = b.arrays()["state"]
    assert all(any(r is h for h in held) for r in b.reducer.residuals)
    for step in range(2, 4):
        for m in (a, b, c):
            m.step(*batch(16, step), 0.05)
    for x, y in zip(a.state_dict()["params"], b.state_dict()["params"]):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, z) for x, z in zip(a.state_dict()["params"], c.state_dict()["params"]))


def test_other_replica_count_gives_the_residual_sum_to_the_first():
    a = compressed("2bit", k=3)
    a.step(*batch(16, 0), 0.05)
    state = a.state_dict()
    b = compressed("2bit", k=2)
    b.load_state_dict(state)
    np.testing.assert_array_equal(b.reducer.residuals[0].asnumpy(), np.sum(state["extra"]["residual"], axis=0))
    assert not b.reducer.residuals[1].asnumpy().any()


def test_compression_needs_fused_gradients():
    reducer = make_reducer("2bit", None, SHAPES)
    with pytest.raises(ValueError, match="fused"):
        Compressed(DataParallel(init_lenet_params(), cpus(2), "sgd", reducer, fuse_grads=False), reducer, "2bit")
