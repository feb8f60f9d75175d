"""The model contract (manual_dp/models/): LeNet's description is the lesson's, and every strategy
trains the transformer, an MLP and a user's Gluon block as one context does.

Tolerance: after 2 momentum steps the parameters of a k-context layout differ from the one-context
lesson step only by the order of float32 additions in the gradient sums (batch shards, layer
pieces): 1e-5 of the largest parameter, about 100 float32 ulps, is far below any real error (a
gradient counted twice or dropped moves parameters by ~1e-2 here). --deterministic layouts are
compared bit for bit (one process, one thread count)."""
import hashlib
import textwrap

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, nd

from conftest import batch, close, cpus, run_main, straight_and_resumed
from manual_dp import models
from manual_dp.lesson import LENET_SHAPES, cross_entropy, init_lenet_params, lenet, lenet_shapes
from manual_dp.models.contract import balanced_cuts
from manual_dp.strategies.wrappers.accum import GradAccum
from manual_dp.strategies.data.async_dp import AsyncDataParallel
from manual_dp.strategies.data.data_parallel import DataParallel
from manual_dp.strategies.sums.fixed_sums import FixedSums
from manual_dp.strategies.data.local_sgd import LocalSGD
from manual_dp.strategies.pipeline.pipeline import PipelineParallel
from manual_dp.strategies.tensor.tensor import TensorParallel
from manual_dp.strategies.zero.zero import ZeroRedundancy

TOL = 1e-5
USER_BLOCK = """
from mxnet.gluon import nn

def net():
    b = nn.HybridSequential()
    b.add(nn.Dense(24, activation="relu"), nn.Dense(16, activation="tanh"), nn.Dense(10))
    return b
"""


