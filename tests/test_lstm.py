"""Seed 000's LSTM text classifier (manual_dp/models/lstm.py): its forward is Gluon's rnn.LSTM on the
same weights, and every layout that can split it trains it as one context does.

Tolerance: as tests/test_models.py, 1e-5 of the largest parameter after 2 momentum steps (layouts
differ from one context only in the order of float32 additions); --deterministic bit for bit."""
import hashlib

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon, nd

from conftest import assert_trained_as, cpus, params_after_steps, run_main
from manual_dp import models
from manual_dp.datasets import Spec
from manual_dp.strategies.data.async_dp import AsyncDataParallel
from manual_dp.strategies.data.data_parallel import DataParallel
from manual_dp.strategies.data.local_sgd import LocalSGD
from manual_dp.strategies.pipeline.pipeline import PipelineParallel
from manual_dp.strategies.wrappers.accum import GradAccum
from manual_dp.strategies.zero.zero import ZeroRedundancy

TOL = 1e-5
SPEC = Spec((6,), 3, 16)


def tokens(n, seed=0, spec=SPEC):
    """n random sequences of spec's tokens (float ids) and labels."""
    rng = np.random.RandomState(seed)
    X = rng.randint(0, spec.vocab, size=(n,) + spec.shape).astype(np.float32)
    return X, (X[:, -1] % spec.classes).astype(np.int32)


@pytest.mark.parametrize("layers", [1, 2])
def test_forward_is_gluons_lstm_on_the_same_weights(layers):
    net = models.build("lstm", layers=layers, d_model=8, spec=SPEC)
    P = net.init_params(0)
    X = nd.array(tokens(5)[0])
    reference = gluon.rnn.LSTM(8, num_layers=layers, layout="NTC", input_size=8)
    reference.initialize()
    table = reference.collect_params()
    for l in range(layers):
        for j, kind in enumerate(("i2h_weight", "h2h_weight", "i2h_bias", "h2h_bias")):
            table[next(k for k in table.keys() if k.endswith(f"l{l}_{kind}"))].set_data(P[1 + 4 * l + j])
    states = reference(nd.Embedding(X, P[0], input_dim=16, output_dim=8))                  # (B, T, D)
    want = nd.FullyConnected(states[:, -1, :], P[-2], P[-1], num_hidden=3)
    assert float(nd.abs(net.forward(X, P) - want).max().asscalar()) <= 1e-6
    symbols = [mx.sym.var(f"p{i}") for i in range(len(P))]
    graph = net.forward(mx.sym.var("X"), symbols, mx.sym, [p.shape for p in P])
    out = graph.bind(mx.cpu(), {"X": X, **{f"p{i}": p for i, p in enumerate(P)}}).forward()[0]
    assert float(nd.abs(out - want).max().asscalar()) <= 1e-6


LAYOUTS = {
    "sync fast 2": lambda P, m: DataParallel(P, cpus(2), "momentum", model=m),
    "sync lesson 3 (towers averaged)": lambda P, m: DataParallel(P, cpus(3), "momentum", lesson=True, model=m),
    "async S=0 2": lambda P, m: AsyncDataParallel(P, cpus(2), "momentum", 0, model=m),
    "local H=1 2": lambda P, m: LocalSGD(P, cpus(2), "momentum", 1, model=m),
    "zero3 2": lambda P, m: ZeroRedundancy(P, cpus(2), "momentum", 3, model=m),
    "pipeline embed | lstm | head, 1f1b": lambda P, m: PipelineParallel(P, cpus(3), "momentum", 2, stages=3,
                                                                          schedule="1f1b", model=m),
    "grad accum 2 x sync 2": lambda P, m: GradAccum(DataParallel(P, cpus(2), "momentum", model=m), 2),
}


def after(strategy, accum=False, steps=2, n=24):
    return params_after_steps(strategy, *tokens(n), steps, accum)


@pytest.fixture(scope="module")
def reference():
    net = models.build("lstm", layers=1, d_model=8, spec=SPEC)
    P = net.init_params(0)
    return net, P, after(DataParallel(P, cpus(1), "momentum", lesson=True, model=net))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_equals_one_context(reference, layout):
    net, P, want = reference
    assert_trained_as(after(LAYOUTS[layout](P, net), accum=layout.startswith("grad accum")), want, P, TOL)


def fortunes_dir(root, sizes=(23, 15, 8)):
    """A folder of category files holding sizes[i] fortunes each, the last category's text unlike the others'."""
    root.mkdir(parents=True, exist_ok=True)
    for c, n in enumerate(sizes):
        lines = [(f"fortune {i} of {'abc'[c]}" * (1 + i % 3)) for i in range(n)]
        (root / f"cat{c}").write_text("\n%\n".join(lines) + "\n")
    return root


def test_cli_trains_on_fortunes_deterministically_on_any_context_count(capsys, tmp_path):
    data = fortunes_dir(tmp_path / "f")
    argv = ["--model", "lstm", "--data", f"fortunes:{data}", "--seq-len", "16", "--d-model", "8", "--epochs", "2",
            "--batch-size", "16", "--optimizer", "adam", "--lr", "0.01", "--deterministic"]
    digests = []
    for n in (1, 2):
        code, out, err = run_main(capsys, argv + ["--cpus", str(n), "--checkpoint-dir", str(tmp_path / f"ck{n}")])
        assert code == 0, err
        assert "43 train / 3 test examples" in out and "lstm" in out
        from manual_dp import checkpoint
        state, _ = checkpoint.load(tmp_path / f"ck{n}")
        digests.append(hashlib.sha256(b"".join(np.asarray(p).tobytes() for p in state["params"])).hexdigest())
    assert digests[0] == digests[1]


@pytest.mark.parametrize("argv, message", [
    (["--mode", "tensor"], "lstm: its recurrence needs every hidden unit"),
    (["--mode", "context"], "--mode context cuts a sequence of tokens over the contexts: --model transformer"),
    (["--mode", "pipeline", "--stages", "4", "--cpus", "4"], "lstm has 3 layers to cut between (embed, lstm, head)"),
])
def test_layouts_that_cannot_split_an_lstm_refuse_in_one_line(capsys, tmp_path, argv, message):
    data = fortunes_dir(tmp_path / "f")
    code, _, err = run_main(capsys, ["--model", "lstm", "--data", f"fortunes:{data}", "--seq-len", "8",
                                     "--cpus", "2", *argv])
    assert code == 2 and len(err) == 1 and message in err[0], err
