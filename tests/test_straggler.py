"""--straggler I:FACTOR: context I's gradients are ready (FACTOR - 1) x its compute later, the other
contexts' are not, and no value changes. Times as lower bounds (a shared machine is only slower)."""
import time

import mxnet as mx
import numpy as np
import pytest
from mxnet import nd

from conftest import batch, run_main
from manual_dp import checkpoint
from manual_dp.lesson import init_lenet_params
from manual_dp.strategies.base import innermost
from manual_dp.strategies.data.async_dp import AsyncDataParallel
from manual_dp.strategies.data.data_parallel import DataParallel
from manual_dp.strategies.data.local_sgd import LocalSGD
from manual_dp.strategies.wrappers.straggler import MEASURED, Straggler

TINY = ["--train-size", "96", "--test-size", "32", "--batch-size", "32", "--epochs", "1", "--no-progress"]


def sync(k=2, **options):
    return DataParallel(init_lenet_params(0), [mx.cpu(i) for i in range(k)], "sgd", **options)


def async_dp(k=2, staleness=1):
    return AsyncDataParallel(init_lenet_params(0), [mx.cpu(i) for i in range(k)], "sgd", staleness=staleness)


def local(k=2, sync_every=2):
    return LocalSGD(init_lenet_params(0), [mx.cpu(i) for i in range(k)], "sgd", sync_every=sync_every)


LAYOUTS = {"fused": sync, "buckets": lambda: sync(bucket_mb=0.05), "async": async_dp, "local": local}


def measured(model, X, y):
    """`model` after the straggler's MEASURED steps, the engine idle."""
    for _ in range(MEASURED):
        model.step(X, y, 0.01)
    nd.waitall()
    assert 0 < model.compute_s < 1 and model.delay_s == pytest.approx((model.factor - 1) * model.compute_s)
    return model


def ready(arrays, start):
    """Seconds from `start` until every one of `arrays` can be read."""
    for a in arrays:
        a.wait_to_read()
    return time.perf_counter() - start


def ready_after(model, X, y, contexts):
    """Seconds from issuing a backward until each of `contexts`' gradient buffers is ready."""
    nd.waitall()
    start, done = time.perf_counter(), {}
    model.backward(X, y)
    for c in contexts:
        for g in innermost(model).grad_buffers(c):
            g.wait_to_read()
        done[c] = time.perf_counter() - start
    return done


@pytest.mark.parametrize("layout", LAYOUTS)
def test_only_the_named_context_is_late(layout):
    X, y = batch(64, 0)
    slow = measured(Straggler(LAYOUTS[layout](), 1, 4.0), X, y)
    times = ready_after(slow, X, y, [0, 1])        # context 0 first: waiting on it does not wait on 1
    assert times[1] >= times[0] + 0.85 * slow.delay_s, (times, slow.delay_s)
    slow.update(0.01, len(X))


def test_async_master_waits_for_the_late_push():
    X, y = batch(64, 0)
    slow = measured(Straggler(async_dp(), 1, 4.0), X, y)
    start = time.perf_counter()
    slow.step(X, y, 0.01)
    assert ready(innermost(slow).master, start) >= 0.85 * slow.delay_s


def test_local_replicas_wait_only_at_their_meeting():
    X, y = batch(64, 0)
    slow = measured(Straggler(local(sync_every=3), 1, 4.0), X, y)   # 3 steps: a sync, then 2 inner
    start, flat = time.perf_counter(), innermost(slow).flat
    slow.step(X, y, 0.01)
    fast = ready([flat[0].flat], start)
    assert ready([flat[1].flat], start) >= fast + 0.85 * slow.delay_s
    slow.step(X, y, 0.01)
    nd.waitall()
    start = time.perf_counter()
    slow.step(X, y, 0.01)                                               # the sync: everyone waits
    assert ready([flat[0].flat], start) >= 0.85 * slow.delay_s