@pytest.fixture(scope="module")
def user_block(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "block.py"
    path.write_text(textwrap.dedent(USER_BLOCK))
    return f"{path}:net"


def small(name, user_block=None):
    if name == "transformer":
        return models.build("transformer", layers=2, d_model=16, heads=2)
    if name == "user":
        return models.build(user_block)
    return models.build(name)


# LeNet under the contract is the lesson's LeNet ------------------------------------------------

@pytest.mark.parametrize("width", [1, 2])
def test_lenet_description_is_the_lessons_table_and_values(width):
    net = models.build("lenet", width=width)
    assert net.shapes() == lenet_shapes(width)
    assert width > 1 or net.shapes() == LENET_SHAPES
    for a, b in zip(net.init_params(3), init_lenet_params(3, width=width)):
        assert (a.asnumpy() == b.asnumpy()).all()
    X = nd.array(batch(8, 1)[0])
    assert (net.forward(X, net.init_params(3)).asnumpy() == lenet(X, init_lenet_params(3, width=width)).asnumpy()).all()
    assert net.cuts(2) == ((0, 1), (2, 3)) and net.n_params() == sum(int(np.prod(s)) for _, s in lenet_shapes(width))


def test_lenet_counts_match_the_hand_counts():
    from manual_dp.flops import flops_per_image
    from manual_dp.memory import piece_activation_elems
    net = models.build("lenet")
    assert net.flops_per_example() == flops_per_image()
    assert [(layer.inputs, layer.acts) for layer in net.layers] == piece_activation_elems()


# The transformer ----------------------------------------------------------------------------------

def test_transformer_forward_as_arrays_equals_its_symbol():
    net = small("transformer")
    params = net.init_params(0)
    X = nd.array(batch(6, 0)[0])
    symbol = net.forward(mx.sym.var("X"), [mx.sym.var(n) for n in net.names()], F=mx.sym,
                         shapes=[p.shape for p in params])
    out = symbol.bind(mx.cpu(), dict(zip(net.names(), params), X=X)).forward()[0]
    np.testing.assert_allclose(out.asnumpy(), net.forward(X, params).asnumpy(), rtol=1e-5, atol=1e-6)


def test_transformer_attention_against_numpy():
    """One block's attention against softmax(q k^T / sqrt(dh)) v written in numpy, per head."""
    from manual_dp.models.transformer import attention
    rng = np.random.RandomState(0)
    B, T, d, H = 2, 5, 8, 2
    a = rng.randn(B, T, d).astype(np.float32)
    p = [rng.randn(*s).astype(np.float32) for s in [(d, d), (d,)] * 4]
    got = attention(nd.array(a), [nd.array(x) for x in p], nd, [x.shape for x in p], d // H).asnumpy()
    q, k, v = [a @ p[i].T + p[i + 1] for i in (0, 2, 4)]
    heads = []
    for h in range(H):
        sl = slice(h * d // H, (h + 1) * d // H)
        s = q[..., sl] @ k[..., sl].transpose(0, 2, 1) / np.sqrt(d // H)
        w = np.exp(s - s.max(-1, keepdims=True))
        heads.append((w / w.sum(-1, keepdims=True)) @ v[..., sl])
    want = np.concatenate(heads, -1) @ p[6].T + p[7]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_transformer_patches_and_refusals():
    net = models.build("transformer", layers=1, d_model=8, heads=2, patch=7)
    assert net.tokens == 16 and net.shapes()[0] == ("embed_w", (8, 49))
    assert net.forward(nd.array(batch(3, 0)[0]), net.init_params(0)).shape == (3, 10)
    for bad in (dict(d_model=10, heads=4), dict(layers=0), dict(patch=5)):
        with pytest.raises(ValueError):
            models.build("transformer", **bad)


@pytest.mark.parametrize("costs,n", [([1, 1, 1, 1], 2), ([1, 9, 1, 1], 2), ([5, 1, 1, 1, 1, 1], 3), ([2, 2, 2], 3)])
def test_balanced_cuts_are_the_best_by_brute_force(costs, n):
    import itertools
    cuts = balanced_cuts(costs, n)
    assert [i for c in cuts for i in c] == list(range(len(costs))) and len(cuts) == n
    best = min(max(sum(costs[a:b]) for a, b in zip((0,) + ends, ends + (len(costs),)))
               for ends in itertools.combinations(range(1, len(costs)), n - 1))
    assert max(sum(costs[i] for i in c) for c in cuts) == best


# Every strategy on every model, against one context -------------------------------------------

LAYOUTS = {
    "sync fast 2": lambda P, m: DataParallel(P, cpus(2), "momentum", model=m, conv_pad=1),
    "sync lesson 3": lambda P, m: DataParallel(P, cpus(3), "momentum", lesson=True, model=m),
    "sync buckets 2": lambda P, m: DataParallel(P, cpus(2), "momentum", bucket_mb=0, model=m, conv_pad=1),
    "async S=0 2": lambda P, m: AsyncDataParallel(P, cpus(2), "momentum", 0, model=m),
    "local H=1 2": lambda P, m: LocalSGD(P, cpus(2), "momentum", 1, model=m),
    "zero1 3": lambda P, m: ZeroRedundancy(P, cpus(3), "momentum", 1, model=m),
    "zero2 2": lambda P, m: ZeroRedundancy(P, cpus(2), "momentum", 2, model=m),
    "zero3 3": lambda P, m: ZeroRedundancy(P, cpus(3), "momentum", 3, model=m),
    "model 2": lambda P, m: PipelineParallel(P, cpus(2), "momentum", 1, stages=2, model=m),
    "pipeline 3 gpipe": lambda P, m: PipelineParallel(P, cpus(3), "momentum", 3, stages=3, model=m),
    "pipeline 2 1f1b recompute": lambda P, m: PipelineParallel(P, cpus(2), "momentum", 4, stages=2,
                                                               schedule="1f1b", recompute=True, model=m),
    "hybrid 2x2": lambda P, m: PipelineParallel(P, cpus(4), "momentum", 2, stages=2, model=m),
    "grad accum 2 x sync 2": lambda P, m: GradAccum(DataParallel(P, cpus(2), "momentum", model=m, conv_pad=1), 2),
    "tensor 2": lambda P, m: TensorParallel(P, cpus(2), "momentum", 2, model=m),
    "tensor 2 x data 2": lambda P, m: TensorParallel(P, cpus(4), "momentum", 2, model=m),
}


def params_after(strategy, steps=2, n=24):
    X, y = batch(n, 0)
    for _ in range(steps):
        strategy.step(X, y, 0.05)
    return strategy.state_dict()["params"]


@pytest.fixture(scope="module")
def references(user_block):
    """Each model's parameters after the one-context lesson step (grad accum: 2 half batches)."""
    out = {}
    for name in ("transformer", "mlp", "user"):
        net = small(name, user_block)
        P = net.init_params(0)
        out[name] = (net, P, params_after(DataParallel(P, cpus(1), "momentum", lesson=True, model=net)))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["transformer", "mlp", "user"])
def test_every_layout_equals_one_context(references, name, layout):
    net, P, want = references[name]
    strategy = LAYOUTS[layout](P, net)
    if layout.startswith("grad accum"):      # two batches of 12, one update: the 24-row step
        X, y = batch(24, 0)
        for _ in range(2):
            strategy.step(X[:12], y[:12], 0.05)
            strategy.step(X[12:], y[12:], 0.05)
        got = strategy.state_dict()["params"]
    else:
        got = params_after(strategy)
    scale = max(float(np.abs(w).max()) for w in want)
    assert [g.shape for g in got] == [w.shape for w in want]
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, want)) <= TOL * scale


def digest(params):
    return hashlib.sha256(b"".join(np.ascontiguousarray(p).tobytes() for p in params)).hexdigest()


@pytest.mark.parametrize("name", ["transformer", "user"])
def test_deterministic_bits_on_any_context_count_and_zero_stage(references, name):
    net, P, _ = references[name]
    want = digest(params_after(DataParallel(P, cpus(1), "momentum", model=net, sums=FixedSums()), n=70))
    for layout in (lambda: DataParallel(P, cpus(3), "momentum", model=net, sums=FixedSums()),
                   lambda: ZeroRedundancy(P, cpus(2), "momentum", 3, model=net, sums=FixedSums()),
                   lambda: ZeroRedundancy(P, cpus(4), "momentum", 1, model=net, sums=FixedSums())):
        assert digest(params_after(layout(), n=70)) == want


def test_zero3_gathers_one_transformer_layer_at_a_time(references):
    """Stage 3's largest moment holds one layer's gathered parameters, never the whole model."""
    net, P, _ = references["transformer"]
    zero = ZeroRedundancy(P, cpus(2), "momentum", 3, model=net)
    params_after(zero, steps=1)
    gathered = sum(h.size for h in zero.peak.held["param"]) // 2       # per context
    biggest = max(sum(p.size for p in layer.params) for layer in net.layers)
    assert 0 < gathered <= biggest < net.n_params()


def test_pipeline_stages_are_balanced_runs_of_layers(references):
    net, P, _ = references["transformer"]            # embed, block0, block1, head
    assert net.cuts(2) == ((0, 1), (2, 3)) and net.cuts(4) == ((0,), (1,), (2,), (3,))
    pipe = PipelineParallel(P, cpus(3), "momentum", 2, stages=3, model=net)
    assert [len(stage) for stage in pipe.params[0]] == [sum(len(net.layers[i].params) for i in c) for c in net.cuts(3)]


# A user's block ----------------------------------------------------------------------------------

def test_user_block_layers_are_its_children(user_block):
    net = models.build(user_block)
    assert [layer.kind for layer in net.layers] == ["gluon"] * 3
    assert [layer.name for layer in net.layers] == ["0:Dense", "1:Dense", "2:Dense"]
    assert net.names() == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
    assert [s for _, s in net.shapes()] == [(24, 784), (24,), (16, 24), (16,), (10, 16), (10,)]
    assert all(a.asnumpy().tolist() == b.asnumpy().tolist()
               for a, b in zip(models.build(user_block).init_params(), net.init_params()))   # seeded


def test_user_block_gradients_equal_gluons_own(user_block):
    """Our forward through the block's graph, with our arrays, against the block itself."""
    from manual_dp.models.gluon_block import load_block
    net = models.build(user_block)
    block = load_block(user_block)
    block.initialize()
    X, y = (nd.array(a) for a in batch(5, 2))
    block(X)
    for p, value in zip(block.collect_params().values(), net.init_params()):
        p.set_data(value)
    with autograd.record():
        loss = cross_entropy(block(X), y).sum()
    loss.backward()
    ours = net.init_params()
    for p in ours:
        p.attach_grad()
    with autograd.record():
        mine = cross_entropy(net.forward(X, ours), y).sum()
    mine.backward()
    assert abs(float(mine.asscalar()) - float(loss.asscalar())) < 1e-5
    for a, p in zip(ours, block.collect_params().values()):
        np.testing.assert_allclose(a.grad.asnumpy(), p.grad().asnumpy(), rtol=1e-5, atol=1e-6)


# Megatron's split on the contract -----------------------------------------------------------------

def test_transformer_split_follows_megatron(references):
    """q, k, v and w1 (and their biases) by output rows, wo and w2 by input columns, the rest whole."""
    net = references["transformer"][0]
    split = {p.name.split("_", 1)[-1]: p.split for p in net.param_table() if p.name.startswith("block0")}
    assert split == {"ln1_g": None, "ln1_b": None, "wq": 0, "bq": 0, "wk": 0, "bk": 0, "wv": 0, "bv": 0,
                     "wo": 1, "bo": None, "ln2_g": None, "ln2_b": None, "w1": 0, "b1": 0, "w2": 1, "b2": None}
    assert all(p.split is None for p in net.param_table() if not p.name.startswith("block"))


def test_tensor_refusals_name_what_does_not_divide(user_block):
    assert "heads" in small("transformer").tensor_refusal(4 * 0 + 3)              # 2 heads
    assert small("transformer").tensor_refusal(2) is None
    assert "0.weight (24, 784)" in models.build(user_block).tensor_refusal(5)       # 24 units
    with pytest.raises(ValueError, match="heads"):
        TensorParallel(small("transformer").init_params(), cpus(3), "momentum", 3, model=small("transformer"))


def test_autotp_pairs_consecutive_dense_layers_only(tmp_path):
    path = tmp_path / "mixed.py"
    path.write_text("from mxnet.gluon import nn\n"
                    "def net():\n"
                    "    b = nn.HybridSequential()\n"
                    "    b.add(nn.Conv2D(4, 3), nn.Flatten(), nn.Dense(8), nn.Dense(10))\n"
                    "    return b\n"
                    "def convs():\n"
                    "    b = nn.HybridSequential()\n"
                    "    b.add(nn.Conv2D(4, 3), nn.Dense(10))\n"
                    "    return b\n")
    net = models.build(f"{path}:net")
    assert net.roles == {2: "column", 3: "row"}
    P = net.init_params()
    want = params_after(DataParallel(P, cpus(1), "momentum", lesson=True, model=net))
    got = params_after(TensorParallel(P, cpus(2), "momentum", 2, model=net))
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, want)) <= TOL * max(float(np.abs(w).max()) for w in want)
    assert "no two consecutive Dense" in models.build(f"{path}:convs").tensor_refusal(2)


