"""`python -m manual_dp.bench.precision`: each precision timed beside fp32 in one run, and the bytes
each hands the all-reduce counted (fp16: half of fp32's)."""
import json
import subprocess
import sys

from manual_dp.bench.precision import variants
from manual_dp.precision import native_bf16


def test_every_precision_is_timed_beside_fp32_with_its_bytes(tmp_path):
    done = subprocess.run([sys.executable, "-m", "manual_dp.bench.precision", "--out", str(tmp_path), "--batch", "8",
                           "--steps", "1", "--rounds", "1"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "precision.json").read_text())
    rates, moved = result["images_per_sec"], result["allreduce_bytes_per_context_step"]
    assert set(rates) == {name for name, _, _ in variants(native_bf16())} and all(r > 0 for r in rates.values())
    assert moved["fp16 emulated"] == moved["fp32"] / 2 > 0
    assert ("bf16 native" in rates) == result["native_bf16"] and "1.00x fp32" in done.stdout


def test_bad_values_are_one_line_and_exit_2():
    for argv, word in ((["--cpus", "0"], "--cpus"), (["--steps", "0"], "--steps")):
        done = subprocess.run([sys.executable, "-m", "manual_dp.bench.precision", *argv],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and word in done.stderr
