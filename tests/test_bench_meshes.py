"""`python -m manual_dp.bench.meshes --quick`: issue 22's figures side by side in one run. Checked
here: the JSON's structure, every mesh's loss equal to one context's, the dry-run bubbles in the
order the schedules promise and equal to the papers' formulas, sequence and context parallelism
holding fewer activation bytes; not timings (the benchmark reports those, as ratios)."""
import json
import subprocess
import sys

import pytest

from manual_dp.bench.meshes import SETTINGS, megatron_sp

SCHEDULES = {"gpipe", "1f1b", "interleaved", "zb-h1"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("meshes") / "meshes.json"
    done = subprocess.run([sys.executable, "-m", "manual_dp.bench.meshes", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text()), done.stdout


def test_header_names_the_machine_and_commit(quick):
    result, stdout = quick
    assert "cores, commit" in stdout.splitlines()[0] and "load average" in stdout.splitlines()[0]
    assert {"cpu", "cores", "commit", "load_before", "cores_free"} <= set(result)


def test_every_mesh_of_eight_contexts_runs_and_equals_one_context(quick):
    result, stdout = quick
    meshes = result["meshes"]
    assert set(meshes) == {"one context", "dp=2 x pp=2 x tp=2", "dp=2 x pp=2 x tp=2 +sp", "dp=2 x pp=2 x cp=2",
                           "dp=2 x cp=4", "dp=4 x tp=2", "pp=2 x cp=2 x tp=2"}
    for name, r in meshes.items():
        assert r["images_per_sec"] > 0 and len(r["losses"]) == SETTINGS["quick"]["steps"], name
        if name != "one context":
            assert r["contexts"] == 8 and r["loss_rel_diff"] <= 1e-4, name
    assert "not a speed target" in stdout


def test_dry_run_bubbles_are_ordered_and_match_the_formulas(quick):
    result, _ = quick
    b = result["bubbles"]
    assert set(b) == SCHEDULES and b["interleaved"]["virtual"] == 2
    for f in b.values():
        assert f["dry_run_over_compute"] == pytest.approx(f["formula"])
        assert 0 <= f["measured"] < 1 and f["measured_over_dry_run"] == pytest.approx(f["measured"] / f["dry_run_timed"])
        assert f["measured_over_flops"] == pytest.approx(f["measured"] / f["dry_run_flops"])
        assert len(f["rounds"]) == 3 and f["measured"] == pytest.approx(sorted(r["measured"] for r in f["rounds"])[1])
        assert all(r["ratio"] == pytest.approx(r["measured"] / r["dry_run_timed"]) for r in f["rounds"])
        assert f["measured_over_unit"] == pytest.approx(f["measured"] / f["dry_run"])
        assert 0 <= f["equal_stages"] < 1 and f["phase_ms"].keys() == f["stage_spread"].keys()
    assert b["gpipe"]["dry_run"] == b["1f1b"]["dry_run"] > b["interleaved"]["dry_run"] > b["zb-h1"]["dry_run"]
    assert set(b["zb-h1"]["phase_ms"]) == {"F", "B", "W"} and set(b["1f1b"]["phase_ms"]) == {"F", "B"}
    assert b["zb-h1"]["durations"]["B0"][1] == 0 and len(b["interleaved"]["durations"]) == 16   # 8 stages, F and B
    assert all(t > 0 for f in b.values() for _, _, t in f["durations"].values())      # every action timed
    targets = result["targets"]
    assert all(targets[f"dry run ({how}): {name} below 1f1b"] for how in ("unit", "FLOPs") for name in ("interleaved", "zb-h1"))


def test_sequence_and_context_parallelism_hold_fewer_activation_bytes(quick):
    result, stdout = quick
    acts = result["activations"]
    assert list(acts) == list(SETTINGS["quick"]["layouts"])
    for name, r in acts.items():
        assert r["largest"] == max(r["activation_bytes"].values()) > 0, name
        assert len(r["activation_bytes"]) == r["contexts"] and r["method"] in ("profiler", "shapes"), name
    assert acts["tp=2 +sp"]["largest"] < acts["tp=2"]["largest"] < acts["one context"]["largest"]
    sp = {r["layouts"][1]: r for r in result["sp_ratios"]}
    assert set(sp) == {"tp=2 +sp", "dp=2 x pp=2 x tp=2 +sp"}
    assert all(0 < r["measured"] < 1 and r["predicted"] == pytest.approx(megatron_sp(28, 16, 4, 2)) for r in sp.values())
    cp = {r["layout"]: r for r in result["cp_ratios"]}
    assert set(cp) == {"cp=2 ring", "cp=2 ulysses"} and all(r["measured"] < 1 for r in cp.values())
    assert "Megatron-SP predicts" in stdout and "1/C = 0.500" in stdout


def test_megatron_sp_prediction():
    assert megatron_sp(2048, 12288, 96, 8) == pytest.approx((34 / 8 + 5 * 96 * 2048 / (12288 * 8))
                                                           / (10 + 24 / 8 + 5 * 96 * 2048 / (12288 * 8)))
    assert megatron_sp(28, 64, 4, 1) == pytest.approx(1)     # t = 1: nothing to shard


@pytest.mark.parametrize("argv,word", [(["--cpus", "6"], "--cpus"), (["--steps", "1"], "--steps"),
                                       (["--heads", "5"], "heads"), (["--batch", "4"], "--batch"),
                                       (["--layers", "0"], "--layers"),
                                       (["--bubble-layers", "5"], "--bubble-layers")])
def test_bad_values_are_one_line_and_exit_2(argv, word):
    done = subprocess.run([sys.executable, "-m", "manual_dp.bench.meshes", *argv],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and word in done.stderr
