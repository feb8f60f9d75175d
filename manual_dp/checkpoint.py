"""Checkpoints: everything needed to continue a run, checked as a whole when read back.

    save    writes a temporary file of its own name in the directory, fsyncs it and renames it over
            checkpoint.npz: a crash or a full disk leaves the previous checkpoint, never half of one
    load    refuses, with one line, a file that is not a checkpoint, was damaged or changed (a
            SHA-256 of every array and of the metadata is stored inside), or holds arrays of the
            wrong shape or type, or values that are not finite; and, before reading any of it, a
            path that is no regular file (a symlink, a FIFO), compressed members, arrays claiming
            more bytes than the file holds, metadata too large or too deeply nested. Every field
            of the metadata is checked (manual_dp.checkpoint_fields) before it is used.
    lock    one run at a time per directory (an flock, released when the process ends, however),
            on a .lock that is a regular file of the directory, never followed through a symlink

`python -m manual_dp.checkpoint DIR [--export FILE.params]` reads one outside the trainer: what it
holds (model, the layout it was saved in, epoch and update, every tensor, its digest), and writes
its parameters as an MXNet .params file (mx.nd.save of {name: array}; a user's block's names are
Gluon's own, "2.weight", so that block.load_parameters(FILE) loads them).
"""
import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import stat
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from . import checkpoint_fields
from .errors import CheckpointError
from .lesson import lenet_shapes

NAME = "checkpoint.npz"
LOCK = ".lock"
TMP_PREFIX = ".checkpoint-"


def digest(meta, arrays):
    """SHA-256 of the metadata (without its own digest) and of every array, by name."""
    h = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "sha256"}, sort_keys=True).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def save(directory, model_state, meta):
    """Write {directory}/checkpoint.npz atomically; CheckpointError (the previous file kept) if the
    disk is full, read-only or otherwise refuses."""
    directory = Path(directory)
    arrays = {f"param_{i}": p for i, p in enumerate(model_state["params"])}
    for i, st in enumerate(model_state["opt_state"]):
        arrays.update({f"opt_{i}_{j}": s for j, s in enumerate(st)})
    extra = model_state.get("extra", {})
    for name, values in extra.items():
        arrays.update({f"extra_{name}_{i}": v for i, v in enumerate(values)})
    meta = dict(meta, t=model_state["t"], n_params=len(model_state["params"]),
                n_opt=[len(st) for st in model_state["opt_state"]],
                n_extra={name: len(values) for name, values in extra.items()})
    meta["sha256"] = digest(meta, arrays)
    tmp = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=TMP_PREFIX, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / NAME)
        tmp = None
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        raise CheckpointError(f"could not write a checkpoint in {directory} ({e.strerror}); "
                              f"the previous one is kept") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def load(directory):
    """(model_state, meta) from {directory}/checkpoint.npz, checked; CheckpointError if anything is off."""
    path = Path(directory) / NAME
    if not os.path.lexists(path):
        raise CheckpointError(f"--resume: no checkpoint at {path}")
    try:
        with open_regular(path) as f:
            problem = members_problem(f)
            if problem:
                raise CheckpointError(f"{path}: {problem}")
            f.seek(0)
            with np.load(f, allow_pickle=False) as z:
                meta = json.loads(z["meta"].tobytes().decode())
                arrays = {name: z[name] for name in z.files if name != "meta"}
    except (OSError, ValueError, KeyError, EOFError, UnicodeDecodeError, RecursionError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path}: unreadable checkpoint ({type(e).__name__}: {str(e)[:100]})") from None
    problem = check(meta, arrays)
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    params = [arrays[f"param_{i}"] for i in range(meta["n_params"])]
    opt = [[arrays[f"opt_{i}_{j}"] for j in range(n)] for i, n in enumerate(meta["n_opt"])]
    extra = {name: [arrays[f"extra_{name}_{i}"] for i in range(n)] for name, n in meta["n_extra"].items()}
    return {"params": params, "opt_state": opt, "t": meta["t"], "extra": extra}, meta


