"""ZeRO over a mesh's data dimension (`--zero-stage 1|2|3` with tensor, context and mesh modes): each
of the D copies of a parameter keeps the optimiser state of 1/D of it (stage 1), in stage 2 also
the gradient of 1/D of it, and in stage 3 also the parameter: 1/D of it between uses.

A copy group is the arrays that hold the same parameter (or the same tensor shard of it) on D
contexts, whose gradients are summed: the data-parallel replicas, or under sequence and context
parallelism the whole data x group. Instead of an all-reduce and D identical updates, each group's
gradients are reduce-scattered (context r receives the sum of chunk r of the flat gradient), each
context updates its chunk of the parameter with its chunk of the state, and the updated chunks are
all-gathered into every copy: the same arithmetic per element as the all-reduce and the update,
so the same parameters (to the rounding of the sum's order), and 1/D of the state per context.

                 gradient kept between the backward and the update     per context
    stage 1      every copy's .grad (grad_req "add"), whole             the whole gradient
    stage 2      grad_chunks[g][r]: chunk r of the summed gradient      1/D of it

Stage 2 and MXNet: a buffer attached to an array (attach_grad) lives as long as the array, so
stage 2 attaches none (a 1-element stand-in: the arrays stay autograd variables) and takes each
backward's gradients from autograd.grad, new arrays that exist only until `scatter` has added
their chunks into the chunk buffers. A backward is one autograd call (tensor, context: the whole
step's; a mesh's pipeline: one stage's micro-batch), so within it the copy's whole gradient exists
once, as in ZeRO-2's bucketed reduce-scatter; between backwards and until the update only chunks.

Stage 3: param_chunks[g][r], chunk r of group g's flat parameter on copy r's context, is all a
copy keeps between uses; the update steps the chunk alone (no all-gather after it). A use (a
step's forward and backward, an evaluation, a fingerprint, a checkpoint) runs inside `gathered`,
which all-gathers every group's chunks into a whole temporary on each copy's context and drops it
afterwards. The strategies' arrays stay the same Python objects (every list that holds them keeps
working): `swap` exchanges the C buffer an NDArray points at, a 1-element stand-in between uses
and the gathered whole during one, as PyTorch FSDP resizes a parameter's storage to 0 and back.

The gathering unit is everything a copy holds (the whole model per replica; in a mesh, a
context's pipeline stage(s)), once per step for its forward and backward together: MXNet's
autograd keeps every array a recorded operator read until that operator's backward, so dropping
the whole after a forward (FSDP's reshard-after-forward) would free nothing before the backward,
and in a pipeline a stage's weights are read from its first micro-batch's forward to its last's
backward anyway. So during a step a context holds its whole share (stage 2's parameter bytes) plus
its chunks; between steps the chunks, 1/D of it.
"""
from contextlib import contextmanager, nullcontext

import numpy as np
from mxnet import autograd, nd

from ...fast.collectives import chunk_bounds
from ...optim import OPTIMIZERS


def backward(heads, arrays, zero=None, head_grads=None, inputs=()):
    """The backward of `heads` (with `head_grads`, or ones); returns the gradients of `inputs`
    (marked arrays the graph starts from). Afterwards the gradients of `arrays` (the parameters
    whose graph it is) are added into their .grad, or under ZeRO stages 2 and 3 into zero's chunks."""
    if zero is not None and zero.stage >= 2:
        grads = autograd.grad(heads, list(arrays) + list(inputs), head_grads)
        zero.scatter(arrays, grads[:len(arrays)])
        return grads[len(arrays):]
    autograd.backward(heads, head_grads)
    return [x.grad for x in inputs]


def gathered(zero, keep=False):
    """A `with` scope in which every copy of every parameter is whole (ZeRO-3: all-gathered from
    its chunks, dropped at the end; keep: the chunks first taken from the copies, as a load writes
    them); without ZeRO-3 there is nothing to do."""
    return zero.whole(keep) if zero is not None and zero.stage == 3 else nullcontext()


def swap(a, b):
    """Afterwards the NDArray object `a` points at the buffer `b` did and `b` at `a`'s: the objects
    (held in the strategy's lists) keep their identity, only their contents and shapes change."""
    a.handle, b.handle = b.handle, a.handle


def peak(held, zero):
    """A strategy's arrays() `held` and, under ZeRO-3, the wholes gathered during a step."""
    return dict(held, param=held["param"] + (zero.whole_records() if zero is not None else []))


