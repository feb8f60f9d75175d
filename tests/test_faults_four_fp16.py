"""Issue 41, item 7: divergence under --precision fp16 ends like fp32's and bf16's, with exit 3, one
line and the last good checkpoint kept: a parameter past fp16's range (every product reading it
overflows), and an epoch whose every update overflowed and was skipped (the model has not trained)."""
import json

import numpy as np

from manual_dp import checkpoint
from conftest import run_main

TINY = ["--train-size", "100", "--test-size", "64", "--batch-size", "32", "--no-progress", "--cpus", "1"]


def test_an_lr_of_1e30_diverges_under_fp16_as_under_fp32_and_bf16(capsys, data_dir):
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--epochs", "1", "--lr", "1e30",
                                       "--precision", "fp16"])
    assert code == 3 and len(err) == 1 and "training diverged at epoch 1: parameter" in err[0], err
    assert "past 65504" in err[0] and "done:" not in out


def test_a_run_whose_every_update_is_skipped_says_the_model_has_not_trained(capsys, data_dir, tmp_path):
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--epochs", "2", "--precision", "fp16",
                                       "--loss-scale", "1e30", "--checkpoint-dir", str(tmp_path / "ck")])
    assert code == 3 and len(err) == 1 and "training diverged at epoch 2" in err[0], err
    assert "every update of the run (8) overflowed fp16 and was skipped" in err[0] and "has not trained" in err[0]
    assert "epoch 1/2" in out and checkpoint.load(tmp_path / "ck")[1]["epoch"] == 1   # epoch 2's never written


def with_scale(capsys, data_dir, ck, scale):
    """The flags of a one-epoch fp16 run checkpointed in `ck`, whose checkpoint's loss scale is
    then set to `scale` (its checksum valid)."""
    argv = ["--data-dir", str(data_dir), *TINY, "--precision", "fp16", "--checkpoint-dir", str(ck)]
    assert run_main(capsys, [*argv, "--epochs", "1"])[0] == 0
    with np.load(ck / checkpoint.NAME) as z:
        meta = json.loads(z["meta"].tobytes().decode())
        arrays = {k: z[k] for k in z.files if k != "meta"}
    arrays["extra_loss_scale_0"] = np.array([scale, 0, *arrays["extra_loss_scale_0"][2:]], dtype=np.float64)
    meta["sha256"] = checkpoint.digest(meta, arrays)
    with open(ck / checkpoint.NAME, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    return argv


def test_a_loss_scale_no_run_can_hold_is_refused_on_resume(capsys, data_dir, tmp_path):
    argv = with_scale(capsys, data_dir, tmp_path / "ck", -1.0)
    code, out, err = run_main(capsys, [*argv, "--epochs", "2", "--resume"])
    assert code == 1 and len(err) == 1 and "its fp16 loss scale state [-1.0" in err[0], err


def test_fp16_divergence_keeps_the_last_good_checkpoint(capsys, data_dir, tmp_path):
    ck = tmp_path / "ck"
    argv = with_scale(capsys, data_dir, ck, 1e30)           # epoch 2 starts from a scale every update overflows at
    kept = (ck / checkpoint.NAME).read_bytes()
    code, out, err = run_main(capsys, [*argv, "--epochs", "2", "--resume"])
    assert code == 3 and len(err) == 1 and "training diverged at epoch 2" in err[0], err
    assert "the checkpoint of the last good epoch is kept" in err[0] and (ck / checkpoint.NAME).read_bytes() == kept
