"""The planner on meshes (issue 22, item 5): context parallelism (dp x cp, ring and Ulysses), tensor
parallelism with and without sequence parallelism, pipelines on every schedule, dp x pp x tp
(MeshParallel); their predicted memory against a hand count and against what each strategy holds
(exactly: the strategies' layout() counts what every context holds whole), their bubbles against
the schedules' formulas, their train flags parsed, and --verify running them."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from manual_dp.models import build
from manual_dp.planner.layouts import candidates, enumerate_layouts, layout, left_out, model_of, name, train_flags
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
    every context copies and what attention keeps beyond its share (Ulysses: linear in the tokens
    T, where the scores are quadratic: within 1.6/C for 28 row tokens, closer to 1/C for 196
    patches of 2 x 2); ring keeps no scores at all, so below 1/C, the more so the more tokens."""
    ratios = []
    for patch in (0, 2):
        s = Setting(1, 64, "adam", build("transformer", patch=patch))
        one = memory(layout("data", 1), s)
        cp = memory(layout("context", 1, cp=C, attention=attention), s)
        ratios.append(C * cp["activations"] / one["activations"])
        assert cp["state"] == one["state"]                       # whole parameters on every context
    if attention == "ring":
        assert 0.3 < ratios[1] < ratios[0] < 1, ratios
    else:
        assert 1 < ratios[1] < ratios[0] < 1.6, ratios


def test_ring_keeps_its_own_block_and_no_scores():
    """By hand, the tiny transformer (28 tokens of width 16, 2 heads, one block), C = 2, a group of
    8 examples: each context 4 examples' activations, the other 4 examples' images (784), and for
    all 8 a log-sum-exp per head and row (2 x 14) where one context's share counts the scores and
    softmax weights (2 x 2 x 14 x 28), which the second ring recomputes instead."""
    from manual_dp.memory import stage_activation_elems
    net = tiny_transformer()
    s = Setting(1, 8, "sgd", net)
    whole = sum(stage_activation_elems(model=net))
    expected = 4 * (4 * whole + 4 * 784 + 8 * (2 * 14 - 2 * 2 * 14 * 28))
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
           layout("context", 2, cp=2, attention="ring"), layout("tensor", 1, tp=2), layout("tensor", 1, tp=2, sp=True),
           layout("pipeline", 1, pp=2, schedule="zb-h1", micro=4),
           layout("pipeline", 1, pp=2, schedule="zb-h1", micro=4, recompute=True),
           layout("mesh", 1, pp=2, tp=2, schedule="1f1b", micro=4),
           layout("mesh", 1, pp=2, tp=2, schedule="gpipe", micro=4, sp=True)]


@pytest.mark.parametrize("l", CHECKED, ids=name)
def test_predicted_memory_against_measured(l):
    """Exact: state from the arrays a step held, activations from the strategy's layout() (what
    every context holds whole included; ZB-H1 counted as it ran, one stage a device)."""
    from manual_dp.planner.verify import measure
    s = Setting(1, 8 * l.dp, "adam", tiny_transformer())
    predicted, measured = memory(l, s), measure(l, s, steps=1)
    assert (measured["state"], measured["activations"]) == (predicted["state"], predicted["activations"])


def test_what_every_context_holds_whole_by_hand():
    """The tiny transformer (784 pixels, 28 tokens of width 16, one block, a group of 8 examples):
    a tensor rank holds whole the images, the embedding's output (896), the head's (943) and, but
    under +sp, what f and g join (4 x 28 x 16); a context block the images of the group's other
    examples and, for all 8, ring's log-sum-exp less the scores it does not keep (2 x 14 - 2 x 2 x 14 x 28)."""
    from manual_dp.memory import part_activation_elems
    from manual_dp.strategies.context.context import attention_held
    from manual_dp.strategies.tensor.tensor_layout import held_whole
    net = tiny_transformer()
    assert held_whole(net, range(3)) == 784 + 896 + 943 + 4 * 28 * 16
    assert held_whole(net, range(3), sp=True) == 784 + 896 + 943
    assert attention_held(net, 2, "ring") == 2 * 14 - 2 * 2 * 14 * 28
    assert part_activation_elems(("whole", 1234), model=net) == 1234


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
    for l in enumerate_layouts(8, 64, model=transformer):
        cfg = parse(f"{train_flags(l)} {model_flags(transformer)} --batch-size 64".split())
        if l.kind == "context":
            assert "--mesh " in train_flags(l)
            assert (cfg.mode, cfg.context_parallel, cfg.attention) == ("context", l.cp, l.attention), l
        if l.kind == "tensor":
            assert (cfg.mode, cfg.tensor_parallel, cfg.sequence_parallel) == ("tensor", l.tp, l.sp), l
        if l.kind == "pipeline":
            assert (cfg.stages, cfg.schedule, cfg.virtual_stages or 1) == (l.pp, l.schedule, l.virtual), l
        if l.kind == "mesh" and l.cp == 1:           # with cp: tests/test_plan_grid.py
            assert f"--mesh dp={l.dp},pp={l.pp},tp={l.tp} " in train_flags(l)
            assert (cfg.mode, cfg.stages, cfg.tensor_parallel, cfg.sequence_parallel, cfg.schedule,
                    cfg.virtual_stages or 1, cfg.micro_batches, cfg.cpus) == (
                "mesh", l.pp, l.tp, l.sp, l.schedule, l.virtual, l.micro, l.dp * l.pp * l.tp), l


