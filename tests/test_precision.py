"""--precision bf16|fp16 (issue 23, items 1 and 2): rounding against numpy's, the loss scale's
updates step by step, an overflow on one context skipping the update on every context, every layout
in bf16 against one context in bf16, and the command line (header, records, resume, refusals).

Tolerances: rounding exactly (numpy's float16, bf16 by the bits); layouts in bf16 against one
context in bf16 within 2% of the parameters' change over 3 momentum steps (each context's gradient
is rounded to bf16 before the sum, one context's once: about 2^-9 relative per element and step);
--deterministic layouts bit for bit (the same pieces, rounded alike, added in one tree)."""
import hashlib
import json

import numpy as np
import pytest
from mxnet import autograd, nd

from conftest import batch, cpus, hand_grads, run_main, small_model
from test_clipping import LAYOUTS as CLIPPING_LAYOUTS
from manual_dp.errors import DivergedError
from manual_dp.models.precise import Precise
from manual_dp.precision import MIN_SCALE, LossScale, Policy, numpy_rounded, rounded
from manual_dp.strategies.data.data_parallel import DataParallel
from manual_dp.strategies.sums.fixed_sums import FixedSums
from manual_dp.strategies.wrappers.loss_scaled import LossScaled
from manual_dp.strategies.pipeline.pipeline import PipelineParallel
from manual_dp.strategies.tensor.tensor import TensorParallel
from manual_dp.strategies.zero.zero import ZeroRedundancy
from manual_dp.strategies.zero.zero_mixed import MixedZero

EDGES = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -7 + 2 ** -9, 65504, 65519.9, 65520, 7e4, 1e-40,
                  -1e-40, 1.17e-38, 6e-8, 3e-8, 2.98e-8, np.inf, -np.inf, 0.0, -0.0, 3.14159], np.float32)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_rounding_equals_numpys(precision):
    rng = np.random.RandomState(0)
    x = np.concatenate([EDGES, (rng.standard_normal(20000) * 10.0 ** rng.randint(-40, 38, 20000)).astype(np.float32)])
    got, want = rounded(nd.array(x), precision).asnumpy(), numpy_rounded(x, precision)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert numpy_rounded(np.float32(1 + 2 ** -8), "bf16") == 1.0          # a tie goes to the even neighbour
    assert numpy_rounded(np.float32(65520), "fp16") == np.inf


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_backward_rounds_the_gradient_too(precision):
    x = nd.array([1.0, 2.0])
    x.attach_grad()
    g = np.array([1 + 2 ** -7 + 2 ** -9, 1e5], np.float32)
    with autograd.record():
        y = rounded(x, precision)
    y.backward(nd.array(g))
    assert np.array_equal(x.grad.asnumpy(), numpy_rounded(g, precision))
    x.attach_grad(grad_req="add")                   # accumulated, as the strategies' gradients are
    for _ in range(2):
        with autograd.record():
            y = rounded(x, precision)
        y.backward(nd.array(g))
    assert np.array_equal(x.grad.asnumpy(), 2 * numpy_rounded(g, precision))


def test_the_loss_scale_skips_halves_and_doubles_step_by_step():
    s = LossScale(scale=8.0, window=3)
    trace = [(s.update(finite), s.scale, s.skipped) for finite in (True, True, False, True, True, True, True)]
    assert trace == [(True, 8.0, 0), (True, 8.0, 0), (False, 4.0, 1), (True, 4.0, 1), (True, 4.0, 1),
                     (True, 8.0, 1), (True, 8.0, 1)]
    assert s.epoch_stats() == {"loss_scale": 8.0, "skipped_steps": 1} and s.epoch_stats()["skipped_steps"] == 0
    copy = LossScale()
    copy.load(s.state())
    assert (copy.scale, copy.good, copy.skipped) == (s.scale, s.good, s.skipped)
    tiny = LossScale(scale=MIN_SCALE)
    with pytest.raises(DivergedError, match="overflow at every loss scale"):
        tiny.update(False)


small, grads_of = small_model, hand_grads


