"""Interleaved 1F1B and ZB-H1 beside GPipe and 1F1B: the schedules as data (every action once, what
each needs ends first, the bubble against the papers' formulas, the micro-batches held, bad orders
refused), and run for real, against the one-device step, on LeNet and a small transformer.

Tolerances: the pipelines sum a stage's micro-batch gradients one micro-batch at a time and the
replicas' in the all-reduce, one device sums the whole batch at once: the same numbers added in
another order, so the parameters agree to float32 rounding (rtol 1e-5, atol 1e-6, as in
tests/test_stages.py). ZB-H1 adds each W's gradient into .grad in 1F1B's order: bit for bit 1F1B.
"""
import mxnet as mx
import numpy as np
import pytest

from conftest import assert_on, batch, cpus
from manual_dp import DataParallel
from manual_dp.models import as_model
from manual_dp.models.transformer import Transformer
from manual_dp.strategies.pipeline.pipeline import PipelineParallel
from manual_dp.strategies.pipeline.schedules import (Plan, bubble_fraction, bubbles, dry_run, formula, held, needs, plan,
                                            schedule, simulate)

CASES = [(name, S, M, 1) for name in ("gpipe", "1f1b", "zb-h1") for S, M in [(1, 3), (2, 4), (3, 5), (4, 8), (4, 2)]]
CASES += [("interleaved", S, M, V) for S, M in [(1, 3), (2, 4), (3, 6), (4, 8), (4, 3)] for V in (1, 2, 3)]


@pytest.mark.parametrize("name,S,M,V", CASES)
def test_every_action_once_each_after_what_it_needs(name, S, M, V):
    p = plan(name, S, M, V)
    times = simulate(p)
    phases = "FBW" if name == "zb-h1" else "FB"
    assert sorted(times) == sorted((ph, k, m) for ph in phases for k in range(S * V) for m in range(M))
    for action, (start, _) in times.items():
        assert all(times[x][1] <= start for x in needs(action, S * V))
    for d, order in enumerate(p.orders):
        assert all(k % S == d for _, k, _ in order)
        spans = [times[a] for a in order]
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))      # one action at a time


@pytest.mark.parametrize("S,M", [(2, 1), (2, 5), (3, 2), (4, 8), (4, 3)])
def test_micro_batches_held(S, M):
    """1F1B and ZB-H1 hold at most S - s micro-batches' activations on stage s until B; ZB-H1 keeps
    them until W, S on every stage (1F1B's stage 0), the paper's "same peak memory as 1F1B"."""
    assert held(plan("gpipe", S, M)) == [M] * S
    assert held(plan("1f1b", S, M)) == [min(S - s, M) for s in range(S)]
    zb = plan("zb-h1", S, M)
    assert held(zb, until="B") == [min(S - s, M) for s in range(S)]
    assert held(zb) == [min(S, M)] * S


def test_bubbles_at_4_stages_8_micro_batches():
    """Bubble over ideal compute, F = B = W = 1 (an unsplit B = 2): 1F1B (p-1)/m = 0.375,
    interleaved V=2 (p-1)/(vm) = 0.1875, ZB-H1 (p-1)/(3m) = 0.125; the simulation hits each."""
    got = {}
    for name, V in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]:
        p = plan(name, 4, 8, V)
        share, ratio = bubbles(p, simulate(p))
        assert ratio == pytest.approx(formula(p), rel=0.02)
        assert share == pytest.approx(ratio / (1 + ratio))
        got[name] = ratio
    assert got["gpipe"] == got["1f1b"] == pytest.approx(3 / 8)
    assert got["interleaved"] == pytest.approx(3 / 16) and got["zb-h1"] == pytest.approx(3 / 24)
    assert got["interleaved"] < got["1f1b"] and got["zb-h1"] < got["1f1b"]


