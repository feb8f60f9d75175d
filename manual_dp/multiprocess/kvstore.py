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

import mxnet as mx
import numpy as np
from mxnet import nd

from ..errors import UsageError
from ..strategies.base import Wrapper, rank_rows
from .distributed import flatten, unflatten
from .ps_server import AddDelta
from .world import Cluster


class PushPull(Wrapper):
    """Asynchronous SGD on a parameter server around a DataParallel `model` (whose all-reduce stays
    inside this process): each process steps on its own rows with its own optimiser state, pushes
    the change of the parameters to the servers and pulls whatever they hold now.

    A model with BatchNorm: its running statistics travel as the parameters do. Each process folds
    its own batches' statistics into the copy it pulled last (DataParallel's fold, per context),
    pushes the change with the parameters' (one key: the servers add it) and pulls the sum of every
    process's changes so far: the statistics of every worker's batches, each folded into the copy
    that worker held, as each worker's step is taken from the parameters it held."""

    def __init__(self, model, world):
        super().__init__(model)
        self.world, self.key, self.rows_seen = world, None, 0
        self.last = None                              # what this process pulled last (or started from), flat

    def held(self, c=0):
        """Context c's parameters, then its running statistics (BatchNorm's, if any)."""
        return list(self.model.replicas[c]) + (list(self.model.running[c]) if getattr(self.model, "running", None)
                                               else [])

    @property
    def min_batch(self):
        return self.world.size * self.model.min_batch

    def backward(self, X, y):
        """This process's rows; the metrics scaled to the whole batch (no waiting for the others)."""
        self.world.progress()
        self.world.step = self.model.t + 1
        start, stop = rank_rows(len(X), self.world.rank, self.world.size, self.model.min_batch)
        self.rows_seen += stop - start
        if self.last is None:                         # before the backward folds any statistics
            self.last = flatten(self.held())
        metrics = self.model.backward(X[start:stop], y[start:stop])
        return [(loss * (len(X) / (stop - start)), correct * (len(X) / (stop - start)))
                for loss, correct in metrics]

    def update(self, lr, n_examples):
        """A step on this process's own rows, its change pushed; everyone's changes so far pulled."""
        if self.key is None:                          # rank 0's parameters (and statistics) go to the servers
            self.key = self.world.new_key("params")
            self.world.kv.init(self.key, self.last)
        self.model.update(lr, self.rows_seen)
        self.rows_seen = 0
        change, pulled = flatten(self.held()) - self.last, self.last

        def push_pull():
            self.world.kv.push(self.key, change)
            self.world.kv.pull(self.key, out=pulled)
        self.world.collective("push-pull", "params", push_pull, result=pulled)
        for c in range(len(self.model.replicas)):
            unflatten(pulled, self.held(c))

    def correct(self, X, y):
        """Every process evaluates all of (X, y) on the parameters it pulled last."""
        self.world.progress()
        return self.model.correct(X, y)

    def layout(self, batch_size):
        return self.model.layout(batch_size // self.world.size)

    def load_state_dict(self, state):
        self.model.load_state_dict(state)
        self.key = self.last = None                   # the servers take the loaded parameters


def require_launcher(backend):
    if os.environ.get("DMLC_ROLE") != "worker" or not os.environ.get("DMLC_PS_ROOT_URI"):
        raise UsageError(f"--backend {backend} runs as a worker under the launcher: python -m "
                         f"manual_dp.launch --workers N --servers S -- python -m manual_dp.train "
                         f"--backend {backend} ... (the DMLC_* environment is missing)")


class KVStoreWorld(Cluster):
    def __init__(self, backend, timeout, on_timeout, flight_dir=None):
        require_launcher(backend)
        self.backend = backend
        super().__init__(timeout, on_timeout, flight_dir)
        try:
            self.kv = mx.kv.create(backend)           # waits until every node has registered
        except Exception:
            self.watchdog.stop()
            raise
        self.rank, self.size, self.joined = self.kv.rank, self.kv.num_workers, True
        self.local_rank = int(os.environ.get("MANUAL_DP_LOCAL_RANK", "0"))
        servers = os.environ.get("DMLC_NUM_SERVER", "?")
        if backend == "dist_async":
            self.kv.set_optimizer(AddDelta())
            self.how = (f"each process updates with its own rows and adds the change to the "
                        f"parameters on {servers} server(s), waiting for no one")
        else:
            self.how = (f"gradients summed by hand over each process's contexts, then by "
                        f"{servers} parameter server(s) across processes (push, pull)")
        self.pulled, self.counter = {}, itertools.count()
        self.open_flight()
        self.progress()

    def new_key(self, what):
        """A key no one used yet; every worker asks for keys in the same order."""
        return f"{what}.{next(self.counter)}"

    def reducer(self, allreduce_fn):
        """dist_async sums nothing across processes: the servers add parameter changes instead."""
        return allreduce_fn if self.backend == "dist_async" else super().reducer(allreduce_fn)

    def wrap(self, model):
        return PushPull(model, self) if self.backend == "dist_async" else super().wrap(model)

    def allreduce(self, array, key):
        """Push, the servers sum every worker's push, pull. The servers count pushes, not workers,
        so a worker's next push of a key must wait until its last round on it has ended: until its
        previous pull of that key has arrived (for gradients it long has)."""
        if self.backend == "dist_async":
            raise RuntimeError("dist_async servers add pushes into parameters; no allreduce")
        self.collective("allreduce", key, lambda: self.push_pull(array, key), result=array)

    def prepare(self, key, like):
        """A key's first push needs kv.init, a barrier of every worker: made here in program order,
        never from inside a backward (whose sums the engine may reach in another order per rank)."""
        if key not in self.pulled:
            zeros = nd.zeros(like.shape, ctx=like.context, dtype=like.dtype)
            self.collective("init", key, lambda: self.kv.init(key, zeros))
            self.pulled[key] = zeros

    def push_pull(self, array, key):
        if key in self.pulled:
            self.pulled[key].wait_to_read()
        else:
            self.kv.init(key, nd.zeros(array.shape, ctx=array.context, dtype=array.dtype))
        self.kv.push(key, array)
        self.kv.pull(key, out=array)
        self.pulled[key] = array

    def broadcast(self, array):
        key = self.new_key("broadcast")
        self.kv.init(key, array)                      # only rank 0's value reaches the servers
        self.kv.pull(key, out=array)

    def broadcast_object(self, obj):
        """(The payload's size is rank 0's to know: the flight record leaves it out.)"""
        return self.collective("broadcast", "", lambda: self.send_object(obj), fallback=obj)

    def send_object(self, obj):
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
            if failed:
                del self.kv
            else:                                     # finalises ps-lite: a barrier of every worker
                self.collective("barrier", "exit", self.finalise)
        finally:
            super().close(failed)

    def finalise(self):
        del self.kv
