"""`--digests FILE`: per update, a fingerprint of every gradient, parameter and optimiser-state
tensor, by name, written as the run goes; `python -m manual_dp.diverge` reads two such files and
names where the runs part (issue 24; `compare`, here, is the comparison it and the replay share).

A header line first, how the run was made (the RunConfig fields that change the numbers, the
layout's flags and the processes; `diverge --replay` rebuilds the run from it), then one JSON
line per update:

    {"run": {"model": "lenet", "seed": 0, "mode": "sync", "cpus": 2, ..., "processes": 1,
             "pieces": {"sequence": 1, "tensor": 1}}}
    {"update": t, "tensors": [[kind, name, digest, sum, norm], ...]}

"pieces" are the fixed pieces a --deterministic run computed in (null without --deterministic):
its bits are every layout's only for the same pieces, so diverge names them, and the other
settings that change the numbers (NUMBERS), where two runs differ in them.

kind is "grad" (the reduced gradient, as the optimiser receives it: summed over the batch, every
context and process), "param" (after the update) or "state<i>" (the optimiser's i-th state array
of that parameter, after the update); digest the first 16 hex digits of the SHA-1 of the tensor's
float32 bytes; sum and norm in float64. The tensors come in the order a step computes them: the
gradients from the last layer back to the first, then each parameter, in the model's order,
followed by its optimiser state. A strategy without one reduced gradient (async, local SGD) logs
parameters and state only.

Each line is one os.write of the whole line, so a process killed with SIGKILL leaves whole lines
(at most a torn last one, which the reader drops and says so). A resumed run first keeps only the
updates its checkpoint has (`DigestFile.resume`), so its file equals an uninterrupted run's.
Files written before the header existed have none: they compare as before (`read_lines`), only
`--replay` needs one (`read_header`).
"""
import dataclasses
import hashlib
import json
import math
import os
import stat
from pathlib import Path

import numpy as np

from . import config
from .errors import OutputError


def summary(kind, name, values):
    """[kind, name, digest, float64 sum, float64 norm] of an array."""
    v = np.ascontiguousarray(values, dtype=np.float32)
    wide = v.astype(np.float64).ravel()
    return [kind, name, hashlib.sha1(v.tobytes()).hexdigest()[:16], float(wide.sum()), math.sqrt(float(wide @ wide))]


def record(t, names, shapes, grads, state):
    """The line of update t: `grads` the reduced gradient as host arrays whose concatenation is the
    model's flat vector (None: no reduced gradient), `state` a Strategy.state_dict()."""
    tensors = []
    if grads is not None:
        flat = np.concatenate([np.asarray(g, dtype=np.float32).ravel() for g in grads])
        sizes = [int(np.prod(s)) for s in shapes]
        if flat.size != sum(sizes):
            raise ValueError(f"the reduced gradient holds {flat.size} values, the model {sum(sizes)}")
        ends = np.cumsum(sizes)
        for i in reversed(range(len(names))):
            tensors.append(summary("grad", names[i], flat[ends[i] - sizes[i]:ends[i]]))
    for i, name in enumerate(names):
        tensors.append(summary("param", name, state["params"][i]))
        for j, s in enumerate(state["opt_state"][i]):
            tensors.append(summary(f"state{j}", name, s))
    return {"update": int(t), "tensors": tensors}


# RunConfig fields that neither change a run's numbers nor say where its state is: left out of the header.
NOT_IN_HEADER = ("log_json", "digests", "ledger", "resume", "no_progress", "dry_run", "trace", "flight_record", "timeout",
                 "memory_per_device", "check_replicas")


def header(cfg, processes=1):
    """The header line of a run of the (resolved) RunConfig `cfg` over `processes` processes: every
    field but NOT_IN_HEADER's, so config.RUN_KEYS, the layout's flags (mode, cpus/gpus, stages,
    micro_batches, schedule, tensor/context parallel, mesh, deterministic, allreduce, graph,
    precision...), the data directory and the checkpoint directory."""
    run = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_IN_HEADER}
    return {"run": dict(run, processes=int(processes), pieces=pieces(cfg))}


def pieces(cfg):
    """The fixed pieces a --deterministic run computed in, {"sequence": K, "tensor": Q} (1: whole),
    whatever its layout (the flags leave them unset where a mode takes the whole); None without
    --deterministic, whose bits no layout keeps."""
    return {"sequence": cfg.sequence_pieces or 1, "tensor": cfg.tensor_pieces or 1} if cfg.deterministic else None


# What changes a --deterministic run's bits in every layout: two runs that differ in one of these part
# whatever their layouts (diverge names it before the tensor). The pieces are read from the header's "pieces".
NUMBERS = ("model", "width", "layers", "d_model", "heads", "patch", "dropout", "init_scale", "data", "seq_len",
           "train_size", "seed", "batch_size", "lr", "scale_lr", "warmup_epochs", "optimizer", "clip_norm",
           "precision", "sync_batchnorm", "deterministic")


def settings_apart(a, b):
    """"--flag X against Y" for each setting of NUMBERS (and each run's pieces) in which the runs of
    headers a and b differ; [] where either has no header."""
    if a is None or b is None:
        return []
    both = "pieces" in a and "pieces" in b                  # (files written before headers said them: not)
    pa, pb = ((p if isinstance(p, dict) else {}) for p in (a.get("pieces"), b.get("pieces")))
    pairs = {f"{kind}_pieces": (pa.get(kind), pb.get(kind)) for kind in ("sequence", "tensor") if both}
    pairs.update({k: (a.get(k), b.get(k)) for k in NUMBERS})
    return [f"--{k.replace('_', '-')}: {x!r} against {y!r}" for k, (x, y) in pairs.items() if x != y]