# The command line ---------------------------------------------------------------------------------

TINY = ["--train-size", "96", "--test-size", "32", "--batch-size", "32", "--no-progress", "--epochs", "1"]


cli = run_main


def test_cli_trains_each_model_and_logs_its_description(capsys, data_dir, tmp_path, user_block):
    import json
    for model, extra in (("transformer", ["--layers", "1", "--d-model", "16", "--heads", "2", "--mode", "tensor"]),
                         ("mlp", ["--mode", "zero", "--zero-stage", "3"]),
                         (user_block, ["--mode", "pipeline", "--stages", "3", "--cpus", "3"])):
        log = tmp_path / "log.jsonl"
        code, out, err = cli(capsys, ["--data-dir", str(data_dir), *TINY, "--model", model, "--log-json", str(log), *extra])
        assert code == 0, err
        record = json.loads(log.read_text().splitlines()[-1])
        assert record["model"]["name"] == model and record["model"]["params"] == [
            [n, list(s)] for n, s in models.build(model, **({"layers": 1, "d_model": 16, "heads": 2}
                                                             if model == "transformer" else {})).shapes()]
        assert f"model {model}" in out


def test_cli_resume_of_another_model_is_refused_and_the_checkpoint_kept(capsys, data_dir, tmp_path):
    ck = tmp_path / "ck"
    base = ["--data-dir", str(data_dir), *TINY, "--checkpoint-dir", str(ck)]
    assert cli(capsys, base + ["--model", "mlp"])[0] == 0
    before = (ck / "checkpoint.npz").read_bytes()
    code, _, err = cli(capsys, base + ["--resume", "--epochs", "2"])
    assert code == 1 and len(err) == 1 and "model 'mlp' there, 'lenet' here" in err[0], err
    assert (ck / "checkpoint.npz").read_bytes() == before
    assert cli(capsys, base + ["--resume", "--epochs", "2", "--model", "mlp"])[0] == 0


