"""The GPT's benchmarks: python -m manual_dp.bench.transformer --model gpt (its PyTorch peer is the same
network, a tiny run writes every row and its three implementations end at the same loss) and the
reference trainer python -m manual_dp.bench.gpt_reference (a tiny run of manual_dp.train ends where
PyTorch does). Timing is never asserted: the machine is shared.

Tolerances: the peer against our forward and backward 1e-5 (float32 sums in another order, as
tests/test_gpt.py); the bench's final losses after 8 SGD steps 1e-4 relative (seen: equal); the
reference's final validation losses 1e-3 relative (the brief's; seen: 2e-7), and every epoch's
training and validation loss 2e-5 relative (seen: 2e-7; a batch order of another seed moves the first
epoch's by 5e-4 and more, keeping the last short batch by 3%)."""
import os

import pytest

from test_bench_transformer import assert_one_line_exit_2, assert_the_same_network, run_bench, torch_or_skip
from manual_dp.bench import gpt_reference, transformer as bench
from manual_dp.bench.transformer_models import MODELS, final_loss

PROG = "python -m manual_dp.bench.transformer"
SIZES = {"layers": 1, "d_model": 16, "heads": 2, "seq_len": 16, "vocab": 256}
TINY = ["--model", "gpt", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "16",
        "--steps", "2", "--pairs", "1"]
REFERENCE = ["--train-size", "121", "--test-size", "32", "--layers", "1", "--d-model", "16", "--heads", "2",
             "--seq-len", "16", "--batch-size", "30", "--epochs", "2"]   # 4 batches an epoch, a last one of 1 dropped


def test_the_pytorch_gpt_is_the_same_network():
    """Copies of our parameters in, the same loss and gradients out (assert_the_same_network)."""
    torch_or_skip()
    from manual_dp.bench.peer_torch import torch_gpt
    spec = dict(SIZES, layers=2, seq_len=8, images=5, seed=0)
    net = MODELS["gpt"].net(spec)
    params = net.init_params(3)
    X, y = MODELS["gpt"].data(spec)
    assert_the_same_network(net, params, X, y, torch_gpt([p.asnumpy() for p in params], 2, 16, 2, 8, 256))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt")
    found = run_bench("manual_dp.bench.transformer", TINY, out, "gpt.json")
    assert not (out / "transformer.json").exists()
    return found


def test_a_tiny_gpt_run_writes_every_row_and_ends_at_one_loss(tiny_run):
    results, stdout = tiny_run
    impls = bench.impls()
    assert results["config"] == dict(results["config"], model="gpt", seq_len=16, vocab=256, batch=16, steps=2)
    rows = results["rows"]
    assert [(r["group"], r["impl"]) for r in rows] == [(0, impl) for impl in impls]
    assert not [r for r in rows if "error" in r]
    for r in rows:
        assert r["tokens_per_sec"] == pytest.approx(16 * r["images_per_sec"]) and 0 < r["peak_share"] < 1
    spec = dict(SIZES, images=32, seed=0)
    X, y = MODELS["gpt"].data(spec)
    net = MODELS["gpt"].net(spec)
    start = final_loss(net, net.init_params(0), X, y)
    losses = [r["final_loss"] for r in rows]
    assert max(losses) - min(losses) <= 1e-4 * min(losses)          # one model, whoever trained it
    assert max(losses) < start - 1e-2                               # and it trained
    assert [s["impl"] for s in results["summary"]] == impls and all("tokens_per_sec" in s for s in results["summary"])
    assert "tok/s" in stdout and "fast / lesson" in stdout


def test_the_causal_work_per_rank_is_reported(tiny_run):
    results, stdout = tiny_run
    assert results["causal_work"] == [{"contexts": 2, "contiguous": [36, 100], "balanced": [68, 68]},
                                      {"contexts": 4, "contiguous": [10, 26, 42, 58], "balanced": [34, 34, 34, 34]}]
    assert "C=2: contiguous [36, 100] (max / mean 1.47); balanced [68, 68] (max / mean 1.00)" in stdout


def test_each_model_has_its_own_defaults():
    gpt, vit = bench.parse(["--model", "gpt"]), bench.parse([])
    assert (gpt.layers, gpt.d_model, gpt.heads, gpt.batch_size, gpt.seq_len) == (2, 128, 4, 64, None)
    assert MODELS["gpt"].settings(gpt) == {"seq_len": 64, "vocab": 256}
    assert (vit.model, vit.layers, vit.d_model, vit.heads, vit.batch_size) == ("transformer", 2, 64, 4, 256)


@pytest.mark.parametrize("argv", [["--model", "gpt", "--heads", "3"], ["--seq-len", "8"], ["--model", "bert"],
                                  ["--model", "gpt", "--seq-len", "0"]])
def test_bad_flags_are_one_line_and_exit_2(argv, capsys):
    assert_one_line_exit_2(bench.main, argv, capsys, PROG)


# --- the reference trainer ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    torch_or_skip()
    return run_bench("manual_dp.bench.gpt_reference", REFERENCE, tmp_path_factory.mktemp("reference"),
                     "gpt_reference.json", timeout=600)


def test_the_reference_ends_at_manual_dps_validation_loss(reference):
    result, stdout = reference
    ours, theirs = result["manual_dp"], result["torch"]
    assert abs(ours["val_loss"] - theirs["val_loss"]) <= 1e-3 * theirs["val_loss"]
    assert result["met"] and result["relative_difference"] <= 1e-3
    assert theirs["steps"] == 8 and ours["devices"] == ["cpu(0)", "cpu(1)"]
    assert theirs["initial_val_loss"] - theirs["val_loss"] > 0.3                          # it trained
    assert "relative difference" in stdout and "manual_dp.train --model gpt --data fortunes" in stdout


def test_every_epoch_of_the_reference_is_manual_dps(reference):
    result, _ = reference
    pairs = list(zip(result["manual_dp_epochs"], result["torch_epochs"][1:]))
    assert [a["epoch"] for a, _ in pairs] == [1, 2]
    for a, b in pairs:
        for key in ("train_loss", "val_loss"):
            assert abs(a[key] - b[key]) <= 2e-5 * b[key], (a["epoch"], key, a[key], b[key])


@pytest.mark.parametrize("argv", [["--mode", "async"], ["--dropout", "0.1"], ["--model", "lenet"],
                                  ["--precision", "bf16"], ["--layers", "x"], ["--bogus"]])
def test_the_reference_refuses_in_one_line(argv, capsys):
    assert_one_line_exit_2(gpt_reference.main, argv, capsys, gpt_reference.PROG)


def test_the_trainers_child_chooses_its_own_threads():
    """The reference starts manual_dp.train in user_environment(): what manual_dp set in this process
    is gone, what the user (or a parent process) set is kept."""
    from manual_dp.fast.runtime import user_environment
    ours = {"MANUAL_DP_SETTINGS": f"{os.getpid()}:MXNET_CPU_TEMP_COPY,OMP_NUM_THREADS", "OMP_NUM_THREADS": "1",
            "MXNET_CPU_TEMP_COPY": "4", "OPENBLAS_NUM_THREADS": "3", "HOME": "/h"}
    assert user_environment(ours) == {"OPENBLAS_NUM_THREADS": "3", "HOME": "/h"}
    given = {"MANUAL_DP_SETTINGS": "1:OMP_NUM_THREADS", "OMP_NUM_THREADS": "1"}
    assert user_environment(given) == {"OMP_NUM_THREADS": "1"}
