"""--precision on the mesh layouts (context, sequence-parallel tensor, dp x pp x tp, dp x pp x cp):
each in bf16 against one context in bf16, as tests/test_precision.py holds the other layouts
(parameters within 2e-2 of the steps' change: the same rounded products, float32 sums in another
order, which bf16's 8-bit mantissa makes visible), and the layout did compute in bf16 (its bits differ
from its float32 twin's). fp16's loss scale through one of them."""
import numpy as np
import pytest

from conftest import batch, cpus
from manual_dp import DataParallel, models
from manual_dp.models.precise import Precise
from manual_dp.precision import Policy
from manual_dp.strategies.context.context import ContextParallel
from manual_dp.strategies.wrappers.loss_scaled import LossScaled
from manual_dp.strategies.mesh.mesh_parallel import MeshParallel
from manual_dp.strategies.tensor.tensor import TensorParallel

LAYOUTS = {
    "context ring 2": lambda P, m: ContextParallel(P, cpus(2), "momentum", 2, "ring", model=m),
    "context ulysses dp2 x cp2": lambda P, m: ContextParallel(P, cpus(4), "momentum", 2, "ulysses", model=m),
    "tensor 2 +sp": lambda P, m: TensorParallel(P, cpus(2), "momentum", 2, model=m, sequence_parallel=True),
    "mesh pp2 x tp2": lambda P, m: MeshParallel(P, cpus(4), "momentum", 2, 2, 2, "1f1b", model=m),
    "mesh pp2 x cp2 zero": lambda P, m: MeshParallel(P, cpus(8), "momentum", 2, 1, 2, "gpipe", model=m,
                                                     context_parallel=2, zero_stage=1),
}


def steps(strategy, n=3):
    X, y = batch(24, 0)
    for _ in range(n):
        strategy.step(X, y, 0.05)
    return strategy.state_dict()["params"]


@pytest.fixture(scope="module")
def reference():
    net = models.build("transformer", layers=4, d_model=16, heads=4)
    P, low = net.init_params(0), Precise(net, Policy("bf16"))
    return low, P, steps(DataParallel(P, cpus(1), "momentum", model=low))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mesh_layouts_in_bf16_equal_one_context_in_bf16(reference, layout):
    low, P, want = reference
    got = steps(LAYOUTS[layout](P, low))
    change = max(float(np.abs(w - p.asnumpy()).max()) for w, p in zip(want, P))
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, want)) <= 2e-2 * change
    fp32 = steps(LAYOUTS[layout](P, low.inner))
    assert any(not np.array_equal(g, f) for g, f in zip(got, fp32))


def test_fp16_loss_scale_through_a_context_group():
    net = models.build("transformer", layers=2, d_model=16, heads=4)
    P = net.init_params(0)
    policy = Policy("fp16", loss_scale=2.0 ** 40)                   # overflows: skipped, halved, then learns
    model = LossScaled(ContextParallel(P, cpus(2), "momentum", 2, model=Precise(net, policy)), policy.scaler)
    model.clip(None)
    X, y = batch(16, 0)
    for _ in range(40):
        model.step(X, y, 0.05)
    assert policy.scaler.scale < 2.0 ** 40
    got = model.state_dict()["params"]
    assert all(np.isfinite(g).all() for g in got) and any(not np.array_equal(g, p.asnumpy()) for g, p in zip(got, P))
