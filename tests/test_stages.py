"""LeNet cut into 1 to 4 stages, GPipe and 1F1B schedules, --recompute, and the activations each
stage holds, counted as the schedule runs.

Tolerances: 1F1B runs the same ops as GPipe but adds each stage's micro-batch gradients in another
order (0, 1, ... instead of M-1, ..., 0), so parameters agree to float32 rounding (1e-6 with SGD).
Recompute runs the very same ops on the very same inputs: bit for bit.
"""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, nd

from conftest import assert_on, cpus, synthetic
from manual_dp import config, init_lenet_params, lenet
from manual_dp.lesson import cross_entropy, get_params, lenet_shapes
from manual_dp.memory import part_activation_elems, per_context, piece_activation_elems, stage_activation_elems
from manual_dp.optim import apply_update, init_states
from manual_dp.strategies.pipeline.pipeline import PipelineParallel
from manual_dp.strategies.pipeline.schedules import (bubble_fraction, clock, gpipe_schedule, held_peaks, schedule,
                                            stage_orders)
from manual_dp.strategies.pipeline.stages import CUTS, MAX_STAGES, make_stages, param_slices, split_params


def batch(n, seed=0):
    images, labels = synthetic(n, seed)
    return (images.astype(np.float32) / 255)[:, None], labels.astype(np.int32)


@pytest.mark.parametrize("width", [1, 2])
@pytest.mark.parametrize("n_stages", sorted(CUTS))
def test_every_cut_composes_to_lenet_bit_for_bit(n_stages, width):
    params = init_lenet_params(seed=4, width=width)
    h = X = nd.array(batch(5)[0])
    for stage, P in zip(make_stages(n_stages), split_params(params, n_stages)):
        h = stage(h, P)
    np.testing.assert_array_equal(h.asnumpy(), lenet(X, params).asnumpy())
    assert sum(map(len, split_params(params, n_stages))) == 8
    assert [s.start for s in param_slices(n_stages)][1:] == [s.stop for s in param_slices(n_stages)][:-1]
    assert config.MAX_STAGES == MAX_STAGES


@pytest.mark.parametrize("width", [1, 3])
def test_piece_activations_add_up_to_the_stages(width):
    shapes = [s for _, s in lenet_shapes(width)]
    conv, dense = (part_activation_elems(p, shapes=shapes) for p in CUTS[2])
    # one context running both halves keeps conv2's pooled output once, as the convolutions'
    # output: the dense half's input is not counted again (issue 21: it was counted twice); a
    # stage on a context of its own keeps its received copy (part_activation_elems)
    assert stage_activation_elems(shapes=shapes) == [conv, dense - 50 * width * 16]
    inputs = [i for i, _ in piece_activation_elems(shapes=shapes)]
    assert inputs == [784, 20 * width * 13 * 13, 50 * width * 16, 128 * width]   # each piece's input
    assert part_activation_elems(("input", 2), shapes=shapes) == 800 * width


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("n_stages,n_micro", [(1, 1), (2, 1), (2, 4), (3, 5), (4, 2), (4, 8)])
def test_schedules_respect_dependencies_and_share_the_bubble(name, n_stages, n_micro):
    done, ticks = {}, schedule(name, n_stages, n_micro)
    for tick, actions in enumerate(ticks):
        assert len({s for _, s, _ in actions}) == len(actions), "a stage does two things in one tick"
        for phase, s, m in actions:
            if phase == "F" and s > 0:
                assert done[("F", s - 1, m)] < tick
            if phase == "B":
                assert done[("F", s, m)] < tick
                assert s == n_stages - 1 or done[("B", s + 1, m)] < tick
        done.update((a, tick) for a in actions)
    assert set(done) == {(p, s, m) for p in "FB" for s in range(n_stages) for m in range(n_micro)}
    assert len(ticks) == 2 * (n_micro + n_stages - 1)
    assert bubble_fraction(ticks, n_stages) == pytest.approx((n_stages - 1) / (n_micro + n_stages - 1))


