"""ZeRO in DeepSpeed's mixed-precision layout (strategies/zero/zero_mixed.py, issue 23): every stage in bf16
and fp16 against one context in the precision, clipped and loss-scaled; the kept bytes per context
from the parameter count (Adam: 2 + 2 + 12, sharded as the stage says) in the measured memory
report and the run's memory record; gradient accumulation; resume bit for bit; the planner's bytes.

Tolerances as tests/test_precision.py's: parameters after 3 clipped momentum steps within 2% of their
change from one context in the precision (each context's gradient is rounded to 16 bits before the
sum and a 16-bit sum rounds again; parameters outside the products, layer norms and positions, are
read rounded to 16 bits where one context reads them in float32: at most 1.3% here); memory to the
byte (sizes and dtypes, not timings); a resume in the same layout bit for bit (the 16-bit copies are
the float32 masters rounded, and the checkpoint holds the masters)."""
import json

import numpy as np
import pytest

from conftest import batch, cpus, run_main, small_model
from manual_dp import memory
from manual_dp.fast.collectives import chunk_bounds
from manual_dp.models.precise import Precise
from manual_dp.planner.layouts import layout
from manual_dp.planner.predict import Setting, memory as memory_of, per_device_bytes
from manual_dp.precision import STORED, Policy
from manual_dp.strategies.data.data_parallel import DataParallel
from manual_dp.strategies.wrappers.loss_scaled import LossScaled
from manual_dp.strategies.zero.zero import ZeroRedundancy
from manual_dp.strategies.zero.zero_mixed import MixedZero

CLIP = 0.5                          # below the first gradients' norms: clipping bites (test_clipping.py)
N = 129_068                         # LeNet x1's parameters
PRECISIONS = [("bf16", True), ("bf16", False), ("fp16", False)]     # native: bf16 sums in 16 bits


def scaled(make, net, precision, native):
    """make(model in the precision), under fp16 inside its loss scale (1024), clipped at CLIP."""
    policy = Policy(precision, native, loss_scale=1024.0)
    strategy = make(Precise(net, policy))
    return (LossScaled(strategy, policy.scaler) if policy.scaler else strategy).clip(CLIP)


def steps(strategy, n=3):
    X, y = batch(48, 0)
    for _ in range(n):
        strategy.step(X, y, 0.05)
    return strategy.state_dict()["params"]


@pytest.fixture(scope="module", params=["lenet", "transformer"])
def net(request):
    return small_model(request.param)


@pytest.mark.parametrize("precision, native", PRECISIONS, ids=["bf16-native", "bf16-float32-sums", "fp16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_stage_in_16_bits_equals_one_context_in_the_precision(net, stage, precision, native):
    P = net.init_params(0)
    want = steps(scaled(lambda m: DataParallel(P, cpus(1), "momentum", model=m, conv_pad=1), net, precision, native))
    zero = scaled(lambda m: MixedZero(P, cpus(3), "momentum", stage, model=m, precision=precision, native=native),
                  net, precision, native)
    got = steps(zero)
    change = max(float(np.abs(w - p.asnumpy()).max()) for w, p in zip(want, P))
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, want)) <= 2e-2 * change
    held = zero.arrays()
    assert {np.dtype(a.dtype) for a in held["param"] + held["grad"]} == {np.dtype(STORED[precision])}
    assert {np.dtype(a.dtype) for a in held["state"]} == {np.dtype(np.float32)}


def kept(stage, k, low, state_bytes):
    """Per context [param, grad, state] bytes that the stage keeps of N parameters over k contexts."""
    shards = np.diff(chunk_bounds(N, k))
    return [[low * (s if stage == 3 else N), low * (N if stage == 1 else s), state_bytes * s] for s in shards]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_measured_report_keeps_2_2_12_bytes_a_parameter_against_fp32s_4_4_8(stage):
    """Adam, LeNet (129,068 = 3 x 43,022 + 2 parameters) over 3 contexts: memory.measure's report
    (the run's memory line) splits each context's peak into what arrays() keeps."""
    P, ctx = small_model("lenet").init_params(0), cpus(3)
    lenet = Precise(small_model("lenet"), Policy("bf16"))
    builds = {2: lambda: MixedZero(P, ctx, "adam", stage, model=lenet, precision="bf16", native=True),
              4: lambda: ZeroRedundancy(P, ctx, "adam", stage, model=lenet.inner)}
    for low, state_bytes in ((2, 12), (4, 8)):
        report = memory.measure(builds[low], ctx, 12)
        got = [[report[str(c)][f"{kind}_bytes"] for kind in ("param", "grad", "state")] for c in ctx]
        assert got == kept(stage, 3, low, state_bytes)
        assert all(r["method"] == "profiler" and r["peak_bytes"] >= sum(g) for r, g in zip(report.values(), got))