@pytest.mark.parametrize("source,message", [
    ("missing.py:net", "no file"),
    ("{dir}/m.py:other", "defines no function other"),
    ("{dir}/m.py:raises", "raises\\(\\) raised ZeroDivisionError"),
    ("{dir}/m.py:number", "returned int, not a Gluon HybridBlock"),
    ("{dir}/m.py:seven", "gives \\(2, 7\\)"),
    ("{dir}/m.py:batchnorm", "BatchNorm\\(axis=1, eps=1e-05, momentum=0.5"),
    ("{dir}/broken.py:net", "failed to load \\(SyntaxError"),
    ("transformerx", "choose lenet, mlp, transformer, resnet, lstm, gpt or PATH.py:FUNCTION"),
])
def test_cli_model_file_errors_are_one_line(capsys, data_dir, tmp_path, source, message):
    (tmp_path / "m.py").write_text("from mxnet.gluon import nn\n"
                                   "def raises():\n    return 1 / 0\n"
                                   "def number():\n    return 3\n"
                                   "def seven():\n    b = nn.HybridSequential(); b.add(nn.Dense(7)); return b\n"
                                   "def batchnorm():\n    b = nn.HybridSequential()\n"
                                   "    b.add(nn.Conv2D(2, 3), nn.BatchNorm(momentum=0.5), nn.Dense(10)); return b\n")
    (tmp_path / "broken.py").write_text("def net(:\n")
    code, _, err = cli(capsys, ["--data-dir", str(data_dir), *TINY, "--model", source.format(dir=tmp_path)])
    assert code == 2 and len(err) == 1 and err[0].startswith("manual_dp.train: error: ")
    assert __import__("re").search(message, err[0]), err[0]


