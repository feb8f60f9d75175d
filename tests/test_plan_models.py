"""The planner on any model (issue 21): tensor traffic counted from Model.tensor_traffic, layouts a
model cannot run left out with a reason, the table of a transformer and of a user's Gluon block,
predicted memory equal to what each strategy holds, --verify on a tiny transformer, bad input
(--memory-per-device on any model: tests/test_memory.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from manual_dp.errors import UsageError
from manual_dp.models import build
from manual_dp.plan import main, network, parse
from manual_dp.planner.layouts import enumerate_layouts, layout, left_out, name
from manual_dp.planner.predict import Device, Setting, communication, memory, tensor_values
from manual_dp.planner.report import format_table, plan, recommend

ROOT = Path(__file__).parent.parent
FIXED = Device("fixed", 1e9, 1e-5, 1e-9, False)      # 1 GFLOP/s, 10 us a message, 1 GB/s
BLOCK = '''from mxnet.gluon import nn


def net():
    block = nn.HybridSequential()
    block.add(nn.Dense(32, activation="relu"), nn.Dense(16, activation="relu"), nn.Dense(10))
    return block
'''


def tiny_transformer():
    return build("transformer", layers=1, d_model=16, heads=2, patch=0)


@pytest.fixture
def user_block(tmp_path):
    path = tmp_path / "block.py"
    path.write_text(BLOCK)
    return build(f"{path}:net")


def test_lenet_tensor_traffic_is_what_the_step_sends():
    """g on conv2's unpooled partial output (50 x 9 x 9), f on dense1's input gradient (800), g on
    the scores (10): 4,860 values an example and step (the hand formula priced 1,620: the pooled
    800 twice and the scores twice)."""
    net = build("lenet")
    assert tensor_values(net) == 50 * 9 * 9 + 800 + 10 == 4_860
    s = Setting(1, 8, "sgd")                          # one group of 2: 8 examples each, no data parallelism
    ring = sum(2 * 1e-5 + 8 * e * 4 * 1e-9 for e in (4_050, 800, 10))   # ring over 2: 2 messages, n bytes
    assert communication(layout("tensor", 1, tp=2), s, FIXED) == pytest.approx(ring)


@pytest.mark.parametrize("layers, patch, tokens", [(1, 0, 28), (3, 7, 16)])
def test_transformer_tensor_traffic_is_four_per_block(layers, patch, tokens):
    """Per block f and g around attention and around the MLP: 4 x tokens x d_model."""
    net = build("transformer", layers=layers, d_model=16, heads=2, patch=patch)
    assert tensor_values(net) == layers * 4 * tokens * 16


def test_layouts_a_model_cannot_run_are_left_out_with_a_reason():
    net = tiny_transformer()                          # 2 heads, 3 layers (embed, block, head), 28 tokens
    names = [name(l) for l in enumerate_layouts(4, 16, model=net)]
    assert "dp=2 x tp=2" in names and "tp=4" not in names
    assert not [n for n in names if n.startswith("pp=4")]
    assert left_out(4, 16, model=net) == (
        "left out: tp=4, tp=4 +sp (4 does not divide the transformer's 2 heads); cp=4 ulysses (Ulysses needs "
        "cp=4 to divide the transformer's 2 heads); cp=2 x tp=2 ulysses (Ulysses needs cp=2 to divide the 1 heads "
        "of each of the tp=2 ranks); dp=2 x pp=2 interleaved, pp=2 x tp=2 interleaved, pp=2 x cp=2 ring "
        "interleaved, pp=2 x cp=2 ulysses interleaved (interleaved: 2 devices x 2 virtual stages need 4 layers, "
        "transformer has 3); pp=4 (transformer has 3 layers to cut between)")
    assert left_out(4, 16).startswith("left out: dp=2 x tp=2 +sp, tp=4 +sp (--sequence-parallel: lenet has no "
                                      "sequence of tokens to cut); dp=2 x cp=2 ring, dp=2 x cp=2 ulysses, cp=4 ring, "
                                      "cp=4 ulysses, cp=2 x tp=2 ring, cp=2 x tp=2 ulysses, pp=2 x cp=2 ring, "
                                      "pp=2 x cp=2 ulysses (lenet has no sequence of tokens to cut); pp=4 interleaved")
    resnet = build("resnet")
    assert [name(l) for l in enumerate_layouts(4, 16, model=resnet)] == [
        "dp=4 data", "dp=4 zero1", "dp=4 zero2", "dp=4 zero3"] + [
        f"{mesh} {s} M=4{rc}" for mesh in ("dp=2 x pp=2", "pp=4") for s in ("gpipe", "1f1b", "interleaved V=2", "zb-h1")
        for rc in ("", " +recompute")]
    assert left_out(4, 16, model=resnet) == (
        "left out: dp=2 x tp=2, dp=2 x tp=2 +sp, tp=4, tp=4 +sp (resnet has no layer that tensor parallelism "
        "splits); dp=2 x cp=2 ring, dp=2 x cp=2 ulysses, cp=4 ring, cp=4 ulysses, cp=2 x tp=2 ring, cp=2 x tp=2 "
        "ulysses, pp=2 x tp=2, pp=2 x cp=2 ring, pp=2 x cp=2 ulysses (resnet keeps BatchNorm's running statistics, "
        "which data parallelism, ZeRO, pipelines and tensor groups carry)")


def table_kinds(net):
    """{kind: [predicted MiB]} of the planner's table of `net` on 4 devices, and the table."""
    rows = plan(4, 2 ** 30, Setting(1, 64, "momentum", net), FIXED)
    kinds = {}
    for r in rows:
        assert r["memory"]["state"] > 0 and r["memory"]["activations"] > 0 and r["fits"]
        kinds.setdefault(r["layout"].kind, []).append(r["memory"]["total"])
    return kinds, rows