def test_two_backward_calls_then_one_update_equal_one_step_on_both_batches():
    """Stage 1's casts write the gradient (they cannot add): earlier calls' are added back."""
    net, (X1, y1), (X2, y2) = small_model("lenet"), batch(6, 0), batch(7, 1)
    P = net.init_params(2)
    low = Precise(net, Policy("bf16", False))
    for stage in (1, 2):
        two, one = (MixedZero(P, cpus(3), "momentum", stage, model=low, precision="bf16") for _ in range(2))
        two.backward(X1, y1), two.backward(X2, y2)
        two.update(0.1, 13)
        one.step(np.concatenate([X1, X2]), np.concatenate([y1, y2]), 0.1)
        got, want = two.state_dict()["params"], one.state_dict()["params"]
        change = max(float(np.abs(w - p.asnumpy()).max()) for w, p in zip(want, P))
        assert max(float(np.abs(g - w).max()) for g, w in zip(got, want)) <= 2e-2 * change


def test_a_checkpoint_holds_the_float32_masters_and_resumes_bit_for_bit():
    net = small_model("transformer")
    P, low = net.init_params(0), Precise(net, Policy("fp16", loss_scale=1.0))
    make = lambda: MixedZero(P, cpus(3), "adam", 3, model=low, precision="fp16")
    whole, first = make(), make()
    steps(whole, 3), steps(first, 2)
    state = first.state_dict()
    assert all(p.dtype == np.float32 for p in state["params"])
    resumed = make()
    resumed.load_state_dict(state)
    X, y = batch(48, 0)
    resumed.step(X, y, 0.05)
    for a, b in zip(resumed.state_dict()["params"] + sum(resumed.state_dict()["opt_state"], []),
                    whole.state_dict()["params"] + sum(whole.state_dict()["opt_state"], [])):
        assert np.array_equal(a, b)


TINY = ["--train-size", "96", "--test-size", "32", "--batch-size", "32", "--no-progress", "--cpus", "3",
        "--mode", "zero", "--zero-stage", "3", "--optimizer", "adam", "--lr", "0.01", "--precision", "fp16",
        "--loss-scale", "256", "--clip-norm", "1"]


def test_cli_fp16_zero3_records_its_kept_bytes_and_resumes_exactly(capsys, data_dir, tmp_path):
    args = ["--data-dir", str(data_dir), *TINY]
    code, out, err = run_main(capsys, [*args, "--epochs", "2", "--log-json", str(tmp_path / "all.jsonl")])
    assert code == 0 and "fp16 parameters and gradients kept" in out, err
    whole = [json.loads(line) for line in (tmp_path / "all.jsonl").read_text().splitlines()]
    got = [[r[f"{kind}_bytes"] for kind in ("param", "grad", "state")] for r in whole[0]["memory"].values()]
    assert got == kept(3, 3, 2, 12)
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--log-json", str(tmp_path / "parts.jsonl")]
    assert run_main(capsys, [*args, "--epochs", "1", *ck])[0] == 0
    code, out, err = run_main(capsys, [*args, "--epochs", "2", "--resume", *ck])
    assert code == 0 and "resumed" in out, err
    parts = [json.loads(line) for line in (tmp_path / "parts.jsonl").read_text().splitlines()]
    keys = ("train_loss", "test_acc", "loss_scale", "skipped_steps", "grad_norm_max")
    assert [[r[k] for k in keys] for r in parts] == [[r[k] for k in keys] for r in whole]
    assert whole[-1]["train_loss"] < whole[0]["train_loss"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_planner_prices_the_mixed_layout_as_it_is_held(stage):
    """The planner's kept bytes by the formula; with its transients (stage 2's pieces, stage 3's
    gathered layer, each layer's gradient whole) the arrays MixedZero holds at its step's peak
    (fp16: its sums are 16-bit on every CPU, as the planner prices them)."""
    from manual_dp.bench.zero_memory import arrays_peak, stepped
    setting, where = Setting(1, 8, "adam", precision="fp16"), layout("zero", 2, zero_stage=stage)
    assert [k for k, _ in per_device_bytes(where, setting)] == [sum(c) for c in kept(stage, 2, 2, 12)]
    net = small_model("lenet")
    zero = MixedZero(net.init_params(0), cpus(2), "adam", stage, model=Precise(net, Policy("fp16")), precision="fp16")
    assert memory_of(where, setting)["state"] == max(arrays_peak(stepped(zero)).values())


def test_two_dist_sync_workers_keep_the_16_bit_layout_and_train_as_one_process(data_dir, tmp_path):
    """The owned gradient shards cross the processes in float32 and are rounded once: 2 workers x 1
    context as 1 process x 2 contexts (whose 16-bit sum of two 16-bit gradients rounds once too)."""
    from jobs import two_workers_as_one_process
    two_workers_as_one_process(tmp_path, 1, "--data-dir", data_dir, "--train-size", 128, "--test-size", 64,
                               "--batch-size", 32, "--epochs", 2, "--mode", "zero", "--zero-stage", 3,
                               "--precision", "bf16", "--check-replicas", 1)


def test_the_bench_profiles_a_16_bit_zero_run_in_a_fresh_process():
    """bench.zero_memory's "profiled" column: the run's memory report, measured by MXNet's profiler
    in a process of its own, holds at least the kept bytes."""
    from manual_dp.bench.zero_memory import profiled
    peak = profiled("zero3", "bf16", 1, 2, "adam", 8)
    assert peak is not None and peak >= max(sum(c) for c in kept(3, 2, 2, 12))