@pytest.mark.parametrize("argv,message", [
    (["--model", "lenet", "--layers", "2"], "--layers applies only to --model transformer"),
    (["--model", "transformer", "--width", "2"], "--width applies only to --model lenet or mlp"),
    (["--model", "transformer", "--d-model", "10", "--heads", "4"], "--heads 4 does not divide --d-model 10"),
    (["--model", "transformer", "--patch", "5"], "--patch must be 0"),
    (["--model", "transformer", "--mode", "tensor", "--cpus", "3"], "3 does not divide the transformer's 4 heads"),
    (["--model", "mlp", "--mode", "pipeline", "--stages", "4", "--cpus", "4"], "--model mlp has 3 layers"),
    (["--model", "mlp", "--mode", "tensor", "--deterministic", "--tensor-pieces", "3", "--cpus", "3"],
     "3 does not divide the split axis of W1"),
])
def test_cli_model_flags_refused_in_one_line(capsys, data_dir, argv, message):
    code, _, err = cli(capsys, ["--data-dir", str(data_dir), *TINY, *argv])
    assert code == 2 and len(err) == 1 and message in err[0], err


# Layers with state: BatchNorm's statistics ----------------------------------------------------------
# lr 0.01: BatchNorm divides by the batch's standard deviation, so a channel whose variance is small
# after a large first step (lr 0.05) amplifies the rounding of a different summation order ~1000x
# in the second; at lr 0.01 every layout stays within the float32 rounding of one context.

