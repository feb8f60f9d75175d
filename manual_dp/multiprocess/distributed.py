"""More than one process: any strategy, composed with a second sum across processes.

Inside a process the strategy's own all-reduce sums the gradients of its contexts; across processes
an existing engine sums them again (CrossProcessAllreduce). Every process draws the same shuffled
global batches and takes the rows its contexts would take if one process split each batch over all
of them (MultiProcess), so N processes x k contexts compute what one process with N*k contexts
computes; update normalises by the global batch.
"""
import time

import numpy as np
from mxnet import nd

from ..errors import CheckpointError
from ..strategies.base import Wrapper, rank_rows


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


class CrossProcessAllreduce:
    """`local` over this process's replicas, then the engine's sum of arrays[0] across processes,
    copied back to the other replicas: afterwards every arrays[i] holds the sum over every context
    of every process. key: the engine's name for the sum (default: by shape); named(key) gives one
    of another name, for sums made inside an autograd backward, which must not wait on a pull of
    the same name made earlier in the step (fast.tensor_ops.keyed)."""

    def __init__(self, local, world, key=None):
        self.local, self.world, self.key = local, world, key

    def named(self, key, like=None):
        """This all-reduce under the name `key`; `like`: an array of the shape it will sum, whose
        name the engine readies now (World.prepare)."""
        if like is not None:
            self.world.prepare(key, like)
        return CrossProcessAllreduce(self.local, self.world, key)

    def __call__(self, arrays):
        self.local(arrays)
        self.world.allreduce(arrays[0], self.key or "sum" + "x".join(map(str, arrays[0].shape)))
        for a in arrays[1:]:
            arrays[0].copyto(a)