@pytest.mark.parametrize("name", ["lenet", "transformer", "mlp"])
@pytest.mark.parametrize("native", [False, True])
def test_every_parameter_gradient_holds_bf16_values_and_fp16_carries_the_scale(name, native):
    net = small(name)
    P, (X, y) = net.init_params(0), batch(8, 0)
    fp32 = grads_of(net, P, X, y)
    bf16 = grads_of(Precise(net, Policy("bf16", native)), P, X, y)
    fed = [not (n == "pos" or "ln" in n) for n in net.names()]     # positions and layer norms: float32 ops
    assert all(np.array_equal(g, numpy_rounded(g, "bf16")) for g, f in zip(bf16, fed) if f)
    assert not any(np.array_equal(g, numpy_rounded(g, "bf16")) for g, f in zip(bf16, fed) if not f)
    assert any(not np.array_equal(g, f) for g, f in zip(bf16, fp32))
    policy = Policy("fp16", loss_scale=1024.0)
    fp16 = grads_of(Precise(net, policy), P, X, y)
    assert all(np.array_equal(g, numpy_rounded(g, "fp16")) for g, f in zip(fp16, fed) if f)
    low, full = (np.concatenate([g.ravel() for g in gs]) for gs in (fp16, fp32))
    assert np.linalg.norm(low / 1024 - full) <= 2e-2 * np.linalg.norm(full)   # unscaled: fp32's, to fp16's error


LAYOUTS = {**{name: make for name, make in CLIPPING_LAYOUTS.items() if "accum" not in name},
           "tensor 2": lambda P, m: TensorParallel(P, cpus(2), "momentum", model=m)}


def steps(strategy, n=3, clip=None):
    X, y = batch(48, 0)
    strategy.clip(clip, getattr(strategy, "scaler", None))
    for _ in range(n):
        strategy.step(X, y, 0.05)
    return strategy.state_dict()["params"]


@pytest.fixture(scope="module", params=["lenet", "transformer"])
def bf16_reference(request):
    net = small(request.param)
    P = net.init_params(0)
    low = Precise(net, Policy("bf16"))
    return low, P, steps(DataParallel(P, cpus(1), "momentum", model=low, conv_pad=1))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_in_bf16_equals_one_context_in_bf16(bf16_reference, layout):
    low, P, want = bf16_reference
    got = steps(LAYOUTS[layout](P, low))
    change = max(float(np.abs(w - p.asnumpy()).max()) for w, p in zip(want, P))
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, want)) <= 2e-2 * change
    assert digest(got) != digest(steps(LAYOUTS[layout](P, low.inner)))     # the layout did compute in bf16


def digest(params):
    return hashlib.sha256(b"".join(p.tobytes() for p in params)).hexdigest()


def test_deterministic_layouts_in_bf16_keep_one_bit_pattern_of_their_own(bf16_reference):
    low, P, _ = bf16_reference
    pad = dict(model=low)
    digests = {digest(steps(make())) for make in (
        lambda: DataParallel(P, cpus(1), "momentum", sums=FixedSums(), **pad),
        lambda: DataParallel(P, cpus(3), "momentum", sums=FixedSums(), **pad),
        lambda: ZeroRedundancy(P, cpus(2), "momentum", 3, sums=FixedSums(), **pad))}
    fp32 = digest(steps(DataParallel(P, cpus(1), "momentum", model=low.inner, sums=FixedSums())))
    assert len(digests) == 1 and fp32 not in digests


@pytest.mark.parametrize("make", [
    lambda P, m: DataParallel(P, cpus(2), "sgd", model=m, conv_pad=1),
    lambda P, m: DataParallel(P, cpus(2), "sgd", model=m, conv_pad=1, bucket_mb=0),
    lambda P, m: ZeroRedundancy(P, cpus(2), "sgd", 2, model=m),
    lambda P, m: PipelineParallel(P, cpus(4), "sgd", 2, model=m),
    lambda P, m: TensorParallel(P, cpus(4), "sgd", 2, model=m),
    lambda P, m: MixedZero(P, cpus(2), "sgd", 1, model=m, precision="fp16"),
    lambda P, m: MixedZero(P, cpus(3), "sgd", 3, model=m, precision="fp16")],
    ids=["fast", "buckets", "zero2", "hybrid", "tensor", "zero1 fp16-kept", "zero3 fp16-kept"])
