"""Issue 41, item 1: a user's block whose first child has no parameters (Flatten, then Dense layers)
trains under ZeRO 2 and 3 and in pipelines whose first stage is the Flatten alone, as one context
does; the planner and the model line name the layer without parameters, and price no collective
for it.

Tolerance as in test_models.py: after 2 momentum steps the parameters differ from the one-context
lesson step only by the order of float32 additions: 1e-5 of the largest parameter (a gradient
dropped or counted twice moves them by ~1e-2 here)."""
import pytest

from conftest import close, cpus, run_main
from manual_dp import models
from manual_dp.planner.layouts import enumerate_layouts
from manual_dp.planner.predict import Setting, communication, gpu
from manual_dp.strategies.data.data_parallel import DataParallel
from manual_dp.strategies.pipeline.pipeline import PipelineParallel
from manual_dp.strategies.zero.zero import ZeroRedundancy
from test_models import params_after

FLAT_FIRST = ("from mxnet.gluon import nn\n"
              "def net():\n"
              "    b = nn.HybridSequential()\n"
              "    b.add(nn.Flatten(), nn.Dense(64, activation='relu'), nn.Dense(32, activation='relu'), nn.Dense(10))\n"
              "    return b\n"
              "def dense_only():\n"
              "    b = nn.HybridSequential()\n"
              "    b.add(nn.Dense(64, activation='relu'), nn.Dense(32, activation='relu'), nn.Dense(10))\n"
              "    return b\n")
TINY = ["--train-size", "96", "--test-size", "32", "--batch-size", "32", "--epochs", "1", "--no-progress"]


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    path = tmp_path_factory.mktemp("flat") / "mine.py"
    path.write_text(FLAT_FIRST)
    return str(path)


@pytest.fixture(scope="module")
def reference(block):
    net = models.build(f"{block}:net")
    P = net.init_params()
    return net, P, params_after(DataParallel(P, cpus(1), "momentum", lesson=True, model=net))


@pytest.mark.parametrize("stage,k", [(2, 2), (2, 4), (3, 2), (3, 4)])
def test_zero_2_and_3_with_a_flatten_first_equal_one_context(reference, stage, k):
    net, P, want = reference
    assert close(params_after(ZeroRedundancy(P, cpus(k), "momentum", stage, model=net)), want)


@pytest.mark.parametrize("extra", [{"stages": 4}, {"stages": 2, "virtual_stages": 2, "schedule": "interleaved"},
                                   {"stages": 4, "schedule": "zb-h1"}], ids=["gpipe4", "interleaved", "zb-h1"])
def test_a_pipeline_stage_of_the_flatten_alone_equals_one_context(reference, extra):
    net, P, want = reference
    assert close(params_after(PipelineParallel(P, cpus(extra["stages"]), "momentum", 4, model=net, **extra)), want)


def test_cli_zero3_losses_equal_one_contexts_and_the_model_line_names_the_flatten(capsys, data_dir, block):
    """Printed to 4 decimals, the epoch's loss of ZeRO 3 on 2 contexts is one context's."""
    base = ["--data-dir", str(data_dir), *TINY, "--model", f"{block}:net"]
    code, out, err = run_main(capsys, base + ["--mode", "zero", "--zero-stage", "3", "--cpus", "2"])
    assert code == 0, err
    code, one, err = run_main(capsys, base + ["--cpus", "1"])
    assert code == 0, err
    loss = [line.split("loss ")[1].split()[0] for line in (out, one) for line in line.splitlines() if "epoch 1/1" in line]
    assert len(loss) == 2 and loss[0] == loss[1]
    assert "(0:Flatten without parameters" in out


def test_deterministic_pipeline_with_a_stage_of_no_parameters_is_refused_in_one_line(capsys, data_dir, block):
    code, _, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--model", f"{block}:net", "--mode", "pipeline",
                                     "--stages", "4", "--cpus", "4", "--deterministic"])
    assert code == 2 and len(err) == 1 and "0:Flatten alone holds no parameters" in err[0], err


def test_planner_prices_no_collective_for_a_layer_without_parameters(block):
    """The Flatten first or Dense's own flattening: the same parameters, the same ZeRO traffic."""
    dev, costs = gpu("pcie"), {}
    for fn in ("net", "dense_only"):
        setting = Setting(1, 256, "momentum", models.build(f"{block}:{fn}"))
        costs[fn] = {l.zero_stage: communication(l, setting, dev)
                     for l in enumerate_layouts(2, 256, 1, setting.model) if l.kind == "zero"}
    assert set(costs["net"]) == {1, 2, 3} and costs["net"] == costs["dense_only"]
