"""How batches reach the devices: a background thread gathers the next shuffled batches (numpy's
fancy indexing releases the GIL) while the main thread feeds MXNet, which takes each batch over
without waiting (host)."""
import queue
import threading

import numpy as np
from mxnet import nd

_DONE = object()


class _Failed:
    def __init__(self, error):
        self.error = error


def prefetch(iterable, depth=2):
    """Yield the items of `iterable` in order, computed up to `depth` items ahead in a thread.

    An exception in `iterable` is raised here; leaving the loop early stops the thread.
    """
    q, stop = queue.Queue(maxsize=depth), threading.Event()

    def put(item):
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def fill():
        try:
            for item in iterable:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as e:  # handed to the consumer
            put(_Failed(e))

    threading.Thread(target=fill, daemon=True, name="manual_dp-prefetch").start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()


def host(a):
    """A numpy batch as an NDArray, without waiting for the devices.

    nd.array copies synchronously, and that copy first waits until cpu(0)'s queue has run dry:
    the host would stall on the devices every batch. Here numpy copies the batch into a private
    buffer (the caller may reuse its own at once) that MXNet then takes over without a copy;
    the copies from it to the devices are queued like any other operation.
    """
    if not isinstance(a, np.ndarray):
        return a
    return nd.from_numpy(np.array(a, order="C", copy=True), zero_copy=True)