def resnet_after(strategy, n=24, steps=2, lr=0.01):
    X, y = batch(n, 0)
    for _ in range(steps):
        strategy.step(X, y, lr)
    return strategy.state_dict()


@pytest.fixture(scope="module")
def resnet():
    net = models.build("resnet")
    P = net.init_params(0)
    return net, P, resnet_after(DataParallel(P, cpus(1), "momentum", lesson=True, model=net))


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("lesson", [True, False], ids=["lesson", "fast"])
def test_sync_batchnorm_equals_one_context(resnet, k, lesson):
    net, P, want = resnet
    model = DataParallel(P, cpus(k), "momentum", lesson=lesson, model=net, sync_batchnorm=True)
    got = resnet_after(model)
    assert close(got["params"], want["params"])
    assert close(got["extra"]["running"], want["extra"]["running"])
    groups = model.fingerprints()
    assert len({tuple(sums) for _, sums in groups["running statistics"]}) == 1   # every replica alike


def test_per_context_batchnorm_is_each_shard_on_its_own(resnet):
    """Without --sync-batchnorm, 2 contexts compute what one context computes on the two halves of
    the batch, each normalised with its own statistics, gradients added (gradient accumulation)."""
    net, P, want = resnet
    per_context = resnet_after(DataParallel(P, cpus(2), "momentum", model=net), steps=1)
    halves = GradAccum(DataParallel(P, cpus(1), "momentum", lesson=True, model=net), 2)
    X, y = batch(24, 0)
    halves.step(X[:12], y[:12], 0.01)
    halves.step(X[12:], y[12:], 0.01)
    assert close(per_context["params"], halves.state_dict()["params"])
    whole = resnet_after(DataParallel(P, cpus(1), "momentum", model=net), steps=1)
    assert not close(per_context["params"], whole["params"], 1e-3)    # the statistics do differ


def test_evaluation_uses_the_running_statistics(resnet):
    """In inference mode an example's scores do not depend on the rest of its batch."""
    from manual_dp.models.batchnorm import Moments
    net, P, _ = resnet
    model = DataParallel(P, cpus(2), "momentum", model=net)
    resnet_after(model)
    X = nd.array(batch(10, 3)[0])
    autograd.set_training(True)         # as loop.evaluate: oneDNN's inference mode reorders weight views in place
    infer = lambda x: net.forward_group([x], [model.replicas[0]], Moments(False, model.running[:1]))[0].asnumpy()
    np.testing.assert_allclose(infer(X)[:4], infer(X[:4]), rtol=1e-5, atol=1e-6)
    train = lambda x: net.forward_group([x], [model.replicas[0]], Moments(True))[0].asnumpy()
    assert not np.allclose(train(X)[:4], train(X[:4]), atol=1e-4)
    Xn, yn = batch(10, 3)
    want = (np.concatenate([infer(X[:5]), net.forward_group([X[5:]], [model.replicas[1]], Moments(False, model.running[1:]))[0].asnumpy()])
            .argmax(1) == yn).sum()
    autograd.set_training(False)
    assert float(model.correct(nd.array(Xn), nd.array(yn)).asscalar()) == want


