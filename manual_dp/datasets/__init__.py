"""Data sets under one contract (contract.py), named by `--data NAME` or `--data KIND:PATH`:

    contract.py       the data contract: a Spec (what one example is), two splits of (X, y), check, batches
    fashion_mnist.py  fashion-mnist (the default): Fashion-MNIST's IDX files, 28x28 images, 10 classes
    fortunes.py       fortunes[:DIR]: Debian's fortunes package, a fortune's category from its bytes
    corpus.py         fortunes[:DIR] and text:PATH as a language-model corpus: the next token everywhere
    arrays.py         npz:PATH: the user's own arrays, X and y (and X_test, y_test)

The task is the model's (models.TASKS): --model gpt reads the next token at every position, so
--data fortunes is then a corpus of the fortunes' text; the other models read one class an example.

`spec_of(cfg)` is what the run's model reads (models.build), `load(cfg)` the run's data, checked
against it; both end bad input in one line (DataError) before any training.
"""
import functools

from ..config import CORPUS_SEQ_LEN, NEXT_TOKEN_MODELS, SEQ_LEN, VOCABS
from ..errors import DataError, UsageError
from .contract import Dataset, Spec, check

IMAGES = Spec((1, 28, 28), 10, names=("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                                      "Sneaker", "Bag", "Ankle boot"))
KINDS = ("fashion-mnist", "fortunes", "text", "npz")   # --data KIND or KIND:PATH (text and npz need their PATH)


def parse(text):
    """(kind, path or None) of a --data value; UsageError in one line for a kind there is not."""
    kind, colon, path = str(text).partition(":")
    if kind not in KINDS:
        raise UsageError(f"--data {text}: choose {', '.join(KINDS)} (fortunes:DIR, text:PATH, npz:PATH)")
    if kind in ("text", "npz") and not path:
        raise UsageError(f"--data {kind} needs the file: --data {kind}:PATH")
    if kind == "fashion-mnist" and colon:
        raise UsageError("--data fashion-mnist takes no path: give its folder with --data-dir DIR")
    return kind, path or None


def task_of(cfg):
    """What cfg's model predicts: "next-token" (--model gpt) or "classify" (one class an example)."""
    return "next-token" if cfg.model in NEXT_TOKEN_MODELS else "classify"


def check_flags(cfg):
    """UsageError (one line) for data flags that do not apply to cfg's --data and model."""
    kind, _ = parse(cfg.data)
    corpus = task_of(cfg) == "next-token" and kind in ("fortunes", "text")
    if cfg.seq_len is not None and kind not in ("fortunes", "text"):
        raise UsageError(f"--seq-len applies only to --data fortunes or text, not --data {cfg.data}")
    if cfg.vocab is not None and not corpus:
        raise UsageError(f"--vocab applies only to a text corpus (--model gpt with --data fortunes or text:PATH)")
    if kind == "text" and task_of(cfg) != "next-token":
        raise UsageError(f"--data text is a corpus for a language model: --model gpt (--model {cfg.model} "
                         f"reads one class an example: --data npz:PATH)")
    if task_of(cfg) == "next-token" and kind == "fashion-mnist":
        raise UsageError(f"--model {cfg.model} predicts the next token of a text: give --data fortunes, "
                         f"text:PATH or npz:PATH of token ids")
    if cfg.data_dir is not None and kind != "fashion-mnist":
        raise UsageError(f"--data-dir is Fashion-MNIST's folder: --data {kind} reads "
                         + ("fortunes:DIR" if kind == "fortunes" else "its PATH"))


def spec_of(cfg):
    """The Spec of cfg's data: Fashion-MNIST's without reading it, another kind's from its data."""
    return IMAGES if parse(cfg.data)[0] == "fashion-mnist" else load(cfg).spec


def load(cfg):
    """cfg's data set, all of it, checked against its Spec (loaded once per process)."""
    task = task_of(cfg)
    return read(cfg.data, cfg.data_dir, cfg.seq_len or (CORPUS_SEQ_LEN if task == "next-token" else SEQ_LEN), task,
                cfg.vocab or VOCABS[0])


@functools.lru_cache(maxsize=2)
def read(data, data_dir, seq_len, task="classify", vocab=VOCABS[0]):
    kind, path = parse(data)
    if kind == "fashion-mnist":
        from .fashion_mnist import load_fashion_mnist, locate_data
        directory, label = locate_data(data_dir)
        train, test = load_fashion_mnist(directory)
        dataset = Dataset(IMAGES, train, test, label)
    elif kind in ("fortunes", "text") and task == "next-token":
        from . import corpus
        dataset = (corpus.load_fortunes if kind == "fortunes" else corpus.load_text)(path, seq_len, vocab)
    elif kind == "fortunes":
        from . import fortunes
        dataset = fortunes.load(path, seq_len)
    else:
        from . import arrays
        dataset = arrays.load(path, task)
    check(dataset)
    return dataset


__all__ = ["Dataset", "Spec", "IMAGES", "KINDS", "parse", "task_of", "spec_of", "load", "DataError"]