def test_transformer_table_lists_every_kind():
    kinds, rows = table_kinds(build("transformer"))
    assert set(kinds) == {"data", "zero", "pipeline", "tensor", "context", "mesh"}
    # tensor and +sp at T = 2, 4; ring and Ulysses at C = 2, 4; S = 2 (x dp 2) on every schedule,
    # S = 4 on all but interleaved (8 layers needed), each with and without recompute; pp=2 x tp=2
    # with and without +sp on GPipe, 1F1B and interleaved; cp=2 x tp=2 ring and Ulysses (context); pp=2 x
    # cp=2 ring and Ulysses on GPipe, 1F1B and interleaved (mesh)
    assert len(kinds["tensor"]) == 4 and len(kinds["context"]) == 4 + 2 and len(kinds["pipeline"]) == 14
    assert len(kinds["mesh"]) == 6 + 6
    assert "tp=4 +sp" in format_table(rows) and "cp=4 ulysses" in format_table(rows)
    assert recommend(rows, 2 ** 30, Setting(1, 64, "momentum", build("transformer"))).endswith(
        "--model transformer --layers 2 --d-model 64 --heads 4 --patch 0 --batch-size 64 --optimizer momentum")


def test_user_block_table_lists_every_kind(user_block):
    kinds, rows = table_kinds(user_block)
    assert set(kinds) == {"data", "zero", "pipeline", "tensor"}     # tensor: AutoTP's Dense pair; no sequence
    assert min(kinds["tensor"]) < min(kinds["data"])                  # the pair's weights cut in 4


CHECKED = [layout("data", 2), layout("zero", 2, zero_stage=2), layout("zero", 2, zero_stage=3),
           layout("pipeline", 1, pp=2, schedule="gpipe", micro=4),
           layout("pipeline", 2, pp=2, schedule="1f1b", micro=4, recompute=True), layout("tensor", 1, tp=2)]


@pytest.mark.parametrize("l", CHECKED, ids=name)
@pytest.mark.parametrize("which", ["transformer", "user block"])
def test_predicted_memory_equals_measured(l, which, user_block):
    """Exact, as for LeNet: the same arrays counted from the layers and from what a step held
    (ZeRO's moments: autograd makes a transformer block's and a Gluon layer's gradient whole). A
    tensor group's both count 1/T of its examples and, for the other half of the 16, what runs
    whole on every rank (TensorParallel.layout, strategies/tensor.held_whole): the transformer's
    images (784), embedding (2 x 28 x 16) and head (2 x 28 x 16 + 16 + 31) and what f and g join
    (4 x 28 x 16); the Gluon pair's images and g output (784 + 16)."""
    from manual_dp.planner.verify import measure
    from manual_dp.strategies.tensor.tensor_layout import held_whole
    net = tiny_transformer() if which == "transformer" else user_block
    s = Setting(1, 16, "adam", net)
    predicted, measured = memory(l, s), measure(l, s, steps=1)
    assert (measured["state"], measured["activations"]) == (predicted["state"], predicted["activations"])
    want = {"transformer": 784 + 896 + 943 + 4 * 28 * 16, "user block": 784 + 16}[which]
    assert held_whole(net, range(len(net.layers))) == want


