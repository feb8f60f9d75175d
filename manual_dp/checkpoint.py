"""Atomic checkpoints: everything needed to continue a run, written to a temporary file and renamed."""
import json
import os
import zipfile
from pathlib import Path

import numpy as np

NAME = "checkpoint.npz"


from .errors import CheckpointError


def save(directory, model_state, meta):
    """Write {directory}/checkpoint.npz atomically: a crash leaves the old file or the new, never half."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {f"param_{i}": p for i, p in enumerate(model_state["params"])}
    for i, st in enumerate(model_state["opt_state"]):
        arrays.update({f"opt_{i}_{j}": s for j, s in enumerate(st)})
    extra = model_state.get("extra", {})
    for name, values in extra.items():
        arrays.update({f"extra_{name}_{i}": v for i, v in enumerate(values)})
    meta = dict(meta, t=model_state["t"], n_params=len(model_state["params"]),
                n_opt=[len(st) for st in model_state["opt_state"]],
                n_extra={name: len(values) for name, values in extra.items()})
    tmp = directory / (NAME + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / NAME)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load(directory):
    """(model_state, meta) from {directory}/checkpoint.npz."""
    path = Path(directory) / NAME
    if not path.is_file():
        raise CheckpointError(f"--resume: no checkpoint at {path}")
    try:
        with np.load(path) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            params = [z[f"param_{i}"] for i in range(meta["n_params"])]
            opt = [[z[f"opt_{i}_{j}"] for j in range(n)] for i, n in enumerate(meta["n_opt"])]
            extra = {name: [z[f"extra_{name}_{i}"] for i in range(n)]
                     for name, n in meta.get("n_extra", {}).items()}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path}: unreadable checkpoint ({e})") from None
    return {"params": params, "opt_state": opt, "t": meta["t"], "extra": extra}, meta
