"""A --trace file read back for `python -m manual_dp.timeline`, checked before any of it is used:
a regular file of at most MAX_BYTES, JSON nested no deeper than the parser goes, every event a
dict whose times are finite numbers, every trainer span naming a kind, a step, one of the trace's
contexts and (but for a forward) one of its buckets; the buckets' sizes whole numbers of bytes,
the algorithm one the cost model prices."""
import math

from .costmodel import terms
from .errors import UsageError
from .jsonfile import read_json

MAX_BYTES = 256 << 20            # a trace of a few steps: MXNet's operators and the spans, a few MB
MAX_CONTEXTS = 4096
MAX_TIME = 1e17                  # microseconds (the Unix epoch's, today ~1.7e15)
KINDS = ("forward", "backward", "allreduce", "update")


def load(path):
    """The trace at `path` as written by --trace; UsageError if it is not one."""
    try:
        trace = read_json(path, MAX_BYTES)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: not a trace written by --trace ({type(e).__name__}: {str(e)[:80]})") from None
    wrong = problem(trace)
    if wrong:
        raise UsageError(f"{path}: not a trace written by --trace ({wrong})")
    return trace


def problem(trace):
    """What is malformed in `trace`, in a few words; None if nothing."""
    meta = trace.get("otherData", {}).get("manual_dp") if isinstance(trace, dict) and isinstance(
        trace.get("otherData"), dict) else None
    if not isinstance(meta, dict):
        return "no otherData.manual_dp"
    contexts, sizes, algorithm = meta.get("contexts"), meta.get("bytes"), meta.get("algorithm", "reduce_bcast")
    if not (isinstance(contexts, list) and 0 < len(contexts) <= MAX_CONTEXTS
            and all(isinstance(c, str) for c in contexts)):
        return f"its contexts are not a list of 1 to {MAX_CONTEXTS} names"
    if not (isinstance(sizes, list) and sizes and all(whole(n, 1, 2 ** 50) for n in sizes)):
        return "its buckets' bytes are not whole numbers from 1 to 2**50"
    try:
        terms(algorithm, 2, 1)
    except (ValueError, TypeError):
        return f"its algorithm {str(algorithm)[:30]!r} is none the cost model knows"
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        return f"traceEvents is a {type(events).__name__}, not a list"
    for i, e in enumerate(events):
        wrong = event_problem(e, contexts, len(sizes))
        if wrong:
            return f"event {i}: {wrong}"
    return None


def whole(value, low, high):
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def number(value, low, high):
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and low <= value <= high)


def event_problem(e, contexts, n_buckets):
    """What is malformed in one event, or None."""
    if not isinstance(e, dict):
        return "not an object"
    if not all(isinstance(e.get(k), t) for k, t in (("ph", str), ("name", str), ("pid", (int, str))) if k in e):
        return "its ph, name or pid is of the wrong type"
    if not isinstance(e.get("tid", 0), (int, str)) or not isinstance(e.get("args", {}), dict):
        return "its tid or args is of the wrong type"
    if e.get("ph") in ("B", "E", "X") and not number(e.get("ts"), 0, MAX_TIME):
        return f"its ts {str(e.get('ts'))[:20]!r} is not a time in microseconds"
    if e.get("ph") == "X" and not number(e.get("dur"), 0, MAX_TIME):
        return f"its dur {str(e.get('dur'))[:20]!r} is not a duration in microseconds"
    if e.get("ph") == "M" and "args" in e and not isinstance(e["args"].get("name"), str):
        return "a process name that is not a string"
    if e.get("cat") == "trainer" and e.get("ph") == "X":
        a = e.get("args", {})
        if a.get("kind") not in KINDS or not whole(a.get("step"), 0, 2 ** 53) or a.get("context") not in contexts:
            return "a trainer span without a kind, a step or one of the trace's contexts"
        if a["kind"] != "forward" and not whole(a.get("bucket"), 0, n_buckets - 1):
            return f"a {a['kind']} span of no bucket of the trace's {n_buckets}"
    return None
