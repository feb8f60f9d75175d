"""All-reduce algorithms, all with the lesson's contract: a list of replicas of one array, one per
context; afterwards every replica holds the elementwise sum of all of them, on its own context.

    lesson          manual_dp.lesson.allreduce: add each replica into the first, copy back (reference)
    reduce_bcast    the same picture, with one add_n on the first context instead of k-1 adds
    ring            reduce-scatter then all-gather over k chunks: each link carries 2(k-1)/k of the data
    tree            pairwise sums up a binary tree in log2(k) rounds, then copies back down it
    scatter_gather  the ring's two halves in one step each: rank i sums chunk i of all k replicas
                    at once, then every rank fetches the summed chunks it lacks (all-to-all links:
                    shared memory, NVSwitch, a network switch), every rank doing the same work
    kvstore         MXNet's own kvstore('device') pushpull, as the reference to beat
    prepared        reduce_bcast's engine calls built once per list of replicas and replayed
                    (manual_dp.fast.prepared): the lesson's one call per gradient, without
                    Python's cost per engine call

Copies between contexts are engine operations like any other: the Python loop only describes who
sends what to whom, and transfers between different arrays run at the same time on different
devices. MXNet tracks dependencies per array, not per byte range, so transfers touching chunks of
the same replica (the ring's, scatter_gather's) wait for each other even when the chunks differ;
a CPU-to-CPU copy runs on the worker of the context it copies from.

Every algorithm but kvstore takes a `wire` (default DIRECT: nothing added): each transfer between
contexts goes through wire.ship(src, ctx), so that a manual_dp.fast.link.EmulatedLink (`--link`)
makes it take the link's time, hop by hop. Under a link, lesson is the lesson's own allreduce run
between the hops into and out of the first context (lesson_over_wire: manual_dp/lesson.py is not
touched), prepared is reduce_bcast (the same engine calls, each delayed, not replayed), and kvstore,
whose transfers happen inside MXNet, is refused (make_allreduce).
"""
import functools

import mxnet as mx
from mxnet import nd

from ..lesson import allreduce as lesson_allreduce
from .prepared import PreparedAllreduce, prepared_allreduce


def any_shape(algorithm):
    """`algorithm` for replicas of any one shape: nothing to do without elements ((0,), (0, 3):
    MXNet's shape inference refuses them), 0-d ones summed as 1-element views; replicas of
    different shapes are one ValueError. (Each .shape is a call into MXNet: asked once a replica.)"""
    @functools.wraps(algorithm)
    def run(*args, **kw):           # (arrays) or, for a method, (self, arrays); kw: wire
        arrays = args[-1]
        if not arrays:
            return
        shapes = [a.shape for a in arrays]
        if any(s != shapes[0] for s in shapes):
            raise ValueError(f"all-reduce of replicas of different shapes: {', '.join(map(str, shapes))}")
        if 0 not in shapes[0]:
            algorithm(*args[:-1], [a.reshape((1,)) for a in arrays] if shapes[0] == () else arrays, **kw)
    return run


