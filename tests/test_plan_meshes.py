"""The planner on meshes (issue 22, item 5): context parallelism (dp x cp, ring and Ulysses), tensor
parallelism with and without sequence parallelism, pipelines on every schedule; their predicted
memory against a hand count and against what each strategy holds, their bubbles against the
schedules' formulas, their train flags parsed, and --verify running them."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from manual_dp.models import build
from manual_dp.planner.layouts import candidates, enumerate_layouts, layout, model_of, name, train_flags
from manual_dp.planner.predict import Device, Setting, memory, step_time
from manual_dp.planner.report import model_flags

ROOT = Path(__file__).parent.parent
FIXED = Device("fixed", 1e9, 1e-5, 1e-9, False)      # 1 GFLOP/s, 10 us a message, 1 GB/s


@pytest.fixture(scope="module")
def transformer():
    return build("transformer")                       # 2 blocks, d_model 64, 4 heads, 28 tokens: 4 layers


def tiny_transformer():
    return build("transformer", layers=1, d_model=16, heads=2, patch=0)


def test_transformer_gets_every_new_layout_and_lenet_refuses_them(transformer):
    names = [name(l) for l in enumerate_layouts(4, 64, model=transformer)]
    for new in ("dp=2 x cp=2 ring", "dp=2 x cp=2 ulysses", "cp=4 ring", "cp=4 ulysses", "dp=2 x tp=2 +sp",
                "tp=4 +sp", "dp=2 x pp=2 interleaved V=2 M=4", "dp=2 x pp=2 zb-h1 M=4 +recompute", "pp=4 zb-h1 M=4"):
        assert new in names, new
    refused = {name(l): why for l, why in candidates(4, 64, model_of(1)) if why}
    assert refused["dp=2 x cp=2 ring"] == refused["cp=4 ulysses"] == "lenet has no sequence of tokens to cut"
    assert refused["tp=4 +sp"] == "--sequence-parallel: lenet has no sequence of tokens to cut"
    assert refused["pp=4 interleaved V=2 M=4"].startswith("interleaved: 4 devices x 2 virtual stages need 8 layers")


@pytest.mark.parametrize("C, attention", [(2, "ring"), (2, "ulysses"), (4, "ring"), (4, "ulysses")])
def test_context_activations_are_about_one_over_c(C, attention):
    """The same 64 examples on one context and on a group of C: each context 1/C, plus the images
    every context copies and what attention keeps beyond its share (linear in the tokens T, where
    the scores are quadratic): within 1.6/C for 28 row tokens, closer to 1/C for 196 patches of 2 x 2."""
    ratios = []
    for patch in (0, 2):
        s = Setting(1, 64, "adam", build("transformer", patch=patch))
        one = memory(layout("data", 1), s)
        cp = memory(layout("context", 1, cp=C, attention=attention), s)
        ratios.append(C * cp["activations"] / one["activations"])
        assert cp["state"] == one["state"]                       # whole parameters on every context
    assert 1 < ratios[1] < ratios[0] < 1.6, ratios


def test_ring_keeps_the_foreign_key_and_value_blocks():
    """By hand, the tiny transformer (28 tokens of width 16, one block), C = 2, a group of 8
    examples: each context 4 examples' activations, the other 4 examples' images (784), and for all
    8 the other block's keys and values (2 x 14 x 16) and the second step's output (2 x 14 x 16)."""
    from manual_dp.memory import stage_activation_elems
    net = tiny_transformer()
    s = Setting(1, 8, "sgd", net)
    whole = sum(stage_activation_elems(model=net))
    expected = 4 * (4 * whole + 4 * 784 + 8 * (2 * 14 * 16 + 2 * 14 * 16))
    assert memory(layout("context", 1, cp=2, attention="ring"), s)["activations"] == expected


@pytest.mark.parametrize("T", [2, 4])
def test_sequence_parallel_holds_less_than_tensor(transformer, T):
    """Megatron-SP cuts what f and g join (4 x 28 x 64 a block) along the sequence: 1 - 1/T of it
    off every rank's activations; parameters and communication are tensor parallelism's."""
    s = Setting(1, 64, "adam", transformer)
    tp, sp = layout("tensor", 1, tp=T), layout("tensor", 1, tp=T, sp=True)
    saved = memory(tp, s)["activations"] - memory(sp, s)["activations"]
    assert saved == 4 * 2 * 4 * 28 * 64 * (64 - 64 // T)
    assert memory(tp, s)["state"] == memory(sp, s)["state"]
    assert step_time(tp, s, FIXED) == step_time(sp, s, FIXED)


@pytest.mark.parametrize("S, M", [(2, 4), (2, 2)])
def test_zb_h1_and_interleaved_bubbles_below_1f1b(transformer, S, M):
    """At the same S and M (micro-batches of the same size): 1F1B's bubble is (S - 1)/M of its
    compute, interleaved's (S - 1)/(V M) of its own, ZB-H1's below 1F1B's (W fills the gaps)."""
    s = Setting(1, 16 * M, "sgd", transformer)
    times = {sched: step_time(layout("pipeline", 1, pp=S, schedule=sched, micro=M,
                                     virtual=2 if sched == "interleaved" else 1), s, FIXED)
             for sched in ("1f1b", "interleaved", "zb-h1")}
    assert times["1f1b"]["bubble"] == pytest.approx(times["1f1b"]["compute"] * (S - 1) / M)
    assert times["interleaved"]["bubble"] == pytest.approx(times["interleaved"]["compute"] * (S - 1) / (2 * M))
    assert times["zb-h1"]["bubble"] < times["1f1b"]["bubble"]
    assert times["interleaved"]["bubble"] < times["1f1b"]["bubble"]
    assert times["zb-h1"]["compute"] == pytest.approx(times["1f1b"]["compute"])


