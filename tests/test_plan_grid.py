"""The planner on context parallelism combined with tensor and pipeline parallelism: dp x cp x tp
(ContextTensorParallel, a C x T grid per replica), dp x pp x cp and dp x pp x cp x tp
(MeshParallel with context_parallel): listed where the model's refusals allow, their flags parsed
and built by the trainer, predicted memory equal to what the strategies hold and report, time
split as the parts they combine (--verify running them: tests/test_plan_meshes.py)."""
import pytest

from manual_dp.models import build
from manual_dp.planner.layouts import candidates, enumerate_layouts, layout, left_out, model_of, name, train_flags
from manual_dp.planner.predict import Device, Setting, memory, per_device_state, step_time
from manual_dp.planner.report import model_flags

FIXED = Device("fixed", 1e9, 1e-5, 1e-9, False)      # 1 GFLOP/s, 10 us a message, 1 GB/s


@pytest.fixture(scope="module")
def transformer():
    return build("transformer")                       # 2 blocks, d_model 64, 4 heads, 28 tokens: 4 layers


def tiny_transformer(layers=1, heads=2):
    return build("transformer", layers=layers, d_model=16, heads=heads, patch=0)


def new_kinds(layouts):
    return [l for l in layouts if l.cp > 1 and (l.tp > 1 or l.pp > 1)]


def test_cp_with_tp_and_pp_listed_on_8_devices(transformer):
    """The transformer (4 heads, 4 layers) on 8 devices: every grid and context mesh whose heads
    divide, on GPipe, 1F1B and interleaved (never ZB-H1, recompute or +sp: MeshParallel refuses
    them beside cp); Ulysses refused where the C contexts do not divide a rank's H/T heads."""
    names = [name(l) for l in enumerate_layouts(8, 64, model=transformer)]
    for new in ("dp=2 x cp=2 x tp=2 ring", "dp=2 x cp=2 x tp=2 ulysses", "cp=2 x tp=4 ring", "cp=4 x tp=2 ring",
                "dp=2 x pp=2 x cp=2 ring 1f1b M=4", "dp=2 x pp=2 x cp=2 ulysses interleaved V=2 M=4",
                "pp=2 x cp=4 ulysses gpipe M=4", "pp=4 x cp=2 ring 1f1b M=4",
                "pp=2 x cp=2 x tp=2 ring gpipe M=4", "pp=2 x cp=2 x tp=2 ulysses interleaved V=2 M=4"):
        assert new in names, new
    assert not [n for n in names if " x cp=" in n and ("zb-h1" in n or "recompute" in n or "+sp" in n)]
    refused = {name(l): why for l, why in candidates(8, 64, transformer) if why}
    assert refused["cp=2 x tp=4 ulysses"] == "Ulysses needs cp=2 to divide the 1 heads of each of the tp=4 ranks"
    assert refused["cp=4 x tp=2 ulysses"] == "Ulysses needs cp=4 to divide the 2 heads of each of the tp=2 ranks"
    assert refused["pp=4 x cp=2 ring interleaved V=2 M=4"].startswith("interleaved: 4 devices x 2 virtual stages")
    assert "pp=4 x cp=2 ring interleaved" in left_out(8, 64, model=transformer)
    # 4 grids (6 less 2 Ulysses), pp x cp: 3 meshes x 3 schedules x 2 attentions less pp=4's
    # interleaved, pp=2 x cp=2 x tp=2 on 3 x 2
    assert len(new_kinds(enumerate_layouts(8, 64, model=transformer))) == 4 + 16 + 6