def chunk_bounds(n, k):
    """k+1 offsets cutting n items into k contiguous chunks that differ by at most one (some may be empty)."""
    return [i * (n // k) + min(i, n % k) for i in range(k + 1)]


def fetch(src, ctx):
    """`src` readable on `ctx`: a copy there, except between CPU contexts, which share one memory
    and so read each other's arrays in place (as MXNet's own CPU kvstore does)."""
    if src.context.device_type == "cpu" and ctx.device_type == "cpu":
        return src
    return src.copyto(ctx)


class Direct:
    """The wire of a transfer that costs nothing more than the copy itself."""

    def ship(self, src, ctx):
        """src's values, ready to be carried to `ctx`: src itself."""
        return src

    def ship_all(self, pairs):
        """[(src, ctx)]: every src as it is."""
        return [src for src, _ in pairs]


DIRECT = Direct()


@any_shape
def reduce_bcast(arrays, wire=DIRECT):
    """Afterwards every `arrays[i]` holds the sum: added in one add_n on the first context, copied back."""
    home = arrays[0].context
    if len(arrays) > 1:
        nd.add_n(*[arrays[0]] + [fetch(wire.ship(a, home), home) for a in arrays[1:]], out=arrays[0])
    for a in arrays[1:]:
        wire.ship(arrays[0], a.context).copyto(a)


@any_shape
def lesson_over_wire(arrays, wire=DIRECT):
    """Afterwards every `arrays[i]` holds the sum: the lesson's allreduce, unchanged, summing the
    first replica and what the k-1 others sent it over `wire`, then the sum sent back over it."""
    home = arrays[0].context
    lesson_allreduce([arrays[0]] + [wire.ship(a, home) for a in arrays[1:]])
    for a in arrays[1:]:
        wire.ship(arrays[0], a.context).copyto(a)


def ring_schedule(k):
    """The ring's transfers, step by step: lists of (src, dst, chunk, phase), phase "add" or "copy".

    Reduce-scatter: in step s rank i sends chunk (i - s) mod k to rank i+1, which adds it to its
    own; after k-1 steps rank i holds the full sum of chunk (i + 1) mod k. All-gather: in step s
    rank i passes chunk (i + 1 - s) mod k on, and rank i+1 overwrites its copy with it.
    """
    reduce = [[(i, (i + 1) % k, (i - s) % k, "add") for i in range(k)] for s in range(k - 1)]
    gather = [[(i, (i + 1) % k, (i + 1 - s) % k, "copy") for i in range(k)] for s in range(k - 1)]
    return reduce + gather


def tree_schedule(k):
    """The tree's transfers, round by round: rank i+step adds into rank i (step 1, 2, 4, ...) until
    rank 0 holds the sum, then the same edges copy it back down, last round first."""
    up, step = [], 1
    while step < k:
        up.append([(i + step, i, None, "add") for i in range(0, k - step, 2 * step)])
        step *= 2
    down = [[(dst, src, None, "copy") for src, dst, _, _ in edges] for edges in reversed(up)]
    return up + down


def land(src, dst, phase):
    """One transfer's arrival: `dst` += `src` ("add") or `dst` = `src` ("copy"), on dst's context."""
    if phase == "add":
        nd.elemwise_add(dst, fetch(src, dst.context), out=dst)
    else:
        src.copyto(dst)


def send_all(pairs, wire):
    """Transfers (src, dst, phase) whose sources are disjoint from their destinations: every source
    shipped first, then every arrival (MXNet orders work per array, not per chunk: shipping chunk c of
    replica i after an arrival wrote another chunk of it would wait for that arrival)."""
    sent = wire.ship_all([(src, dst.context) for src, dst, _ in pairs])     # one step's transfers at once
    for src, (_, dst, phase) in zip(sent, pairs):
        land(src, dst, phase)


@any_shape
def ring_allreduce(arrays, wire=DIRECT):
    """Afterwards every `arrays[i]` holds the sum, passed around the ring 0 -> 1 -> ... -> k-1 -> 0
    in k chunks: each link carries 2(k-1)/k of the array (see ring_schedule)."""
    k = len(arrays)
    bounds = chunk_bounds(arrays[0].size, k)
    # chunk[rank][c]: views into the arrays (writing them writes the arrays); None when empty,
    # as some are for an array smaller than k
    chunk = [[flat[a:b] if b > a else None for a, b in zip(bounds, bounds[1:])]
             for flat in (x.reshape((-1,)) for x in arrays)]
    for transfers in ring_schedule(k):
        send_all([(chunk[src][c], chunk[dst][c], phase) for src, dst, c, phase in transfers
                  if chunk[src][c] is not None], wire)


@any_shape
def tree_allreduce(arrays, wire=DIRECT):
    """Afterwards every `arrays[i]` holds the sum, added up a binary tree into rank 0 in
    ceil(log2 k) rounds and copied back down it (see tree_schedule)."""
    for transfers in tree_schedule(len(arrays)):
        send_all([(arrays[src], arrays[dst], phase) for src, dst, _, phase in transfers], wire)


@any_shape
def scatter_gather_allreduce(arrays, wire=DIRECT):
    """Afterwards every `arrays[i]` holds the sum. Reduce-scatter in one step: rank i adds up
    chunk i of every replica (one add_n on its own context); all-gather in one step: rank i's
    summed chunk is copied to every other rank. Each rank takes in (k-1)/k of the array per half,
    as in the ring, but in 2 steps instead of 2(k-1), and no rank does more work than another."""
    k = len(arrays)
    bounds = chunk_bounds(arrays[0].size, k)
    flat = [x.reshape((-1,)) for x in arrays]
    owned = [(i, flat[i][a:b]) for i, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a]
    # reduce-scatter: chunk i summed on rank i, every chunk shipped before any sum (see send_all),
    # in k-1 rounds in which rank j sends to rank j + r: no port is used twice in a round
    sent = {(j, i): fetch(wire.ship(flat[j][bounds[i]:bounds[i + 1]], mine.context), mine.context)
            for r in range(1, k) for i, mine in owned for j in [(i - r) % k]}
    for i, mine in owned:
        if k > 1:
            nd.add_n(mine, *[sent[j, i] for j in range(k) if j != i], out=mine)
    send_all([(mine, flat[(i + r) % k][bounds[i]:bounds[i + 1]], "copy")   # all-gather: chunk i to the others
              for r in range(1, k) for i, mine in owned], wire)


class KVStoreAllreduce:
    """MXNet's kvstore(kind) as an all-reduce: pushpull sums the replicas and hands every one the sum.

    Holds its store and one key per (shape, dtype, contexts), created on first use.
    """

    def __init__(self, kind="device"):
        self.kind, self.store, self.keys, self.tried = kind, None, {}, 0

    @any_shape
    def __call__(self, arrays):
        """Afterwards every `arrays[i]` holds the sum; a key whose init failed is not kept."""
        if self.store is None:
            self.store = mx.kv.create(self.kind)
        sig = (arrays[0].shape, str(arrays[0].dtype), tuple(str(a.context) for a in arrays))
        if sig not in self.keys:
            key, self.tried = self.tried, self.tried + 1   # a failed init's number is not reused
            self.store.init(key, nd.zeros(arrays[0].shape, arrays[0].context, arrays[0].dtype))
            self.keys[sig] = key
        self.store.pushpull(self.keys[sig], arrays, out=arrays)


def kvstore_allreduce(arrays):
    """Afterwards every `arrays[i]` holds the sum, via a fresh kvstore('device') (use make_allreduce
    ("kvstore") to keep one store across calls, as a trainer does)."""
    KVStoreAllreduce()(arrays)


ALLREDUCE_ALGORITHMS = {
    "lesson": any_shape(lesson_allreduce),
    "reduce_bcast": reduce_bcast,
    "ring": ring_allreduce,
    "tree": tree_allreduce,
    "scatter_gather": scatter_gather_allreduce,
    "kvstore": kvstore_allreduce,
    "prepared": prepared_allreduce,
}


def make_allreduce(name, wire=None):
    """The all-reduce called `name`, ready for repeated use (kvstore gets a store of its own,
    prepared a plan cache of its own); given a `wire` (an EmulatedLink), every transfer over it."""
    if name not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"unknown allreduce {name!r}; choose from {', '.join(ALLREDUCE_ALGORITHMS)}")
    if wire is not None:
        if name == "kvstore":
            raise ValueError("allreduce kvstore moves its data inside MXNet, where no link can be emulated")
        over_wire = {"lesson": lesson_over_wire, "prepared": reduce_bcast}.get(name, ALLREDUCE_ALGORITHMS[name])
        return functools.partial(over_wire, wire=wire)
    if name == "kvstore":
        return KVStoreAllreduce()
    return PreparedAllreduce() if name == "prepared" else ALLREDUCE_ALGORITHMS[name]
