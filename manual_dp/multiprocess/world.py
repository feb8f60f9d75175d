"""This process's place in a multi-process job: rank, size, collectives, a watchdog.

By itself a process is the single-process job (World); under horovodrun or the parameter-server
launcher it is a Cluster whose collectives come from that engine (manual_dp.multiprocess.horovod,
.kvstore; manual_dp.multiprocess.connect picks one). A World composes with any strategy in two places:

    world.reducer(allreduce_fn)   the strategy's all-reduce, summing across processes as well
    world.wrap(model)             the strategy fed this process's rows of every global batch

Every collective of a Cluster goes through `collective()`, which gives it its sequence number,
reports it to the progress board and records it in the flight recorder (manual_dp.multiprocess.flight).
"""
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

from mxnet import nd

from ..errors import UsageError
from .board import Reporter, fingerprint, verdict
from .distributed import CrossProcessAllreduce, MultiProcess
from .flight import Recorder, SignalDumps, nbytes, skipped_seq


class Watchdog:
    """Calls `on_timeout(message)` when no progress is reported for `timeout` seconds; calls
    `beat()` on every tick until then (a heartbeat: this thread stops only with the process).

    A collective whose peer died blocks inside MXNet's engine, where no Python exception can reach
    the waiting thread; this thread notices. `who()` names this process, `situation()` says where
    it is and who holds the job up; the command line's `on_timeout` ends the process.
    """

    def __init__(self, timeout, who, on_timeout, situation=lambda: "another process died or hangs",
                 beat=lambda: None, record=lambda reason: ""):
        self.timeout, self.who, self.on_timeout = timeout, who, on_timeout
        self.situation, self.beat, self.record = situation, beat, record
        self.last, self.stopped = time.monotonic(), threading.Event()
        threading.Thread(target=self._watch, name="manual_dp-watchdog", daemon=True).start()

    @property
    def tick(self):
        return min(1.0, self.timeout / 4)

    def progress(self):
        self.last = time.monotonic()

    def stop(self):
        self.stopped.set()

    def _watch(self):
        while not self.stopped.wait(self.tick):
            self.beat()
            if time.monotonic() - self.last > self.timeout:
                where = self.situation()
                record = self.record(f"watchdog: no progress for {self.timeout:g} s")
                self.on_timeout(f"{self.who()}: no progress for {self.timeout:g} s; {where}; giving up; "
                                + (f"{record}; " if record else "")
                                + "rank 0's last checkpoint resumes with --resume")
                return


class World:
    """This process's place in the job; by itself, the single-process job (rank 0 of 1)."""
    backend, rank, size, local_rank = "local", 0, 1, 0
    how = "one process"

    @property
    def is_root(self):
        return self.rank == 0

    def describe(self):
        return f"rank {self.rank} of {self.size} ({self.backend})"

    def summary(self):
        return f"backend {self.backend}: {self.size} process(es); {self.how}"

    def reducer(self, allreduce_fn):
        """The all-reduce a strategy of this process should use: `allreduce_fn` alone here."""
        return allreduce_fn

    def wrap(self, model):
        """The strategy as this process should run it: `model` itself here."""
        return model

    def share(self, fn):
        """fn() computed on rank 0, its value (or its exception) on every rank."""
        return fn()

    def progress(self):
        pass

    def situation(self):
        """Where this process is in the job's collectives, and who holds the job up."""
        return "one process"

    def record_flight(self, reason):
        """This process's flight record written, and a clause saying where ("": none here)."""
        return ""

    def close(self, failed=False):
        pass


