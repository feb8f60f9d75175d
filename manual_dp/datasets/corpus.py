"""Text as a language-model corpus (`--model gpt`): the next token at every position of a window.

A corpus is one stream of token ids per split. An example is a window of seq_len + 1 tokens cut
from its split's stream at a stride of seq_len (windows share their boundary token, as nanoGPT's
`get_batch` windows do): X the first seq_len tokens, y the same shifted by one, so that y[t] is the
token after X[t]. `--train-size` and `--test-size` count these windows.

    --vocab bytes   every byte value is a token (256 of them): any file, any encoding
    --vocab chars   every distinct character of the text is a token, numbered in code-point order;
                    the text must be UTF-8. The characters are the Spec's `names`, so a checkpoint
                    (and `python -m manual_dp.sample`) can turn ids back into text

The two splits:
    fortunes[:DIR]  Debian's fortunes package (datasets/fortunes.py reads its category files, in name
                    order): every FORTUNES["test_every"]-th fortune of a file goes to the validation
                    stream, the rest to the training stream, each fortune followed by "\\n%\\n"
    text:PATH       any text file: its first 90% (TEXT_TRAIN of it) the training stream, the rest
                    the validation stream
"""
from pathlib import Path

import numpy as np

from ..config import FORTUNES, TEXT_TRAIN
from ..errors import DataError
from .contract import Dataset, Spec
from . import fortunes

END = b"\n%\n"              # after every fortune of the stream, as in the package's files


def vocabulary(streams, vocab, where):
    """(token ids of each stream, the tokens' names) for `vocab` "bytes" or "chars"; DataError if a
    stream is not UTF-8 where characters are asked for."""
    if vocab == "bytes":
        names = tuple(bytes([i]).decode("latin-1") for i in range(256))
        return [np.frombuffer(s, dtype=np.uint8).astype(np.int64) for s in streams], names
    texts = []
    for s in streams:
        try:
            texts.append(s.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: byte {e.start} is not UTF-8, which --vocab chars reads "
                            f"(--vocab bytes reads any file)") from None
    names = tuple(sorted(set("".join(texts))))
    index = {c: i for i, c in enumerate(names)}
    return [np.array([index[c] for c in t], dtype=np.int64) for t in texts], names


def windows(ids, seq_len):
    """(X (N, seq_len) float32, y (N, seq_len) int32): the windows of seq_len + 1 tokens of `ids`."""
    n = max((len(ids) - 1) // seq_len, 0)
    starts = np.arange(n) * seq_len
    rows = ids[starts[:, None] + np.arange(seq_len + 1)[None, :]] if n else np.zeros((0, seq_len + 1), np.int64)
    return rows[:, :-1].astype(np.float32), rows[:, 1:].astype(np.int32)


def corpus(streams, seq_len, vocab, where):
    """The Dataset of a (train, validation) pair of byte streams (see the module docstring)."""
    (train, test), names = vocabulary(streams, vocab, where)
    for split, ids in (("training", train), ("validation", test)):
        if len(ids) < seq_len + 1:
            raise DataError(f"{where}: its {split} text holds {len(ids)} tokens, shorter than one example of "
                            f"--seq-len {seq_len} + 1")
    spec = Spec((seq_len,), len(names), len(names), task="next-token", names=names, text=vocab)
    train, test = windows(train, seq_len), windows(test, seq_len)
    return Dataset(spec, train, test, f"{where}: {len(train[0])} + {len(test[0])} windows of {seq_len} + 1 "
                                      f"{'bytes' if vocab == 'bytes' else 'characters'}, {len(names)} tokens")


def load_fortunes(path, seq_len, vocab):
    """Debian's fortunes (or DIR's category files) as a corpus."""
    where, label = fortunes.directory(path)
    streams = ([], [])
    for f in fortunes.category_files(where):
        for i, text in enumerate(fortunes.read_category(f)):
            streams[i % FORTUNES["test_every"] == FORTUNES["test_every"] - 1].append(text + END)
    return corpus([b"".join(s) for s in streams], seq_len, vocab, label)


def load_text(path, seq_len, vocab):
    """The text file at `path` as a corpus: its first TEXT_TRAIN for training, the rest for validation."""
    where = f"--data text:{path}"
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{where}: {'not a regular file' if p.exists() else 'no such file'}")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise DataError(f"{where}: cannot be read ({e.strerror})") from None
    cut = int(len(raw) * TEXT_TRAIN)
    if vocab == "chars":            # cut on a character's first byte, never inside one
        while 0 < cut < len(raw) and raw[cut] & 0xC0 == 0x80:
            cut += 1
    return corpus([raw[:cut], raw[cut:]], seq_len, vocab, where)