class MultiProcess(Wrapper):
    """`model` as one process of `world`: its backward sees this process's rows of each global
    batch; its all-reduce must already sum across processes (World.reducer)."""

    def __init__(self, model, world):
        super().__init__(model)
        self.world, self.stamps, self.first_at = world, [], None

    @property
    def min_batch(self):
        """The smallest global batch that gives every process's strategy its min_batch rows (with
        the default rows, what one process with every context needs: size x min_batch)."""
        k, size = self.model.min_batch, self.world.size
        return next(n for n in range(1, size * k + 1) if self.fits(n, k, size))

    def fits(self, n, k, size):
        """Whether a global batch of n gives every process's strategy k rows at least."""
        try:
            return all(stop - start >= k for start, stop in (self.model.rows(n, r, size) for r in range(size)))
        except ValueError:                                 # too few rows to split at all
            return False

    def own_rows(self, n):
        """This process's rows of a global batch of n, as its strategy asks (Strategy.rows)."""
        return self.model.rows(n, self.world.rank, self.world.size)

    def backward(self, X, y):
        self.world.progress()
        self.world.step = self.model.t + 1
        self.stamps.append(time.perf_counter())
        if self.first_at is None:
            self.first_at = time.time()
        start, stop = self.own_rows(len(X))
        return self.model.backward(X[start:stop], y[start:stop])

    def correct(self, X, y):
        """Each process counts its share of (X, y); the counts are summed across processes."""
        self.world.progress()
        if len(X) >= self.world.size:
            start, stop = rank_rows(len(X), self.world.rank, self.world.size, 1)
        else:
            start, stop = (0, len(X)) if self.world.is_root else (0, 0)
        count = nd.zeros((1,), ctx=self.ctx[0])
        if stop > start:
            count += self.model.correct(X[start:stop], y[start:stop]).as_in_context(self.ctx[0])
        self.world.allreduce(count, "correct")
        return count

    def job_metrics(self, metrics):
        """Every process's (loss sum, correct) pairs, in the order of the global contexts, as one
        process with all of them would hold them (exact: each pair is summed with zeros only)."""
        k, rank = len(metrics), self.world.rank
        K, home = self.world.size * k, metrics[0][0].context
        slots = nd.zeros((2 * K,), ctx=home)            # [loss_0 .. loss_K-1, correct_0 .. correct_K-1]
        for i, (loss, correct) in enumerate(metrics):
            g = rank * k + i
            slots[g:g + 1] = loss.as_in_context(home)
            slots[K + g:K + g + 1] = correct.as_in_context(home)
        self.world.allreduce(slots, "metrics")
        return [(slots[g:g + 1], slots[K + g:K + g + 1]) for g in range(K)]

    def fingerprints(self):
        """Every rank's copies, gathered: each checksum as two 16-bit halves (exact in float32) in
        the rank's slots of one array, summed across processes."""
        mine = self.model.fingerprints()
        flat = [c for copies in mine.values() for _, sums in copies for _, c in sums]
        n, rank = 2 * len(flat), self.world.rank
        slots = nd.zeros((self.world.size * n,), ctx=self.ctx[0])
        slots[rank * n:(rank + 1) * n] = nd.array([h for c in flat for h in divmod(c, 1 << 16)],
                                                   ctx=self.ctx[0])
        self.world.allreduce(slots, "fingerprints")
        halves = slots.asnumpy().astype("int64").reshape(self.world.size, -1, 2)
        sums = [iter(int(hi) << 16 | int(lo) for hi, lo in halves[r]) for r in range(self.world.size)]
        return {group: [(f"rank {r} {place}", [(name, next(sums[r])) for name, _ in values])
                        for r in range(self.world.size) for place, values in copies]
                for group, copies in mine.items()}

    def end_epoch(self, lr):
        """The inner strategy's extras, with every rank's step times of the epoch and the wall
        clock time of rank 0's first step."""
        extras, first_at = self.model.end_epoch(lr), self.first_at
        return dict(extras, **self.step_times(), first_step_at=first_at)

    def step_times(self):
        """{"step_sec_median": [per rank], "step_sec_max": [per rank]}: the seconds between one
        batch's start and the next's on each rank's host (the last batch's until now), gathered;
        afterwards a new epoch's times begin."""
        stamps, self.stamps, self.first_at = self.stamps + [time.perf_counter()], [], None
        own = np.diff(stamps) if len(stamps) > 1 else np.zeros(1)
        size, rank = self.world.size, self.world.rank
        slots = nd.zeros((2 * size,), ctx=self.ctx[0])           # [median_r .., max_r ..]
        slots[rank] = float(np.median(own))
        slots[size + rank] = float(own.max())
        self.world.allreduce(slots, "step_times")
        got = slots.asnumpy()
        return {"step_sec_median": [round(float(v), 6) for v in got[:size]],
                "step_sec_max": [round(float(v), 6) for v in got[size:]]}

    def layout(self, batch_size):
        start, stop = self.own_rows(batch_size)
        return self.model.layout(stop - start)

    def state_dict(self):
        """The strategy's state, with every process's part of what differs between processes
        (Strategy.per_process_extra: local SGD's replicas and their inner optimiser state) gathered,
        rank after rank, and the process count in extra["processes"]; then what the strategy makes
        of them (Strategy.job_state: local SGD's mean inner state over every process's replicas).
        Every rank must call it."""
        state = self.model.state_dict()
        size, rank = self.world.size, self.world.rank
        extra = dict(state["extra"], processes=[np.array([size], dtype=np.int64)])
        for key in (k for k in self.model.per_process_extra if k in extra):
            gathered = []
            for i, mine in enumerate(extra[key]):
                table = nd.zeros((size,) + mine.shape, ctx=self.ctx[0], dtype=mine.dtype)
                table[rank] = nd.array(mine, ctx=self.ctx[0], dtype=mine.dtype)
                self.world.allreduce(table, f"state-{key}-{i}")    # zeros elsewhere: each slot exact
                gathered.append(table.asnumpy())
            extra[key] = [g[r] for r in range(size) for g in gathered]
        return self.model.job_state(dict(state, extra=extra))

    def load_state_dict(self, state):
        """This process's part of what differs between processes; CheckpointError if the checkpoint
        holds such state of another number of processes."""
        extra, keys = dict(state.get("extra", {})), [k for k in self.model.per_process_extra if k in state.get("extra", {})]
        saved = int(extra.pop("processes", [np.array([1])])[0][0])
        if keys and saved != self.world.size:
            raise CheckpointError(f"the checkpoint holds the per-process state ({', '.join(keys)}) of {saved} "
                                  f"process(es); resume it with {saved}, not {self.world.size}")
        for key in keys:
            per = len(extra[key]) // saved
            extra[key] = extra[key][self.world.rank * per:(self.world.rank + 1) * per]
        self.model.load_state_dict(dict(state, extra=extra))