@pytest.mark.parametrize("S", [2, 3, 4, 5])
def test_formulas_hold_wherever_their_assumptions_do(S):
    for M in range(S, 4 * S + 1):
        zb = plan("zb-h1", S, M)
        assert bubbles(zb, simulate(zb))[1] == pytest.approx(formula(zb))
        f1b = plan("1f1b", S, M)
        assert bubbles(f1b, simulate(f1b))[0] == pytest.approx(bubble_fraction(schedule("1f1b", S, M), S))
        for V in (2, 3):
            if M % S == 0:
                inter = plan("interleaved", S, M, V)
                assert bubbles(inter, simulate(inter))[1] == pytest.approx(formula(inter))


def broken(p, d, order):
    return Plan(p.name, p.n_devices, p.n_micro, p.virtual, p.orders[:d] + (tuple(order),) + p.orders[d + 1:])


def test_bad_orders_are_refused_naming_the_first_stuck_action():
    zb = plan("zb-h1", 2, 2)
    order = list(zb.orders[1])
    i = order.index(("W", 1, 0))
    order.insert(order.index(("B", 1, 0)), order.pop(i))                 # W before its B
    with pytest.raises(ValueError, match="W of stage 1, micro-batch 0 on device 1 waits for B of stage 1, "
                                         "micro-batch 0, which runs later on the same device"):
        simulate(broken(zb, 1, order))
    f1b = plan("1f1b", 2, 2)   # device 1 wants F1 before B0, device 0 runs B0 before F1: each waits on the other
    swapped = broken(broken(f1b, 1, [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)]), 0,
                     [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)])
    with pytest.raises(ValueError, match="B of stage 0, micro-batch 0 on device 0 waits for B of stage 1, "
                                         "micro-batch 0, which device 1 runs only after another wait on this one"):
        simulate(swapped)
    with pytest.raises(ValueError, match="F of stage 1, micro-batch 1 never runs"):
        simulate(broken(f1b, 1, [("F", 1, 0), ("B", 1, 0), ("B", 1, 1)]))
    with pytest.raises(ValueError, match="runs twice"):
        simulate(broken(f1b, 1, [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("B", 1, 1)]))
    with pytest.raises(ValueError, match="is on device 1, not 0"):
        simulate(broken(f1b, 1, f1b.orders[1] + (("F", 0, 0),)))


def test_dry_run_text():
    text = dry_run("interleaved", 4, 8, 2).splitlines()
    assert len(text) == 7 and text[1].startswith("device 0: F0c0 F1c0 F2c0 F3c0 F0c1")
    assert text[-1].startswith("bubble (idle share of the step): 0.158 simulated, formula 0.158; "
                               "the papers' ratio, idle over compute: 0.188 simulated, formula 0.188")
    zb = dry_run("zb-h1", 4, 8).splitlines()
    assert zb[4].split()[2:9] == [".", ".", ".", "F0", "B0", "F1", "B1"]
    assert "[4, 4, 4, 4] until W, [4, 3, 2, 1] until B" in zb[5]


def test_stage_costs_by_hand_and_the_priced_bubble():
    """Transformer (2 blocks of f FLOPs, an embedding of e, a head of h): cut in 2, stage 0 is
    embed + block0 (no input gradient for the embedding), stage 1 block1 + head. Unsplit, B is both
    gradients; split as SplitPass runs it, stage 0's B is nothing and each W the weight gradients
    and the input gradients' chain again, less the stage's first layer's; --recompute adds F to B.
    Priced with equal stages, the bubble is the unit one; ZB-H1 priced is not: stage 0 has no B."""
    from manual_dp.strategies.pipeline.stage_costs import plan_costs, priced, stage_costs
    net = transformer(2)
    e, f, h = net.layers[0].flops, net.layers[2].flops, net.layers[3].flops
    assert net.cuts(2) == ((0, 1), (2, 3))
    assert stage_costs(net, net.cuts(2), split=False) == {("F", 0): e + f, ("B", 0): e + 2 * f,
                                                          ("F", 1): f + h, ("B", 1): 2 * f + 2 * h}
    assert stage_costs(net, net.cuts(2), split=True, recompute=True) == {
        ("F", 0): e + f, ("B", 0): e + f, ("W", 0): e + 2 * f,
        ("F", 1): f + h, ("B", 1): 2 * (f + h), ("W", 1): f + 2 * h}
    one_f_one_b = plan("1f1b", 4, 8)
    even = {(ph, k): {"F": 1.0, "B": 2.0}[ph] for ph in "FB" for k in range(4)}
    assert priced(one_f_one_b, even) == pytest.approx(bubbles(one_f_one_b, simulate(one_f_one_b)))
    zb, deep = plan("zb-h1", 4, 8), transformer(6)
    costs = plan_costs(deep, zb)
    assert costs[("B", 0)] == 0 and all(costs[("B", k)] > 0 for k in (1, 2, 3))
    assert priced(zb, costs)[1] > formula(zb)