def test_an_overflow_on_one_context_skips_the_update_on_every_context(make):
    net = small("lenet")
    policy = Policy("fp16", loss_scale=256.0)
    P = net.init_params(0)
    strategy = LossScaled(make(P, Precise(net, policy)), policy.scaler).clip(None)
    X, y = batch(16, 0)
    poisoned = X.copy()
    poisoned[-1] = 1e6                     # the last context's rows only: its fp16 products overflow
    before = strategy.state_dict()["params"]
    strategy.step(poisoned, y, 0.05)
    after = strategy.state_dict()["params"]
    assert all(np.array_equal(a, b) for a, b in zip(after, before))
    assert (policy.scaler.scale, policy.scaler.skipped) == (128.0, 1)
    for g in strategy.arrays().get("grad", []):
        assert float(nd.abs(g).sum().asscalar()) == 0   # zeroed for the next update
    strategy.step(X, y, 0.05)                          # the next update applies, unscaled
    moved = strategy.state_dict()["params"]
    assert any(not np.array_equal(a, b) for a, b in zip(moved, before)) and policy.scaler.skipped == 1


def test_fp16_clipping_sees_the_unscaled_norm():
    net = small("lenet")
    P = net.init_params(0)
    norms = {}
    for precision, scale in (("bf16", None), ("fp16", 64.0), ("fp16", 512.0)):
        policy = Policy(precision, loss_scale=scale or 1.0)
        strategy = DataParallel(P, cpus(2), "momentum", model=Precise(net, policy), conv_pad=1)
        strategy = LossScaled(strategy, policy.scaler) if policy.scaler else strategy
        steps(strategy, n=1, clip=0.5)
        norms[precision, scale] = strategy.grad_norms()["grad_norm_max"]
    # Unscaled, both scales see the same norm: a scale left in would be a factor of 8 apart. Not
    # the same bits: the scaled values below fp16's normal range (6.1e-5) round as subnormals,
    # which of them do depends on the scale (the two norms were 1 ulp apart on an AMD Zen 5, equal on an Intel Xeon).
    assert norms["fp16", 64.0] == pytest.approx(norms["fp16", 512.0], rel=1e-3)
    assert norms["fp16", 64.0] == pytest.approx(norms["bf16", None], rel=2e-2)


TINY = ["--train-size", "512", "--test-size", "64", "--batch-size", "32", "--no-progress"]


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_fp16_header_records_and_an_exact_resume(capsys, data_dir, tmp_path):
    args = ["--data-dir", str(data_dir), *TINY, "--precision", "fp16", "--scale-window", "4", "--cpus", "2"]
    code, out, err = run_main(capsys, [*args, "--epochs", "2", "--log-json", str(tmp_path / "all.jsonl")])
    assert code == 0 and "precision fp16: fp16 emulated" in out and "loss scale" in out, err
    whole = records(tmp_path / "all.jsonl")
    assert all("loss_scale" in r and "skipped_steps" in r for r in whole)
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--log-json", str(tmp_path / "parts.jsonl")]
    assert run_main(capsys, [*args, "--epochs", "1", *ck])[0] == 0
    code, out, err = run_main(capsys, [*args, "--epochs", "2", "--resume", *ck])
    assert code == 0 and "resumed" in out, err
    parts = records(tmp_path / "parts.jsonl")
    keys = ("train_loss", "test_acc", "loss_scale", "skipped_steps", "grad_norm_max")
    assert [[r[k] for k in keys] for r in parts] == [[r[k] for k in keys] for r in whole]
    code, _, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--epochs", "2", "--cpus", "2",
                                     "--resume", *ck[:2]])
    assert code != 0 and len(err) == 1 and "precision 'fp16' there, 'fp32' here" in err[0], err


def test_cli_fp16_from_a_scale_of_1e30_skips_halves_and_then_learns(capsys, data_dir, tmp_path):
    log = tmp_path / "log.jsonl"
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), "--train-size", "512", "--test-size", "64",
                                       "--batch-size", "8", "--no-progress", "--epochs", "3", "--cpus", "1",
                                       "--precision", "fp16", "--loss-scale", "1e30", "--log-json", str(log)])
    assert code == 0, err
    r = records(log)
    assert r[0]["skipped_steps"] > 60 and r[-1]["skipped_steps"] < 5 and r[-1]["loss_scale"] < 1e6
    assert r[-1]["train_loss"] < r[0]["train_loss"] and r[-1]["train_acc"] > 0.3


