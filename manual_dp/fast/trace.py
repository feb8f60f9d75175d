"""`--trace PATH`: a few steps recorded as one Chrome trace (chrome://tracing, Perfetto): MXNet's
profiler (every operator, on the context that ran it) and the trainer's own spans.

MXNet runs operators asynchronously, so a span timed in Python measures when work was queued,
not when it ran. The trainer's spans are timed by markers instead: a custom operator that reads
one array and notes the time it runs, i.e. once everything writing that array before it has
finished. Markers on each context's batch shard, loss, and each bucket's gradient (before and
after its all-reduce) and parameters (after the update) give, per context and step:

    forward                 shard loaded -> loss computed          (cached graph only)
    backward <params>       previous mark -> the bucket's gradients written
    allreduce <bucket>      the bucket's gradients ready on every context -> summed here
    update <bucket>         summed -> parameters updated

A marker costs a wake-up of MXNet's custom-operator thread (tens of microseconds; on a loaded
machine, milliseconds), and the all-reduce after a "ready" marker waits for it: traced steps run a
little slower than others. Marks on one array keep their order (each all-reduce, and the zeroing
after an update, waits for the marker before it); marks on different arrays may not, by that
latency: a span whose end was noted before its start is drawn with no length, and a forward whose
loss was noted after one of the step's gradients ends there (the loss comes before every gradient;
on a loaded machine the late note made a single buffer's all-reduce look hidden under compute).
"""
import json
import os
import threading
import time
from pathlib import Path

import mxnet as mx
from mxnet import nd

from ..errors import OutputError
from . import memtrack

OP = "manual_dp_mark"
TRACE_UPDATES = 5                  # by default updates 3..5 are recorded (2 warm up, 3 traced)
TRAINER_PID = 1_000_000            # pid of context i's trainer lane in the trace: TRAINER_PID + i
_noted, _lock, _registered = [], threading.Lock(), []


class Mark(mx.operator.CustomOp):
    """Notes (label, unix time in us) when it runs; its output is a dummy."""

    def __init__(self, label):
        super().__init__()
        self.label = label

    def forward(self, is_train, req, in_data, out_data, aux):
        _noted.append((self.label, time.time() * 1e6))

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        pass


class MarkProp(mx.operator.CustomOpProp):
    def __init__(self, label):
        super().__init__(need_top_grad=False)
        self.label = label

    def list_arguments(self):
        return ["data"]

    def infer_shape(self, in_shape):
        return in_shape, [(1,)], []

    def create_operator(self, ctx, shapes, dtypes):
        return Mark(self.label)


def mark(array, label):
    """Queue a marker after everything that writes `array` so far; it notes `label` when it runs."""
    with _lock:
        if not _registered:
            mx.operator.register(OP)(MarkProp)
            _registered.append(OP)
    nd.Custom(array, op_type=OP, label=label)