CHECKED = [layout("context", 1, cp=2, attention="ring"), layout("context", 1, cp=2, attention="ulysses"),
           layout("tensor", 1, tp=2, sp=True), layout("pipeline", 1, pp=2, schedule="zb-h1", micro=4),
           layout("pipeline", 1, pp=2, schedule="zb-h1", micro=4, recompute=True)]


@pytest.mark.parametrize("l", CHECKED, ids=name)
def test_predicted_memory_against_measured(l):
    """State exact. Activations: ZB-H1 exact (one stage a device); the strategies' layout() prices
    1/C (1/T) of the group's examples, the prediction adds what every context holds whole."""
    from manual_dp.planner.verify import measure
    s = Setting(1, 8, "adam", tiny_transformer())
    predicted, measured = memory(l, s), measure(l, s, steps=1)
    extra = {"context": 4 * 784 + 8 * 896, "tensor": 4 * (784 + 896 + 943), "pipeline": 0}[l.kind]
    assert (measured["state"], measured["activations"] + 4 * extra) == (predicted["state"], predicted["activations"])


def test_interleaved_prediction_bounds_what_it_counted(transformer):
    """Interleaved: a device's two stages' peaks added (PipelineParallel.layout's bound), at least
    what the run counted on each context at once."""
    from manual_dp.planner.verify import measure
    l = layout("pipeline", 1, pp=2, schedule="interleaved", micro=4, virtual=2)
    s = Setting(1, 8, "sgd", transformer)
    predicted, measured = memory(l, s), measure(l, s, steps=1)
    assert measured["state"] == predicted["state"]
    assert 0.5 * predicted["activations"] < measured["activations"] <= predicted["activations"]


def test_printed_flags_parse(transformer):
    """Every transformer layout's flags, with the model's, parse into the mode and degrees it names."""
    from manual_dp.cli.options import parse
    for l in enumerate_layouts(4, 64, model=transformer):
        cfg = parse(f"{train_flags(l)} {model_flags(transformer)} --batch-size 64".split())
        if l.kind == "context":
            assert "--mesh " in train_flags(l)
            assert (cfg.mode, cfg.context_parallel, cfg.attention) == ("context", l.cp, l.attention), l
        if l.kind == "tensor":
            assert (cfg.mode, cfg.tensor_parallel, cfg.sequence_parallel) == ("tensor", l.tp, l.sp), l
        if l.kind == "pipeline":
            assert (cfg.stages, cfg.schedule, cfg.virtual_stages or 1) == (l.pp, l.schedule, l.virtual), l


def test_verify_runs_a_context_layout():
    out = subprocess.run([sys.executable, "-m", "manual_dp.plan", "--devices", "2", "--memory-per-device", "8MiB",
                          "--model", "transformer", "--layers", "1", "--d-model", "16", "--heads", "2",
                          "--batch-size", "8", "--verify", "--top", "20", "--steps", "1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    head = lines.index(next(l for l in lines if l.startswith("layout") and "meas MiB" in l))
    rows = {r[:44].strip(): r[44:].split() for r in lines[head + 1:]}
    assert {"cp=2 ring", "cp=2 ulysses", "tp=2 +sp", "pp=2 zb-h1 M=4"} <= set(rows)
    for key in ("cp=2 ring", "cp=2 ulysses"):
        pred, meas, ratio = (float(x) for x in rows[key][:3])
        assert meas > 0 and 0.5 < ratio <= 1.0, rows[key]      # measured: the strategy's floor
        assert float(rows[key][-2]) > 0                          # measured ms
    assert rows["pp=2 zb-h1 M=4"][2] == "1.000"