def open_regular(path):
    """`path` opened for reading if it is a regular file, never through a symlink (nor blocking on
    a FIFO); CheckpointError saying what it is otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:                       # the name is a symlink (dangling, a loop or not)
            raise CheckpointError(f"{path} is a symbolic link: a checkpoint is read only from a regular file "
                                  f"of its directory (copy the file there)") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise CheckpointError(f"{path} is {kind}, not a checkpoint file")
    return os.fdopen(fd, "rb")


def members_problem(f):
    """What makes the zip file `f` unsafe to read as np.savez's (each member stored uncompressed, its
    array's header claiming no more bytes than the member holds, the metadata bounded), or None."""
    with zipfile.ZipFile(f) as zf:
        for info in zf.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                return f"not a manual_dp checkpoint ({info.filename} is compressed)"
            if info.filename == "meta.npy" and info.file_size > checkpoint_fields.MAX_META_BYTES:
                return (f"damaged: its metadata is {info.file_size:,} bytes "
                        f"(at most {checkpoint_fields.MAX_META_BYTES:,})")
            with zf.open(info) as member:
                version = np.lib.format.read_magic(member)
                if version not in ((1, 0), (2, 0)):
                    return f"not a manual_dp checkpoint ({info.filename}: .npy format {version})"
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(member)
            if dtype.hasobject or math.prod(shape) * dtype.itemsize > info.file_size:
                return f"damaged: its array {info.filename} claims {shape} {dtype}, more than the file holds"
    return None


SCHEMA = {"epoch": int, "t": int, "history": list, "config": dict, "rng_state": dict, "n_params": int,
          "n_opt": list, "n_extra": dict, "sha256": str}


def check(meta, arrays):
    """What is wrong with a checkpoint's contents, in a few words; None if nothing."""
    if not isinstance(meta, dict):
        return "not a manual_dp checkpoint (no metadata)"
    if "sha256" not in meta:
        return "written by an older manual_dp (no checksum): start a new run or use that version"
    for key, kind in SCHEMA.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            return f"damaged: '{key}' is missing or not of type {kind.__name__}"
    problem = checkpoint_fields.problem(meta)
    if problem:
        return problem
    if digest(meta, arrays) != meta["sha256"]:
        return "damaged or changed since it was written (checksum mismatch)"
    shapes = described_shapes(meta)
    if isinstance(shapes, str):
        return shapes
    if meta["n_params"] != len(shapes) or len(meta["n_opt"]) != len(shapes):
        return f"holds {meta['n_params']} parameters, its model has {len(shapes)}"
    for i, (name, shape) in enumerate(shapes):
        for key in [f"param_{i}"] + [f"opt_{i}_{j}" for j in range(meta["n_opt"][i])]:
            a = arrays.get(key)
            if a is None or a.shape != shape or a.dtype != np.float32:
                got = "missing" if a is None else f"{a.dtype} {a.shape}"
                return f"{name} ({key}) is {got}, expected float32 {shape}"
            if not np.isfinite(a).all():
                return f"{name} ({key}) holds values that are not finite (the run it came from diverged)"
    for name, n in meta["n_extra"].items():
        for key in (f"extra_{name}_{i}" for i in range(n)):
            a = arrays.get(key)
            if a is None or a.dtype.kind not in "biuf" or (a.dtype.kind == "f" and not np.isfinite(a).all()):
                return f"its {name} state ({key}) is " + ("missing" if a is None else "not finite numbers")
    return None


def described_shapes(meta):
    """[(name, shape)] of the model the checkpoint describes (models.Model.describe; a checkpoint
    written before models existed holds LeNet of its width), or what is wrong, in a few words."""
    if "model" not in meta:
        width = meta["config"].get("width", 1)
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            return f"damaged: its width {width!r} is not a positive integer"
        return lenet_shapes(width)
    table = meta["model"].get("params") if isinstance(meta["model"], dict) else None
    if not isinstance(table, list) or not all(
            isinstance(row, list) and len(row) == 2 and isinstance(row[0], str) and isinstance(row[1], list)
            and len(row[1]) <= 32 and all(checkpoint_fields.whole(d, 0, 2 ** 40) for d in row[1]) for row in table):
        return "damaged: its model description is not a table of parameter names and shapes"
    return [(name, tuple(shape)) for name, shape in table]