def config_of(run):
    """The RunConfig a header's `run` describes (fields it does not hold: their defaults)."""
    names = {f.name for f in config.fields()}
    return config.RunConfig(**{k: v for k, v in run.items() if k in names})


class DigestFile:
    """The --digests file of a run, appended to a line per update, after its `head` line (the
    `header` of the run; None: none, as files were before headers)."""

    def __init__(self, path, head=None):
        self.path, self.head, self.fd = Path(path), head, None

    def resume(self, t):
        """Keep the whole lines of updates 1..t (a resumed run's checkpoint holds t updates; none
        for a fresh start) after this run's header, replacing the file atomically, then open it for
        appending."""
        kept = [line for line in read_lines(self.path) if line["update"] <= t] if t and self.path.exists() else []
        kept = ([self.head] if self.head else []) + kept
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in kept))
            os.replace(tmp, self.path)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as e:
            raise OutputError(f"--digests {self.path}: cannot write it ({e.strerror})") from None
        return self

    def write(self, line):
        data = (json.dumps(line, allow_nan=True) + "\n").encode()
        if os.write(self.fd, data) != len(data):
            raise OutputError(f"--digests {self.path}: short write (disk full?)")

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class DigestError(Exception):
    """A file that is not a digest file, or one that cannot be read."""


def read_text(path):
    """The text of file `path`; DigestError for one that cannot be read, or a device (/dev/zero
    never ends) or anything else that is no file or pipe."""
    try:
        mode = os.stat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            raise DigestError(f"{path}: not a file (a digest file is a --digests output)")
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DigestError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    except MemoryError:
        raise DigestError(f"{path}: too large to read") from None


def parse(line):
    """The JSON value of one line, or None if it is not JSON (or nested too deep to read)."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def read_header(path):
    """The `run` dict of a digest file's header line; None for a file written before headers."""
    return header_of(read_text(path).split("\n", 1)[0])


def header_of(first):
    """The `run` dict of the header line `first`; None if it is none."""
    head = parse(first)
    return head["run"] if isinstance(head, dict) and isinstance(head.get("run"), dict) else None


def number(x):
    """A JSON number as a float (NaN and the infinities included: a run may diverge), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        return float(x)
    except OverflowError:
        return None


def tensor_of(x):
    """[kind, name, digest, sum, norm] with the sum and norm floats, or None if x is not one."""
    if not (isinstance(x, list) and len(x) == 5 and all(isinstance(v, str) for v in x[:3])):
        return None
    values = [number(v) for v in x[3:]]
    return None if None in values else x[:3] + values


def record_of(r):
    """A digest record with its tensors checked (tensor_of), or None if r is not one."""
    if not (isinstance(r, dict) and type(r.get("update")) is int and isinstance(r.get("tensors"), list)):
        return None
    tensors = [tensor_of(x) for x in r["tensors"]]
    return None if None in tensors else dict(r, tensors=tensors)


def read_lines(path, torn=None):
    """The records of a digest file, in order, its header skipped. A torn last line (a run killed
    mid-write) is dropped and, if `torn` is a list, noted in it; anything else malformed raises
    DigestError."""
    return read(path, torn)[1]


def read(path, torn=None):
    """(the header's `run` dict or None, the records): read_lines' records and read_header's run,
    from one read of the file."""
    lines, out = read_text(path).split("\n"), []
    for i, line in enumerate(lines):
        if not line.strip() or (i == 0 and line.startswith('{"run"')):
            continue
        r = record_of(parse(line))
        if r is None:
            if i == len(lines) - 1:                  # no newline after it: torn by a kill
                if torn is not None:
                    torn.append(i + 1)
                break
            raise DigestError(f"{path}: line {i + 1} is not a digest record")
        out.append(r)
    return header_of(lines[0]), out


def compare(a, b):
    """(status, message) for two lists of digest records."""
    by_update = {r["update"]: r for r in b}
    common = [r for r in a if r["update"] in by_update]
    if not common:
        raise DigestError("the two files have no update in common")
    for ra in common:
        rb = by_update[ra["update"]]
        keys_a, keys_b = [tuple(x[:2]) for x in ra["tensors"]], [tuple(x[:2]) for x in rb["tensors"]]
        if keys_a != keys_b:
            only = sorted(set(keys_a) ^ set(keys_b))
            raise DigestError(f"update {ra['update']}: the runs hold different tensors"
                              + (f" ({', '.join(' '.join(k) for k in only[:3])} in one only)" if only else
                                 " (in another order)"))
        for x, y in zip(ra["tensors"], rb["tensors"]):
            if x[2] != y[2]:
                kind, name, _, sum_a, norm_a = x
                _, _, _, sum_b, norm_b = y
                rel = abs(norm_a - norm_b) / max(abs(norm_a), abs(norm_b), 1e-300)
                return 1, (f"the runs part at update {ra['update']}: {kind} {name} is the first tensor that differs "
                           f"(sum {sum_a:.10g} against {sum_b:.10g}, norm {norm_a:.10g} against {norm_b:.10g}, "
                           f"norms {rel:.1e} apart); every tensor before it is identical")
    extra = len(a) - len(common), len(b) - len(common)
    more = f"; A has {extra[0]} more, B {extra[1]} more" if any(extra) else ""
    return 0, (f"identical: {len(common)} updates in common, {len(common[0]['tensors'])} tensors each, "
               f"every digest equal{more}")
