"""The flight recorder: every process's last collectives, written down when the job goes wrong.

A hung job's processes each wait inside a collective, and none can say which of them took another
path. So every process keeps a ring buffer of its last CAPACITY collectives (Recorder): sequence
number, operation, key, training step, bytes, the caller's file:line, start and end times, and a
state, `started` until the engine has delivered the result, then `completed`. When the watchdog
gives up, when a collective fails, on SIGTERM, SIGHUP or SIGINT, and at the end of a run with
--flight-record DIR, each process writes its buffer to DIR/flight-RANK.json; `python -m
manual_dp.flight DIR` lines the ranks up by sequence number and names the first one where they
part, and the rank that is late (PyTorch's Flight Recorder does this for NCCL, in C++; this one is
written by hand for Horovod and the parameter servers).

Horovod's all-reduce and the servers' push and pull only enqueue work in MXNet's engine and return
at once; an entry for such a collective is completed by a tiny operation pushed into the engine
behind the result (`when_ready`), which runs when the result has arrived, and never if the
collective fails (the error stays where the trainer reads it).
"""
import collections
import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

CAPACITY = 512                                  # entries each process keeps (about 100 kB of JSON)
FORMAT = "manual_dp.flight 1"                   # the dumps' "format", checked by the reader
SKIP = "MANUAL_DP_TEST_SKIP_COLLECTIVE"         # test-only fault: "RANK:SEQ", that rank skips that call
HERE = str(Path(__file__).resolve().parent)
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
ENGINE_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)


class EngineContext(ctypes.Structure):
    """MXNet's Context as its C API reads it."""
    _fields_ = [("dev_type", ctypes.c_int), ("dev_id", ctypes.c_int)]


def call_site():
    """file:line of the first caller outside manual_dp/multiprocess and contextlib (the strategy
    or loop that asked for the collective); paths inside this repository relative to it."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(HERE) or
                                 frame.f_code.co_filename == contextlib.__file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    path = os.path.relpath(path, PACKAGE_ROOT) if path.startswith(PACKAGE_ROOT + os.sep) else path
    return f"{path}:{frame.f_lineno}"


def nbytes(array):
    """Bytes of an NDArray: its number of elements times its dtype's size."""
    return int(array.size) * np.dtype(array.dtype).itemsize


def skipped_seq(rank, environ=os.environ):
    """The sequence number this rank must skip under the test-only fault $MANUAL_DP_TEST_SKIP_COLLECTIVE
    ("RANK:SEQ"), else None."""
    value = environ.get(SKIP, "")
    who, _, seq = value.partition(":")
    try:
        return int(seq) if value and int(who) == rank else None
    except ValueError:
        raise ValueError(f"${SKIP} must be RANK:SEQ, got {value!r}") from None


class Recorder:
    """A ring buffer of this process's last `capacity` collectives; thread-safe (the engine's
    threads complete entries, the watchdog's and the signal thread dump them)."""

    def __init__(self, capacity=CAPACITY):
        self.entries = collections.deque(maxlen=capacity)
        self.lock = threading.Lock()
        self.waiting, self.ids = {}, iter(range(1, 1 << 62))   # id -> entry whose result is not there yet
        self.callback = ENGINE_CALLBACK(self._ready)           # kept alive as long as the recorder

    def start(self, seq, op, key, step, size=None):
        """A new entry, `started` now, called from the caller's caller's site."""
        entry = dict(seq=seq, op=op, key=key, step=step, bytes=size, site=call_site(),
                     start=time.time(), end=None, state="started")
        with self.lock:
            self.entries.append(entry)
        return entry

    def complete(self, entry):
        """Afterwards `entry` is `completed`, ended now."""
        with self.lock:
            entry.update(end=time.time(), state="completed")

    def complete_when_ready(self, entry, array):
        """Afterwards the engine completes `entry` once `array` (the collective's result) is there."""
        with self.lock:
            key = next(self.ids)
            self.waiting[key] = entry
        ctx = EngineContext(array.context.device_typeid, array.context.device_id)
        handles = (ctypes.c_void_p * 1)(array.handle.value)
        from mxnet.base import _LIB, check_call   # here: the reader (manual_dp.flight) never loads MXNet
        check_call(_LIB.MXEnginePushSyncND(self.callback, ctypes.c_void_p(key), None, ctypes.byref(ctx),
                                           handles, 1, None, 0, None, 0, None))

    def _ready(self, run_context, key):
        with self.lock:
            entry = self.waiting.pop(key, None)
            if entry is not None:
                entry.update(end=time.time(), state="completed")

    def snapshot(self):
        """Copies of the entries, oldest first."""
        with self.lock:
            return [dict(e) for e in self.entries]

    def dump(self, directory, **about):
        """Write the entries and `about` (rank, size, backend, job, reason...) to
        directory/flight-RANK.json, atomically (a reader sees the old file or the new, whole);
        returns its path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"flight-{about['rank']}.json"
        record = dict(format=FORMAT, **about, dumped_at=time.time(), pid=os.getpid(),
                      capacity=self.entries.maxlen, entries=self.snapshot())
        tmp = directory / f".flight-{about['rank']}-{os.getpid()}-{threading.get_ident()}.tmp"
        try:
            tmp.write_text(json.dumps(record, indent=0))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path


class SignalDumps:
    """Dumps on SIGTERM, SIGHUP and SIGINT even while the main thread waits inside MXNet, where
    Python's own handler cannot run until the wait ends (and the launcher's SIGKILL follows 3 s
    after its SIGTERM): the signal's C handler writes its number to a pipe (signal.set_wakeup_fd),
    and a thread of ours reads it and calls `dump(reason)`. Python's handlers still run as before."""

    SIGNALS = {int(s): s.name for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}

    def __init__(self, dump):
        self.previous = None
        if threading.current_thread() is not threading.main_thread():
            return                                   # set_wakeup_fd works in the main thread only
        self.read, self.write = os.pipe()
        os.set_blocking(self.write, False)
        self.previous = signal.set_wakeup_fd(self.write)
        self.dump = dump
        threading.Thread(target=self._watch, name="manual_dp-flight-signals", daemon=True).start()

    def _watch(self):
        while True:
            try:
                data = os.read(self.read, 16)
            except OSError:
                return
            if not data:                             # close(): the write end is gone
                os.close(self.read)
                return
            for signum in data:
                if signum in self.SIGNALS:
                    try:
                        self.dump(f"stopped by {self.SIGNALS[signum]}")
                    except OSError:
                        pass

    def close(self):
        """Python's wakeup fd back as it was; the thread ends."""
        if self.previous is None:
            return
        signal.set_wakeup_fd(self.previous)
        self.previous = None
        os.close(self.write)