def job_name():
    """A name for a new job: rank 0's clock and process id."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{socket.gethostname()}-{os.getpid()}"


class Cluster(World):
    """A process of a multi-process job: collectives from the engine, a watchdog on every one, and
    a flight recorder of the last ones. `flight_dir`: where every rank writes its flight record
    (--flight-record; dumped at the end of the run too), None: TMPDIR/manual_dp-flight-JOB, written
    only when the job fails."""

    def __init__(self, timeout, on_timeout, flight_dir=None):
        self.seq, self.step, self.op, self.reporter = 0, 0, "start-up", Reporter()
        self.joined = False                               # True once the engine gave rank and size
        self.unanswered = "the board did not answer"      # what a silent board means here
        self.recorder, self.asked_dir, self.flight_dir = Recorder(), flight_dir, None
        self.job, self.skip, self.signals = None, None, None
        self.watchdog = Watchdog(timeout, self.describe, on_timeout, self.situation, self.beat,
                                 self.record_flight)

    def open_flight(self):
        """Once the engine has joined the job: rank 0 names the job, and so the default directory of
        the flight records; signals dump them from now on. UsageError if --flight-record's
        directory cannot be made."""
        self.job = self.share(job_name)
        self.flight_dir = Path(self.asked_dir or Path(tempfile.gettempdir()) / f"manual_dp-flight-{self.job}")
        if self.asked_dir:
            try:
                self.flight_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise UsageError(f"--flight-record {self.asked_dir}: cannot create it ({e.strerror})") from None
        try:
            self.skip = skipped_seq(self.rank)
        except ValueError as e:
            raise UsageError(str(e)) from None
        self.signals = SignalDumps(self.record_flight)

    def collective(self, op, key, run, result=None, size=None, fallback=None):
        """run() as this rank's next collective: numbered, reported to the board, recorded in the
        flight recorder and completed there when `result` (the NDArray the engine fills, if any) is
        there, else when run() returns. Returns run()'s value (`fallback` if the test-only fault
        makes this rank skip the call)."""
        if self.skip == self.seq + 1:                     # manual_dp.multiprocess.flight.SKIP
            self.skip = None
            return fallback
        self.enter(f"{op} {key}".strip())
        entry = self.recorder.start(self.seq, op, key, self.step,
                                    size if size is not None or result is None else nbytes(result))
        value = run()
        if result is None:
            self.recorder.complete(entry)
        else:
            self.recorder.complete_when_ready(entry, result)
        return value

    def record_flight(self, reason):
        if self.job is None:
            return ""
        try:
            path = self.recorder.dump(self.flight_dir, rank=self.rank, size=self.size, backend=self.backend,
                                      job=self.job, reason=reason, host=socket.gethostname())
        except OSError as e:
            return f"the flight record could not be written in {self.flight_dir} ({e.strerror})"
        return f"flight record in {path}: python -m manual_dp.flight {self.flight_dir} compares every rank's"

    def enter(self, op):
        """Afterwards this process's fingerprint is its next collective: `op`, the step, the
        sequence number (every rank enters the same collectives in the same order)."""
        self.seq, self.op = self.seq + 1, op
        self.beat()

    def beat(self):
        if self.joined:
            self.reporter.report(self.rank, self.seq, self.step, self.op)

    def situation(self):
        """The last collective this rank entered, and the board's verdict on the others."""
        if not self.joined:
            return "waiting for every process of the job to join"
        silent_after = 2.5 * self.watchdog.tick            # a live rank beats every tick
        unanswered = self.unanswered if self.reporter.target else "no board here"
        return (f"last entered {fingerprint(self.seq, self.step, self.op)}; "
                f"{verdict(self.reporter.ask(), self.size, self.rank, silent_after, unanswered)}")

    def reducer(self, allreduce_fn):
        return CrossProcessAllreduce(allreduce_fn, self)

    def wrap(self, model):
        return MultiProcess(model, self)

    def share(self, fn):
        result = None
        if self.is_root:
            try:
                result = ("ok", fn())
            except Exception as e:  # handed to every rank, raised there
                result = ("error", e)
        self.progress()
        kind, value = self.broadcast_object(result)
        self.progress()
        if kind == "error":
            raise value
        return value

    def progress(self):
        self.watchdog.progress()

    def close(self, failed=False):
        """The watchdog stopped; with --flight-record, this rank's flight record written (every
        engine callback run first, on success)."""
        try:
            if self.asked_dir and self.job is not None:
                if not failed:
                    nd.waitall()
                self.record_flight("run failed" if failed else "end of run")
        finally:
            if self.signals is not None:
                self.signals.close()
            self.watchdog.stop()

    # Collectives each engine provides.
    def allreduce(self, array, key):
        """Afterwards `array` holds the elementwise sum of every process's `array` (same key)."""
        raise NotImplementedError

    def prepare(self, key, like):
        """Ready the engine for sums of `key` over arrays like `like`, now, in the program's order:
        for a sum that will run inside an autograd backward, as the engine reaches it (nothing to
        do unless the engine must set a name up with every process at once)."""

    def broadcast_object(self, obj):
        """rank 0's `obj` (picklable), on every rank."""
        raise NotImplementedError
