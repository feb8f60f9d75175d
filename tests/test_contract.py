"""Every strategy keeps the Strategy contract and computes what one device computes.

The reference is the lesson's step on one context. Tolerances: the k-context runs add the same
float32 gradients in another order, so parameters agree to ~1e-6 (adam divides by sqrt(v), which
magnifies that noise near zero gradients: 1e-3 absolute), losses to a relative 1e-5; the numbers
of correct predictions are integers and must be equal.
"""
import numpy as np
import pytest
from mxnet import nd

from conftest import batch, cpus
from manual_dp import replicas
from manual_dp.loop import evaluate
from manual_dp.fast.compress import make_reducer
from manual_dp.strategies.wrappers.compressed import Compressed
from manual_dp import (AsyncDataParallel, DataParallel, GradAccum, PipelineParallel, Strategy,
                       init_lenet_params, make_allreduce)
from manual_dp import ZeroRedundancy
from manual_dp import LocalSGD
from manual_dp.strategies.sums.fixed_sums import FixedSums
from manual_dp.strategies.tensor.tensor import TensorParallel
from manual_dp.strategies.sums.fixed_sums import FixedSums


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
    "deterministic x3": lambda p, opt: DataParallel(p, cpus(3), opt, sums=FixedSums(piece=4)),
    "zero1 x3": lambda p, opt: ZeroRedundancy(p, cpus(3), opt, stage=1),
    "zero2 x4": lambda p, opt: ZeroRedundancy(p, cpus(4), opt, stage=2),
    "zero3 x3": lambda p, opt: ZeroRedundancy(p, cpus(3), opt, stage=3),
    "zero3 naive x2": lambda p, opt: ZeroRedundancy(p, cpus(2), opt, stage=3, collective="naive"),
    # local SGD, H = 1, outer sgd at lr 1: one replica, so the step for every optimiser (bit for bit);
    # with several, sync's step for sgd and momentum only (tests/test_local_sgd.py): Adam is not linear
    "local H=1 x1": lambda p, opt: LocalSGD(p, cpus(1), opt, sync_every=1),
    "pipeline S=3 gpipe M=2": lambda p, opt: PipelineParallel(p, cpus(3), opt, 2, stages=3),
    "pipeline S=3 1f1b M=5": lambda p, opt: PipelineParallel(p, cpus(3), opt, 5, stages=3, schedule="1f1b"),
    "pipeline S=4 gpipe M=8": lambda p, opt: PipelineParallel(p, cpus(4), opt, 8, stages=4),
    "pipeline S=4 1f1b M=3": lambda p, opt: PipelineParallel(p, cpus(4), opt, 3, stages=4, schedule="1f1b"),
    "pipeline S=2 1f1b M=4 recompute": lambda p, opt: PipelineParallel(p, cpus(2), opt, 4, schedule="1f1b",
                                                                       recompute=True),
    "model S=4 recompute": lambda p, opt: PipelineParallel(p, cpus(4), opt, 1, stages=4, recompute=True),
    "hybrid 2x3 1f1b M=2 recompute": lambda p, opt: PipelineParallel(p, cpus(6), opt, 2, stages=3,
                                                                     schedule="1f1b", recompute=True),
    "buckets 0.001 MB ring x3": lambda p, opt: DataParallel(p, cpus(3), opt, make_allreduce("ring"), bucket_mb=0.001),
    "buckets 0 MB no graph x2": lambda p, opt: DataParallel(p, cpus(2), opt, graph=False, bucket_mb=0),
    "tensor T=1 x1": lambda p, opt: TensorParallel(p, cpus(1), opt),
    "tensor T=2 x2": lambda p, opt: TensorParallel(p, cpus(2), opt),
    "tensor T=4 x4": lambda p, opt: TensorParallel(p, cpus(4), opt),
    "tensor TPxDP 2x2": lambda p, opt: TensorParallel(p, cpus(4), opt, 2),
    # topk with K >= every gradient sends everything: compression that must change nothing
    "compress topk:all x2": lambda p, opt: Compressed(
        DataParallel(p, cpus(2), opt, r := make_reducer("topk:1000000", None, [q.shape for q in p])),
        r, "topk:1000000"),
    "compress powersgd:1000 x2": lambda p, opt: Compressed(
        DataParallel(p, cpus(2), opt, r := make_reducer("powersgd:1000", make_allreduce("reduce_bcast"),
                                                        [q.shape for q in p])), r, "powersgd:1000"),
    "zero-deterministic s1 x2": lambda p, opt: ZeroRedundancy(p, cpus(2), opt, stage=1, sums=FixedSums(piece=4)),
    "zero-deterministic s2 x4": lambda p, opt: ZeroRedundancy(p, cpus(4), opt, stage=2, sums=FixedSums(piece=4)),
    "zero-deterministic s3 x3": lambda p, opt: ZeroRedundancy(p, cpus(3), opt, stage=3, sums=FixedSums(piece=4)),
    "tensor-deterministic T2 x4": lambda p, opt: TensorParallel(p, cpus(4), opt, 2, sums=FixedSums(4, tensor_pieces=4)),
}
# Strategies that keep the contract but compute, by design, something other than the one-device
# step (their own references are in their own tests): every test here but the equality with it.
OWN_ALGORITHM = {
    "local H=3 x3 nesterov": lambda p, opt: LocalSGD(p, cpus(3), opt, 3, "nesterov", 0.7, 0.9),
    "local H=1 x2 sgd lr 0.5": lambda p, opt: LocalSGD(p, cpus(2), opt, 1, "sgd", 0.5),
}
CONTRACT = {**STRATEGIES, **OWN_ALGORITHM}


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


