"""The autotune's bookkeeping (not its timing): a cached choice is used, a cache of another machine
is not, the environment wins, --no-autotune takes the plain graph; and every padding it may choose
computes what the unpadded graph computes."""
import json

import mxnet as mx
import numpy as np
import pytest

from manual_dp import DataParallel, init_lenet_params
from manual_dp.fast import autotune
from test_step import batch, numpy_params


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """No $MANUAL_DP_CONV_PAD, a cache file of this test's own; returns the fake measurements' log."""
    monkeypatch.delenv("MANUAL_DP_CONV_PAD", raising=False)
    monkeypatch.setenv("MANUAL_DP_CACHE", str(tmp_path / "cache.json"))
    return []


def fake(calls, fastest=8):
    """A stand-in measurement: CPU ms per image, lowest for `fastest`; records what it measured."""
    def measure(pad):
        calls.append(pad)
        return 1.0 if pad == fastest else 2.0
    return measure


def test_measures_once_then_uses_the_cache(fresh, tmp_path):
    said = []
    assert autotune.conv_pad(measure=fake(fresh), say=said.append) == 8
    assert fresh == list(autotune.CONV_PADS) and len(said) == 1 and "multiples of 8" in said[0]
    cache = json.loads((tmp_path / "cache.json").read_text())
    assert cache[autotune.machine_key()]["conv_pad"] == 8
    assert autotune.conv_pad(measure=fake(fresh, fastest=16), say=said.append) == 8   # cached: no new measurement
    assert fresh == list(autotune.CONV_PADS) and len(said) == 1


def test_a_cache_of_another_machine_is_ignored(fresh, tmp_path):
    (tmp_path / "cache.json").write_text(json.dumps({"Some other CPU | AVX-512 | 64 cores | mxnet 1.9.1": {"conv_pad": 16}}))
    assert autotune.conv_pad(measure=fake(fresh, fastest=1), say=lambda s: None) == 1
    assert fresh == list(autotune.CONV_PADS)
    cache = json.loads((tmp_path / "cache.json").read_text())
    assert len(cache) == 2 and cache[autotune.machine_key()]["conv_pad"] == 1


def test_the_environment_and_no_autotune_win(fresh, monkeypatch):
    assert autotune.conv_pad(enabled=False, measure=fake(fresh)) == 1
    monkeypatch.setenv("MANUAL_DP_CONV_PAD", "16")
    assert autotune.conv_pad(measure=fake(fresh)) == 16
    assert fresh == []
    for bad in ("eight", "0", "100000"):               # 100000 overflowed a shape inside MXNet (issue 25)
        monkeypatch.setenv("MANUAL_DP_CONV_PAD", bad)
        with pytest.raises(ValueError, match=f"MANUAL_DP_CONV_PAD='{bad}' must be a whole number from 1 to 64"):
            autotune.conv_pad(measure=fake(fresh))


def test_a_damaged_cache_is_measured_again(fresh, tmp_path):
    (tmp_path / "cache.json").write_text("{not json")
    assert autotune.conv_pad(measure=fake(fresh), say=lambda s: None) == 8 and fresh


@pytest.mark.parametrize("conv_pad", autotune.CONV_PADS + (3,))
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_padded_graph_equals_the_lessons_step(conv_pad, optimizer):
    """Zero filters change only the order of float additions: the same tolerance as k contexts."""
    ref = DataParallel(init_lenet_params(seed=1), [mx.cpu(0)], optimizer, lesson=True)
    fast = DataParallel(init_lenet_params(seed=1), [mx.cpu(0), mx.cpu(1)], optimizer, conv_pad=conv_pad)
    assert fast.graph.conv_pad == conv_pad
    for step in range(3):
        X, y = batch(12, seed=step)
        want = sum(l.asscalar() for l, _ in ref.step(X, y, 0.05))
        assert sum(l.asscalar() for l, _ in fast.step(X, y, 0.05)) == pytest.approx(want, rel=1e-5)
    atol = 1e-3 if optimizer == "adam" else 1e-6
    for W in fast.replicas:
        assert [p.shape for p in W] == [p.shape for p in ref.replicas[0]]
        for got, want in zip(numpy_params(W), numpy_params(ref.replicas[0])):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=atol)
