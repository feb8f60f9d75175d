"""--backend dist_sync / dist_async: MXNet's parameter-server KVStore (ps-lite) across processes.

Start scheduler, servers and workers with the launcher:
    python -m manual_dp.launch --workers 2 --servers 1 -- \
        python -m manual_dp.train --backend dist_sync --cpus 1

dist_sync: the servers only add. Every worker pushes its flat gradient buffer, the servers sum
the pushes of all workers, every worker pulls the sum and takes the update itself: an allreduce.
dist_async: the servers hold the parameters. Every worker steps on its own rows with its own
optimiser state, pushes the change to the parameters and pulls whatever the servers hold now,
without waiting for the others (asynchronous SGD).
"""
import ctypes
import itertools
import os
import pickle

import numpy as np
from mxnet import nd

from .cli import UsageError
from .distributed import TwoLevelDataParallel, flatten, unflatten
from .ps_server import AddDelta
from .step import DataParallel
from .world import Cluster


class AsyncDataParallel(TwoLevelDataParallel):
    """Asynchronous SGD on a parameter server: each process updates with its own rows' gradient
    and state, pushes the change to the servers and pulls their current parameters."""

    def sync(self):
        """Rank 0's parameters go to the servers (a fresh key), its optimiser state to everyone."""
        self.key = self.world.new_key("params")
        params, states = flatten(self.replicas[0]), flatten(self.tensors(0))
        self.world.kv.init(self.key, params)          # rank 0's value; every worker waits
        self.world.kv.pull(self.key, out=params)
        self.world.broadcast(states)
        for i in range(len(self.ctx)):
            unflatten(states, self.tensors(i))
        self.in_sync = True

    def step(self, X, y, lr):
        self.t += 1
        flats = self.local_step(X, y)
        start, stop = self.rows(len(X))
        W = self.replicas[0]
        unflatten(flats[0], self.grads(0))
        before = flatten(W)
        self.update(0, lr, stop - start)
        self.world.kv.push(self.key, flatten(W) - before)
        self.world.kv.pull(self.key, out=before)      # everyone's changes so far
        for replica in self.replicas:
            unflatten(before, replica)
        # The log shows this process's rows, scaled to the whole batch (no waiting for the others).
        k, scale = len(self.ctx), len(X) / (stop - start)
        mine = range(self.world.rank * k, (self.world.rank + 1) * k)
        return [(loss * scale, correct * scale) for loss, correct in self.metrics(flats[0], mine)]

    def correct(self, X, y):
        """Every process evaluates all of (X, y) on the parameters it pulled last."""
        if not self.in_sync:
            self.sync()
        self.world.progress()
        return DataParallel.correct(self, X, y)


def require_launcher(backend):
    if os.environ.get("DMLC_ROLE") != "worker" or not os.environ.get("DMLC_PS_ROOT_URI"):
        raise UsageError(f"--backend {backend} runs as a worker under the launcher: python -m "
                         f"manual_dp.launch --workers N --servers S -- python -m manual_dp.train "
                         f"--backend {backend} ... (the DMLC_* environment is missing)")


class KVStoreWorld(Cluster):
    def __init__(self, backend, timeout):
        require_launcher(backend)
        self.backend = backend
        super().__init__(timeout)
        import mxnet as mx
        try:
            self.kv = mx.kv.create(backend)           # waits until every node has registered
        except Exception:
            self.watchdog.stop()
            raise
        self.rank, self.size = self.kv.rank, self.kv.num_workers
        self.local_rank = int(os.environ.get("MANUAL_DP_LOCAL_RANK", "0"))
        self.strategy = AsyncDataParallel if backend == "dist_async" else TwoLevelDataParallel
        servers = os.environ.get("DMLC_NUM_SERVER", "?")
        if backend == "dist_async":
            self.kv.set_optimizer(AddDelta())
            self.how = (f"each process updates with its own rows and adds the change to the "
                        f"parameters on {servers} server(s), waiting for no one")
        else:
            self.how = (f"gradients summed by hand over each process's contexts, then by "
                        f"{servers} parameter server(s) across processes (push, pull)")
        self.keys, self.counter = set(), itertools.count()
        self.progress()

    def new_key(self, what):
        """A key no one used yet; every worker asks for keys in the same order."""
        return f"{what}.{next(self.counter)}"

    def allreduce(self, array, key):
        if self.backend == "dist_async":
            raise RuntimeError("dist_async servers add pushes into parameters; no allreduce")
        if key not in self.keys:
            self.kv.init(key, nd.zeros(array.shape, ctx=array.context, dtype=array.dtype))
            self.keys.add(key)
        self.kv.push(key, array)                      # the servers wait for every worker's push,
        self.kv.pull(key, out=array)                  # store the sum, and hand it back
        if key != "grads":
            # The servers count pushes, not workers: a second push of this worker must not reach
            # them before the round ends. Gradients need no wait: the next step's push depends
            # on this pull through the update.
            array.wait_to_read()

    def broadcast(self, array):
        key = self.new_key("broadcast")
        self.kv.init(key, array)                      # only rank 0's value reaches the servers
        self.kv.pull(key, out=array)

    def broadcast_object(self, obj):
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if self.is_root else None
        size = nd.array(divmod(len(data), 1 << 20) if self.is_root else (0, 0))
        self.broadcast(size)                          # float32 is exact below 2**24: split it
        hi, lo = size.asnumpy().astype(np.int64)
        buf = nd.array(data, dtype=np.float32) if self.is_root else nd.zeros((int(hi) << 20) + int(lo))
        self.broadcast(buf)                           # one float32 per byte
        return pickle.loads(buf.asnumpy().astype(np.uint8).tobytes())

    def close(self, failed=False):
        try:
            if failed:  # do not wait at exit for workers that may be gone
                from mxnet.base import _LIB
                _LIB.MXKVStoreSetBarrierBeforeExit(self.kv.handle, ctypes.c_int(0))
            elif self.backend == "dist_async":
                # Asynchronous workers finish at their own pace: the last barrier may wait long.
                self.watchdog.timeout *= 10
            self.progress()
            del self.kv                               # finalises ps-lite (a barrier on success)
        finally:
            super().close(failed)
