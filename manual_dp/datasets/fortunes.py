"""Debian's `fortunes` package as a classification set: which category file a fortune comes from
(seed 000's task: a text classifier over the largest categories).

A category file holds fortunes separated by lines that are a lone "%" (the `.dat` files beside them
are strfile's indexes, the `.u8` names links). A fortune becomes its first `seq_len` bytes, as token
ids 1..255 (a NUL byte is refused), padded on the left with 0, so that a recurrent model's last step
reads its last byte. The split is fixed by the files alone: every FORTUNES["test_every"]-th fortune
of each category is a test example, in file order.
"""
from pathlib import Path

import numpy as np

from ..config import FORTUNES
from ..errors import DataError
from .contract import Dataset, Spec

VOCAB = 256                 # byte values; 0 pads


def directory(path=None):
    """(the folder of category files, a label for it): `path` if given, else Debian's package."""
    where = Path(path or FORTUNES["directory"])
    label = f"fortunes {where}" if path else f"Debian's fortunes package {where}"
    if not where.is_dir():
        how = "" if path else " (apt-get install -y fortunes, or give --data fortunes:DIR)"
        raise DataError(f"{label} {'is not a directory' if where.exists() else 'does not exist'}{how}")
    return where, label


def category_files(where):
    """The category files of `where`, by name: regular files that are not strfile's .dat indexes."""
    return sorted(p for p in where.iterdir() if p.is_file() and not p.is_symlink() and p.suffix != ".dat")


def read_category(path):
    """The fortunes (bytes, stripped, non-empty) of one category file; DataError naming it if it
    cannot be read or holds a NUL byte."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})") from None
    if b"\0" in raw:
        raise DataError(f"{path}: holds a NUL byte, not text")
    parts, current = [], []
    for line in raw.split(b"\n"):
        if line.rstrip(b"\r") == b"%":
            parts.append(b"\n".join(current))
            current = []
        else:
            current.append(line)
    parts.append(b"\n".join(current))
    return [p.strip() for p in parts if p.strip()]


def categories(where, k):
    """[(name, fortunes)] of the k categories with the most fortunes (ties by name), largest first."""
    found = [(p.name, read_category(p)) for p in category_files(where)]
    found = [(name, items) for name, items in found if items]
    if len(found) < 2:
        raise DataError(f"{where}: {len(found)} category file(s) with fortunes; a classifier needs 2 or more")
    return sorted(found, key=lambda c: (-len(c[1]), c[0]))[:k]


def encode(text, seq_len):
    """The token ids (seq_len,) float32 of `text`'s first seq_len bytes, left-padded with 0."""
    ids = np.frombuffer(text[:seq_len], dtype=np.uint8).astype(np.float32)
    return np.concatenate([np.zeros(seq_len - len(ids), np.float32), ids])


def load(path, seq_len):
    """The fortunes of the largest FORTUNES["categories"] categories as a Dataset of seq_len bytes."""
    where, label = directory(path)
    chosen = categories(where, FORTUNES["categories"])
    rows = {"train": ([], []), "test": ([], [])}
    for c, (_, items) in enumerate(chosen):
        for i, text in enumerate(items):
            X, y = rows["test" if i % FORTUNES["test_every"] == FORTUNES["test_every"] - 1 else "train"]
            X.append(encode(text, seq_len))
            y.append(c)
    split = {name: (np.stack(X).astype(np.float32) if X else np.zeros((0, seq_len), np.float32),
                    np.array(y, dtype=np.int32)) for name, (X, y) in rows.items()}
    names = tuple(name for name, _ in chosen)
    return Dataset(Spec((seq_len,), len(chosen), VOCAB, names=names), split["train"], split["test"],
                   f"{label}: {len(chosen)} categories ({', '.join(names)})")
