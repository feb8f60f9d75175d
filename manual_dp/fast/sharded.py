"""Reduce-scatter and all-gather, the two halves of an all-reduce, in the collectives' contract style:
one array per context, explicit contexts, a naive algorithm beside a ring.

A sharded array of n elements over k contexts: context i owns the contiguous chunk
[bounds[i], bounds[i+1]) (default: collectives.chunk_bounds(n, k), sizes differing by at most one,
some empty when n < k).

    reduce_scatter(arrays, shards)   afterwards shards[i] (on its own context) holds chunk i of the
                                     elementwise sum of all `arrays`; the arrays are unchanged
    reduce_scatter(arrays)           in place: chunk i of arrays[i] holds it (MPI_IN_PLACE); the
                                     other chunks of the arrays are left undefined
    all_gather(outs, shards)         afterwards every outs[j] holds shards[i] in its chunk i, for every i
    all_gather(outs)                 in place: chunk i of outs[i] is the source of chunk i

Each takes a `wire` (default collectives.DIRECT: nothing added): every transfer between contexts goes
through wire.ship(src, ctx), so that an EmulatedLink (manual_dp.fast.link, `--link`) delays each one.

A shard is a 1-D array of its own (None for an empty chunk): MXNet tracks dependencies per array,
so shards written on different contexts proceed independently, while chunks that are views of one
array wait for each other. Two algorithms each:

    naive   through one device: everything summed (or assembled) on the first context, then
            copied out, as the lesson's allreduce does
    ring    k-1 steps around the ring 0 -> 1 -> ... -> k-1 -> 0, each moving one chunk per link
            (half of collectives.ring_allreduce, scheduled so that rank i ends with chunk i)
"""
from mxnet import nd

from .collectives import DIRECT, chunk_bounds, fetch


def flat_views(arrays):
    """1-D views of `arrays` (any shapes; 0-d ones as 1 element)."""
    return [a.reshape((1,)) if a.ndim == 0 else a.reshape((-1,)) for a in arrays]


def shard_sizes_of(bounds):
    return [b - a for a, b in zip(bounds, bounds[1:])]


def empty_shards(n, ctx, dtype="float32", bounds=None):
    """Zeroed shards of an n-element array over `ctx`: shards[i] on ctx[i], of chunk i's size
    (None where the chunk is empty)."""
    bounds = bounds or chunk_bounds(n, len(ctx))
    return [nd.zeros((m,), ctx=c, dtype=dtype) if m else None for m, c in zip(shard_sizes_of(bounds), ctx)]


def checked(arrays, shards, bounds):
    """(1-D views of arrays, bounds) after checking the arguments agree; ValueError otherwise."""
    if not arrays:
        return [], [0]
    sizes = {a.size for a in arrays}
    if len(sizes) != 1:
        raise ValueError(f"sharded collective over arrays of different sizes: {sorted(sizes)}")
    n, k = sizes.pop(), len(arrays)
    bounds = list(bounds or chunk_bounds(n, k))
    if len(bounds) != k + 1 or bounds[0] != 0 or bounds[-1] != n or any(
            a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"bounds {bounds} do not cut {n} elements into {k} ordered chunks")
    if shards is not None:
        want = shard_sizes_of(bounds)
        got = [0 if s is None else s.size for s in shards]
        if got != want:
            raise ValueError(f"shards of sizes {got}, expected {want}")
    return flat_views(arrays), bounds


def chunk(flat, bounds, i):
    """View of chunk i of the 1-D `flat`, or None when empty."""
    a, b = bounds[i], bounds[i + 1]
    return flat[a:b] if b > a else None


def naive_reduce_scatter(arrays, shards=None, bounds=None, wire=DIRECT):
    """Afterwards shards[i] (or chunk i of arrays[i]) holds chunk i of the sum: every array added
    up in one add_n on the first context, then each chunk copied to its owner."""
    flat, bounds = checked(arrays, shards, bounds)
    if not flat or bounds[-1] == 0 or (shards is None and len(flat) == 1):
        return
    home = flat[0].context
    total = nd.add_n(*[flat[0]] + [fetch(wire.ship(f, home), home) for f in flat[1:]]) if len(flat) > 1 else flat[0]
    for i in range(len(flat)):
        dest = shards[i] if shards is not None else chunk(flat[i], bounds, i)
        if dest is not None:
            wire.ship(chunk(total, bounds, i), dest.context).copyto(dest)