def test_refusals_each_in_one_line():
    from manual_dp import init_lenet_params
    cases = [(dict(schedule="zigzag"), "unknown schedule 'zigzag'"),
             (dict(schedule="1f1b", virtual_stages=2), "2 virtual stages a device need the interleaved schedule"),
             (dict(schedule="interleaved", virtual_stages=3), "2 devices x 3 virtual stages need 6 layers; "),
             (dict(schedule="interleaved", virtual_stages=2, micro_batches=3),
              r"interleaved needs the micro-batches \(3\) to be a multiple of the 2 devices: pick 2 or 4")]
    for kwargs, message in cases:
        kwargs = {"micro_batches": 2, **kwargs}
        with pytest.raises(ValueError, match=message) as e:
            PipelineParallel(init_lenet_params(), cpus(2), "sgd", stages=2, **kwargs)
        assert "\n" not in str(e.value)


def transformer(layers):
    return Transformer(layers=layers, d_model=16, heads=2)


RUNS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


@pytest.mark.parametrize("net_name,name,V", [("lenet", n, v) for n, v in RUNS] +
                         [("transformer", n, v) for n, v in RUNS + [("interleaved", 3)]])
def test_one_step_equals_the_one_device_step(net_name, name, V):
    """4 contexts: 2 replicas x 2 devices; stage k of replica r on ctx[2 r + k % 2]. LeNet's
    interleaved and ZB-H1 runs recompute their activations in the backward."""
    net = as_model(None) if net_name == "lenet" else transformer(4 if V == 3 else 2)
    ref = DataParallel(net.init_params(seed=5), [mx.cpu(0)], "sgd", graph=False, model=net)
    model = PipelineParallel(net.init_params(seed=5), cpus(4), "sgd", 4, stages=2, schedule=name, model=net,
                             virtual_stages=V, recompute=net_name == "lenet" and name in ("interleaved", "zb-h1"))
    X, y = batch(14, seed=1)
    want, got = ref.step(X, y, 0.1)[0], model.step(X, y, 0.1)
    assert [l.context for l, _ in got] == [mx.cpu(1), mx.cpu(3)]
    assert sum(l.asscalar() for l, _ in got) == pytest.approx(want[0].asscalar(), rel=1e-5)
    assert len(model.stages) == 2 * V and len(model.fingerprints()) == 2 * V
    for r, (P_row, S_row) in enumerate(zip(model.params, model.states)):
        for k, (P, S) in enumerate(zip(P_row, S_row)):
            assert_on(P + [p.grad for p in P] + [s for st in S for s in st], mx.cpu(2 * r + k % 2))
    for a, b in zip(model.state_dict()["params"], ref.state_dict()["params"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    Xt, yt = batch(9, seed=3)
    assert model.correct(mx.nd.array(Xt), mx.nd.array(yt)).asscalar() == ref.correct(
        mx.nd.array(Xt), mx.nd.array(yt)).asscalar()


def test_zb_h1_is_1f1b_bit_for_bit_and_interleaved_state_round_trips():
    from manual_dp import init_lenet_params
    runs = {}
    for name, recompute in [("1f1b", False), ("zb-h1", False), ("zb-h1", True)]:
        model = PipelineParallel(init_lenet_params(seed=1), cpus(2), "adam", 4, stages=2, schedule=name,
                                 recompute=recompute)
        for step in range(2):
            model.step(*batch(12, seed=step), 0.05)
        runs[name, recompute] = model.state_dict()["params"]
    for a, b, c in zip(*runs.values()):
        np.testing.assert_array_equal(b, a)
        np.testing.assert_array_equal(c, a)
    inter = PipelineParallel(init_lenet_params(seed=7), cpus(2), "adam", 4, schedule="interleaved", virtual_stages=2)
    inter.load_state_dict(DataParallel(init_lenet_params(seed=1), [mx.cpu(0)], "adam").state_dict())
    want = [p.asnumpy() for p in init_lenet_params(seed=1)]
    assert all(np.array_equal(a, b) for a, b in zip(inter.state_dict()["params"], want))
    assert [g.shape for g in inter.reduced_grads()] == [w.shape for w in want]          # the model's order
    f1b = PipelineParallel(init_lenet_params(seed=1), cpus(2), "adam", 4, schedule="1f1b")
    for n in (12, 3):   # 3 examples: 3 micro-batches, rounded down to 2 for the interleaved order
        inter.step(*batch(n, seed=n), 0.05), f1b.step(*batch(n, seed=n), 0.05)
        assert inter.plan(n).n_micro == (4 if n == 12 else 2)
    for a, b in zip(inter.state_dict()["params"], f1b.state_dict()["params"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_end_epoch_reports_the_measured_bubble_when_asked():
    from manual_dp import init_lenet_params
    for measure in (False, True):
        model = PipelineParallel(init_lenet_params(seed=0), cpus(2), "sgd", 4, schedule="zb-h1", measure=measure)
        model.step(*batch(16, seed=0), 0.01)
        stats = model.end_epoch(0.01)
        assert stats["bubble_fraction"] == pytest.approx(1 / 13)       # (S-1) F+B-W idle / (3M + 1) span
        assert ("bubble_measured" in stats) == measure
        if measure:
            assert 0 <= stats["bubble_measured"] < 1


def test_counted_peaks_against_the_layout():
    """ZB-H1 without recompute: one window a stage, its count is the layout's; interleaved's
    layout adds the two chunks' peaks on a context: at least what ran."""
    from manual_dp import init_lenet_params
    from manual_dp.memory import per_context
    for name, V, exact in [("zb-h1", 1, True), ("interleaved", 2, False)]:
        model = PipelineParallel(init_lenet_params(seed=0), cpus(2), "sgd", 4, schedule=name, virtual_stages=V)
        model.step(*batch(16, seed=0), 0.01)
        counted = model.end_epoch(0.01)["activation_peak_bytes"]
        priced = {c: r["activation_bytes"] for c, r in per_context(model, 16).items()}
        assert all((counted[c] == priced[c]) if exact else counted[c] <= priced[c] for c in counted)


def test_stage_times_time_every_action_of_the_schedule_and_leave_no_trace():
    """strategies/pipeline/stage_times.py: one micro-batch through the pipeline alone, every (phase, stage)
    of the schedule timed (ZB-H1: F, B and W of each of 4 stages), the parameters and their
    gradients as they were; on LeNet cut in two, the convolutions' forward (about 20 times the
    dense layers' FLOPs) takes longer than the dense layers' with their loss."""
    import mxnet as mx
    from manual_dp import init_lenet_params
    from manual_dp.strategies.pipeline.pipeline import PipelineParallel
    from manual_dp.strategies.pipeline.stage_times import stage_times
    net = transformer(2)
    params = net.init_params(0)
    pipe = PipelineParallel(params, [mx.cpu(i) for i in range(4)], "sgd", 8, stages=4, schedule="zb-h1", model=net)
    before = [p.asnumpy() for P in pipe.params[0] for p in P]
    took = stage_times(pipe, micro=4, repeats=2)
    assert set(took) == {(ph, k) for ph in "FBW" for k in range(4)} and all(s > 0 for s in took.values())
    assert all((p.asnumpy() == b).all() and not p.grad.asnumpy().any()
               for p, b in zip((p for P in pipe.params[0] for p in P), before))
    lenet = PipelineParallel(init_lenet_params(0), [mx.cpu(0), mx.cpu(1)], "sgd", 1, stages=2)
    took = stage_times(lenet, micro=64, repeats=3)
    assert set(took) == {(ph, k) for ph in "FB" for k in range(2)} and took[("F", 0)] > took[("F", 1)]