def params_and_replicas(model):
    state = model.state_dict()
    extra = state.get("extra", {})
    return state["params"] + list(extra.get("replicas", [])) + list(extra.get("local_replicas", []))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_straggler_changes_no_value(layout):
    X, y = batch(64, 0)
    plain, slow = LAYOUTS[layout](), Straggler(LAYOUTS[layout](), 0, 2.0)
    for _ in range(MEASURED + 2):
        plain.step(X, y, 0.01)
        slow.step(X, y, 0.01)
    for a, b in zip(params_and_replicas(plain), params_and_replicas(slow)):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("mode", [["--mode", "async", "--staleness", "1"], ["--mode", "local", "--sync-every", "2"]],
                         ids=["async", "local"])
def test_the_cli_straggles_async_and_local_and_changes_no_value(capsys, data_dir, tmp_path, mode):
    states = {}
    for name, extra in {"plain": [], "straggler": ["--straggler", "1:2"]}.items():
        code, _, err = run_main(capsys, ["--cpus", "2", "--data-dir", str(data_dir), "--checkpoint-dir",
                                         str(tmp_path / name), *TINY, *mode, *extra])
        assert code == 0, err
        states[name] = checkpoint.load(tmp_path / name)[0]
    assert all(np.array_equal(a, b) for a, b in zip(states["plain"]["params"], states["straggler"]["params"]))


@pytest.mark.parametrize("argv,message", [
    (["--straggler", "1"], "--straggler 1: give CONTEXT:FACTOR"),
    (["--straggler", "a:2"], "--straggler a:2: give CONTEXT:FACTOR"),
    (["--straggler", "1:2:3"], "give CONTEXT:FACTOR"),
    (["--straggler", "2:2"], "context 2 is not one of the 2 contexts"),
    (["--straggler=-1:2"], "context -1 is not one of the 2 contexts"),
    (["--straggler", "1:0.5"], "the factor must be >= 1 and finite"),
    (["--straggler", "1:inf"], "the factor must be >= 1 and finite"),
    (["--straggler", "1:nan"], "the factor must be >= 1 and finite"),
    (["--straggler", "1:2", "--mode", "pipeline"], "slows one replica of --mode sync, async, local"),
    (["--straggler", "1:2", "--deterministic"], "without --deterministic"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_stragglers_are_one_line_and_exit_2(capsys, data_dir, argv, message):
    code, out, err = run_main(capsys, ["--cpus", "2", "--data-dir", str(data_dir), *TINY, *argv])
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert out == ""


def test_a_given_compute_time_is_not_measured():
    X, y = batch(64, 0)
    slow = Straggler(local(), 1, 3.0, compute_s=0.05)
    start = time.perf_counter()
    slow.step(X, y, 0.01)
    assert ready(innermost(slow).grad_buffers(1), start) >= 0.85 * 0.1 and slow.compute_s == 0.05


def test_the_benchmark_prints_every_layout_beside_sync(capsys):
    from manual_dp.bench.straggler import main
    main(["--devices", "2", "--straggler", "1:2", "--staleness", "1", "--sync-every", "2", "--steps", "2",
          "--rounds", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["layout", "sync", "async", "local"]
    assert lines[1].split()[4] == "1.00" and all(float(line.split()[-1]) > 0 for line in lines[1:])


def test_a_moving_straggler_slows_each_context_in_turn_and_changes_no_value():
    X, y = batch(64, 0)
    plain, slow = local(3), Straggler(local(3), 0, 3.0, compute_s=0.04, moving=True)
    for step in range(3):
        assert slow.slow_context() == step
        start = time.perf_counter()
        slow.step(X, y, 0.01)
        plain.step(X, y, 0.01)
        assert ready(innermost(slow).grad_buffers(step), start) >= 0.85 * 0.08
    for a, b in zip(params_and_replicas(plain), params_and_replicas(slow)):
        assert np.array_equal(a, b)