def test_refused_where_heads_or_tokens_do_not_divide():
    """Two heads: no tp=4 in a grid or a stage group. Four tokens (patches of 14 x 14) on 16 devices:
    no block of 8 (cp=8 x tp=2, pp=2 x cp=8). LeNet: none of them, in its own words."""
    two = {name(l): why for l, why in candidates(8, 64, build("transformer", heads=2))}
    assert two["cp=2 x tp=4 ring"] == "4 does not divide the transformer's 2 heads"
    assert two["pp=2 x cp=2 x tp=2 ulysses 1f1b M=4"] == \
        "Ulysses needs cp=2 to divide the 1 heads of each of the tp=2 ranks"
    assert two["pp=2 x cp=2 x tp=2 ring 1f1b M=4"] is None
    four_tokens = {name(l): why for l, why in candidates(16, 64, build("transformer", patch=14))}
    tokens = "8 contexts cannot each take a block of the transformer's 4 tokens"
    assert four_tokens["cp=8 x tp=2 ring"] == four_tokens["pp=2 x cp=8 ring 1f1b M=4"] == tokens
    assert four_tokens["pp=2 x cp=4 x tp=2 ring 1f1b M=4"] is None
    lenet = {why for l, why in candidates(8, 64, model_of(1)) if l.cp > 1 and (l.tp > 1 or l.pp > 1)}
    assert lenet == {"lenet has no sequence of tokens to cut"}


def test_flags_parse_and_build_with_the_trainer(transformer):
    """Every new layout's printed flags, with the model's, parse into the mode and degrees it names,
    pass the trainer's layout check and build its strategy (cli.build.build_model: no UsageError)."""
    import mxnet as mx
    from manual_dp.checks import check_layout
    from manual_dp.cli.build import build_model, network
    from manual_dp.cli.options import parse
    from manual_dp.multiprocess.world import World
    from manual_dp.strategies.context.context_tensor import ContextTensorParallel
    from manual_dp.strategies.mesh.mesh_parallel import MeshParallel
    ctx = [mx.cpu(i) for i in range(8)]
    for l in new_kinds(enumerate_layouts(8, 64, model=transformer)):
        cfg = parse(f"{train_flags(l)} {model_flags(transformer)} --batch-size 64".split())
        check_layout(cfg, 8)
        model = build_model(cfg, network(cfg).init_params(0), ctx, World())
        assert (cfg.context_parallel, cfg.attention, cfg.tensor_parallel or 1, cfg.cpus) == (l.cp, l.attention, l.tp, 8), l
        if l.kind == "context":
            assert (cfg.mode, type(model)) == ("context", ContextTensorParallel), l
            assert f"--mesh dp={l.dp}," in train_flags(l) or l.dp == 1
        else:
            assert (cfg.mode, type(model), cfg.stages, cfg.schedule, cfg.virtual_stages or 1, cfg.micro_batches) == (
                "mesh", MeshParallel, l.pp, l.schedule, l.virtual, l.micro), l
            assert (model.mesh.dp, model.mesh.pp, model.mesh.cp, model.mesh.tp) == (l.dp, l.pp, l.cp, l.tp), l


CHECKED = [(layout("context", 1, cp=2, tp=2, attention="ring"), 1, 2),
           (layout("context", 2, cp=2, tp=2, attention="ring"), 1, 2),
           (layout("context", 1, cp=2, tp=2, attention="ulysses"), 2, 4),
           (layout("mesh", 1, pp=2, cp=2, attention="ring", schedule="1f1b", micro=4), 1, 2),
           (layout("mesh", 1, pp=2, cp=2, attention="ulysses", schedule="gpipe", micro=4), 1, 2),
           (layout("mesh", 1, pp=2, cp=2, tp=2, attention="ring", schedule="1f1b", micro=4), 1, 2),
           (layout("mesh", 1, pp=2, cp=2, attention="ring", schedule="interleaved", micro=4, virtual=2), 2, 4)]


@pytest.mark.parametrize("l, layers, heads", CHECKED, ids=lambda x: name(x) if hasattr(x, "kind") else str(x))
def test_predicted_memory_against_measured(l, layers, heads):
    """Exact: state from the arrays a step held (ContextTensorParallel's and MeshParallel's own),
    activations from the strategy's layout()."""
    from manual_dp.planner.verify import measure
    s = Setting(1, 8 * l.dp, "adam", tiny_transformer(layers, heads))
    predicted, measured = memory(l, s), measure(l, s, steps=1)
    assert (measured["state"], measured["activations"]) == (predicted["state"], predicted["activations"])


