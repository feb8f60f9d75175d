"""Dropout whose masks no layout changes (manual_dp/models/dropout.py): every layout of the
transformer with dropout trains as one context does, recompute and micro-batches draw the same
masks, evaluation draws none, and a resumed run continues the masks.

Tolerance as in tests/test_models.py: after 2 momentum steps, 1e-5 of the largest parameter (the
order of float32 additions in the sums); a mask drawn differently on one context would move
parameters by ~1e-2 here (dropout at 0.3 changes the step by that much: checked below)."""
import hashlib
import json
import re
import textwrap

import numpy as np
import pytest
from mxnet import nd

from conftest import batch, cpus, run_main
from manual_dp import models
from manual_dp.models.dropout import Noise, row_keys, training_batch, uniform
from manual_dp.strategies.wrappers.accum import GradAccum
from manual_dp.strategies.data.async_dp import AsyncDataParallel
from manual_dp.strategies.context.context import ContextParallel
from manual_dp.strategies.context.context_tensor import ContextTensorParallel
from manual_dp.strategies.data.data_parallel import DataParallel
from manual_dp.strategies.sums.fixed_sums import FixedSums
from manual_dp.strategies.data.local_sgd import LocalSGD
from manual_dp.strategies.mesh.mesh_parallel import MeshParallel
from manual_dp.strategies.pipeline.pipeline import PipelineParallel
from manual_dp.strategies.tensor.tensor import TensorParallel
from manual_dp.strategies.zero.zero import ZeroRedundancy

TOL, RATE = 1e-5, 0.3
USER_BLOCK = """
from mxnet.gluon import nn

def net():
    b = nn.HybridSequential()
    b.add(nn.Dense(24, activation="relu"), nn.Dropout(0.25), nn.Dense(16, activation="tanh"), nn.Dense(10))
    return b
"""

LAYOUTS = {
    "sync fast 2": lambda P, m: DataParallel(P, cpus(2), "momentum", model=m),
    "sync lesson 3": lambda P, m: DataParallel(P, cpus(3), "momentum", lesson=True, model=m),
    "sync buckets 2": lambda P, m: DataParallel(P, cpus(2), "momentum", bucket_mb=0, model=m),
    "async S=0 2": lambda P, m: AsyncDataParallel(P, cpus(2), "momentum", 0, model=m),
    "local H=1 2": lambda P, m: LocalSGD(P, cpus(2), "momentum", 1, model=m),
    "zero1 3": lambda P, m: ZeroRedundancy(P, cpus(3), "momentum", 1, model=m),
    "zero3 2": lambda P, m: ZeroRedundancy(P, cpus(2), "momentum", 3, model=m),
    "model 2": lambda P, m: PipelineParallel(P, cpus(2), "momentum", 1, stages=2, model=m),
    "pipeline 3 gpipe": lambda P, m: PipelineParallel(P, cpus(3), "momentum", 3, stages=3, model=m),
    "pipeline 2 1f1b recompute": lambda P, m: PipelineParallel(P, cpus(2), "momentum", 4, stages=2,
                                                               schedule="1f1b", recompute=True, model=m),
    "pipeline 2 zb-h1": lambda P, m: PipelineParallel(P, cpus(2), "momentum", 4, stages=2, schedule="zb-h1", model=m),
    "hybrid 2x2": lambda P, m: PipelineParallel(P, cpus(4), "momentum", 2, stages=2, model=m),
    "grad accum 2 x sync 2": lambda P, m: GradAccum(DataParallel(P, cpus(2), "momentum", model=m), 2),
    "tensor 2": lambda P, m: TensorParallel(P, cpus(2), "momentum", 2, model=m),
    "tensor 2 x data 2 +sp": lambda P, m: TensorParallel(P, cpus(4), "momentum", 2, model=m, sequence_parallel=True),
    "context ring 2": lambda P, m: ContextParallel(P, cpus(2), "momentum", 2, "ring", model=m),
    "context ulysses 2 x data 2": lambda P, m: ContextParallel(P, cpus(4), "momentum", 2, "ulysses", model=m),
    "cp 2 x tp 2": lambda P, m: ContextTensorParallel(P, cpus(4), "momentum", 2, 2, "ring", model=m),
    "dp 2 x pp 2 x tp 2 1f1b": lambda P, m: MeshParallel(P, cpus(8), "momentum", 2, 2, 2, "1f1b", model=m),
    "pp 2 x cp 2": lambda P, m: MeshParallel(P, cpus(4), "momentum", 2, 1, 2, "gpipe", model=m, context_parallel=2),
    "pp 2 x cp 2 x tp 2": lambda P, m: MeshParallel(P, cpus(8), "momentum", 2, 2, 2, "1f1b", model=m,
                                                    context_parallel=2),
}
USER_LAYOUTS = ("sync fast 2", "sync lesson 3", "zero3 2", "pipeline 2 1f1b recompute", "tensor 2", "hybrid 2x2")


