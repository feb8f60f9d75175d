"""This process's place in a multi-process job: rank, size, collectives, a watchdog.

`connect(args)` gives the World for --backend: by itself the single-process job; under horovodrun
or the parameter-server launcher a Cluster whose collectives come from that engine
(manual_dp.dist_horovod, manual_dp.dist_kvstore) and whose strategy is manual_dp.distributed's.
"""
import contextlib
import os
import sys
import threading
import time

from mxnet.base import MXNetError

from .cli import UsageError
from .parallel import allreduce
from .step import DataParallel

BACKENDS = ("local", "horovod", "dist_sync", "dist_async")


class DistributedError(Exception):
    """Another process of the job failed or vanished; reported as one line and exit status 1."""


class Watchdog:
    """Ends the process with one clear line when no progress is reported for `timeout` seconds.

    A collective whose peer died blocks inside MXNet's engine, where no Python exception can
    reach it; this thread is what turns such a hang into a bounded, non-zero exit.
    """

    def __init__(self, timeout, who):
        self.timeout, self.who, self.last = timeout, who, time.monotonic()
        self.stopped = threading.Event()
        threading.Thread(target=self._watch, name="manual_dp-watchdog", daemon=True).start()

    def progress(self):
        self.last = time.monotonic()

    def stop(self):
        self.stopped.set()

    def _watch(self):
        while not self.stopped.wait(min(1.0, self.timeout / 4)):
            if time.monotonic() - self.last > self.timeout:
                sys.stderr.write(f"manual_dp.train: error: {self.who()}: no progress for "
                                 f"{self.timeout:g} s (another process died or hangs); giving up; "
                                 f"rank 0's last checkpoint resumes with --resume\n")
                sys.stderr.flush()
                os._exit(1)


class World:
    """This process's place in the job; by itself, the single-process job (rank 0 of 1)."""
    backend, rank, size, local_rank = "local", 0, 1, 0

    @property
    def is_root(self):
        return self.rank == 0

    how = "one process"

    def describe(self):
        return f"rank {self.rank} of {self.size} ({self.backend})"

    def summary(self):
        return f"backend {self.backend}: {self.size} process(es); {self.how}"

    def contexts(self, args):
        from .cli import contexts
        return contexts(args)

    def wrap(self, model):
        return model

    def share(self, fn):
        """fn() computed on rank 0, its value (or its exception) on every rank."""
        return fn()

    def close(self, failed=False):
        pass


class Cluster(World):
    """A process of a multi-process job: collectives from the engine, a watchdog on every one."""
    strategy = None  # the DataParallel subclass that runs the steps

    def __init__(self, timeout):
        self.watchdog = Watchdog(timeout, self.describe)

    def contexts(self, args):
        return local_contexts(args, self.local_rank)

    def wrap(self, model):
        """The synchronous trainer `model`, turned into one that also reduces across processes."""
        if type(model) is not DataParallel:
            raise UsageError(f"--backend {self.backend} runs the synchronous data-parallel trainer "
                             f"only (--mode sync)")
        twin = self.strategy(model.replicas[0], model.ctx, model.optimizer, self,
                             getattr(model, "allreduce_fn", allreduce),
                             fuse_grads=getattr(model, "flat", None) is not None,
                             graph=getattr(model, "graph", None) is not None)
        twin.load_state_dict(model.state_dict())
        return twin

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

    def broadcast(self, array):
        """Afterwards `array` holds rank 0's values on every process."""
        raise NotImplementedError

    def broadcast_object(self, obj):
        raise NotImplementedError


def local_contexts(args, local_rank):
    """This process's contexts: --cpus N as given; --gpus N the local_rank-th group of N GPUs
    of this machine; by default one GPU per process, else two CPU contexts."""
    import mxnet as mx
    from .cli import contexts
    found = mx.context.num_gpus()
    if args.cpus is not None or (args.gpus is None and not found):
        return contexts(args)
    k = args.gpus or 1
    first = local_rank * k
    if first + k > found:
        raise UsageError(f"process {local_rank} of this machine needs gpu({first})..gpu({first + k - 1}) "
                         f"but found {found} GPU(s); start fewer processes per machine or lower --gpus")
    return [mx.gpu(first + i) for i in range(k)]


def make_world(backend, timeout):
    if backend == "local":
        return World()
    if backend == "horovod":
        from .dist_horovod import HorovodWorld
        return HorovodWorld(timeout)
    if backend in ("dist_sync", "dist_async"):
        from .dist_kvstore import KVStoreWorld
        return KVStoreWorld(backend, timeout)
    raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend}")


@contextlib.contextmanager
def connect(args):
    """The World of this process for the run; only rank 0 writes to stdout.

    A failed collective (a peer died) becomes a DistributedError; the world is closed on exit.
    """
    world = make_world(getattr(args, "backend", "local"), getattr(args, "timeout", None) or 120)
    failed = True
    try:
        with contextlib.ExitStack() as stack:
            if not world.is_root:
                stack.enter_context(contextlib.redirect_stdout(stack.enter_context(
                    open(os.devnull, "w"))))
            if world.backend != "local":
                print(world.summary(), flush=True)
            yield world
        failed = False
    except MXNetError as e:
        if world.size == 1 and world.backend == "local":
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
        raise DistributedError(f"{world.describe()}: a collective failed, another process probably "
                               f"died ({first})") from None
    finally:
        world.close(failed)
