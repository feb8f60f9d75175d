"""The user's own arrays, `--data npz:PATH`: a NumPy .npz file holding X and y, and optionally
X_test and y_test (without them every tenth row is held out for the test, in order).

X is (N, ...) of numbers: floats are values (images, vectors), integers token ids (the vocabulary
their largest + 1); y is (N,) of whole class numbers from 0. For a language model (--model gpt)
X is (N, T) token ids and y (N, T) the token after each (the vocabulary the largest of both + 1).
Nothing is pickled: a file that needs pickle to load is refused.
"""
import zipfile

import numpy as np

from ..errors import DataError
from .contract import Dataset, Spec

HELD_OUT = 10               # without X_test: every HELD_OUT-th row is a test example


def read(path):
    """{name: array} of the .npz file at `path`; DataError in one line if it cannot be read."""
    try:
        with np.load(path, allow_pickle=False) as f:
            return {name: f[name] for name in f.files}
    except FileNotFoundError:
        raise DataError(f"--data npz:{path}: no such file") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f"--data npz:{path}: not a readable .npz file without pickles ({e})") from None


def labels(y, where, ndim=1):
    """y as int32, or DataError unless it is one whole class number from 0 per row (ndim 2: per
    position of a row)."""
    if y.ndim != ndim or not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
        what = "one class number per row" if ndim == 1 else "(N, T) like X, the next token at each position (y of X's shape)"
        raise DataError(f"{where}: y must be {what}, got {y.dtype} {y.shape}")
    if len(y) and (not np.isfinite(y).all() or (y != np.round(y)).any() or y.min() < 0):
        raise DataError(f"{where}: y must hold whole class numbers from 0")
    return y.astype(np.int32)


def inputs(X, where):
    """X as float32, and whether it holds token ids (integers); DataError unless numbers."""
    if X.ndim < 2 or not (np.issubdtype(X.dtype, np.integer) or np.issubdtype(X.dtype, np.floating)):
        raise DataError(f"{where}: X must be (N, ...) numbers with one example per row, got {X.dtype} {X.shape}")
    return X.astype(np.float32), np.issubdtype(X.dtype, np.integer)


def load(path, task="classify"):
    """The arrays of `path` as a Dataset for the task "classify" or "next-token" (see the module
    docstring)."""
    arrays, where = read(path), f"--data npz:{path}"
    ndim = 2 if task == "next-token" else 1
    missing = [k for k in ("X", "y") if k not in arrays]
    if missing or ("X_test" in arrays) != ("y_test" in arrays):
        raise DataError(f"{where}: needs arrays X and y (and X_test with y_test, or neither); it holds "
                        f"{', '.join(sorted(arrays)) or 'none'}")
    (X, tokens), y = inputs(arrays["X"], where), labels(arrays["y"], where, ndim)
    if len(X) != len(y) or len(X) == 0:
        raise DataError(f"{where}: {len(X)} inputs and {len(y)} labels: one label per input, at least one example")
    if "X_test" in arrays:
        (Xt, test_tokens), yt = inputs(arrays["X_test"], where + " X_test"), labels(arrays["y_test"], where + " y_test", ndim)
        if test_tokens != tokens:
            raise DataError(f"{where}: X holds {'integers' if tokens else 'floats'} but X_test does not")
    else:
        held = np.arange(len(X)) % HELD_OUT == HELD_OUT - 1
        X, y, Xt, yt = X[~held], y[~held], X[held], y[held]
    if len(Xt) != len(yt):
        raise DataError(f"{where}: {len(Xt)} test inputs and {len(yt)} labels: one label per input")
    vocab = int(max(X.max(), Xt.max() if Xt.size else 0)) + 1 if tokens else 0
    classes = int(max(y.max(), yt.max() if yt.size else 0)) + 1
    if ndim == 2:
        if not tokens or y.shape != X.shape or yt.shape != Xt.shape:
            raise DataError(f"{where}: a language model reads X (N, T) integer token ids and y of X's shape, the "
                            f"next token at each position; got X {X.dtype} {X.shape}, y {y.shape}")
        vocab = classes = max(vocab, classes)
    return Dataset(Spec(tuple(X.shape[1:]), classes, vocab, task), (X, y), (Xt, yt),
                   f"{where} ({len(X)} + {len(Xt)} examples of {tuple(X.shape[1:])})")