@pytest.mark.parametrize("devices,kinds", [
    (4, {"dp=2 x cp=2 ring", "cp=4 ring", "dp=2 x tp=2 +sp", "dp=2 x pp=2 zb-h1 M=4", "pp=2 x tp=2 1f1b M=4",
         "pp=2 x tp=2 +sp gpipe M=4"}),
    (8, {"dp=2 x cp=2 x tp=2 ring", "cp=4 x tp=2 ring", "dp=2 x pp=2 x cp=2 ulysses 1f1b M=4",
         "pp=2 x cp=4 ring gpipe M=4", "pp=2 x cp=2 x tp=2 ring 1f1b M=4"})])
def test_verify_runs_every_mesh_kind_exactly(devices, kinds):
    """--verify, one step each: context, tensor +sp, pipelines and dp x pp x tp on 4 contexts; cp x
    tp grids, pp x cp and pp x cp x tp on 8: each printed with its measured memory (equal to the
    prediction: the strategies' own count) and step time beside the predicted."""
    out = subprocess.run([sys.executable, "-m", "manual_dp.plan", "--devices", str(devices), "--memory-per-device", "8MiB",
                          "--model", "transformer", "--layers", "1", "--d-model", "16", "--heads", "2",
                          "--batch-size", "8", "--verify", "--top", "100", "--steps", "1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    head = lines.index(next(l for l in lines if l.startswith("layout") and "meas MiB" in l))
    rows = {" ".join(r.split()[:-7]): r.split()[-7:] for r in lines[head + 1:]}
    assert kinds <= set(rows)
    for key, row in rows.items():
        assert row[2] == "1.000" and float(row[-2]) > 0 and float(row[-3]) > 0, (key, row)   # memory; ms


def test_3d_layouts_on_8_devices_and_their_refusals(transformer):
    """The transformer (4 layers, 4 heads) on 8 devices: dp x pp x tp on GPipe, 1F1B and interleaved,
    with and without +sp (never ZB-H1 or recompute: MeshParallel runs neither); refused with a
    reason where T does not divide the heads, where there are too few layers, and for LeNet."""
    names = [name(l) for l in enumerate_layouts(8, 64, model=transformer)]
    for new in ("dp=2 x pp=2 x tp=2 1f1b M=4", "dp=2 x pp=2 x tp=2 +sp interleaved V=2 M=4",
                "pp=2 x tp=4 gpipe M=4", "pp=2 x tp=4 +sp 1f1b M=4", "pp=4 x tp=2 +sp gpipe M=4"):
        assert new in names, new
    assert not [n for n in names if " x tp=" in n and ("zb-h1" in n or "recompute" in n)]
    refused = {name(l): why for l, why in candidates(8, 64, transformer) if why}
    assert refused["pp=4 x tp=2 interleaved V=2 M=4"].startswith("interleaved: 4 devices x 2 virtual stages")
    two_heads = build("transformer", heads=2)
    assert {name(l): why for l, why in candidates(8, 64, two_heads)}["pp=2 x tp=4 1f1b M=4"] == \
        "4 does not divide the transformer's 2 heads"
    assert {name(l): why for l, why in candidates(8, 64, tiny_transformer())}["pp=4 x tp=2 1f1b M=4"] == \
        "transformer has 3 layers to cut between"
    lenet = "lenet splits as a whole model; tp x pp needs layers that split on their own"
    assert {why for l, why in candidates(8, 64, model_of(1)) if l.kind == "mesh" and l.cp == 1} == {lenet}
    assert f"dp=2 x pp=2 x tp=2, pp=2 x tp=4, pp=4 x tp=2 ({lenet})" in left_out(8, 64)


def test_3d_memory_below_pp_alone_and_tp_alone(transformer):
    """pp=2 x tp=2 on 4 devices: each context keeps its stage's shards, 4 (adam) x (the embedding
    3,648 + block 0's split 33,088 / 2 + its layer norms and unsplit biases 384) floats, below
    pp=2's (the whole stage) and tp=2's (every layer's shards); activations below both."""
    s = Setting(1, 64, "adam", transformer)
    mesh = memory(layout("mesh", 1, pp=2, tp=2, schedule="1f1b", micro=4), s)
    pp = memory(layout("pipeline", 1, pp=2, schedule="1f1b", micro=4), s)
    tp = memory(layout("tensor", 1, tp=2), s)
    assert mesh["state"] == 4 * 4 * (3_648 + 33_088 // 2 + 384)
    assert mesh["state"] < pp["state"] and mesh["state"] < tp["state"]
    assert mesh["activations"] < pp["activations"] and mesh["activations"] < tp["activations"]
    assert mesh["total"] < min(pp["total"], tp["total"])


@pytest.mark.parametrize("schedule, V", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_3d_is_the_pipeline_split_t_ways(transformer, schedule, V):
    """At T = 1 the prediction is the pipeline's (same schedule, same micro-batches held); at T = 2
    compute and bubble halve (each stage's FLOPs over T), activations fall to between half and all
    of the pipeline's (what every rank holds whole stays), +sp below; comm adds the tensor
    collectives."""
    from manual_dp.planner.pipelines import activations, mesh_activations
    s = Setting(1, 64, "sgd", transformer)
    pipe = layout("pipeline", 1, pp=2, schedule=schedule, micro=4, virtual=V)
    one, two = (layout("mesh", 1, pp=2, tp=t, schedule=schedule, micro=4, virtual=V) for t in (1, 2))
    assert mesh_activations(one, transformer, 64) == activations(pipe, transformer, 64)
    t_pipe, t_two = step_time(pipe, s, FIXED), step_time(two, s, FIXED)
    assert t_two["compute"] == pytest.approx(t_pipe["compute"] / 2)
    assert t_two["bubble"] == pytest.approx(t_pipe["bubble"] / 2)
    assert t_two["comm"] > t_pipe["comm"]
    acts = [memory(l, s)["activations"] for l in (pipe, two, two._replace(sp=True))]
    assert acts[0] / 2 < acts[2] < acts[1] < acts[0], acts