def transformer(rate=RATE):
    net = models.build("transformer", layers=2, d_model=16, heads=2)
    return net.drop(Noise(rate, seed=5)) if rate else net


def steps(strategy, net, n=24, count=2):
    """`count` momentum steps on the same batch, as the run's batches 0, 1, ...: the parameters."""
    X, y = batch(n, 0)
    for i in range(count):
        with training_batch(net.noise, i):
            if isinstance(strategy, GradAccum):                # two half batches, one update
                strategy.step(X[:n // 2], y[:n // 2], 0.05)
                strategy.step(X[n // 2:], y[n // 2:], 0.05)
            else:
                strategy.step(X, y, 0.05)
    return strategy.state_dict()["params"]


def gap(got, want):
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want)) / max(float(np.abs(w).max()) for w in want)


@pytest.fixture(scope="module")
def reference():
    net = transformer()
    P = net.init_params(0)
    return net, P, steps(DataParallel(P, cpus(1), "momentum", lesson=True, model=net), net)


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "block.py"
    path.write_text(textwrap.dedent(USER_BLOCK))
    net = models.build(f"{path}:net")
    P = net.init_params(0)
    return net, P, steps(DataParallel(P, cpus(1), "momentum", lesson=True, model=net), net), f"{path}:net"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_draws_one_contexts_masks(reference, layout):
    net, P, want = reference
    assert gap(steps(LAYOUTS[layout](P, net), net), want) <= TOL


@pytest.mark.parametrize("layout", USER_LAYOUTS)
def test_a_gluon_blocks_dropout_child_is_layout_invariant(user, layout):
    net, P, want, _ = user
    assert net.dropout_sites() == 1 and [layer.extra["type"] for layer in net.layers][1] == "Dropout"
    assert gap(steps(LAYOUTS[layout](P, net), net), want) <= TOL


def test_dropout_changes_the_step_and_evaluation_draws_none(reference):
    net, P, want = reference
    plain = transformer(rate=0)
    assert gap(steps(DataParallel(P, cpus(1), "momentum", lesson=True, model=plain), plain), want) > 100 * TOL
    X, y = batch(24, 1)
    strategy = DataParallel(P, cpus(2), "momentum", model=net)
    scores = [net.forward(nd.array(X), P).asnumpy() for _ in range(2)]
    assert (scores[0] == scores[1]).all() and (scores[0] == plain.forward(nd.array(X), P).asnumpy()).all()
    assert float(strategy.correct(nd.array(X), nd.array(y)).asscalar()) == \
        float(DataParallel(P, cpus(2), "momentum", model=plain).correct(nd.array(X), nd.array(y)).asscalar())


def test_masks_follow_the_example_not_its_place(reference):
    """The same images in another order (another shard, micro-batch, piece) get the same masks."""
    net, P, _ = reference
    X = nd.array(batch(12, 2)[0])
    order = nd.array(np.arange(12)[::-1].copy())
    with training_batch(net.noise, 7):
        a = net.forward(X, P).asnumpy()
        b = net.forward(nd.take(X, order), P).asnumpy()
    with training_batch(net.noise, 8):
        c = net.forward(X, P).asnumpy()
    assert (a[::-1] == b).all() and not (a == c).all()


def test_masks_are_the_documented_hash_at_the_rate():
    noise = Noise(RATE, seed=3)
    noise.batch = 11
    keys = row_keys(batch(64, 4)[0])
    assert len(set(keys.tolist())) == 64
    mask = noise.mask(keys, 2, (28, 16), 0, cpus(1)[0], RATE).asnumpy()
    u = uniform(keys, noise.salt(2), 0, 28 * 16).reshape(mask.shape)
    np.testing.assert_array_equal(mask, np.where(u >= RATE, np.float32(1 / (1 - RATE)), 0).astype(np.float32))
    assert abs((mask == 0).mean() - RATE) < 0.01                 # 28,672 draws: 4 standard deviations
    block = noise.mask(keys, 2, (3, 16), 5 * 16, cpus(1)[0], RATE).asnumpy()   # tokens 5..7 alone
    assert (block == mask[:, 5:8]).all()


def test_deterministic_bits_hold_with_dropout(reference):
    net, P, _ = reference
    digests = {hashlib.sha256(b"".join(p.tobytes() for p in steps(layout(), net, n=70))).hexdigest() for layout in (
        lambda: DataParallel(P, cpus(1), "momentum", model=net, sums=FixedSums()),
        lambda: DataParallel(P, cpus(3), "momentum", model=net, sums=FixedSums()),
        lambda: ZeroRedundancy(P, cpus(2), "momentum", 3, model=net, sums=FixedSums()))}
    assert len(digests) == 1


TINY = ["--model", "transformer", "--layers", "1", "--d-model", "16", "--heads", "2", "--train-size", "256",
        "--test-size", "64", "--batch-size", "64", "--no-progress", "--dropout", "0.2"]


def test_cli_dropout_resumes_exactly_on_another_layout_and_refuses_another_rate(capsys, data_dir, tmp_path):
    args = ["--data-dir", str(data_dir), *TINY, "--cpus", "2"]
    assert run_main(capsys, [*args, "--epochs", "2", "--log-json", str(tmp_path / "all.jsonl")])[0] == 0
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--log-json", str(tmp_path / "parts.jsonl")]
    assert run_main(capsys, [*args, "--epochs", "1", *ck])[0] == 0
    code, out, err = run_main(capsys, [*args[:-1], "1", "--epochs", "2", "--resume", *ck])   # on 1 context
    assert code == 0 and "resumed" in out, err
    whole = [json.loads(line) for line in (tmp_path / "all.jsonl").read_text().splitlines()]
    parts = [json.loads(line) for line in (tmp_path / "parts.jsonl").read_text().splitlines()]
    assert [r["train_loss"] for r in whole] == pytest.approx([r["train_loss"] for r in parts], rel=1e-5)
    code, out, err = run_main(capsys, [*args, "--epochs", "3", "--resume", *ck, "--dropout", "0.1"])
    assert code == 1 and len(err) == 1 and "dropout 0.2 there, 0.1 here" in err[0], err


@pytest.mark.parametrize("argv,message", [
    (["--dropout", "0.5"], "lenet has no dropout sites"),
    (["--model", "transformer", "--dropout", "1"], "a rate must be in \\[0, 1\\)"),
    (["--model", "transformer", "--dropout", "-0.1"], "a rate must be in \\[0, 1\\)"),
])
def test_cli_bad_dropout_is_one_line(capsys, data_dir, argv, message):
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), "--cpus", "1", "--epochs", "1", *argv])
    assert code == 2 and len(err) == 1 and re.search(message, err[0]), err


def test_cli_a_gluon_block_keeps_its_own_rates(capsys, data_dir, user):
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), "--cpus", "1", "--model", user[3], "--dropout", "0.1"])
    assert code == 2 and len(err) == 1 and "keep their own rates" in err[0], err