class Tracer:
    """Records updates skip+1 .. skip+steps of a DataParallel to `path` (see the module docstring).

    The strategy calls step_begins(X_shards) before its forward, forward_done(losses) between
    forward and backward, and step_ends() after its update; its Buckets call bucket(...)."""

    def __init__(self, path, ctx, buckets, skip=2, steps=3, algorithm=None):
        self.path, self.ctx, self.buckets, self.algorithm = Path(path), [str(c) for c in ctx], buckets, algorithm
        self.skip, self.steps, self.updates, self.tmp, self.offset = skip, steps, 0, None, 0

    @property
    def active(self):
        return self.skip <= self.updates < self.skip + self.steps

    def note(self, arrays, what):
        if self.active:
            for c, a in zip(self.ctx, arrays):
                mark(a, f"{self.updates - self.skip}|{c}|{what}")

    def step_begins(self, X_shards):
        if self.updates == self.skip and self.tmp is None:
            self.start_profiler()
        self.note(X_shards, "start")

    def forward_done(self, losses):
        self.note(losses, "forward")

    def bucket(self, b, event, arrays):
        self.note(arrays, f"{event}|{b}")

    def step_ends(self):
        self.updates += 1
        if self.updates == self.skip + self.steps:
            self.finish()

    def start_profiler(self):
        """MXNet 1.9 takes one profiler configuration per process (a second set_config fails after
        a dump), and each dump appends a trace to the file: this trace starts at its current end."""
        nd.waitall()
        with _lock:
            self.tmp = str(memtrack.trace_file())    # the one configuration of this process
        self.offset = os.path.getsize(self.tmp) if os.path.exists(self.tmp) else 0
        _noted.clear()
        mx.profiler.set_state("run")

    def finish(self):
        """Stop the profiler and write MXNet's events and the trainer's spans to `path`."""
        nd.waitall()
        mx.profiler.set_state("stop")
        mx.profiler.dump()
        trace = read_dump(self.tmp, self.offset)
        trace["traceEvents"] += trainer_events(list(_noted), self.ctx, self.buckets.names)
        trace["otherData"] = {"manual_dp": {"contexts": self.ctx, "steps": self.steps,
                                            "buckets": self.buckets.names, "bytes": self.buckets.bytes,
                                            "algorithm": self.algorithm}}
        try:
            self.path.write_text(json.dumps(trace))
        except OSError as e:
            raise OutputError(f"--trace {self.path}: could not write it ({e.strerror})") from None


def read_dump(path, offset):
    """The trace MXNet's profiler dumped into `path` from `offset` on. Its first dump is a JSON
    document; a later one appends ", {event}, ... ], ...}" to it, without the process names, which
    are taken from the first."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    first, _ = json.JSONDecoder().raw_decode(text)
    if not offset:
        return first
    trace = json.loads('{"traceEvents": [' + text[offset:].lstrip().lstrip(","))
    trace["traceEvents"] = [e for e in first["traceEvents"] if e.get("ph") == "M"] + trace["traceEvents"]
    return trace


def trainer_events(noted, contexts, bucket_names):
    """Chrome trace events ("X", one lane per context) of the spans the markers' times give."""
    at = {}
    for label, t in noted:
        step, c, what = label.split("|", 2)
        at[(int(step), c, what)] = t
    events = [{"ph": "M", "name": "process_name", "pid": TRAINER_PID + i, "args": {"name": f"trainer {c}"}}
              for i, c in enumerate(contexts)]
    for step in sorted({s for s, _, _ in at}):
        for i, c in enumerate(contexts):
            events += step_spans(at, step, i, c, contexts, bucket_names)
    return events


def span(name, kind, start, end, pid, **args):
    return {"name": name, "cat": "trainer", "ph": "X", "ts": start, "dur": max(0.0, end - start),
            "pid": pid, "tid": 0, "args": dict(kind=kind, **args)}


def step_spans(at, step, i, c, contexts, bucket_names):
    """One context's spans of one step (those whose two marks were both noted)."""
    get, pid, out = (lambda what, ctx=c: at.get((step, ctx, what))), TRAINER_PID + i, []
    prev = get("start")
    readies = [r for r in (get(f"ready|{b}") for b in range(len(bucket_names))) if r is not None]
    if prev is not None and get("forward") is not None:   # the loss precedes every gradient: a late note clipped
        end = min([get("forward")] + readies)
        out.append(span("forward", "forward", prev, end, pid, step=step, context=c))
        prev = end
    for b, names in enumerate(bucket_names):
        ready = get(f"ready|{b}")
        if prev is not None and ready is not None:
            out.append(span("backward " + ",".join(names), "backward", min(prev, ready), ready, pid, step=step,
                            context=c, bucket=b))
        everywhere = [at.get((step, other, f"ready|{b}")) for other in contexts]
        reduced, updated = get(f"reduced|{b}"), get(f"updated|{b}")
        if None not in everywhere and reduced is not None:
            out.append(span(f"allreduce {b}", "allreduce", max(everywhere), reduced, pid, step=step,
                            context=c, bucket=b))
        if reduced is not None and updated is not None:
            out.append(span(f"update {b}", "update", reduced, updated, pid, step=step, context=c, bucket=b))
        prev = ready if ready is not None else prev
    return out