def test_running_statistics_are_checkpointed_and_resume_exactly(resnet):
    net, P, _ = resnet
    def make():
        return DataParallel(P, cpus(2), "momentum", model=net, sync_batchnorm=True)
    straight, resumed, state = straight_and_resumed(make, make(), *batch(24, 0))
    for kind in ("params", "opt_state"):
        assert digest(np.concatenate([np.ravel(a) for a in np.array(resumed.state_dict()[kind], dtype=object).ravel()])) == \
            digest(np.concatenate([np.ravel(a) for a in np.array(straight.state_dict()[kind], dtype=object).ravel()]))
    assert digest(resumed.state_dict()["extra"]["running"]) == digest(straight.state_dict()["extra"]["running"])
    from manual_dp.errors import CheckpointError
    with pytest.raises(CheckpointError, match="running statistics"):
        DataParallel(P, cpus(1), "momentum", model=net).load_state_dict(dict(state, extra={}))


def test_strategies_without_running_statistics_refuse_them(resnet):
    net, P, _ = resnet
    for make in (lambda: ZeroRedundancy(P, cpus(2), "momentum", 1, model=net, sums=FixedSums(tensor_pieces=2)),
                 lambda: PipelineParallel(P, cpus(2), "momentum", 2, model=net, sums=FixedSums(tensor_pieces=2))):
        with pytest.raises(ValueError, match="running statistics"):
            make()


def test_cli_resnet_with_sync_batchnorm_and_refusals(capsys, data_dir, tmp_path):
    ck = tmp_path / "ck"
    code, out, err = cli(capsys, ["--data-dir", str(data_dir), *TINY, "--model", "resnet", "--sync-batchnorm",
                                  "--checkpoint-dir", str(ck)])
    assert code == 0 and "BatchNorm statistics over every context" in out, err
    code, out, err = cli(capsys, ["--data-dir", str(data_dir), *TINY, "--model", "resnet", "--sync-batchnorm",
                                  "--checkpoint-dir", str(ck), "--resume", "--epochs", "2"])
    assert code == 0 and "resumed" in out, err
    for argv, message in ((["--model", "resnet", "--mode", "context"], "not --mode context: it cuts a sequence"),
                          (["--model", "resnet", "--mode", "tensor"], "--model resnet has none"),
                          (["--model", "resnet", "--deterministic", "--sync-batchnorm"], "not --sync-batchnorm (the batch"),
                          (["--sync-batchnorm"], "--sync-batchnorm applies to models with BatchNorm"),
                          (["--model", "mlp", "--sync-batchnorm", "--mode", "async"], "applies to models with BatchNorm")):
        code, _, err = cli(capsys, ["--data-dir", str(data_dir), *TINY, *argv])
        assert code == 2 and len(err) == 1 and message in err[0], err


def test_layers_without_parameters_pass_through_zero_and_pipelines(tmp_path):
    """A user block with Flatten (no parameters) and a convolution: ZeRO 2 and 3 gather nothing for
    it and hand its input's gradient on; every layout still equals one context."""
    path = tmp_path / "flat.py"
    path.write_text("from mxnet.gluon import nn\n"
                    "def net():\n"
                    "    b = nn.HybridSequential()\n"
                    "    b.add(nn.Conv2D(4, 3, activation='relu'), nn.Flatten(), nn.Dense(16, activation='relu'), nn.Dense(10))\n"
                    "    return b\n")
    net = models.build(f"{path}:net")
    assert [len(layer.params) for layer in net.layers] == [2, 0, 2, 2]
    P = net.init_params()
    want = params_after(DataParallel(P, cpus(1), "momentum", lesson=True, model=net))
    for make in (lambda: ZeroRedundancy(P, cpus(2), "momentum", 2, model=net),
                 lambda: ZeroRedundancy(P, cpus(3), "momentum", 3, model=net),
                 lambda: PipelineParallel(P, cpus(2), "momentum", 2, stages=2, model=net),
                 lambda: TensorParallel(P, cpus(2), "momentum", 2, model=net)):
        assert close(params_after(make()), want)