def test_verify_a_tiny_transformer():
    out = subprocess.run([sys.executable, "-m", "manual_dp.plan", "--devices", "2", "--memory-per-device", "8MiB",
                          "--model", "transformer", "--layers", "1", "--d-model", "16", "--heads", "2",
                          "--batch-size", "16", "--verify", "--top", "2", "--steps", "1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("transformer (layers 1, d_model 16, heads 2, mlp_ratio 2, patch 0): 3,338 parameters")
    head = lines.index(next(l for l in lines if l.startswith("layout") and "meas MiB" in l))
    rows = lines[head + 1:]
    assert len(rows) == 2 and all(r.split()[-5] == "1.000" for r in rows), rows   # memory: exact
    assert any(l.startswith("recommended: ") and "--model transformer --layers 1" in l for l in lines)


BAD = [(["--model", "lenet", "--layers", "2"], "--layers applies only to --model transformer or lstm or gpt, not --model lenet"),
       (["--model", "transformer", "--width", "2"], "--width applies only to --model lenet or mlp or resnet"),
       (["--model", "transformer", "--heads", "0"], "--heads must be >= 1, got 0"),
       (["--model", "transformer", "--patch", "5"], "--patch must be 0 (rows) or divide 28, got 5"),
       (["--model", "vgg"], "--model vgg: choose lenet, mlp, transformer, resnet, lstm, gpt or PATH.py:FUNCTION")]


@pytest.mark.parametrize("argv, says", BAD, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_model_flags_one_line_exit_2(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        main(["--devices", "2", "--memory-per-device", "1G"] + argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err


@pytest.mark.parametrize("argv, says", [(["--model", "transformer", "--d-model", "16", "--heads", "3"],
                                         "--heads 3 does not divide --d-model 16"),
                                        (["--model", "transformer", "--heads", "3"], "heads dividing d_model"),
                                        (["--model", "missing.py:net"], "no file missing.py")])
def test_models_that_cannot_be_built_are_refused(argv, says):
    with pytest.raises(UsageError, match=says):
        network(parse(["--devices", "2", "--memory-per-device", "1G"] + argv))



def test_precision_halves_the_gradient_bytes_data_parallelism_and_pipelines_send():
    """--precision bf16|fp16 in the planner: the gradient all-reduces of data parallelism and of
    pipeline stages cross the links in 2 bytes an element (what LowReduce sends); tensor
    parallelism's collectives, which stay float32, and its memory are unchanged; ZeRO keeps and
    sends 16-bit parameters and gradients (strategies/zero/zero_mixed.py): fewer bytes on the links,
    its transients halved (test_zero_mixed.py checks the kept bytes)."""
    from manual_dp import costmodel
    from manual_dp.planner.predict import gpu, layer_sizes
    lenet = build("lenet", 4)
    dev = gpu("eth25")
    total = 4 * sum(layer_sizes(lenet))
    for precision in ("bf16", "fp16"):
        low, full = Setting(4, 64, "adam", lenet, precision), Setting(4, 64, "adam", lenet)
        data = layout("data", 8)
        assert communication(data, low, dev) == pytest.approx(costmodel.allreduce_time("ring", 8, total / 2, dev.alpha, dev.beta))
        assert communication(data, low, dev) < communication(data, full, dev)
        tensor, zero = layout("tensor", 8, tp=2), layout("zero", 8, zero_stage=3)
        assert communication(tensor, low, dev) == communication(tensor, full, dev)
        assert memory(tensor, low) == memory(tensor, full)
        assert communication(zero, low, dev) < communication(zero, full, dev)
        zero1 = layout("zero", 8, zero_stage=1)          # 2N + 2N + 12N/8 bytes kept, not 4N + 4N + 8N/8
        assert memory(zero1, low)["state"] < memory(zero1, full)["state"]
    bad = subprocess.run([sys.executable, "-m", "manual_dp.plan", "--devices", "2", "--memory-per-device", "1G",
                          "--precision", "fp8"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "fp8" in bad.stderr


def test_a_users_block_with_batchnorm_lists_its_tensor_groups(tmp_path):
    """A user's Dense pairs with a BatchNorm between them: tensor groups carry its statistics (not
    with +sp, which cuts the tokens it does not have), and each rank's predicted state counts them."""
    from manual_dp.models.gluon_block import GluonModel
    path = tmp_path / "dense.py"
    path.write_text("from mxnet.gluon import nn\ndef net():\n    b = nn.HybridSequential()\n"
                    "    b.add(nn.Dense(32, activation='relu'), nn.Dense(16), nn.BatchNorm(), nn.Dense(32), nn.Dense(10))\n"
                    "    return b\n")
    net = GluonModel(f"{path}:net")
    names = [name(l) for l in enumerate_layouts(4, 16, model=net)]
    assert "dp=2 x tp=2" in names and "tp=4" in names and "tp=4 +sp" not in names
    from manual_dp.planner.predict import per_device_state
    tp = next(l for l in enumerate_layouts(4, 16, model=net) if name(l) == "tp=4")
    split = sum(p.size // 4 if p.split is not None else p.size for p in net.param_table())
    assert per_device_state(tp, Setting(1, 64, "sgd", net)) == [((2 + 0) * split + 32, 0)] * 4