@pytest.mark.parametrize("n_stages,n_micro", [(1, 3), (2, 4), (3, 5), (4, 8)])
def test_clock_of_gpipes_orders_is_the_closed_form(n_stages, n_micro):
    general = clock(stage_orders("gpipe", n_stages, n_micro))
    assert [sorted(t) for t in general] == [sorted(t) for t in gpipe_schedule(n_stages, n_micro)]


@pytest.mark.parametrize("n_stages,n_micro", [(2, 1), (2, 5), (3, 2), (4, 8), (4, 3)])
def test_1f1b_holds_at_most_S_minus_s_micro_batches_gpipe_all(n_stages, n_micro):
    ones = [1] * n_micro
    assert held_peaks(schedule("gpipe", n_stages, n_micro), n_stages, ones) == [n_micro] * n_stages
    assert held_peaks(schedule("1f1b", n_stages, n_micro), n_stages, ones) == [
        min(n_stages - s, n_micro) for s in range(n_stages)]


def test_unknown_schedule_and_impossible_cuts_are_refused():
    with pytest.raises(ValueError, match="unknown schedule"):
        PipelineParallel(init_lenet_params(), cpus(2), "sgd", 2, schedule="zigzag")
    with pytest.raises(ValueError, match="cannot be cut into 3-stage"):
        PipelineParallel(init_lenet_params(), cpus(4), "sgd", 2, stages=3)
    with pytest.raises(ValueError, match="cannot be cut into 5-stage"):
        PipelineParallel(init_lenet_params(), cpus(5), "sgd", 2, stages=5)


def params_after(model, steps=3, n=16):
    """(losses, numbers correct, parameters) after `steps` steps of SGD on fixed batches."""
    losses, correct = [], []
    for step in range(steps):
        metrics = model.step(*batch(n, seed=step), 0.05)
        losses.append([l.asnumpy() for l, _ in metrics])
        correct.append([c.asscalar() for _, c in metrics])
    return losses, correct, model.state_dict()["params"]


