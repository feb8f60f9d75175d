"""This process's place in a multi-process job: rank, size, collectives, a watchdog.

By itself a process is the single-process job (World); under horovodrun or the parameter-server
launcher it is a Cluster whose collectives come from that engine (manual_dp.multiprocess.horovod,
.kvstore; manual_dp.multiprocess.connect picks one). A World composes with any strategy in two places:

    world.reducer(allreduce_fn)   the strategy's all-reduce, summing across processes as well
    world.wrap(model)             the strategy fed this process's rows of every global batch
"""
import threading
import time

from .board import Reporter, fingerprint, verdict
from .distributed import CrossProcessAllreduce, MultiProcess


class Watchdog:
    """Calls `on_timeout(message)` when no progress is reported for `timeout` seconds; calls
    `beat()` on every tick until then (a heartbeat: this thread stops only with the process).

    A collective whose peer died blocks inside MXNet's engine, where no Python exception can reach
    the waiting thread; this thread notices. `who()` names this process, `situation()` says where
    it is and who holds the job up; the command line's `on_timeout` ends the process.
    """

    def __init__(self, timeout, who, on_timeout, situation=lambda: "another process died or hangs",
                 beat=lambda: None):
        self.timeout, self.who, self.on_timeout = timeout, who, on_timeout
        self.situation, self.beat = situation, beat
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
                self.on_timeout(f"{self.who()}: no progress for {self.timeout:g} s; {self.situation()}; "
                                f"giving up; rank 0's last checkpoint resumes with --resume")
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

    def close(self, failed=False):
        pass


class Cluster(World):
    """A process of a multi-process job: collectives from the engine, a watchdog on every one."""

    def __init__(self, timeout, on_timeout):
        self.seq, self.step, self.op, self.reporter = 0, 0, "start-up", Reporter()
        self.joined = False                               # True once the engine gave rank and size
        self.unanswered = "the board did not answer"      # what a silent board means here
        self.watchdog = Watchdog(timeout, self.describe, on_timeout, self.situation, self.beat)

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
        self.watchdog.stop()

    # Collectives each engine provides.
    def allreduce(self, array, key):
        """Afterwards `array` holds the elementwise sum of every process's `array` (same key)."""
        raise NotImplementedError

    def broadcast_object(self, obj):
        """rank 0's `obj` (picklable), on every rank."""
        raise NotImplementedError
