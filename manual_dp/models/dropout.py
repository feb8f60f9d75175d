"""Dropout whose masks no layout changes: drawn per (batch, example), never per context.

MXNet's Dropout draws from each device's own generator, so two contexts, a pipeline's micro-batches,
a recomputed forward or a resumed run would each drop other units. Here an example's mask is a
function of the run's seed, the batch number (counted from the run's first batch, so a resume
continues it), the dropout site, the element's place in the example's activation, and the example
itself, identified by the bytes of its image:

    u = splitmix64(key(image) ^ salt(seed, batch, site) + element * golden) >> 40     (24 bits)
    mask = (u / 2**24 >= p) / (1 - p)

Whichever context, micro-batch or token block computes an element draws the same u for it, so
every layout applies the same masks, and so does evaluation none (Noise.batch is None between
training batches: the loop sets it). Two identical images in one batch share their masks.

The masks reach the layers through the operators' namespace F, as a precision does
(manual_dp.precision): Model.forward and its group forms wrap F in Noisy with the keys of the images
they start from; a strategy that runs a model stage by stage takes F from Model.noisy(F, X) for each
micro-batch. A model's layers call dropout(h, site, F): the identity unless F is Noisy.
"""
import contextlib
import functools
import math

import numpy as np
from mxnet import nd

from ..precision import Low

GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix(z):
    """SplitMix64's finaliser of every element of the uint64 array z, in place (wrapping arithmetic)."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


@functools.lru_cache(maxsize=4)
def _weights(n):
    """n fixed odd uint64 multipliers, one per word of an image (drawn once, from seed 0)."""
    rng = np.random.RandomState(0)
    return rng.randint(0, 2 ** 62, size=n, dtype=np.int64).astype(np.uint64) * np.uint64(2) + np.uint64(1)


def row_keys(X):
    """A uint64 key per example of X (B, ...): a hash of its float32 bytes, the same on any context."""
    a = X.asnumpy() if isinstance(X, nd.NDArray) else np.asarray(X)
    words = np.ascontiguousarray(a, dtype=np.float32).reshape(len(a), -1).view(np.uint32).astype(np.uint64)
    with np.errstate(over="ignore"):
        return splitmix((words * _weights(words.shape[1])).sum(axis=1, dtype=np.uint64))


@functools.lru_cache(maxsize=64)
def _offsets(first, count):
    """(1, count): element * golden for elements first..first+count-1 (the same for every batch)."""
    with np.errstate(over="ignore"):
        return np.arange(first, first + count, dtype=np.uint64)[None, :] * GOLDEN


def draws(keys, salt, first, count):
    """(B, count) 24-bit integers (uint64): elements first..first+count-1 of each example's stream."""
    with np.errstate(over="ignore"):
        z = _offsets(first, count) + (keys[:, None] ^ np.uint64(salt))         # (B, count)
        return splitmix(z) >> np.uint64(40)


def uniform(keys, salt, first, count):
    """draws(...) as floats in [0, 1)."""
    return draws(keys, salt, first, count).astype(np.float32) * np.float32(2.0 ** -24)


class Noise:
    """Dropout's settings for a run: rate `p` (a site may have its own), `seed`; `batch` the training
    batch being computed (None: no dropout, as in evaluation)."""

    def __init__(self, p, seed=0):
        if not 0 <= p < 1:
            raise ValueError(f"--dropout {p}: a rate must be in [0, 1)")
        self.p, self.seed, self.batch = float(p), int(seed), None

    def salt(self, site):
        """The stream of (seed, batch, site), one uint64."""
        with np.errstate(over="ignore"):
            z = np.uint64(self.seed) * GOLDEN + np.uint64(self.batch) * np.uint64(0xD1B54A32D192ED03)
            return int(splitmix(np.array([z ^ (np.uint64(site) << np.uint64(48))], dtype=np.uint64))[0])

    def mask(self, keys, site, shape, first, ctx, rate):
        """The (B, *shape) mask of `site` at `rate` for examples `keys`, their elements from `first`
        on, on ctx: 0 or 1 / (1 - rate)."""
        count, cut = int(np.prod(shape)), np.uint64(math.ceil(rate * 2 ** 24))   # u < rate: u < cut / 2**24
        keep = draws(keys, self.salt(site), first, count) >= cut
        values = keep.astype(np.float32).reshape((len(keys),) + tuple(shape))
        values *= np.float32(1 / (1 - rate))
        return nd.from_numpy(values, zero_copy=True).as_in_context(ctx)   # queued, no wait (fast.prefetch.host)


class Noisy:
    """The namespace F whose dropout sites draw `noise`'s masks for the examples `keys`."""

    def __init__(self, F, noise, keys):
        self.F, self.noise, self.keys = F, noise, keys

    def __getattr__(self, name):
        return getattr(self.F, name)


def noisy(F, noise, X):
    """F, wrapped for X's examples when `noise` is drawing (a training batch)."""
    if noise is None or noise.batch is None or isinstance(F, Noisy):
        return F
    if not isinstance(X, (nd.NDArray, np.ndarray)):
        raise ValueError("dropout's masks are drawn per example on the host: a symbolic graph cannot take them")
    return Noisy(F, noise, row_keys(X))


class Sites:
    """The namespace F (mx.sym) of a cached graph whose dropout sites are inputs: each site's mask is
    a variable, `inputs` names them {name: (site, rate)}, and the graph's caller draws them for each
    call's examples (fast.graph.ModelGraph)."""

    def __init__(self, F, noise):
        self.F, self.noise, self.inputs = F, noise, {}

    def __getattr__(self, name):
        return getattr(self.F, name)

    def mask(self, site, rate):
        name = f"dropout{site}"
        self.inputs[name] = (site, rate)
        return self.F.var(name)


def drawing(F):
    """The Noisy or Sites under F (through a precision's namespace), or None."""
    while isinstance(F, Low):
        F = F.F
    return F if isinstance(F, (Noisy, Sites)) else None


def dropout(h, site, F, start=0, rate=None):
    """h (B, T, ...) with dropout site `site` applied at `rate` (default the run's p): its mask over
    tokens start.. of each example (a context-parallel or sequence-parallel block starts later);
    h itself unless F is drawing. In a cached graph (Sites) the mask is an input of the graph."""
    draw = drawing(F)
    rate = draw.noise.p if draw is not None and rate is None else rate
    if draw is None or not rate:
        return h
    if isinstance(draw, Sites):                   # a whole model's graph: every block starts at token 0
        return h * draw.mask(site, rate)
    per_token = int(np.prod(h.shape[2:])) if len(h.shape) > 2 else 1
    mask = draw.noise.mask(draw.keys, site, h.shape[1:], start * per_token, h.context, rate)
    return h * mask


def dropout_at(h, site, F, where=0):
    """dropout of h (B, T_j, ...) whose tokens start at `where`, or are the chunks `where` [(start,
    stop), ...] of the sequence in turn (a causal model's balanced context-parallel cut): each
    chunk's tokens their own positions' masks."""
    if isinstance(where, int):
        return dropout(h, site, F, where)
    if len(where) == 1:
        return dropout(h, site, F, where[0][0])
    parts, at = [], 0
    for a, b in where:
        parts.append(dropout(F.slice_axis(h, axis=1, begin=at, end=at + b - a), site, F, a))
        at += b - a
    return F.concat(*parts, dim=1)


@contextlib.contextmanager
def training_batch(noise, batch):
    """Within: `noise` (None: no dropout) draws the masks of the run's training batch number `batch`."""
    if noise is None:
        yield
        return
    noise.batch = batch
    try:
        yield
    finally:
        noise.batch = None