@pytest.mark.parametrize("n_ctx,n_stages,micro", [(2, 2, 4), (3, 3, 2), (4, 4, 5), (4, 4, 8), (6, 3, 3)])
def test_1f1b_equals_gpipe(n_ctx, n_stages, micro):
    gpipe = params_after(PipelineParallel(init_lenet_params(seed=6), cpus(n_ctx), "sgd", micro, stages=n_stages))
    f1b = params_after(PipelineParallel(init_lenet_params(seed=6), cpus(n_ctx), "sgd", micro, stages=n_stages,
                                        schedule="1f1b"))
    np.testing.assert_allclose(np.array(f1b[0]), np.array(gpipe[0]), rtol=1e-6)
    assert f1b[1] == gpipe[1]
    for a, b in zip(f1b[2], gpipe[2]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("n_ctx,n_stages,micro,name", [(2, 2, 1, "gpipe"), (3, 3, 4, "gpipe"), (4, 4, 8, "1f1b"),
                                                       (4, 2, 3, "1f1b"), (6, 3, 2, "gpipe")])
def test_recompute_is_bit_for_bit_the_same_step(n_ctx, n_stages, micro, name, optimizer):
    def make(recompute):
        return PipelineParallel(init_lenet_params(seed=1), cpus(n_ctx), optimizer, micro, stages=n_stages,
                                schedule=name, recompute=recompute)
    kept, again = params_after(make(False)), params_after(make(True))
    for got, want in zip(sum(again[0], []), sum(kept[0], [])):     # every replica's loss of every step
        np.testing.assert_array_equal(got, want)
    assert again[1] == kept[1]
    for a, b in zip(again[2], kept[2]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("n_stages", [1, 3, 4])
def test_model_mode_on_any_cut_is_bitwise_the_one_device_step(n_stages, recompute):
    """One micro-batch: nothing is summed in a new order, the very same floats come out."""
    params = get_params(init_lenet_params(seed=2), mx.cpu(0))
    states = init_states(params, "adam")
    model = PipelineParallel(init_lenet_params(seed=2), cpus(n_stages), "adam", 1, stages=n_stages,
                             recompute=recompute)
    for step in range(3):
        X, y = (nd.array(a) for a in batch(13, seed=step))
        with autograd.record():
            loss = cross_entropy(lenet(X, params), y)
        loss.backward()
        apply_update(params, states, "adam", 0.05, step + 1, 13)
        got = model.step(X, y, 0.05)
        assert got[0][0].asscalar() == loss.sum().asscalar()
    for got, want in zip(model.state_dict()["params"], params):
        np.testing.assert_array_equal(got, want.asnumpy())
    for row, P_row, S_row in zip(model.grid, model.params, model.states):
        for c, P, S in zip(row, P_row, S_row):
            assert_on(P + [p.grad for p in P] + [s for st in S for s in st], c)


def measured_peaks(n_ctx, n_stages, micro, name, recompute, n=32):
    """Per context, the activation bytes counted as one step's schedule ran, and those the layout
    prices (manual_dp.memory)."""
    model = PipelineParallel(init_lenet_params(seed=0), cpus(n_ctx), "sgd", micro, stages=n_stages,
                             schedule=name, recompute=recompute)
    model.step(*batch(n), 0.01)
    peaks = model.end_epoch(0.01)["activation_peak_bytes"]
    priced = {c: r["activation_bytes"] for c, r in per_context(model, n).items()}
    return [peaks[str(c)] for c in model.ctx], [priced[str(c)] for c in model.ctx]


def test_1f1b_holds_fewer_activations_than_gpipe_at_S4_M8():
    """Counted, not timed: 32 examples in 8 micro-batches of 4; GPipe holds all 8 on every stage,
    1F1B at most 4 - s on stage s."""
    gpipe, gpipe_priced = measured_peaks(4, 4, 8, "gpipe", False)
    f1b, f1b_priced = measured_peaks(4, 4, 8, "1f1b", False)
    assert gpipe == gpipe_priced and f1b == f1b_priced
    assert all(f < g for f, g in zip(f1b, gpipe))
    assert [8 * f for f in f1b] == [(4 - s) * g for s, g in enumerate(gpipe)]
    pieces = piece_activation_elems()
    assert gpipe == [32 * 4 * (i + k) for i, k in pieces]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_recompute_holds_less_where_activations_outweigh_inputs(name):
    """Recompute keeps each held micro-batch's input and one micro-batch's activations: less on
    GPipe's every stage; on 1F1B less in total, but not on dense1 (its input, 800 floats an
    example, is most of what it keeps, 1,184, and it holds two micro-batches)."""
    kept, _ = measured_peaks(4, 4, 8, name, False)
    again, priced = measured_peaks(4, 4, 8, name, True)
    assert again == priced
    assert sum(again) < sum(kept) and again[0] < kept[0] / 3
    if name == "gpipe":
        assert all(a < k for a, k in zip(again, kept))
    else:
        assert again[2] > kept[2]


def test_hybrid_peaks_are_per_replica():
    peaks, priced = measured_peaks(6, 3, 4, "1f1b", True, n=30)
    assert peaks == priced and peaks[:3] == peaks[3:]


def test_bench_prints_the_counted_peaks_and_the_times():
    """python -m manual_dp.bench.stages: its peaks are the strategy's counts (GPipe's stage 0 holds
    all 8 examples' activations of conv1), 1F1B's below GPipe's after stage 0, and a time for each setting."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "manual_dp.bench.stages", "--stages", "4", "--micro-batches",
                           "4", "--batch-size", "8", "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["gpipe"], ["1f1b"])]
    peaks = {(r[0], r[1]): [int(v.replace(",", "")) for v in r[2:]] for r in rows[:4]}
    i, k = piece_activation_elems()[0]
    assert peaks["gpipe", "no"][0] == 8 * (i + k) * 4
    assert peaks["1f1b", "no"][0] == peaks["gpipe", "no"][0]        # M = S: stage 0 holds all 4 on both
    assert all(f < g for f, g in zip(peaks["1f1b", "no"][1:], peaks["gpipe", "no"][1:]))
    assert peaks["gpipe", "yes"][-1] < peaks["gpipe", "no"][-1]
    assert [r[-2:] for r in rows[4:]] == [["ms", "1.00x"], rows[5][-2:], ["ms", "1.00x"], rows[7][-2:]]
