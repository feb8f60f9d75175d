"""`--ledger FILE`: per update, where every token of the batch went in each MoE block of an MoE GPT
(models/moe.py), with a digest; `python -m manual_dp.diverge A B` on two ledgers names the first
update, block and token routed differently (as it does for two --digests files, digests.py).

A header line first, then one JSON line per update:

    {"ledger": {"experts": E, "top_k": K, "capacity": C, "tokens": T, "layers": ["block0", ...]}}
    {"update": t, "examples": B, "digest": sha256, "layers": [{"name": "block0", "expert": b64,
     "slot": b64, "kept": b64, "dropped": n, "load": [first choices per expert]}, ...]}

expert (int16), slot (int32) and kept (uint8) are (B, T, K) arrays, base64 of their little-endian
bytes, example b the update's b-th in batch order (its accumulated batches one after the other),
then the position, then the choice; digest the SHA-256 of every layer's three arrays in order.
`python -m manual_dp.ledger FILE...` prints each block's balance: the most-loaded expert's share of
the first choices and the share of choices dropped, at update 1 and over the last 10 updates.

The routing is recomputed eagerly, in float32, on one context, from the parameters before the
update and the update's examples (strategies/wrappers/ledgered.py): the routing those parameters give the batch. A
layout's own forward is not tapped; since every layout routes per window, equal parameters route
alike in every layout (tests/test_moe.py checks the layouts' parameters and losses).
"""
import base64
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from .errors import OutputError

ARRAYS = (("expert", np.int16), ("slot", np.int32), ("kept", np.uint8))


def record(t, routes, E):
    """The line of update t from its batches' route_batch lists, in batch order, of E experts."""
    digest, layers = hashlib.sha256(), []
    for parts in zip(*routes):
        arrays = [np.ascontiguousarray(np.concatenate([p[1 + j] for p in parts]), dtype=kind)
                  for j, (_, kind) in enumerate(ARRAYS)]
        for a in arrays:
            digest.update(a.astype(a.dtype.newbyteorder("<")).tobytes())
        entry = {"name": parts[0][0]}
        entry.update({name: base64.b64encode(a.tobytes()).decode() for (name, _), a in zip(ARRAYS, arrays)})
        entry.update(dropped=int((arrays[2] == 0).sum()), load=np.bincount(arrays[0][..., 0].ravel(), minlength=E).tolist())
        layers.append(entry)
    return {"update": int(t), "examples": sum(len(r[0][1]) for r in routes), "digest": digest.hexdigest(), "layers": layers}


class LedgerFile:
    """The --ledger file of a run: its header, then a line per update, each one os.write."""

    def __init__(self, path, head):
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise OutputError(f"--ledger {self.path}: cannot write it ({e.strerror})") from None
        self.write(head)

    def write(self, line):
        data = (json.dumps(line) + "\n").encode()
        if os.write(self.fd, data) != len(data):
            raise OutputError(f"--ledger {self.path}: short write (disk full?)")


class LedgerError(Exception):
    """A file that is not a readable ledger (diverge: exit 2)."""


def is_ledger(path):
    """Whether the file at `path` starts as a ledger's header line does (its first bytes only: a
    damaged or huge file is the digest reader's to refuse)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(b'{"ledger": ')) == b'{"ledger": '
    except OSError:
        return False


def read(path):
    """(header, [update lines]) of a ledger file; a torn last line dropped."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise LedgerError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    try:
        head = json.loads(lines[0])["ledger"]
        body = [json.loads(line) for line in lines[1:-1]]
    except (IndexError, ValueError, KeyError, TypeError, RecursionError):
        raise LedgerError(f"{path}: not a --ledger file") from None
    try:
        body.append(json.loads(lines[-1])) if len(lines) > 1 else None
    except (ValueError, RecursionError):
        pass                                        # a run killed mid-write
    return head, body


def arrays_of(entry, shape):
    return [np.frombuffer(base64.b64decode(entry[name]), dtype=kind).reshape(shape) for name, kind in ARRAYS]


def first_difference(ra, rb, K, T):
    """(layer, example, position, what A did, what B did) of the first token routed differently."""
    for la, lb in zip(ra["layers"], rb["layers"]):
        a, b = arrays_of(la, (-1, T, K)), arrays_of(lb, (-1, T, K))
        apart = np.nonzero(np.any([(x != y).any(-1) for x, y in zip(a, b)], axis=0))
        if len(apart[0]):
            i, t = int(apart[0][0]), int(apart[1][0])

            def says(e, s, k):
                return ", ".join(f"expert {e[i, t, j]} slot {s[i, t, j]}" + ("" if k[i, t, j] else " (dropped)")
                                 for j in range(K))
            return la["name"], i, t, says(*a), says(*b)
    return None


def compare(path_a, path_b):
    """(status, message): 0 where both ledgers route every common update alike, 1 where they part;
    LedgerError (one line) for files that are not ledgers, or damaged ones."""
    (ha, a), (hb, b) = read(path_a), read(path_b)
    if ha != hb:
        raise LedgerError(f"the ledgers are of different MoEs ({str(ha)[:200]} against {str(hb)[:200]})")
    try:
        return compare_lines(a, b, ha)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise LedgerError(f"a ledger line is damaged ({type(e).__name__}: {str(e)[:100]})") from None


def compare_lines(a, b, head):
    by_update = {r["update"]: r for r in b}
    common = [r for r in a if r["update"] in by_update]
    if not common:
        raise LedgerError("the two ledgers have no update in common")
    for ra in common:
        rb = by_update[ra["update"]]
        if ra["digest"] != rb["digest"]:
            where = first_difference(ra, rb, head["top_k"], head["tokens"])
            if where is None:
                return 1, f"the ledgers part at update {ra['update']}: {ra['examples']} against {rb['examples']} examples"
            name, i, t, got, want = where
            return 1, (f"the ledgers part at update {ra['update']}: {name}, example {i} position {t} went to {got} "
                       f"in A, {want} in B; every token before it routed alike")
    return 0, f"identical: {len(common)} updates in common, every routing digest equal"


def balance(path, last=10):
    """Per MoE block of a ledger: (name, the most-loaded expert's share of first choices and the
    share of choices dropped, each the mean over the first update and over the last `last`)."""
    head, lines = read(path)
    out = []
    for i, name in enumerate(head["layers"]):
        loads = np.zeros((len(lines), head["experts"]))
        for row, r in zip(loads, lines):
            row[:len(r["layers"][i]["load"])] = r["layers"][i]["load"]
        share = loads.max(1) / loads.sum(1)
        dropped = np.array([r["layers"][i]["dropped"] / (r["examples"] * head["tokens"] * head["top_k"]) for r in lines])
        out.append((name, share[0], share[-last:].mean(), dropped[0], dropped[-last:].mean()))
    return out


def main(argv=None):
    """`python -m manual_dp.ledger FILE...`: each ledger's balance, a line per MoE block."""
    import sys
    for path in (sys.argv[1:] if argv is None else argv):
        try:
            rows = balance(path)
        except LedgerError as e:
            sys.stderr.write(f"manual_dp.ledger: error: {e}\n")
            sys.exit(2)
        for name, first, late, drop_first, drop_late in rows:
            print(f"{path} {name}: most-loaded expert {first:.3f} of first choices at update 1, {late:.3f} over the "
                  f"last 10 updates; dropped {drop_first:.3f}, then {drop_late:.3f}")


if __name__ == "__main__":
    main()
