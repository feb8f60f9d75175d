"""Issue 41, item 4, the output paths' part: a lock that is a symlink is never written through, a
--checkpoint-dir of thousands of characters is used or refused in one line, outputs that lead
(through a symlink) where nothing can be written are refused before any training with exit 2, and
a resumed run whose --model file was edited says so."""
import tempfile
import textwrap
from pathlib import Path

import pytest

from manual_dp import checkpoint
from conftest import run_main

TINY = ["--train-size", "100", "--test-size", "64", "--batch-size", "32", "--no-progress", "--epochs", "1",
        "--cpus", "1"]


def test_a_lock_that_is_a_symlink_is_refused_and_never_written_through(capsys, data_dir, tmp_path):
    outside, ck = tmp_path / "outside.txt", tmp_path / "ck"
    outside.write_text("keep")
    ck.mkdir()
    (ck / checkpoint.LOCK).symlink_to(outside)
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--checkpoint-dir", str(ck)])
    assert code == 1 and len(err) == 1 and "a symbolic link, never written through" in err[0], err
    assert outside.read_text() == "keep" and not (ck / checkpoint.NAME).exists() and "epoch 1" not in out


def remove_deep(top, levels):
    """Remove `levels` nested directories x/x/... under `top` and their files, deepest first (rmtree
    recurses, and fails on such a tree: pytest's own clean-up of its temporary directories too)."""
    d = Path(top, *["x"] * levels)
    while d != Path(top).parent:
        if d.is_dir():
            for f in d.iterdir():
                if not f.is_dir():
                    f.unlink()
            d.rmdir()
        d = d.parent


def test_a_checkpoint_dir_thousands_of_levels_deep_is_used_and_one_too_long_refused(capsys, data_dir, monkeypatch):
    top = tempfile.mkdtemp(prefix="manual_dp-deep-")       # outside pytest's directories, removed here
    monkeypatch.chdir(top)
    try:
        deep = "x/" * 1200                       # 1,200 levels (pathlib's mkdir recursed once a level)
        code, _, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--checkpoint-dir", deep])
        assert code == 0 and (Path(top) / deep / checkpoint.NAME).is_file(), err[-3:]
        code, _, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--checkpoint-dir", "y/" * 2100])
        assert code == 2 and len(err) == 1 and "too long" in err[0], err[-3:]
    finally:
        monkeypatch.undo()
        remove_deep(top, 1200)
    assert not Path(top).exists()


@pytest.mark.parametrize("flag", ["--log-json", "--digests", "--trace"])
def test_an_output_linked_where_nothing_can_be_written_is_refused_before_training(capsys, data_dir, tmp_path, flag):
    link = tmp_path / "out.json"
    link.symlink_to("/proc/self/out.json")                 # no file can be made in /proc, even by root
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--epochs", "3", flag, str(link)])
    assert code == 2 and len(err) == 1 and f"{flag} {link} (a link to /proc/" in err[0], err
    assert "epoch 1" not in out and link.is_symlink()


BLOCK = """
from mxnet.gluon import nn

def net():
    b = nn.HybridSequential()
    b.add(nn.Dense(16, activation="{act}"), nn.Dense(10))
    return b
"""


def test_resuming_after_the_model_file_was_edited_says_so_in_one_line(capsys, data_dir, tmp_path):
    block = tmp_path / "block.py"
    block.write_text(textwrap.dedent(BLOCK.format(act="relu")))
    argv = ["--data-dir", str(data_dir), *TINY, "--model", f"{block}:net", "--checkpoint-dir", str(tmp_path / "ck")]
    assert run_main(capsys, argv)[0] == 0
    block.write_text(textwrap.dedent(BLOCK.format(act="tanh")))          # the same shapes, another model
    code, out, err = run_main(capsys, [*argv, "--epochs", "2", "--resume"])
    assert code == 0 and "resumed" in out and "epoch 2/2" in out, err
    assert len(err) == 1 and "warning" in err[0] and f"{block} changed since the checkpoint" in err[0], err
