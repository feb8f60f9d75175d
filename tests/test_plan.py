"""The planner: its layouts, predicted memory against a hand count and against what each strategy
measurably holds, the table on a fixed cost model, --verify, and bad input."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from manual_dp.lesson import lenet_shapes
from manual_dp.memory import stage_activation_elems
from manual_dp.plan import main, parse_bytes
from manual_dp.planner.layouts import enumerate_layouts, layout, mode, name, train_flags
from manual_dp.planner.predict import Device, Setting, activation_elems, memory, per_device_state, step_time
from manual_dp.planner.report import format_table, plan, recommend

ROOT = Path(__file__).parent.parent
N = 129_068                                           # LeNet x1's parameters
LAYERS = [20 * 9 + 20, 50 * 20 * 25 + 50, 800 * 128 + 128, 128 * 10 + 10]   # conv1, conv2, dense1, dense2
FIXED = Device("fixed", 1e9, 1e-5, 1e-9, False)      # 1 GFLOP/s, 10 us a message, 1 GB/s


def test_layer_count_is_the_lesson_s():
    assert sum(LAYERS) == N == sum(math.prod(s) for _, s in lenet_shapes(1))


def test_every_layout_of_four_devices_is_listed():
    names = [name(l) for l in enumerate_layouts(4, 256)]
    assert "tp=8" not in [name(l) for l in enumerate_layouts(8, 256, width=1)]     # 20 % 8
    assert "tp=8" in [name(l) for l in enumerate_layouts(8, 256, width=2)]
    assert names[:6] == ["dp=4 data", "dp=4 zero1", "dp=4 zero2", "dp=4 zero3", "dp=2 x tp=2", "tp=4"]
    pipelines = {f"{mesh} {sched} M=4{rc}" for mesh, scheds in (("dp=2 x pp=2", ("gpipe", "1f1b", "interleaved V=2",
                                                                                  "zb-h1")),
                                                                 ("pp=4", ("gpipe", "1f1b", "zb-h1")))
                 for sched in scheds for rc in ("", " +recompute")}
    assert set(names[6:]) == pipelines and len(names) == 20      # LeNet: no sequence (cp, +sp), 4 layers (V=2 at S=2)


@pytest.mark.parametrize("optimizer, c", [("sgd", 0), ("momentum", 1), ("adam", 2)])
def test_state_per_device_by_hand(optimizer, c):
    s = Setting(1, 8, optimizer)
    half = N // 2                                      # 64,534 on each of 2 devices
    assert per_device_state(layout("data", 2), s) == [((2 + c) * N, 0)] * 2
    assert per_device_state(layout("zero", 2, zero_stage=1), s) == [(2 * N + c * half, 0)] * 2
    # stage 2's peak: the reduce of dense1's piece owned by device 1 (elements 64,534..127,777):
    # 63,244 on device 0 (its part of the gradient), twice that on device 1 (part and sum)
    piece = sum(LAYERS[:3]) - half
    assert per_device_state(layout("zero", 2, zero_stage=2), s) == [(N + (1 + c) * half, piece),
                                                                    (N + (1 + c) * half, 2 * piece)]
    # stage 3's peak: dense1 gathered whole on both devices (102,528 > 2 x 63,244 / 2 per device)
    assert per_device_state(layout("zero", 2, zero_stage=3), s) == [((2 + c) * half, LAYERS[2])] * 2
    # tensor T=2: every weight and b1, b3 cut in 2; b2 (50) and b4 (10) whole on both ranks
    assert per_device_state(layout("tensor", 1, tp=2), s) == [((2 + c) * ((N - 60) // 2 + 60), 0)] * 2
    assert per_device_state(layout("pipeline", 1, pp=2, schedule="gpipe", micro=4), s) == \
        [((2 + c) * sum(LAYERS[:2]), 0), ((2 + c) * sum(LAYERS[2:]), 0)]


def test_activations_by_hand():
    s = Setting(1, 8, "sgd")
    conv = 784 + 2 * 20 * 26 * 26 + 20 * 13 * 13 + 2 * 50 * 9 * 9 + 50 * 4 * 4   # input, conv, ReLU, pool x2
    dense = 800 + 3 * 128 + 3 * 10 + 1
    # one context running both halves keeps conv2's pooled output (800) once: as the convolutions'
    # output, not again as the dense layers' input (it was counted twice before issue 21)
    assert stage_activation_elems() == [conv, dense - 800]
    assert memory(layout("data", 2), s)["activations"] == 4 * 4 * (conv + dense - 800)   # 4 examples each
    # tensor T=2, one group: half the group's 8 examples on each rank, and for the other 4 what
    # every rank holds whole: the images (784, copies) and what f and g join (conv2's partial
    # output 4,050, dense1's input 800, the scores 10)
    assert memory(layout("tensor", 1, tp=2), s)["activations"] == 4 * (4 * (conv + dense - 800) + 4 * (784 + 4_860))
    gpipe = layout("pipeline", 1, pp=2, schedule="gpipe", micro=4)
    assert activation_elems(gpipe, s) == [8 * conv, 8 * dense]                          # all 8 micro-batches
    f1b = gpipe._replace(schedule="1f1b")                  # stage 0: 2 of 4 micro-batches, stage 1: 1
    assert activation_elems(f1b, s) == [4 * conv, 2 * dense]
    rc = f1b._replace(recompute=True)                      # those micro-batches' inputs + one's all
    assert activation_elems(rc, s) == [4 * 784 + 2 * conv, 2 * 800 + 2 * dense]
    assert memory(rc, s)["activations"] == 4 * (2 * 800 + 2 * dense)     # stage 1 is the busiest


CHECKED = [layout("data", 2), layout("zero", 2, zero_stage=1), layout("zero", 2, zero_stage=2),
           layout("zero", 2, zero_stage=3),
           layout("pipeline", 1, pp=2, schedule="gpipe", micro=4),
           layout("pipeline", 1, pp=2, schedule="1f1b", micro=4, recompute=True),
           layout("pipeline", 2, pp=2, schedule="1f1b", micro=2),
           layout("tensor", 1, tp=2), layout("tensor", 2, tp=2), layout("tensor", 1, tp=4)]


@pytest.mark.parametrize("l", CHECKED, ids=name)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_predicted_memory_equals_measured(l, optimizer):
    """Exact: the prediction and the measurement count the same arrays, the one from shapes by hand,
    the other from the NDArrays a step held (and, for pipelines, the activations it counted); for
    tensor groups both count 1/T of the group's examples and, for the rest, what every rank holds
    whole (TensorParallel.layout and the prediction: the images and what f and g join)."""
    from manual_dp.planner.verify import measure
    s = Setting(1, 12, optimizer)
    predicted, measured = memory(l, s), measure(l, s, steps=1)
    assert (measured["state"], measured["activations"]) == (predicted["state"], predicted["activations"])


def test_table_on_a_fixed_cost_model():
    s = Setting(1, 256, "momentum")
    rows = plan(4, 8 * 2 ** 20, s, FIXED)
    assert format_table(rows) == format_table(plan(4, 8 * 2 ** 20, s, FIXED))
    # 8 MiB: only the recomputing hybrids fit (everything else holds ~10 MiB of activations);
    # interleaved balances conv1 + dense1 against conv2 + dense2, ZB-H1 fills 1F1B's bubble
    assert [(name(r["layout"]), r["fits"]) for r in rows[:6]] == [
        ("dp=2 x pp=2 interleaved V=2 M=4 +recompute", True), ("dp=2 x pp=2 zb-h1 M=4 +recompute", True),
        ("dp=2 x pp=2 1f1b M=4 +recompute", True), ("dp=2 x pp=2 gpipe M=4 +recompute", True),
        ("dp=4 zero1", False), ("dp=4 data", False)]
    by = {name(r["layout"]): r for r in rows}
    ring = 2 * 3 * 1e-5 + 2 * 3 / 4 * 4 * N * 1e-9                                     # by hand
    assert by["dp=4 data"]["time"]["comm"] == pytest.approx(ring)
    assert by["dp=4 zero1"]["time"]["comm"] == pytest.approx(ring)
    flops = 2 * (2 * 20 * 26 * 26 * 9 + 3 * (50 * 9 * 9 * 20 * 25 + 800 * 128 + 1280))  # fwd + bwd
    assert by["dp=4 data"]["time"]["compute"] == pytest.approx(64 * flops / 1e9)
    assert [r["fits"] for r in rows] == sorted((r["fits"] for r in rows), reverse=True)
    fitting = [r["time"]["total"] for r in rows if r["fits"]]
    assert fitting == sorted(fitting)
    assert recommend(rows, 8 * 2 ** 20, s) == (
        "recommended: dp=2 x pp=2 interleaved V=2 M=4 +recompute: python -m manual_dp.train --mesh dp=2,pp=2 "
        "--schedule interleaved --virtual-stages 2 --micro-batches 4 --recompute --cpus 4 --width 1 "
        "--batch-size 256 --optimizer momentum")
    assert recommend(plan(4, 1000, s, FIXED), 1000, s).startswith("no layout fits in 0.0 MiB per device")


def test_every_runnable_layout_s_flags_are_accepted():
    from manual_dp.cli.options import parse
    from manual_dp.checks import check_layout
    from manual_dp.modes import MODES
    for l in enumerate_layouts(4, 256):
        if mode(l) in MODES:
            cfg = parse(train_flags(l).split() + ["--batch-size", "256"])
            check_layout(cfg, cfg.cpus)
            assert (cfg.stages or 1, cfg.zero_stage) == (l.pp, l.zero_stage), l
            assert (cfg.schedule, cfg.virtual_stages or 1) == (l.schedule, l.virtual) or l.kind != "pipeline", l


def test_bubble_is_s_minus_one_ticks():
    t = step_time(layout("pipeline", 1, pp=4, schedule="gpipe", micro=4), Setting(1, 256, "sgd"), FIXED)
    assert t["bubble"] == pytest.approx(t["compute"] * 3 / 4)


@pytest.mark.parametrize("text, value", [("4096", 4096), ("2K", 2000), ("1.5M", 1_500_000), ("3G", 3e9),
                                         ("2KiB", 2048), ("300MiB", 300 * 2 ** 20), ("1gib", 2 ** 30)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


BAD = [(["--devices", "0", "--memory-per-device", "1G"], "--devices must be >= 1, got 0"),
       (["--devices", "two", "--memory-per-device", "1G"], "argument --devices: invalid int value"),
       (["--devices", "2", "--memory-per-device", "lots"], "--memory-per-device must be a byte count such as 300MiB"),
       (["--devices", "2", "--memory-per-device", "5XB"], "got '5XB'"),
       (["--devices", "2", "--memory-per-device", "1G", "--link", "carrier-pigeon"],
        "--link carrier-pigeon: choose from pcie, nvlink, eth25, eth100"),
       (["--devices", "8", "--memory-per-device", "1G", "--batch-size", "4"], "--batch-size 4 is smaller"),
       (["--memory-per-device", "1G"], "the following arguments are required: --devices"),
       (["--devices", "2", "--memory-per-device", "1G", "--plot", "x.png"], "--plot draws what --verify measured"),
       (["--devices", "2", "--memory-per-device", "1G", "--optimizer", "lion"], "--optimizer lion: choose from")]


@pytest.mark.parametrize("argv, says", BAD, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_input_one_line_exit_2(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err


def test_verify_prints_predicted_and_measured(tmp_path):
    out = subprocess.run([sys.executable, "-m", "manual_dp.plan", "--devices", "2", "--memory-per-device",
                          "8MiB", "--batch-size", "16", "--verify", "--top", "2", "--steps", "1",
                          "--plot", str(tmp_path / "plan.png")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    head = lines.index(next(l for l in lines if l.startswith("layout") and "meas MiB" in l))
    assert lines[head].split() == ["layout", "pred", "MiB", "meas", "MiB", "ratio", "GFLOP/s", "pred", "ms",
                                   "meas", "ms", "ratio"]
    rows = lines[head + 1:]
    assert len(rows) == 2 and all(r.split()[-5] == "1.000" for r in rows), rows   # memory: exact
    assert any(l.startswith("recommended: ") for l in lines)
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"
