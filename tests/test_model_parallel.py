"""Model, pipeline and hybrid parallelism against one device; the GPipe schedule; memory per context."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, nd

from conftest import assert_on, cpus, synthetic
from manual_dp import DataParallel, cross_entropy, get_params, init_lenet_params, lenet
from manual_dp.strategies.wrappers.accum import GradAccum
from manual_dp.memory import per_context, scratch_buffers, stage_activation_elems
from manual_dp.lesson import LENET_SHAPES, conv_block
from manual_dp.optim import apply_update, init_states
from manual_dp.strategies.pipeline.pipeline import PipelineParallel, cut
from manual_dp.strategies.pipeline.stages import STAGE_SLICES, conv_stage, dense_stage, split_params


def batch(n, seed=0):
    images, labels = synthetic(n, seed)
    return (images.astype(np.float32) / 255)[:, None], labels.astype(np.int32)


# (contexts, micro-batches): model, pipeline, hybrid of 2 and 3 replicas.
LAYOUTS = [(2, 1), (2, 3), (2, 13), (4, 1), (4, 2), (6, 4)]
LAYOUT_IDS = ["model", "pipeline3", "pipeline13", "hybrid2x1", "hybrid2x2", "hybrid3x4"]


def test_stages_compose_to_lenet():
    params = init_lenet_params(seed=4)
    X = nd.array(batch(5)[0])
    P0, P1 = split_params(params)
    np.testing.assert_array_equal(dense_stage(conv_stage(X, P0), P1).asnumpy(), lenet(X, params).asnumpy())
    assert [len(P) for P in (P0, P1)] == [4, 4] and STAGE_SLICES[1].stop == len(LENET_SHAPES)


@pytest.mark.parametrize("n,m", [(13, 3), (12, 4), (3, 5), (1, 1)])
def test_cut_reassembles(n, m):
    X = np.arange(2 * n).reshape(n, 2)
    pieces = cut(nd.array(X), m)
    assert len(pieces) == min(n, m)
    assert max(p.shape[0] for p in pieces) - min(p.shape[0] for p in pieces) <= 1
    np.testing.assert_array_equal(np.concatenate([p.asnumpy() for p in pieces]), X)


def check_placement(model):
    """Every stage's parameters, gradients and optimiser state live on that stage's context."""
    for row, P_row, S_row in zip(model.grid, model.params, model.states):
        for c, P, S in zip(row, P_row, S_row):
            assert_on(P, c)
            assert_on([p.grad for p in P], c)
            assert_on([s for st in S for s in st], c)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("n_ctx,micro", LAYOUTS, ids=LAYOUT_IDS)
def test_mode_equals_one_device(n_ctx, micro, optimizer):
    ref = DataParallel(init_lenet_params(seed=2), [mx.cpu(0)], optimizer)
    model = PipelineParallel(init_lenet_params(seed=2), cpus(n_ctx), optimizer, micro)
    for step in range(3):
        X, y = batch(13, seed=step)
        want = ref.step(X, y, 0.05)[0]
        got = model.step(X, y, 0.05)
        assert [l.context for l, _ in got] == [row[-1] for row in model.grid]
        assert sum(l.asscalar() for l, _ in got) == pytest.approx(want[0].asscalar(), rel=1e-5)
        assert sum(c.asscalar() for _, c in got) == want[1].asscalar()
    check_placement(model)
    atol = 1e-3 if optimizer == "adam" else 1e-6   # adam's 1/sqrt(v) magnifies float noise near 0
    for row in model.params:
        for got, want in zip([p for P in row for p in P], ref.replicas[0]):
            np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=1e-4, atol=atol)
    X, y = batch(11, seed=9)
    assert model.correct(nd.array(X), nd.array(y)).asscalar() == ref.correct(nd.array(X), nd.array(y)).asscalar()


@pytest.mark.parametrize("n_ctx,micro", [(2, 2), (4, 2)], ids=["pipeline", "hybrid"])
def test_grad_accum_equals_one_big_batch(n_ctx, micro):
    big = PipelineParallel(init_lenet_params(seed=3), cpus(n_ctx), "momentum", micro)
    acc = GradAccum(PipelineParallel(init_lenet_params(seed=3), cpus(n_ctx), "momentum", micro), 2)
    for step in range(2):
        (X1, y1), (X2, y2) = batch(8, seed=2 * step), batch(9, seed=2 * step + 1)
        big.step(np.concatenate([X1, X2]), np.concatenate([y1, y2]), 0.05)
        acc.step(X1, y1, 0.05)
        assert acc.t == step
        acc.step(X2, y2, 0.05)
        assert acc.t == step + 1
    check_placement(acc.model)
    for got, want in zip(acc.state_dict()["params"], big.state_dict()["params"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_state_dict_is_interchangeable_with_data_parallel():
    a = DataParallel(init_lenet_params(seed=0), cpus(2), "adam")
    X, y = batch(10)
    a.step(X, y, 0.01)
    b = PipelineParallel(init_lenet_params(seed=7), cpus(4), "adam", 2)
    b.load_state_dict(a.state_dict())
    check_placement(b)
    a.step(X, y, 0.01), b.step(X, y, 0.01)
    for got, want in zip(b.state_dict()["params"], a.state_dict()["params"]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert b.t == a.t == 2


def test_end_epoch_reports_the_mean_bubble():
    model = PipelineParallel(init_lenet_params(seed=0), cpus(2), "sgd", 4)
    for n in (16, 16, 3):   # the short last batch has only 3 micro-batches
        model.step(*batch(n), 0.01)
    want = np.mean([1 / 5, 1 / 5, 1 / 4])
    stats = model.end_epoch(0.01)
    assert stats["bubble_fraction"] == pytest.approx(want)
    assert set(stats) == {"bubble_fraction", "activation_peak_bytes"}     # the peaks: tests/test_stages.py
    assert model.end_epoch(0.01) == {}


def test_activation_walk_matches_real_shapes():
    params = init_lenet_params(seed=0)
    X = nd.array(batch(1)[0])
    h1 = nd.Convolution(data=X, weight=params[0], bias=params[1], kernel=(3, 3), num_filter=20)
    p1 = conv_block(X, params[0], params[1])
    h2 = nd.Convolution(data=p1, weight=params[2], bias=params[3], kernel=(5, 5), num_filter=50)
    p2 = conv_stage(X, params[:4])
    convs = X.size + 2 * h1.size + p1.size + 2 * h2.size + p2.size
    scores = dense_stage(p2, params[4:])
    # p2 is counted once, in convs: on one context it is also the dense half's input (issue 21:
    # it was counted twice)
    dense = 3 * params[5].size + 3 * scores.size + 1
    assert stage_activation_elems() == [convs, dense]


def param_bytes(names):
    return sum(4 * int(np.prod(shape)) for name, shape in LENET_SHAPES if name in names)


@pytest.mark.parametrize("optimizer,n_state", [("sgd", 0), ("adam", 2)])
def test_memory_per_context(optimizer, n_state):
    conv, dense = stage_activation_elems()
    stage0, stage1 = param_bytes({"W1", "b1", "W2", "b2"}), param_bytes({"W3", "b3", "W4", "b4"})
    model = per_context(PipelineParallel(init_lenet_params(), cpus(4), optimizer, 2), 10)

    def expect(params, act):
        return {"param_bytes": params, "grad_bytes": params, "state_bytes": n_state * params,
                "activation_bytes": act, "peak_bytes": (2 + n_state) * params + act, "method": "shapes",
                "scratch_buffers": scratch_buffers("cpu(0)")}
    received = 50 * 4 * 4       # stage 1's copy of conv2's pooled output: a real array on its own context
    assert model == {"cpu(0)": expect(stage0, 4 * 5 * conv), "cpu(1)": expect(stage1, 4 * 5 * (dense + received)),
                     "cpu(2)": expect(stage0, 4 * 5 * conv), "cpu(3)": expect(stage1, 4 * 5 * (dense + received))}
    sync = per_context(DataParallel(init_lenet_params(), cpus(3), optimizer), 10)
    assert [r["activation_bytes"] for r in sync.values()] == [4 * n * (conv + dense) for n in (4, 3, 3)]
    assert all(r["param_bytes"] == stage0 + stage1 for r in sync.values())


def test_model_mode_is_bitwise_the_one_device_step():
    """Without micro-batches nothing is summed in a new order: the very same floats come out."""
    params = get_params(init_lenet_params(seed=2), mx.cpu(0))
    states = init_states(params, "adam")
    model = PipelineParallel(init_lenet_params(seed=2), cpus(2), "adam", 1)
    for step in range(3):
        X, y = (nd.array(a) for a in batch(13, seed=step))
        with autograd.record():   # the definition of one step on one device
            loss = cross_entropy(lenet(X, params), y)
        loss.backward()
        apply_update(params, states, "adam", 0.05, step + 1, 13)
        model.step(X, y, 0.05)
    for got, want in zip(model.state_dict()["params"], params):
        np.testing.assert_array_equal(got, want.asnumpy())


@pytest.mark.parametrize("name", ["ring", "tree", "reduce_bcast", "kvstore"])
def test_hybrid_with_any_allreduce_equals_one_device(name):
    from manual_dp.fast.collectives import make_allreduce
    ref = DataParallel(init_lenet_params(seed=2), [mx.cpu(0)], "momentum")
    model = PipelineParallel(init_lenet_params(seed=2), cpus(6), "momentum", 2, allreduce_fn=make_allreduce(name))
    for step in range(2):
        X, y = batch(14, seed=step)
        ref.step(X, y, 0.05), model.step(X, y, 0.05)
    check_placement(model)
    for got, want in zip(model.state_dict()["params"], ref.state_dict()["params"]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
