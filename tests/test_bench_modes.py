"""`python -m manual_dp.bench.modes`: every mode timed side by side in one run, each against sync."""
import json
import subprocess
import sys

from manual_dp.bench.modes import strategies
from manual_dp.modes import MODES


def test_every_mode_is_timed_beside_sync(tmp_path):
    done = subprocess.run([sys.executable, "-m", "manual_dp.bench.modes", "--out", str(tmp_path), "--batch", "8",
                           "--steps", "1", "--rounds", "1"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "modes.json").read_text())
    rates, left_out = report["images_per_sec"], report["left_out"]
    assert set(rates) | set(left_out) == set(strategies(None)) and all(r > 0 for r in rates.values())
    assert "1.00x sync" in done.stdout and "cores, commit" in done.stdout
    assert all(any(name.startswith(mode) for name in rates) for mode in MODES if mode not in ("context", "mesh", "expert"))
    assert set(left_out) == {n for n in strategies(None) if n.startswith(("context", "mesh", "expert"))}   # LeNet has
    # no sequence and no experts
    assert all(left_out.values())                                         # each with the model's reason


def test_bad_values_are_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "-m", "manual_dp.bench.modes", "--steps", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "--steps" in done.stderr


def test_any_model_is_timed_and_what_it_refuses_is_left_out_with_a_reason(tmp_path):
    done = subprocess.run([sys.executable, "-m", "manual_dp.bench.modes", "--out", str(tmp_path), "--batch", "8",
                           "--steps", "1", "--rounds", "1", "--model", "mlp"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "modes.json").read_text())
    assert result["model"]["name"] == "mlp" and "tensor T=4" in result["images_per_sec"]
    assert "cannot be cut into 4-stage pipelines" in result["left_out"]["model S=4"]     # 3 layers
    assert "left out:" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "manual_dp.bench.modes", "--model", "transformer", "--heads", "5"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "heads" in bad.stderr


def test_two_contexts_time_the_modes_that_fit_two(tmp_path):
    done = subprocess.run([sys.executable, "-m", "manual_dp.bench.modes", "--out", str(tmp_path), "--batch", "8",
                           "--steps", "1", "--rounds", "1", "--cpus", "2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "modes.json").read_text())
    rates = result["images_per_sec"]
    assert result["cpus"] == 2 and set(rates) | set(result["left_out"]) == set(strategies([0, 1]))
    assert "deterministic" in rates and set(result["left_out"]) == {"context cp=2 ring", "expert ep=2"}   # LeNet:
    # no sequence, no experts
    assert "tensor T=2" in rates and "model S=2" in rates and not any(n.startswith("hybrid") for n in rates)
    bad = subprocess.run([sys.executable, "-m", "manual_dp.bench.modes", "--cpus", "1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--cpus" in bad.stderr