def pieces(part):
    """LeNet's pieces (conv1, conv2, dense1, dense2) whose activations a layout part holds: stage 0
    (the convs) or 1 (the dense layers), or a tuple of pieces, or ("input", i) (only an input)."""
    if isinstance(part, int):
        return (0, 1) if part == 0 else (2, 3)
    return () if part[0] == "input" else part


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_arrays_live_on_the_strategys_contexts_and_layout_covers_the_batch(name):
    model = CONTRACT[name](init_lenet_params(seed=0), "adam")
    run(model, steps=1)
    held = model.arrays()
    assert set(held) in ({"param", "state"}, {"param", "grad", "state"}) and held["param"]
    assert held.get("grad", held["state"])           # gradients, in "grad" or (older) in "state"
    assert {a.context for a in sum(held.values(), [])} <= set(model.ctx)
    covered = [sum(n for _, s, n in model.layout(13) if piece in pieces(s)) for piece in range(4)]
    if "1f1b" in name or "recompute" in name:  # at most S - s micro-batches, or one, held at once
        assert all(0 < n <= 13 for n in covered), covered
    else:
        assert covered == [13] * 4


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_replica_checks_never_fire_on_a_correct_run(name):
    model = CONTRACT[name](init_lenet_params(seed=4), "adam")
    for step in range(3):
        model.step(*batch(13, seed=step), 0.05)
        groups = model.fingerprints()
        replicas.check(groups, model.t)
        assert groups and all(len(sums) == len(groups[g][0][1]) for g in groups for _, sums in groups[g])


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_state_dict_resumes_the_same_run(name):
    """A fresh strategy loaded with another's state_dict takes the very same next step."""
    a = CONTRACT[name](init_lenet_params(seed=1), "momentum")
    run(a, steps=2)
    b = CONTRACT[name](init_lenet_params(seed=8), "momentum")
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


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_takes_a_wider_lenet(name):
    """--width 2 (4x the parameters): still the one-device step, to float32 rounding (plain SGD, so
    rounding differences stay at the size of the sums' last bits)."""
    ref = DataParallel(init_lenet_params(seed=5, width=2), cpus(1), "sgd", lesson=True)
    model = STRATEGIES[name](init_lenet_params(seed=5, width=2), "sgd")
    got, want = run(model, steps=2), run(ref, steps=2)
    np.testing.assert_allclose([l for l, _ in got], [l for l, _ in want], rtol=1e-5)
    for a, b in zip(model.state_dict()["params"], ref.state_dict()["params"]):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    X, y = batch(40, seed=7)       # 40 channels: oneDNN's blocked layout, which must not touch the params
    before = model.state_dict()["params"]
    assert evaluate(model, X, y, 16) == evaluate(ref, X, y, 16)
    for a, b in zip(model.state_dict()["params"], before):
        np.testing.assert_array_equal(a, b)
