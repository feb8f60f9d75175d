"""More than one process: the same trainer, with a second allreduce across processes.

Inside a process the lesson's hand-written allreduce sums the gradients of its own contexts;
across processes an existing engine sums them again (Horovod, or MXNet's parameter-server
KVStore), in one fused call per step. Every process draws the same shuffled global batches and
takes the rows its contexts would take if one process split each batch over all of them, so
N processes x k contexts compute what one process with N*k contexts computes.
"""
from mxnet import nd

from .optim import apply_update
from .parallel import allreduce, shard_sizes, split_and_load
from .step import DataParallel, forward_backward, graph_forward_backward


def rank_rows(n, rank, size, k):
    """Rows [start, stop) of a batch of n that contexts rank*k .. rank*k+k-1 take when one
    process splits it over size*k contexts with shard_sizes."""
    sizes = shard_sizes(n, size * k)
    return sum(sizes[:rank * k]), sum(sizes[:(rank + 1) * k])


def flatten(arrays, extra=()):
    """One 1-D array on arrays[0]'s context: every array raveled, end to end, then `extra`."""
    home = arrays[0].context
    return nd.concat(*[a.reshape((-1,)) for a in arrays], *[e.as_in_context(home) for e in extra],
                     dim=0)


def unflatten(flat, arrays):
    """Afterwards each arrays[i] holds its slice of `flat` (the inverse of flatten, any context)."""
    offset = 0
    for a in arrays:
        a[:] = flat[offset:offset + a.size].reshape(a.shape).as_in_context(a.context)
        offset += a.size


class TwoLevelDataParallel(DataParallel):
    """DataParallel over several processes: gradients summed by hand over this process's
    contexts, then across processes in one call; then every replica takes the same update."""

    def __init__(self, params, ctx, optimizer, world, allreduce_fn=allreduce, **options):
        super().__init__(params, ctx, optimizer, allreduce_fn, **options)  # fuse_grads, graph
        self.world, self.in_sync = world, False
        self.min_batch = world.size * len(self.ctx)  # what one process with all contexts needs

    def rows(self, n):
        return rank_rows(n, self.world.rank, self.world.size, len(self.ctx))

    def tensors(self, i):
        """Parameters, then optimiser state, of replica i: what rank 0 hands to everyone."""
        return self.replicas[i] + [s for st in self.states[i] for s in st]

    def sync(self):
        """Every process takes rank 0's parameters and optimiser state (at start, after resume)."""
        flat = flatten(self.tensors(0))
        self.world.broadcast(flat)
        for i in range(len(self.ctx)):
            unflatten(flat, self.tensors(i))
        self.in_sync = True

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.in_sync = False  # broadcast from rank 0 before the next step

    def metric_slots(self, i, loss, correct):
        """(2K,) zeros but for context i's loss sum and correct count at its global index g:
        [loss_0 .. loss_{K-1}, correct_0 .. correct_{K-1}] once summed over all processes."""
        K, g = self.min_batch, self.world.rank * len(self.ctx) + i
        slots = nd.zeros((2 * K,), ctx=loss.context, dtype=loss.dtype)
        slots[g:g + 1] = loss
        slots[K + g:K + g + 1] = correct
        return slots

    def local_step(self, X, y):
        """Forward and backward on this process's rows; returns one flat buffer per context,
        its gradients then its metric slots, summed over the contexts by hand."""
        self.world.progress()
        if not self.in_sync:
            self.sync()
        start, stop = self.rows(len(X))
        shards = split_and_load(X[start:stop], self.ctx), split_and_load(y[start:stop], self.ctx)
        metrics = graph_forward_backward(self.graph, *shards, self.replicas) if self.graph else \
            forward_backward(*shards, self.replicas)
        flats = [flatten(self.grads(i), [self.metric_slots(i, *m)]) for i, m in enumerate(metrics)]
        self.allreduce_fn(flats)                       # inside the process: the lesson's allreduce
        return flats

    def grads(self, i):
        """Context i's gradients: one flat buffer with --fuse-grads, else one array per parameter."""
        return [self.flat[i].grad] if self.flat else [p.grad for p in self.replicas[i]]

    def update(self, i, lr, batch_size):
        """Replica i's optimiser step from the gradients now in its grads(i)."""
        if self.flat:
            apply_update([self.flat[i].flat], [self.flat_states[i]], self.optimizer, lr, self.t,
                         batch_size)
        else:
            apply_update(self.replicas[i], self.states[i], self.optimizer, lr, self.t, batch_size)

    def metrics(self, total, contexts):
        """(loss sum, correct) of the given global contexts: slices of the reduced buffer."""
        K, P = self.min_batch, total.size - 2 * self.min_batch
        return [(total[P + g:P + g + 1], total[P + K + g:P + K + g + 1]) for g in contexts]

    def step(self, X, y, lr):
        self.t += 1
        flats = self.local_step(X, y)
        total = flats[0]                               # (P + 2K,)
        self.world.allreduce(total, "grads")           # across processes: one call per step
        for i in range(len(self.ctx)):
            unflatten(total, self.grads(i))
            self.update(i, lr, len(X))
        # What one process with all K contexts returns: every context's (loss sum, correct).
        return self.metrics(total, range(self.min_batch))

    def correct(self, X, y):
        """Correct predictions on (X, y): each process counts its share, the counts are summed."""
        self.world.progress()
        if not self.in_sync:
            self.sync()
        if len(X) >= self.world.size:
            start, stop = rank_rows(len(X), self.world.rank, self.world.size, 1)
        else:
            start, stop = (0, len(X)) if self.world.is_root else (0, 0)
        if stop > start:
            count = super().correct(X[start:stop], y[start:stop]).as_in_context(self.ctx[0])
        else:
            count = nd.zeros((1,), ctx=self.ctx[0])
        self.world.allreduce(count, "correct")
        return count
