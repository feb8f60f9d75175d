"""--clip-norm (issue 23, item 3): the global gradient norm counts every parameter exactly once in
every layout, and every layout's clipped step equals one context's clipped step.

Tolerances: the norm against numpy's float64 norm to 1e-5 relative (float32 gradients summed in
another order); parameters after 3 clipped momentum steps within 1e-5 of the largest parameter
(the same float32 rounding as tests/test_models.py); --deterministic layouts bit for bit (the norm
is then taken in float64 on the host over the same gradient bits)."""
import hashlib
import json

import numpy as np
import pytest

from conftest import batch, cpus, hand_grads, run_main, small_model
from manual_dp.strategies.wrappers.accum import GradAccum
from manual_dp.strategies.data.data_parallel import DataParallel
from manual_dp.strategies.sums.fixed_sums import FixedSums
from manual_dp.strategies.pipeline.pipeline import PipelineParallel
from manual_dp.strategies.tensor.tensor import TensorParallel
from manual_dp.strategies.zero.zero import ZeroRedundancy

CLIP = 0.5          # well below the first gradients' norms (about 2.6 and 4.8 here): clipping bites
LAYOUTS = {
    "lesson 3": lambda P, m: DataParallel(P, cpus(3), "momentum", lesson=True, model=m),
    "fast 2": lambda P, m: DataParallel(P, cpus(2), "momentum", model=m, conv_pad=1),
    "buckets 2": lambda P, m: DataParallel(P, cpus(2), "momentum", model=m, conv_pad=1, bucket_mb=0),
    "zero1 2": lambda P, m: ZeroRedundancy(P, cpus(2), "momentum", 1, model=m),
    "zero3 3": lambda P, m: ZeroRedundancy(P, cpus(3), "momentum", 3, model=m),
    "pipeline 2": lambda P, m: PipelineParallel(P, cpus(2), "momentum", 2, model=m),
    "hybrid 2x2": lambda P, m: PipelineParallel(P, cpus(4), "momentum", 2, model=m),
    "tensor 2x2": lambda P, m: TensorParallel(P, cpus(4), "momentum", 2, model=m),
    "grad accum 2": lambda P, m: GradAccum(DataParallel(P, cpus(2), "momentum", model=m, conv_pad=1), 2),
}


small = small_model


def numpy_norm(net, P, X, y):
    """The first update's global norm by hand: every parameter's mean gradient, float64."""
    g = np.concatenate([a.ravel() for a in hand_grads(net, P, X, y)]).astype(np.float64) / len(X)
    return float(np.sqrt(g @ g))


def steps(strategy, clip, n=3, accum=1):
    X, y = batch(48, 0)
    strategy.clip(clip)
    for _ in range(n):
        for part in range(accum):
            rows = slice(part * 48 // accum, (part + 1) * 48 // accum)
            strategy.step(X[rows], y[rows], 0.05)
    return strategy.state_dict()["params"], strategy.grad_norms()


@pytest.fixture(scope="module", params=["lenet", "transformer"])
def reference(request):
    net = small(request.param)
    P = net.init_params(0)
    return net, P, steps(DataParallel(P, cpus(1), "momentum", lesson=True, model=net), CLIP)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_counts_each_parameter_once_and_clips_as_one_context(reference, layout):
    net, P, (want, _) = reference
    X, y = batch(48, 0)
    first = LAYOUTS[layout](P, net)
    _, norms = steps(first, None, n=1, accum=2 if "accum" in layout else 1)
    assert norms["grad_norm_max"] == pytest.approx(numpy_norm(net, P, X, y), rel=1e-5)
    got, _ = steps(LAYOUTS[layout](P, net), CLIP, accum=2 if "accum" in layout else 1)
    scale = max(float(np.abs(w).max()) for w in want)
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, want)) <= 1e-5 * scale


def digest(params):
    return hashlib.sha256(b"".join(p.tobytes() for p in params)).hexdigest()


def test_clipping_changes_the_step_and_a_large_bound_changes_nothing(reference):
    net, P, (clipped, _) = reference
    plain, norms = steps(DataParallel(P, cpus(1), "momentum", lesson=True, model=net), None)
    huge, _ = steps(DataParallel(P, cpus(1), "momentum", lesson=True, model=net), 1e9)
    assert digest(huge) == digest(plain) != digest(clipped)
    assert norms["grad_norm_max"] > CLIP


def test_deterministic_layouts_keep_one_bit_pattern_when_clipped(reference):
    net, P, _ = reference
    pad = dict(model=net)
    digests = {digest(steps(make(), CLIP)[0]) for make in (
        lambda: DataParallel(P, cpus(1), "momentum", sums=FixedSums(), **pad),
        lambda: DataParallel(P, cpus(3), "momentum", sums=FixedSums(), **pad),
        lambda: ZeroRedundancy(P, cpus(2), "momentum", 3, sums=FixedSums(), **pad),
        lambda: ZeroRedundancy(P, cpus(4), "momentum", 1, sums=FixedSums(), **pad))}
    assert len(digests) == 1


TINY = ["--train-size", "96", "--test-size", "32", "--batch-size", "32", "--no-progress", "--epochs", "1"]


def test_cli_logs_the_norm_and_refuses_what_does_not_clip(capsys, data_dir, tmp_path):
    log = tmp_path / "log.jsonl"
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--clip-norm", "0.5", "--mode", "zero",
                                       "--zero-stage", "3", "--log-json", str(log)])
    assert code == 0 and "clipped to a global norm of 0.5" in out and "grad norm" in out, err
    record = json.loads(log.read_text().splitlines()[-1])
    assert record["grad_norm_max"] >= record["grad_norm_mean"] > 0
    for argv, message in ((["--mode", "async", "--clip-norm", "1"], "--clip-norm applies only to --mode sync"),
                          (["--mode", "local", "--clip-norm", "1"], "--clip-norm applies only to --mode sync"),
                          (["--clip-norm", "0"], "--clip-norm must be positive and finite"),
                          (["--clip-norm", "nan"], "--clip-norm must be positive and finite")):
        code, _, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, *argv])
        assert code == 2 and len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("mode", [[], ["--mode", "zero", "--zero-stage", "2"]], ids=["sync", "zero2"])
def test_two_dist_sync_workers_clip_as_one_process(data_dir, tmp_path, mode):
    """The norm is taken after the cross-process sum: 2 workers x 1 context clip as 1 process x 2."""
    from jobs import two_workers_as_one_process
    one, two = two_workers_as_one_process(tmp_path, 1, "--data-dir", data_dir, "--train-size", 256, "--test-size", 64,
                                          "--batch-size", 32, "--epochs", 2, "--clip-norm", 0.5, *mode)
    assert two["grad_norm_max"] == pytest.approx(one["grad_norm_max"], rel=1e-5) and one["grad_norm_max"] > 0.5
