"""Data sets under one contract (contract.py), named by `--data NAME` or `--data KIND:PATH`:

    contract.py       the data contract: a Spec (what one example is), two splits of (X, y), check, batches
    fashion_mnist.py  fashion-mnist (the default): Fashion-MNIST's IDX files, 28x28 images, 10 classes
    fortunes.py       fortunes[:DIR]: Debian's fortunes package, a fortune's category from its bytes
    arrays.py         npz:PATH: the user's own arrays, X and y (and X_test, y_test)

`spec_of(cfg)` is what the run's model reads (models.build), `load(cfg)` the run's data, checked
against it; both end bad input in one line (DataError) before any training.
"""
import functools

from ..config import SEQ_LEN
from ..errors import DataError, UsageError
from .contract import Dataset, Spec, check

IMAGES = Spec((1, 28, 28), 10, names=("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                                      "Sneaker", "Bag", "Ankle boot"))
KINDS = ("fashion-mnist", "fortunes", "npz")      # --data KIND or KIND:PATH (npz needs its PATH)


def parse(text):
    """(kind, path or None) of a --data value; UsageError in one line for a kind there is not."""
    kind, colon, path = str(text).partition(":")
    if kind not in KINDS:
        raise UsageError(f"--data {text}: choose {', '.join(KINDS)} (fortunes:DIR, npz:PATH)")
    if kind == "npz" and not path:
        raise UsageError("--data npz needs the file: --data npz:PATH")
    if kind == "fashion-mnist" and colon:
        raise UsageError("--data fashion-mnist takes no path: give its folder with --data-dir DIR")
    return kind, path or None


def check_flags(cfg):
    """UsageError (one line) for data flags that do not apply to cfg's --data."""
    kind, _ = parse(cfg.data)
    if cfg.seq_len is not None and kind != "fortunes":
        raise UsageError(f"--seq-len applies only to --data fortunes, not --data {cfg.data}")
    if cfg.data_dir is not None and kind != "fashion-mnist":
        raise UsageError(f"--data-dir is Fashion-MNIST's folder: --data {kind} reads "
                         + ("fortunes:DIR" if kind == "fortunes" else "its PATH"))


def spec_of(cfg):
    """The Spec of cfg's data: Fashion-MNIST's without reading it, another kind's from its data."""
    return IMAGES if parse(cfg.data)[0] == "fashion-mnist" else load(cfg).spec


def load(cfg):
    """cfg's data set, all of it, checked against its Spec (loaded once per process)."""
    return read(cfg.data, cfg.data_dir, cfg.seq_len or SEQ_LEN)


@functools.lru_cache(maxsize=2)
def read(data, data_dir, seq_len):
    kind, path = parse(data)
    if kind == "fashion-mnist":
        from .fashion_mnist import load_fashion_mnist, locate_data
        directory, label = locate_data(data_dir)
        train, test = load_fashion_mnist(directory)
        dataset = Dataset(IMAGES, train, test, label)
    elif kind == "fortunes":
        from . import fortunes
        dataset = fortunes.load(path, seq_len)
    else:
        from . import arrays
        dataset = arrays.load(path)
    check(dataset)
    return dataset


__all__ = ["Dataset", "Spec", "IMAGES", "KINDS", "parse", "spec_of", "load", "DataError"]
