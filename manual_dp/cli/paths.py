"""A run's output paths, checked before any training: each can be written, none clobbers another or
the checkpoint's own files. An output named through a symbolic link is checked where the link
leads (a link into a read-only file system is refused now, not after the training)."""
import os
import stat
import tempfile
from pathlib import Path

from .. import checkpoint
from ..errors import UsageError
from . import config_file

PATH_MAX = 4096                 # Linux's longest path, with its final NUL
LONGEST_INSIDE = 40             # the longest name written in a checkpoint directory (.checkpoint-XXXXXXXX.tmp)


def writable(directory, flag):
    """UsageError unless a file can be created (and removed) in `directory`."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise UsageError(f"{flag}: cannot write in {directory} ({e.strerror})") from None


def check_outputs(cfg):
    """Refuse, before any training, output paths that cannot be written or would clobber each
    other; create the checkpoint directory. A path the system refuses to look at (too long, a
    name it cannot hold, a symlink loop) is bad input too."""
    try:
        check_output_paths(cfg)
    except OSError as e:
        raise UsageError(f"an output path cannot be used: {e.strerror} ({str(e.filename)[:60]}...)") from None
    except RuntimeError as e:                               # pathlib's resolve() on a symlink loop
        raise UsageError(f"an output path cannot be used: {str(e)[:100]}") from None


def make_directory(d):
    """mkdir -p `d`, one level at a time (pathlib's recursion fails on a path of thousands of levels)."""
    missing = []
    while not d.exists() and d != d.parent:
        missing.append(d)
        d = d.parent
    for level in reversed(missing):
        level.mkdir(exist_ok=True)


def check_checkpoint_dir(cfg):
    d = Path(cfg.checkpoint_dir)
    if len(os.fsencode(os.path.abspath(d))) + LONGEST_INSIDE >= PATH_MAX:
        raise UsageError(f"--checkpoint-dir {str(d)[:60]}...: its path is {len(str(d)):,} characters, too long "
                         f"for the files a checkpoint writes in it (at most {PATH_MAX - LONGEST_INSIDE - 1} in all)")
    if d.exists() and not d.is_dir():
        raise UsageError(f"--checkpoint-dir {d} is a file, not a directory")
    try:
        make_directory(d)
    except OSError as e:
        raise UsageError(f"--checkpoint-dir {d}: cannot create it ({e.strerror})") from None
    writable(d, "--checkpoint-dir")


def check_output_paths(cfg):
    if cfg.checkpoint_dir:
        check_checkpoint_dir(cfg)
    files = {flag: Path(path) for flag, path in (("--log-json", cfg.log_json), ("--trace", cfg.trace),
                                                 ("--digests", cfg.digests), ("--ledger", cfg.ledger)) if path}
    seen = {}
    for flag, path in files.items():
        target = path.resolve()                          # where the file is written, through any symlink
        if target.is_dir():
            raise UsageError(f"{flag} {path} is a directory, not a file")
        if target.exists() and not stat.S_ISREG(target.stat().st_mode):
            raise UsageError(f"{flag} {path} is not a regular file" + (f" ({target})" if target != path else ""))
        if not target.parent.is_dir():
            raise UsageError(f"{flag} {path}: the directory {target.parent} does not exist")
        if cfg.checkpoint_dir and target.parent == Path(cfg.checkpoint_dir).resolve() and (
                target.name in (checkpoint.NAME, checkpoint.LOCK) or target.name.startswith(checkpoint.TMP_PREFIX)):
            raise UsageError(f"{flag} {path} would overwrite the checkpoint's own files")
        if target in seen:
            raise UsageError(f"{flag} {path} is also {seen[target]}'s file: give each output its own path")
        seen[target] = flag
        writable(path.parent, flag)
        if target.parent != path.parent.resolve():
            writable(target.parent, f"{flag} {path} (a link to {target})")
    for flag, path in config_file.paths(cfg):        # the resolved settings beside the log, in the checkpoint directory
        if path.is_dir():
            raise UsageError(f"{flag}: {path}, where its run's settings go, is a directory")
        if path.resolve() in seen:
            raise UsageError(f"{flag}: {path}, where its run's settings go, is also {seen[path.resolve()]}'s file: "
                             f"give each output its own path")
        seen[path.resolve()] = f"{flag}'s settings"