# Across processes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [[], ["--mode", "tensor", "--tensor-parallel", "2"]], ids=["sync", "tensor"])
def test_two_dist_sync_workers_train_the_transformer_as_one_process(data_dir, tmp_path, mode):
    """2 workers x 2 contexts against one process with 4: the same losses and parameters (to float
    rounding: the cross-process sum adds the replicas' gradients in another order)."""
    from jobs import two_workers_as_one_process
    two_workers_as_one_process(tmp_path, 2, "--model", "transformer", "--layers", 1, "--d-model", 16, "--heads", 2,
                               "--data-dir", data_dir, "--train-size", 256, "--test-size", 64, "--batch-size", 32,
                               "--epochs", 2, *mode)


@pytest.mark.parametrize("sync_bn", [[], ["--sync-batchnorm"]], ids=["per-context", "sync-batchnorm"])
def test_two_dist_sync_workers_train_resnet_as_one_process(data_dir, tmp_path, sync_bn):
    """BatchNorm across processes: 2 workers x 1 context against one process with 2 contexts, per-context
    statistics or --sync-batchnorm's (their sums and counts cross the processes), the running
    statistics folded over every context of the job: the same losses and parameters (to float
    rounding; lr 0.01, as BatchNorm amplifies the rounding of another summation order)."""
    from jobs import two_workers_as_one_process
    one, two = two_workers_as_one_process(tmp_path, 1, "--model", "resnet", "--data-dir", data_dir, "--train-size", 128,
                                          "--test-size", 64, "--batch-size", 64, "--epochs", 1, "--lr", 0.01, *sync_bn)
    assert one["test_acc"] == pytest.approx(two["test_acc"], abs=1e-6)     # evaluation reads the running statistics


@pytest.mark.skipif(not __import__("importlib").util.find_spec("horovod"), reason="horovod is not installed")
def test_two_horovod_processes_train_resnet_with_sync_batchnorm_as_one_process(data_dir, tmp_path):
    from jobs import assert_same_run, horovod_cmd, run_job, train_cmd
    argv = ["--model", "resnet", "--sync-batchnorm", "--data-dir", data_dir, "--train-size", 128, "--test-size", 64,
            "--batch-size", 64, "--epochs", 1, "--lr", 0.01]
    for name, cmd in (("one", train_cmd("--cpus", 2, *argv)), ("hvd", horovod_cmd(2, "--cpus", 1, *argv))):
        code, out = run_job([*cmd, "--log-json", tmp_path / f"{name}.jsonl", "--checkpoint-dir", tmp_path / name],
                            tmp_path / f"{name}.txt")
        assert code == 0, out
    assert_same_run(tmp_path / "one.jsonl", tmp_path / "one", tmp_path / "hvd.jsonl", tmp_path / "hvd", exact=False)


@pytest.mark.skipif(not __import__("importlib").util.find_spec("horovod"), reason="horovod is not installed")
@pytest.mark.parametrize("mode", [["--mode", "zero", "--zero-stage", "3"], ["--mode", "hybrid", "--micro-batches", "2"]],
                         ids=["zero3", "hybrid"])
def test_two_horovod_processes_train_the_transformer_as_one_process(data_dir, tmp_path, mode):
    """Horovod on a model other than LeNet: 2 processes x 2 contexts against one process with 4 (to
    float rounding: the cross-process sum adds the replicas' gradients in another order)."""
    from jobs import assert_same_run, horovod_cmd, run_job, train_cmd
    argv = ["--model", "transformer", "--layers", 1, "--d-model", 16, "--heads", 2, "--data-dir", data_dir,
            "--train-size", 256, "--test-size", 64, "--batch-size", 32, "--epochs", 2, *mode]
    for name, cmd in (("one", train_cmd("--cpus", 4, *argv)), ("hvd", horovod_cmd(2, "--cpus", 2, *argv))):
        code, out = run_job([*cmd, "--log-json", tmp_path / f"{name}.jsonl", "--checkpoint-dir", tmp_path / name],
                            tmp_path / f"{name}.txt")
        assert code == 0, out
    assert_same_run(tmp_path / "one.jsonl", tmp_path / "one", tmp_path / "hvd.jsonl", tmp_path / "hvd", exact=False)