def naive_all_gather(outs, shards=None, bounds=None, wire=DIRECT):
    """Afterwards every outs[j] holds every chunk: each assembled in outs[0], then outs[0] copied
    whole to the others."""
    flat, bounds = checked(outs, shards, bounds)
    if not flat or bounds[-1] == 0:
        return
    for i in range(len(flat)):
        if shards is not None and shards[i] is not None:
            wire.ship(shards[i], flat[0].context).copyto(chunk(flat[0], bounds, i))
        elif shards is None and i > 0 and bounds[i + 1] > bounds[i]:
            wire.ship(chunk(flat[i], bounds, i), flat[0].context).copyto(chunk(flat[0], bounds, i))
    for f in flat[1:]:
        wire.ship(flat[0], f.context).copyto(f)


def ring_reduce_scatter_schedule(k):
    """Steps of (src, dst, chunk): in step s rank i sends its partial sum of chunk (i - s - 1) mod k
    to rank i+1, which adds its own; after k-1 steps rank i holds the full sum of chunk i."""
    return [[(i, (i + 1) % k, (i - s - 1) % k) for i in range(k)] for s in range(k - 1)]


def ring_all_gather_schedule(k):
    """Steps of (src, dst, chunk): in step s rank i passes chunk (i - s) mod k (its own first) to
    rank i+1; after k-1 steps every rank holds every chunk."""
    return [[(i, (i + 1) % k, (i - s) % k) for i in range(k)] for s in range(k - 1)]


def ring_reduce_scatter(arrays, shards=None, bounds=None, wire=DIRECT):
    """Afterwards shards[i] (or chunk i of arrays[i]) holds chunk i of the sum, the partial sums
    passed around the ring (see ring_reduce_scatter_schedule). Each partial sum is a new array on
    the receiving context, so the ring's links work independently; the inputs are only read."""
    flat, bounds = checked(arrays, shards, bounds)
    k = len(flat)
    partial = {}                                   # (rank, chunk) -> that rank's running sum
    for step, transfers in enumerate(ring_reduce_scatter_schedule(k)):
        for src, dst, c in transfers:
            if bounds[c + 1] == bounds[c]:
                continue
            sent = partial.get((src, c), chunk(flat[src], bounds, c))
            own = chunk(flat[dst], bounds, c)
            if step == k - 2:                      # the last addition: into its destination
                out = shards[dst] if shards is not None else own
                nd.elemwise_add(own, fetch(wire.ship(sent, own.context), own.context), out=out)
            else:
                partial[(dst, c)] = nd.elemwise_add(own, fetch(wire.ship(sent, own.context), own.context))
    if k == 1 and shards is not None and shards[0] is not None:
        flat[0].copyto(shards[0])


def ring_all_gather(outs, shards=None, bounds=None, wire=DIRECT):
    """Afterwards every outs[j] holds every chunk, each passed on around the ring (see
    ring_all_gather_schedule). What a rank passes on it reads from its own out (one array per
    rank, so a rank's receives and sends take turns). A step's sends are all issued before its
    receives: a receive writes the array its rank's send of the step reads, and issued first it
    would chain the step's sends one after another (over a link, k delays a step instead of one)."""
    flat, bounds = checked(outs, shards, bounds)
    k = len(flat)
    for i in range(k):
        if shards is not None and shards[i] is not None:
            shards[i].copyto(chunk(flat[i], bounds, i))
    for transfers in ring_all_gather_schedule(k):
        sent = [(wire.ship(chunk(flat[src], bounds, c), flat[dst].context), dst, c)
                for src, dst, c in transfers if bounds[c + 1] > bounds[c]]
        for piece, dst, c in sent:
            piece.copyto(chunk(flat[dst], bounds, c))


REDUCE_SCATTER = {"naive": naive_reduce_scatter, "ring": ring_reduce_scatter}
ALL_GATHER = {"naive": naive_all_gather, "ring": ring_all_gather}