@pytest.mark.parametrize("argv, message", [
    (["--precision", "bf16", "--loss-scale", "8"], "--loss-scale applies only to --precision fp16"),
    (["--scale-window", "8"], "--scale-window applies only to --precision fp16"),
    (["--precision", "fp16", "--loss-scale", "0"], "--loss-scale must be positive and finite"),
    (["--precision", "fp16", "--loss-scale", "inf"], "--loss-scale must be positive and finite"),
    (["--precision", "fp16", "--scale-window", "0"], "--scale-window must be >= 1"),
    (["--precision", "fp16", "--mode", "async"], "--precision fp16 needs one reduced gradient"),
    (["--precision", "fp16", "--mode", "local"], "--precision fp16 needs one reduced gradient"),
    (["--precision", "bf16", "--model", "resnet"], "BatchNorm trains in fp32 only"),
])
def test_cli_refuses_bad_precision_settings_in_one_line(capsys, data_dir, argv, message):
    code, _, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--epochs", "1", *argv])
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_cli_refuses_an_unknown_precision(capsys, data_dir):
    code, _, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--precision", "fp8"])
    assert code == 2 and "fp8" in err[-1]


def test_fp16_that_no_scale_rescues_ends_with_exit_3_and_one_line(capsys, data_dir):
    code, _, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--epochs", "1", "--precision", "fp16",
                                     "--loss-scale", "1e-6", "--lr", "1e30"])
    assert code == 3 and len(err) == 1, err


@pytest.mark.parametrize("precision, native", [("fp16", False), ("bf16", True), ("bf16", False)])
@pytest.mark.parametrize("algorithm", ["ring", "tree", "reduce_bcast"])
def test_gradients_are_all_reduced_in_the_precision(precision, native, algorithm):
    from manual_dp.fast.collectives import make_allreduce
    rng = np.random.RandomState(1)
    values = [rng.standard_normal(1000).astype(np.float32) for _ in range(2)]
    arrays = [nd.array(v, ctx=c) for v, c in zip(values, cpus(2))]
    reduce = Policy(precision, native).reducer(make_allreduce(algorithm), algorithm)
    reduce(arrays)
    want = numpy_rounded(numpy_rounded(values[0], precision) + numpy_rounded(values[1], precision), precision) \
        if reduce.low else numpy_rounded(values[0] + values[1], precision)
    for a, c in zip(arrays, cpus(2)):
        assert a.context == c and a.dtype == np.float32 and np.array_equal(a.asnumpy(), want)
    assert reduce.moved == 2 * 1000 * (2 if reduce.low else 4)
    assert reduce.low == (precision == "fp16" or native)


def test_an_fp16_sum_past_65504_overflows_and_is_skipped():
    from manual_dp.fast.collectives import make_allreduce
    arrays = [nd.full((4,), 40000.0, ctx=c) for c in cpus(2)]
    Policy("fp16").reducer(make_allreduce("ring"))(arrays)
    assert np.isinf(arrays[0].asnumpy()).all()


def test_cli_says_how_gradients_are_reduced_and_refuses_compression(capsys, data_dir):
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--epochs", "1", "--cpus", "2",
                                       "--precision", "fp16"])
    assert code == 0 and "gradients all-reduced in fp16 (2 bytes an element on every link)" in out, err
    code, _, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--epochs", "1", "--precision", "bf16",
                                     "--compress", "fp16"])
    assert code == 2 and len(err) == 1 and "--compress sends gradients in fewer bits" in err[0], err


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_two_dist_sync_workers_train_in_the_precision_as_one_process(data_dir, tmp_path, precision):
    """The engine sums across processes in float32, then the sum is rounded once: the values one
    process's 16-bit sum of its two contexts' gradients gives."""
    from jobs import two_workers_as_one_process
    one, two = two_workers_as_one_process(tmp_path, 1, "--data-dir", data_dir, "--train-size", 256, "--test-size", 64,
                                          "--batch-size", 32, "--epochs", 2, "--precision", precision)
    assert one.get("loss_scale") == two.get("loss_scale") and one.get("skipped_steps") == two.get("skipped_steps")
