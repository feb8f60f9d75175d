"""Every strategy keeps the Strategy contract and computes what one device computes.

The reference is the lesson's step on one context. Tolerances: the k-context runs add the same
float32 gradients in another order, so parameters agree to ~1e-6 (adam divides by sqrt(v), which
magnifies that noise near zero gradients: 1e-3 absolute), losses to a relative 1e-5; the numbers
of correct predictions are integers and must be equal.
"""
import mxnet as mx
import numpy as np
import pytest
from mxnet import nd

from conftest import synthetic
from manual_dp import replicas
from manual_dp.fast.compress import make_reducer
from manual_dp.strategies.compressed import Compressed
from manual_dp import (AsyncDataParallel, DataParallel, GradAccum, PipelineParallel, Strategy,
                       init_lenet_params, make_allreduce)


def cpus(n):
    return [mx.cpu(i) for i in range(n)]


STRATEGIES = {
    "lesson x3": lambda p, opt: DataParallel(p, cpus(3), opt, lesson=True),
    "fast x1": lambda p, opt: DataParallel(p, cpus(1), opt),
    "fast x4": lambda p, opt: DataParallel(p, cpus(4), opt),
    "fast ring x3": lambda p, opt: DataParallel(p, cpus(3), opt, make_allreduce("ring")),
    "graph only x2": lambda p, opt: DataParallel(p, cpus(2), opt, fuse_grads=False, graph=True),
    "grad-accum(fast) x2": lambda p, opt: GradAccum(DataParallel(p, cpus(2), opt), 1),
    "async S=0 x3": lambda p, opt: AsyncDataParallel(p, cpus(3), opt, staleness=0),
    "model": lambda p, opt: PipelineParallel(p, cpus(2), opt, 1),
    "pipeline M=3": lambda p, opt: PipelineParallel(p, cpus(2), opt, 3),
    "hybrid 2x2": lambda p, opt: PipelineParallel(p, cpus(4), opt, 2),
    # topk with K >= every gradient sends everything: compression that must change nothing
    "compress topk:all x2": lambda p, opt: Compressed(
        DataParallel(p, cpus(2), opt, r := make_reducer("topk:1000000", None, [q.shape for q in p])),
        r, "topk:1000000"),
    "compress powersgd:1000 x2": lambda p, opt: Compressed(
        DataParallel(p, cpus(2), opt, r := make_reducer("powersgd:1000", make_allreduce("reduce_bcast"),
                                                        [q.shape for q in p])), r, "powersgd:1000"),
}


def batch(n, seed):
    images, labels = synthetic(n, seed)
    return (images.astype(np.float32) / 255)[:, None], labels.astype(np.int32)


def run(model, steps=3, n=13, lr=0.05):
    """(loss, correct) of each step's batch, the sums over every placement."""
    out = []
    for step in range(steps):
        metrics = model.step(*batch(n, seed=step), lr)
        out.append((sum(l.asscalar() for l, _ in metrics), sum(c.asscalar() for _, c in metrics)))
    return out


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_strategy_equals_the_one_device_step(name, optimizer):
    ref = DataParallel(init_lenet_params(seed=3), cpus(1), optimizer, lesson=True)
    model = STRATEGIES[name](init_lenet_params(seed=3), optimizer)
    assert isinstance(model, Strategy)
    got, want = run(model), run(ref)
    np.testing.assert_allclose([l for l, _ in got], [l for l, _ in want], rtol=1e-5)
    assert [c for _, c in got] == [c for _, c in want]
    assert model.t == ref.t == 3
    atol = 1e-3 if optimizer == "adam" else 1e-6
    state, ref_state = model.state_dict(), ref.state_dict()
    for a, b in zip(state["params"], ref_state["params"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)
    for a, b in zip(sum(state["opt_state"], []), sum(ref_state["opt_state"], [])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)
    X, y = (nd.array(a) for a in batch(11, seed=9))
    assert model.correct(X, y).asscalar() == ref.correct(X, y).asscalar()


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_arrays_live_on_the_strategys_contexts_and_layout_covers_the_batch(name):
    model = STRATEGIES[name](init_lenet_params(seed=0), "adam")
    run(model, steps=1)
    held = model.arrays()
    assert set(held) == {"param", "state"} and held["param"] and held["state"]
    assert {a.context for a in held["param"] + held["state"]} <= set(model.ctx)
    for stage in (0, 1):
        assert sum(n for _, s, n in model.layout(13) if s == stage) == 13


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_replica_checks_never_fire_on_a_correct_run(name):
    model = STRATEGIES[name](init_lenet_params(seed=4), "adam")
    for step in range(3):
        model.step(*batch(13, seed=step), 0.05)
        groups = model.fingerprints()
        replicas.check(groups, model.t)
        assert groups and all(len(sums) == len(groups[g][0][1]) for g in groups for _, sums in groups[g])


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_state_dict_resumes_the_same_run(name):
    """A fresh strategy loaded with another's state_dict takes the very same next step."""
    a = STRATEGIES[name](init_lenet_params(seed=1), "momentum")
    run(a, steps=2)
    b = STRATEGIES[name](init_lenet_params(seed=8), "momentum")
    b.load_state_dict(a.state_dict())
    assert b.t == a.t == 2
    assert run(b, steps=1) == run(a, steps=1)
    for x, y in zip(b.state_dict()["params"], a.state_dict()["params"]):
        np.testing.assert_array_equal(x, y)


def test_backward_adds_and_update_normalises_by_the_examples_it_is_told():
    """Two backward calls then one update == one step on both batches (the contract GradAccum
    and the multi-process wrapper build on)."""
    (X1, y1), (X2, y2) = batch(6, 0), batch(7, 1)
    for make in (STRATEGIES["fast x4"], STRATEGIES["lesson x3"], STRATEGIES["hybrid 2x2"]):
        two = make(init_lenet_params(seed=2), "sgd")
        one = make(init_lenet_params(seed=2), "sgd")
        two.backward(X1, y1), two.backward(X2, y2)
        two.update(0.1, 13)
        one.step(np.concatenate([X1, X2]), np.concatenate([y1, y2]), 0.1)
        for a, b in zip(two.state_dict()["params"], one.state_dict()["params"]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