def test_grid_and_context_mesh_memory_by_hand():
    """The tiny transformer (784 pixels; embedding 28 x 16 + 16 + 28 x 16 = 912 parameters, one
    block, head 16 x 10 + 10), a group of 8 examples, sgd: a cp=2 x tp=2 context keeps the tensor
    rank's parameters (as tp=2) and 8 / 4 examples' activations (ContextTensorParallel's floor);
    pp=2 x cp=2's first stage keeps its stage's whole parameters (as pp=2), 1/2 of the micro-batches
    it holds and the images of the rest."""
    from manual_dp.memory import part_activation_elems, stage_activation_elems
    from manual_dp.planner.pipelines import mesh_activations
    from manual_dp.strategies.pipeline.schedules import held, plan
    net = tiny_transformer()
    s = Setting(1, 8, "sgd", net)
    grid = memory(layout("context", 1, cp=2, tp=2, attention="ring"), s)
    assert grid["state"] == memory(layout("tensor", 1, tp=2), s)["state"]
    assert grid["activations"] == 4 * 2 * sum(stage_activation_elems(model=net))
    l = layout("mesh", 1, pp=2, cp=2, attention="ring", schedule="gpipe", micro=4)
    pipe = memory(layout("pipeline", 1, pp=2, schedule="gpipe", micro=4), s)
    assert memory(l, s)["state"] == pipe["state"]
    cuts, h = net.cuts(2), held(plan("gpipe", 2, 4), [2] * 4, per="stage")
    first = part_activation_elems(cuts[0], model=net) * h[0] // 2 + 784 * h[0] // 2
    second = part_activation_elems(cuts[1], model=net) * h[1] // 2
    assert mesh_activations(l, net, 8) == [first, second]


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_grid_time_is_context_split_t_ways(transformer, attention):
    """cp=2 x tp=2 against cp=2 on the same group: compute halves; the attention's collectives carry
    blocks half as wide, the gradients half the split parameters, but each row adds f and g over
    T on its block of tokens."""
    from manual_dp.planner import sequence
    s = Setting(1, 64, "sgd", transformer)
    cp, grid = layout("context", 1, cp=2, attention=attention), layout("context", 1, cp=2, tp=2, attention=attention)
    t_cp, t_grid = step_time(cp, s, FIXED), step_time(grid, s, FIXED)
    assert t_grid["compute"] == pytest.approx(t_cp["compute"] / 2)
    assert t_grid["bubble"] == t_cp["bubble"] == 0
    layers = sequence.attention_layers(transformer)
    assert sequence.attention_communication(grid, layers, 64, FIXED) < sequence.attention_communication(
        cp, layers, 64, FIXED)
    assert sequence.row_tensor_communication(cp, transformer.tensor_traffic(), 64, FIXED) == 0
    assert sequence.row_tensor_communication(grid, transformer.tensor_traffic(), 64, FIXED) > 0


@pytest.mark.parametrize("schedule, V", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_context_mesh_is_the_pipeline_split_c_ways(transformer, schedule, V):
    """pp=2 x cp=2 (x tp=2) against pp=2 on the same schedule: compute and bubble over C (C T); the
    state per device is the pipeline's (pp x tp's with tp); activations 1/C of the pipeline's, and
    the first stage's images for the rest; comm adds the attention's collectives."""
    s = Setting(1, 64, "sgd", transformer)
    pipe = layout("pipeline", 1, pp=2, schedule=schedule, micro=4, virtual=V)
    cp = layout("mesh", 1, pp=2, cp=2, attention="ring", schedule=schedule, micro=4, virtual=V)
    grid, tp = cp._replace(tp=2), layout("mesh", 1, pp=2, tp=2, schedule=schedule, micro=4, virtual=V)
    t_pipe, t_cp, t_grid = (step_time(l, s, FIXED) for l in (pipe, cp, grid))
    for t, k in ((t_cp, 2), (t_grid, 4)):
        assert t["compute"] == pytest.approx(t_pipe["compute"] / k)
        assert t["bubble"] == pytest.approx(t_pipe["bubble"] / k)
    assert t_cp["comm"] > t_pipe["comm"]
    assert per_device_state(cp, s) == per_device_state(pipe, s)
    assert per_device_state(grid, s) == per_device_state(tp, s)
    m_pipe, m_cp, m_grid = (memory(l, s) for l in (pipe, cp, grid))
    assert m_pipe["activations"] / 2 <= m_cp["activations"] < m_pipe["activations"]
    assert m_grid["activations"] < m_cp["activations"]
