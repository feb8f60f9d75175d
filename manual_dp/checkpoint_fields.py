"""What each field of a checkpoint's metadata may hold, checked before any of it is used: a
checkpoint is input from outside, and a valid checksum says only that nothing changed since it was
written, not that what was written makes sense.

    epoch       a whole number >= 0, the length of the history
    t           updates taken, a whole number from 0 to 2**53
    history     one record per epoch, the i-th saying epoch i + 1, its numbers finite
    config      the run's settings: names to numbers, strings, booleans or nothing
    rng_state   numpy's PCG64 state, as bit_generator.state gives it
    n_params, n_opt, n_extra    how many arrays of each kind the file holds
    model_file  (a run of --model PATH.py:FUNCTION) the file's path and SHA-256
    cursor      (a checkpoint taken mid-epoch) where epoch `epoch` + 1 stands: batches taken, the
                sums of their losses and correct predictions, examples seen, seconds
"""
import json
import re

MAX_META_BYTES = 64 << 20       # the metadata at most (a long run's history: about 2 kB an epoch)
MAX_DEPTH = 12                  # nesting of the metadata at most (a history record's memory table: 4)
MAX_T = 2 ** 53                 # updates at most (JSON's exact integers)
MAX_SETTING = 4096              # characters of a setting's value at most (a path)
RECORD_NUMBERS = ("train_loss", "train_acc", "test_acc", "epoch_sec", "images_per_sec")
NAME = re.compile(r"[A-Za-z0-9_]{1,64}")
HEX64 = re.compile(r"[0-9a-f]{64}")


def whole(value, low=0, high=None):
    """Whether `value` is an int (not a bool) from `low` to `high`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)


def depth(value):
    """How deeply `value` (parsed JSON) nests lists and dicts, counted without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def problem(meta):
    """What is wrong with the metadata's fields, in a few words; None if nothing."""
    if depth(meta) > MAX_DEPTH:
        return f"damaged: its metadata nests more than {MAX_DEPTH} levels deep"
    return (counts_problem(meta) or history_problem(meta["history"], meta["epoch"])
            or config_problem(meta["config"]) or rng_problem(meta["rng_state"]) or model_file_problem(meta)
            or cursor_problem(meta.get("cursor")))


def counts_problem(meta):
    if not whole(meta["epoch"]):
        return f"damaged: its epoch {meta['epoch']} is negative"
    if not whole(meta["t"], 0, MAX_T):
        return f"damaged: its update count {meta['t']} is not from 0 to 2**53"
    if not whole(meta["n_params"]) or not all(whole(n, 0, 64) for n in meta["n_opt"]):
        return "damaged: its array counts (n_params, n_opt) are not small whole numbers"
    if not all(isinstance(k, str) and NAME.fullmatch(k) and whole(n) for k, n in meta["n_extra"].items()):
        return "damaged: its extra arrays (n_extra) are not names with whole-number counts"
    return None


def history_problem(history, epoch):
    if len(history) != epoch:
        return f"damaged: it holds {len(history)} epoch record(s) after epoch {epoch}"
    for i, r in enumerate(history):
        if not isinstance(r, dict) or r.get("epoch") != i + 1 or isinstance(r.get("epoch"), bool):
            return f"damaged: its history's record {i + 1} is not the record of epoch {i + 1}"
        bad = [k for k in RECORD_NUMBERS if k in r and not (
            isinstance(r[k], (int, float)) and not isinstance(r[k], bool) and abs(r[k]) < float("inf"))]
        if bad:
            return f"damaged: epoch {i + 1}'s {bad[0]} is {str(r[bad[0]])[:20]!r}, not a finite number"
    try:
        json.dumps(history, allow_nan=False)
    except ValueError:
        return "damaged: its history holds values that are not finite"
    return None


def config_problem(config):
    for k, v in config.items():
        if not (v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= MAX_SETTING)):
            return f"damaged: its setting {k[:40]!r} holds a {type(v).__name__}, not a value a flag takes"
    return None


def rng_problem(state):
    """Whether `state` is a PCG64 state numpy will take, checked field by field."""
    inner = state.get("state")
    if (set(state) != {"bit_generator", "state", "has_uint32", "uinteger"} or state["bit_generator"] != "PCG64"
            or not isinstance(inner, dict) or set(inner) != {"state", "inc"}
            or not all(whole(inner[k], 0, 2 ** 128 - 1) for k in inner)
            or not whole(state["has_uint32"], 0, 1) or not whole(state["uinteger"], 0, 2 ** 32 - 1)):
        return "damaged: its random-number state is not a PCG64 generator's"
    return None


def model_file_problem(meta):
    f = meta.get("model_file")
    if f is None:
        return None
    if not (isinstance(f, dict) and set(f) == {"path", "sha256"} and isinstance(f["path"], str)
            and len(f["path"]) <= MAX_SETTING and isinstance(f["sha256"], str) and HEX64.fullmatch(f["sha256"])):
        return "damaged: its model file's path and SHA-256 (model_file) are malformed"
    return None


def cursor_problem(cursor):
    """Whether a mid-epoch checkpoint's cursor is one loop.Cursor wrote."""
    if cursor is None:
        return None
    numbers = ("loss", "correct", "sec")
    if not (isinstance(cursor, dict) and set(cursor) == {"batches", "seen", *numbers}
            and whole(cursor["batches"], 1, MAX_T) and whole(cursor["seen"], 1, MAX_T)
            and all(isinstance(cursor[k], (int, float)) and not isinstance(cursor[k], bool)
                    and 0 <= cursor[k] < float("inf") for k in numbers)):
        return "damaged: its place in the epoch (cursor) is not batches, examples and finite sums"
    return None
