"""The data contract: what a data set hands the trainer, and what a model declares it reads.

A data set is two splits of arrays and a Spec:

    X      float32 (N, *spec.shape): one example per row. Values (images, vectors), or token ids
           below spec.vocab held as whole floats (MXNet's Embedding reads float indices, and every
           strategy moves X as it moves images: split in rows over the contexts and processes,
           as the lesson's split_and_load does)
    y      int32 (N,): the class of each example, below spec.classes; or, for the task
           "next-token", int32 (N, T): the token after each of the example's T tokens
    spec   shape, classes, vocab (0: values, not tokens), the task ("classify": one class per
           example; "next-token": one per position, classes = vocab) and the classes' names
           (a corpus's: the text of each token, `text` saying whether they are bytes or chars)

A model reads a Spec (models.build(..., spec=)), refusing in one line one it cannot read; the
trainer, the strategies and the loop read only X and y. `check` holds a data set to its Spec before
any work, so bad data ends in one line (DataError) rather than deep inside MXNet.
"""
from dataclasses import dataclass

import numpy as np

from ..errors import DataError


@dataclass(frozen=True)
class Spec:
    """One example as a model reads it (see the module docstring)."""
    shape: tuple
    classes: int
    vocab: int = 0
    task: str = "classify"
    names: tuple = ()
    text: str = ""              # a corpus's tokens: "bytes" (ids are byte values) or "chars" (names[i] is a character)

    @property
    def targets(self):
        """The shape of one example's target: () a class, (T,) the next token at each position."""
        return tuple(self.shape) if self.task == "next-token" else ()

    @property
    def tokens(self):
        """Whether an example is a sequence of token ids (below vocab), not values."""
        return self.vocab > 0

    def describe(self):
        """A few words on what an example is: "(1, 28, 28) values, 10 classes"."""
        what = f"{self.shape[0]} tokens of {self.vocab}" if self.tokens else f"{self.shape} values"
        return f"{what}, the next token at each" if self.task == "next-token" else f"{what}, {self.classes} classes"


@dataclass
class Dataset:
    """A data set under the contract: its Spec, (X, y) of each split, and where it came from."""
    spec: Spec
    train: tuple
    test: tuple
    label: str

    def cut(self, train_size=None, test_size=None):
        """The data set with only the first train_size and test_size examples of its splits."""
        (Xtr, ytr), (Xte, yte) = self.train, self.test
        return Dataset(self.spec, (Xtr[:train_size], ytr[:train_size]), (Xte[:test_size], yte[:test_size]),
                       self.label)


def check(dataset):
    """Returns once both splits hold to the data set's Spec; else DataError in one line naming the
    split and what is wrong (shape, dtype, a label or token out of range, a value not finite)."""
    spec = dataset.spec
    for split, (X, y) in (("train", dataset.train), ("test", dataset.test)):
        where = f"{dataset.label} ({split})"
        if X.dtype != np.float32 or y.dtype != np.int32:
            raise DataError(f"{where}: inputs must be float32 and labels int32, got {X.dtype} and {y.dtype}")
        if X.shape[1:] != tuple(spec.shape) or y.shape != (len(X),) + spec.targets:
            raise DataError(f"{where}: inputs {X.shape} and labels {y.shape} do not hold one example of "
                            f"{tuple(spec.shape)} and one label {spec.targets or ''} per row")
        if len(X) and (y.min() < 0 or y.max() >= spec.classes):
            raise DataError(f"{where}: a label outside 0..{spec.classes - 1}")
        if not np.isfinite(X).all():
            raise DataError(f"{where}: an input that is not a finite number")
        if spec.tokens and len(X) and (X.min() < 0 or X.max() >= spec.vocab or (X != np.round(X)).any()):
            raise DataError(f"{where}: a token id that is not a whole number in 0..{spec.vocab - 1}")


def batches(X, y, batch_size, rng=None):
    """Yield (X_batch, y_batch) numpy slices; shuffled by `rng` when given; keeps the last short batch."""
    order = rng.permutation(len(X)) if rng is not None else None
    for start in range(0, len(X), batch_size):
        if order is None:
            yield X[start:start + batch_size], y[start:start + batch_size]
        else:
            idx = order[start:start + batch_size]
            yield X[idx], y[idx]
