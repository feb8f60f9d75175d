"""Gradient buckets: the flat buffer of manual_dp.fast.flat cut into several, one per bucket, so
that each bucket's all-reduce can start as soon as backward has written its gradients.

    buckets of 0.1 MB, LeNet (reverse layer order, as backward produces them):
        bucket 0  [ W4 | b4 | W3 ]      (W3 alone is 0.39 MB: the bucket closes when it reaches the size)
        bucket 1  [ b3 | W2 | b2 | ... ]

MXNet tracks dependencies per array, not per byte range: an all-reduce of one flat buffer waits
for every write into it, i.e. the whole backward. Each bucket here is an NDArray of its own
(parameters and gradients are views of it), so its all-reduce, pushed right after backward was
pushed, depends only on the backward ops that write its gradients: the engine runs it while
earlier layers' backward still runs. bucket_mb 0 is one bucket per parameter (the lesson's one
all-reduce per gradient, in reverse order), a huge one is the single fused buffer.
"""
import numpy as np

from ..optim import apply_update_and_clear, init_states
from .flat import FlatReplica

MB = 1024 * 1024


def plan_buckets(sizes, bucket_bytes):
    """Lists of parameter indices, last parameter first: a bucket takes parameters until it holds
    at least `bucket_bytes` (0: one parameter a bucket), so only the last one can be smaller."""
    if bucket_bytes < 0:
        raise ValueError(f"a bucket size must be >= 0, got {bucket_bytes}")
    buckets, current, held = [], [], 0
    for i in reversed(range(len(sizes))):
        current.append(i)
        held += sizes[i]
        if held >= bucket_bytes:
            buckets.append(current)
            current, held = [], 0
    return buckets + ([current] if current else [])


class BucketedReplica:
    """One device's parameters as views of one FlatReplica per bucket (`groups`, in bucket order);
    `params` in the model's order, `states` the per-parameter views of the flat optimiser state."""

    def __init__(self, params, ctx, buckets, optimizer):
        self.buckets, self.groups = buckets, [FlatReplica([params[i] for i in b], ctx) for b in buckets]
        self.flat_states = [init_states([g.flat], optimizer)[0] for g in self.groups]
        self.params, self.states = [None] * len(params), [None] * len(params)
        for b, g, s in zip(buckets, self.groups, self.flat_states):
            for i, p, st in zip(b, g.params, g.state_views(s)):
                self.params[i], self.states[i] = p, st


class Buckets:
    """Every context's BucketedReplica of `params` in buckets of `bucket_mb` MB (same plan on all).

    reduce_and_update pushes, bucket by bucket, its all-reduce and then its optimiser update: each
    touches only that bucket's arrays, so MXNet runs it as soon as backward has written them.
    `marks`, if set, is called mark(bucket, event, arrays) around them (manual_dp.fast.trace).
    """

    def __init__(self, params, ctx, bucket_mb, optimizer, names=None):
        sizes = [p.size * np.dtype(p.dtype).itemsize for p in params]       # bytes
        self.plan = plan_buckets(sizes, bucket_mb * MB)
        self.bytes = [sum(sizes[i] for i in b) for b in self.plan]
        names = names or [f"p{i}" for i in range(len(params))]
        self.names = [[names[i] for i in b] for b in self.plan]
        self.replicas = [BucketedReplica(params, c, self.plan, optimizer) for c in ctx]
        self.optimizer, self.marks = optimizer, None

    def grads(self, b):
        """Bucket b's flat gradient on every context."""
        return [r.groups[b].grad for r in self.replicas]

    def reduce_and_update(self, allreduce_fn, lr, t, n_examples, count=None, reduced=None):
        """Afterwards every replica took the same update from the gradients summed over the
        contexts, bucket by bucket, and the gradients are zero. count(n) (clipping) needs every
        bucket summed first: then all are reduced before any is updated, with n = count(n);
        reduced(b, grads), if given, sees each bucket's sum before its update."""
        mark = self.marks or (lambda b, event, arrays: None)
        if count:
            for b in range(len(self.plan)):
                allreduce_fn(self.grads(b))
            n_examples = count(n_examples)
        for b in range(len(self.plan)):
            grads = self.grads(b)
            if not count:
                mark(b, "ready", grads)
                allreduce_fn(grads)
                mark(b, "reduced", grads)
                if reduced:
                    reduced(b, grads)
            for r in self.replicas:
                apply_update_and_clear([r.groups[b].flat], [r.flat_states[b]], self.optimizer, lr, t, n_examples)
            mark(b, "updated", grads)      # zeroed after the update read them: so after both
