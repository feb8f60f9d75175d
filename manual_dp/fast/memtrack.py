"""Bytes MXNet's storage holds on each context, over a window of time: its profiler's memory counters.

With `profile_memory`, MXNet's storage manager adds every allocation's size to a counter of its
device ("Memory: cpu/1") and subtracts it when the array's storage is freed, and the profiler
writes each new value, timestamped, to its trace. `Window` turns the profiler on, and on exit
reads, per context, the value the counter had when the window opened (its baseline) and the
largest it reached inside the window: peak - baseline = the most bytes the window's work held at
once on that context. Everything that goes through MXNet's storage is counted: arrays made from
Python, autograd's saved outputs, the cached graph's planned memory, operators' temporary
workspace (kTempSpace), copies between contexts.

Limits (MXNet 1.9.1):
- Counted are the bytes asked for, not what the pooled storage manager rounds them up to or keeps
  in its pool after a free; memory outside MXNet's storage (oneDNN's own scratchpads and reordered
  weight caches, OpenBLAS buffers, numpy) is not counted.
- Allocations made before the window that are freed inside it lower the counter (it cannot go
  below 0): measure on fresh arrays, with garbage collected first.
- The profiler numbers CPU devices 0..P-1 with P = the processors this process may run on
  (omp_get_num_procs), then the GPUs, then "cpu pinned" and "cpu shared": cpu(i) for i >= P lands
  on one of the last two names, and an index past them aborts the process inside MXNet. So
  `counter_names` answers None when a context cannot be counted; callers then fall back.
- On CPU, operators' scratch space is one pool of MXNET_CPU_TEMP_COPY buffers shared by every
  cpu(i) and registered on cpu(0): its counter carries all of it. Buffers stay allocated once
  used, so a second window in the same process does not see them again.
- The profiler is configured once per process (MXNet refuses a second set_config, so
  manual_dp.bench.overlap cannot run in a process that measured memory, nor the reverse:
  `configured` then says False). The trace is written with dump(finished=False), which appends
  and leaves the JSON open: the counter events are read with a regular expression.
"""
import atexit
import gc
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import mxnet as mx

EVENT = re.compile(r'"name": "Memory: ([^"]*)",\s*"cat": "Device Storage",\s*"ph": "C",\s*'
                   r'"ts": (\d+),\s*"args": \{ "[^"]*": (\d+) \}')
_trace = []          # the trace file, once the profiler is configured in this process


def counter_names(ctxs, n_procs=None, n_gpus=None):
    """{str(context): the profiler's counter name} for `ctxs`, or None if one cannot be counted (or
    two would share a counter)."""
    n_procs = len(os.sched_getaffinity(0)) if n_procs is None else n_procs
    n_gpus = mx.context.num_gpus() if n_gpus is None else n_gpus
    extra = ["cpu pinned/", "cpu shared/"]
    names = {}
    for c in ctxs:
        if c.device_type == "gpu":
            names[str(c)] = f"gpu/{c.device_id}"
        elif c.device_type == "cpu" and c.device_id < n_procs:
            names[str(c)] = f"cpu/{c.device_id}"
        elif c.device_type == "cpu" and c.device_id < n_procs + len(extra) and not n_gpus:
            names[str(c)] = extra[c.device_id - n_procs]
        else:
            return None
    return names if len(set(names.values())) == len(names) else None


def trace_file():
    """The profiler's trace file, configured on the first call (by this module or by --trace's
    manual_dp.fast.trace: MXNet takes one configuration per process, so it records everything,
    operators and memory counters alike, for both); removed when the process exits."""
    if not _trace:
        path = Path(tempfile.mkdtemp(prefix="manual_dp_profile_")) / "trace.json"
        atexit.register(shutil.rmtree, path.parent, ignore_errors=True)
        mx.profiler.set_config(profile_all=True, aggregate_stats=False, filename=str(path))
        _trace.append(path)
    return _trace[0]


def configured():
    """True if the profiler counts memory for us (False if this process configured it otherwise)."""
    try:
        trace_file()
    except mx.base.MXNetError:
        return False
    return True


def counter_events():
    """[(microseconds, counter name, bytes)] of every memory counter update so far, in time order."""
    mx.profiler.dump(finished=False)
    path = trace_file()
    text = path.read_text() if path.exists() else ""
    return sorted((int(ts), name, int(value)) for name, ts, value in EVENT.findall(text))


def window_peaks(events, start, mark, end):
    """{counter name: (baseline, peak)}: each counter's last value before `start` (0 if none), and
    the largest value it held in [mark, end] (counting the value it entered `mark` with)."""
    out = {}
    for ts, name, value in events:
        base, now, peak = out.get(name, (0, 0, 0))
        if ts < start:
            out[name] = (value, value, value)
        elif ts < mark:
            out[name] = (base, value, value)
        elif ts <= end:
            out[name] = (base, value, max(peak, now, value))
    return {name: (base, max(peak, now)) for name, (base, now, peak) in out.items()}


class Window:
    """`with Window(ctxs) as w: setup; w.mark(); work`: afterwards w.peak[str(ctx)] = the most bytes
    held at once on each context during `work`, of those allocated since the window opened."""

    def __init__(self, ctxs):
        self.names = counter_names(ctxs)
        if self.names is None:
            raise ValueError(f"MXNet's profiler cannot count memory on {', '.join(map(str, ctxs))}")
        self.peak = {}

    def __enter__(self):
        trace_file()
        gc.collect()
        gc.disable()         # no earlier garbage freed inside the window (it would lower the counters)
        mx.nd.waitall()
        mx.profiler.set_state("run")
        self.start = self.marked = time.time() * 1e6
        return self

    def mark(self):
        """From here on the window's peak is measured (what was allocated before still counts)."""
        mx.nd.waitall()
        self.marked = time.time() * 1e6

    def __exit__(self, *exc):
        mx.nd.waitall()
        end = time.time() * 1e6
        mx.profiler.set_state("stop")
        gc.enable()
        peaks = window_peaks(counter_events(), self.start, self.marked, end)
        for ctx, name in self.names.items():
            base, peak = peaks.get(name, (0, 0))
            self.peak[ctx] = peak - base
        return False
