"""connect(): the World of this process for --backend, opened and closed around a run."""
import contextlib
import os

from mxnet.base import MXNetError

from ..errors import DistributedError, UsageError
from .horovod import HorovodWorld
from .kvstore import KVStoreWorld
from .world import World


def make_world(backend, timeout, on_timeout, flight_dir=None):
    if backend == "local":
        if flight_dir:
            raise UsageError(f"--flight-record {flight_dir}: one process has no collectives between "
                             f"processes to record; give it with --backend horovod, dist_sync or dist_async")
        return World()
    if backend == "horovod":
        return HorovodWorld(timeout, on_timeout, flight_dir)
    if backend in ("dist_sync", "dist_async"):
        return KVStoreWorld(backend, timeout, on_timeout, flight_dir)
    raise UsageError(f"unknown backend {backend}")


@contextlib.contextmanager
def connect(backend, timeout, on_timeout, flight_dir=None):
    """The World of this process for the run; only rank 0 writes to stdout.

    A failed collective (a peer died) becomes a DistributedError, its flight record written; the
    world is closed on exit (--flight-record DIR: every rank's flight record written there).
    """
    world = make_world(backend, timeout, on_timeout, flight_dir)
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
        if world.backend == "local":
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
        record = world.record_flight(f"a collective failed ({first})")
        raise DistributedError(f"{world.describe()}: a collective failed, another process probably "
                               f"died ({first}); {world.situation()}" + (f"; {record}" if record else "")) from None
    finally:
        world.close(failed)