@contextlib.contextmanager
def lock(directory):
    """Hold the directory's lock inside the with-block (or until the process ends, however it ends);
    CheckpointError naming the process that holds it. Left-over temporary files of a killed run are
    removed once the lock is ours."""
    directory = Path(directory)
    try:
        fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        raise CheckpointError(f"{directory / LOCK}: cannot be the run's lock ("
                              + ("a symbolic link, never written through" if e.errno == errno.ELOOP else e.strerror)
                              + "): remove it") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{directory / LOCK}: cannot be the run's lock (not a regular file): remove it")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise CheckpointError(f"{directory} is in use by another run (pid {holder}); give each run "
                              f"its own --checkpoint-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    for stale in directory.glob(TMP_PREFIX + "*.tmp"):
        stale.unlink(missing_ok=True)
    try:
        yield
    finally:
        os.close(fd)                                  # closing the last descriptor releases the flock


def summary(state, meta):
    """Lines saying what a loaded checkpoint holds."""
    model, run = meta.get("model", {"name": "lenet"}), meta["config"]
    shapes, last = described_shapes(meta), (meta["history"] or [{}])[-1]
    sizes = ", ".join(f"{k} {v}" for k, v in model.get("config", {}).items() if not isinstance(v, (dict, list)))
    opt = [s for st in state["opt_state"] for s in st]
    cursor = meta.get("cursor")
    within = f" and {cursor['batches']} batch(es) of epoch {meta['epoch'] + 1} (saved mid-epoch)" if cursor else ""
    lines = [f"epoch {meta['epoch']}{within}, update {meta['t']}, sha256 {meta['sha256'][:16]} (checked)",
             f"model {model.get('name')} ({sizes}): {sum(int(np.prod(s)) for _, s in shapes):,} parameters "
             f"in {len(shapes)} tensors",
             f"saved by --mode {last.get('mode', run.get('mode', 'sync'))} on {', '.join(last.get('devices', [])) or '?'}"
             f" (--data {run.get('data', 'fashion-mnist')}, --optimizer {run.get('optimizer')}, --lr {run.get('lr')})",
             "last epoch: " + ", ".join(f"{k} {last[k]:.4f}" for k in ("train_loss", "test_acc", "val_loss") if k in last),
             f"optimiser state: {len(opt)} arrays, {sum(a.size for a in opt):,} values"]
    return lines + [f"  {name:24} {str(tuple(shape)):18} {int(np.prod(shape)):>12,}" for name, shape in shapes]


def export(state, meta, path):
    """Write the parameters to `path` as mx.nd.save({name: array}), atomically; CheckpointError if
    `path` exists (nothing is overwritten) or cannot be written."""
    import mxnet as mx
    path = Path(path)
    if os.path.lexists(path):
        raise CheckpointError(f"--export {path}: exists; choose another path (nothing is overwritten)")
    arrays = {name: mx.nd.array(p) for (name, _), p in zip(described_shapes(meta), state["params"])}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        mx.nd.save(str(tmp), arrays)
        os.replace(tmp, path)
    except (OSError, mx.base.MXNetError) as e:
        Path(tmp).unlink(missing_ok=True)
        raise CheckpointError(f"--export {path}: cannot be written ({str(e).strip().splitlines()[0][:100]})") from None


def main(argv=None):
    import sys
    from .cli.options import OneLineParser
    from .cli.output import fail
    from .errors import UsageError
    p = OneLineParser(prog="python -m manual_dp.checkpoint", description="What a checkpoint holds; its parameters as a .params file.")
    p.add_argument("directory", help="a --checkpoint-dir")
    p.add_argument("--export", metavar="FILE.params", help="write the parameters as an MXNet .params file")
    try:
        args = p.parse_args(argv)
        if not os.path.lexists(Path(args.directory) / NAME):
            raise CheckpointError(f"{args.directory}: holds no {NAME}")
        state, meta = load(args.directory)
        print("\n".join([f"{Path(args.directory) / NAME}:"] + summary(state, meta)))
        if args.export:
            export(state, meta, args.export)
            print(f"wrote {args.export}: {len(state['params'])} parameters (mx.nd.load reads them by name)")
    except UsageError as e:
        sys.exit(fail(e, 2, "manual_dp.checkpoint"))
    except CheckpointError as e:
        sys.exit(fail(e, 1, "manual_dp.checkpoint"))


if __name__ == "__main__":
    main()