class Record:
    """An array's context, shape, size and dtype, for the memory report of a transient array."""

    def __init__(self, context, shape, dtype):
        self.context, self.shape, self.dtype = context, shape, dtype
        self.size = int(np.prod(shape))


class DataShardedOptimizer:
    """The optimiser of every copy group: groups[g] the D arrays (one per context, equal shapes)
    whose gradients are summed, marked for autograd (grad_req "add"); stage 1 reads their .grad,
    stage 2 swaps it for a stand-in and keeps grad_chunks instead (gradients come in by `scatter`);
    stage 3 keeps param_chunks too, and the arrays are 1-element stand-ins outside `whole`."""

    def __init__(self, groups, optimizer, stage=1):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO over the data dimension has stages 1, 2 and 3, not {stage}")
        self.groups, self.optimizer, self.stage = groups, optimizer, stage
        self.shapes, self.depth = [g[0].shape for g in groups], 0
        init, self.rule = OPTIMIZERS[optimizer]
        self.bounds = [chunk_bounds(int(np.prod(g[0].shape)), len(g)) for g in self.groups]
        # states[g][r]: the state of chunk r of group g, on copy r's context (None for an empty chunk)
        self.states = [[init(nd.zeros((b - a,), ctx=p.context, dtype=p.dtype)) if b > a else None
                        for p, a, b in zip(group, bounds, bounds[1:])]
                       for group, bounds in zip(self.groups, self.bounds)]
        self.grad_chunks = self.param_chunks = None
        if stage >= 2:           # grad_chunks[g][r]: chunk r of group g's summed gradient, on copy r's context
            self.grad_chunks = [[nd.zeros((b - a,), ctx=p.context, dtype=p.dtype) if b > a else None
                                 for p, a, b in zip(group, bounds, bounds[1:])]
                                for group, bounds in zip(self.groups, self.bounds)]
            self.where = {id(p): (g, r) for g, group in enumerate(self.groups) for r, p in enumerate(group)}
            for group in self.groups:    # the whole .grad buffers freed: each array keeps a 1-element stand-in
                autograd.mark_variables(group, [nd.zeros((1,), ctx=p.context, dtype=p.dtype) for p in group], "write")
        if stage == 3:           # param_chunks[g][r]: chunk r of group g's flat parameter, on copy r's context
            self.param_chunks = [[p.reshape((-1,))[a:b].copy() if b > a else None
                                  for p, a, b in zip(group, bounds, bounds[1:])]
                                 for group, bounds in zip(self.groups, self.bounds)]
            self.release()

    def gather(self):
        """Afterwards every copy is whole on its context: the concatenation of its group's chunks
        (an all-gather), marked for autograd with a 1-element stand-in gradient (as stage 2)."""
        for group, chunks, shape in zip(self.groups, self.param_chunks, self.shapes):
            for p in group:
                swap(p, nd.concat(*[c.as_in_context(p.context) for c in chunks if c is not None], dim=0)
                     .reshape(shape))
            autograd.mark_variables(group, [nd.zeros((1,), ctx=p.context, dtype=p.dtype) for p in group], "write")

    def release(self):
        """Afterwards every copy is a 1-element stand-in; its whole is freed (once autograd lets go)."""
        for group in self.groups:
            for p in group:
                swap(p, nd.zeros((1,), ctx=p.context, dtype=p.dtype))

    def take(self):
        """Chunk r of every group from copy r (after a load has written the copies whole)."""
        for group, chunks, bounds in zip(self.groups, self.param_chunks, self.bounds):
            for p, chunk, a, b in zip(group, chunks, bounds, bounds[1:]):
                if chunk is not None:
                    chunk[:] = p.reshape((-1,))[a:b]

    @contextmanager
    def whole(self, keep=False):
        """Stage 3: within, every copy whole (gathered once, however deep the scopes nest);
        afterwards only the chunks (keep: taken from the copies first)."""
        self.depth += 1
        if self.depth == 1:
            self.gather()
        try:
            yield
        finally:
            if keep:
                self.take()
            self.depth -= 1
            if self.depth == 0:
                self.release()

    def scatter(self, arrays, grads):
        """Stage 2: afterwards chunk r of every group holds itself plus chunk r of the sum of `grads`
        (grads[n] the gradient of arrays[n], a copy in some group), summed in copy order."""
        by_group = {}
        for p, grad in zip(arrays, grads):
            g, r = self.where[id(p)]
            by_group.setdefault(g, []).append((r, grad.reshape((-1,))))
        for g, pieces in by_group.items():
            flats = [flat for _, flat in sorted(pieces, key=lambda rf: rf[0])]
            for chunk, a, b in zip(self.grad_chunks[g], self.bounds[g], self.bounds[g][1:]):
                if chunk is not None:
                    total = nd.add_n(*[f[a:b].as_in_context(chunk.context) for f in flats])    # (b - a,)
                    nd.elemwise_add(chunk, total, out=chunk)

    def summed_chunk(self, g, r, a, b):
        """Chunk r ([a, b) of the flat gradient) of group g summed over its copies, on copy r's context."""
        if self.stage >= 2:
            return self.grad_chunks[g][r]
        p = self.groups[g][r]
        return nd.add_n(*[q.grad.reshape((-1,))[a:b].as_in_context(p.context) for q in self.groups[g]])

    def step(self, lr, t, n_examples):
        """Reduce-scatter (stages 2, 3: already done, chunk by chunk), update each chunk where its
        state lives, all-gather (stage 3: not until the next use); then zero the gradients.
        n_examples None: a skipped update (the gradients only zeroed)."""
        for g, (group, bounds, states) in enumerate(zip(self.groups, self.bounds, self.states)):
            if n_examples is not None and self.stage == 3:
                for r, (chunk, state) in enumerate(zip(self.param_chunks[g], states)):
                    if chunk is not None:
                        self.rule(chunk, self.grad_chunks[g][r] / n_examples, state, lr, t)
            elif n_examples is not None:
                flats = [p.reshape((-1,)) for p in group]
                for r, (p, a, b, state) in enumerate(zip(flats, bounds, bounds[1:], states)):
                    if b > a:
                        self.rule(p[a:b], self.summed_chunk(g, r, a, b) / n_examples, state, lr, t)
                for r, (a, b) in enumerate(zip(bounds, bounds[1:])):
                    if b > a:
                        for p in flats:
                            if p is not flats[r]:
                                p[a:b] = flats[r][a:b].as_in_context(p.context)
            for grad in self.grad_arrays(g):
                grad[:] = 0

    def grad_arrays(self, g=None):
        """The gradient arrays kept (of group g, or of all): every copy's .grad (stage 1), or the chunks."""
        groups = range(len(self.groups)) if g is None else [g]
        if self.stage == 1:
            return [p.grad for n in groups for p in self.groups[n]]
        return [c for n in groups for c in self.grad_chunks[n] if c is not None]

    def param_arrays(self):
        """The parameter chunks kept between uses (stage 3; none before it)."""
        return [c for chunks in self.param_chunks or [] for c in chunks if c is not None]

    def whole_records(self):
        """Stage 3: a record of every copy's gathered whole, held during a step (none before it)."""
        return [Record(p.context, shape, p.dtype) for group, shape in zip(self.groups, self.shapes)
                for p in group] if self.stage == 3 else []

    def total(self, g, home):
        """Group g's gradient summed over its copies, whole, in the parameter's shape, on `home`."""
        if self.stage == 1:
            return nd.add_n(*[a.grad.as_in_context(home) for a in self.groups[g]])
        chunks = [c.as_in_context(home) for c in self.grad_chunks[g] if c is not None]
        return nd.concat(*chunks, dim=0).reshape(self.shapes[g])

    def state_arrays(self):
        """Every state array (for the memory report)."""
        return [s for states in self.states for state in states if state for s in state]

    def whole_state(self, g):
        """Group g's optimiser state, whole: one host array per state slot, in the parameter's shape."""
        shape = self.shapes[g]
        slots = next((len(s) for s in self.states[g] if s is not None), 0)
        return [np.concatenate([s[k].asnumpy() for s in self.states[g] if s is not None]).reshape(shape)
                for k in range(slots)]

    def load_state(self, g, values):
        """Group g's state from whole host arrays (one per slot)."""
        for state, a, b in zip(self.states[g], self.bounds[g], self.bounds[g][1:]):
            if state is not None:
                for s, v in zip(state, values):
                    s[:] = nd.array(np.asarray(v).reshape(-1)[a:b], ctx=s.context)
