"""Gradient compression with error feedback: what a replica sends instead of its float32 gradient.

A compressor keeps nothing itself; each replica's residual (what earlier steps did not send) is
handed in, and the compressor adds the gradient to it, sends what it can and keeps the rest:

    encode(grad, residual) -> payload     residual += grad; payload = C(residual); residual -= D(payload)
    decode(payload, n, ctx) -> array      D(payload) on ctx: an (n,) float32 array
    spec(n)                -> [(shape, dtype)]: the arrays of a payload for an n-element gradient

    fp16        float16 values                                   2n bytes
    2bit:T      MXNet's kvstore 2bit: {+T, -T, 0} as 11/10/00,  ceil(n/16) x 4 bytes (MXNet's size)
                four to a byte, MSB first, 16 to a float32 block
    1bit        the sign, eight to a byte, times a scale = mean |residual| per parameter
                (EF-signSGD)                                     ceil(n/8) + 4 x parameters bytes
    topk:K      the K largest |residual|: int32 indices and float32 values      8K bytes

None of these can be summed in compressed form, so GatherAllreduce gathers every replica's payload
(across processes too) and adds the decoded gradients on the first context, in the order of the
replicas: N processes x k contexts add what one process with N*k contexts adds.
"""
import numpy as np
from mxnet import nd

from ..checks import parse_compress
from .powersgd import PowerSGDAllreduce


def padded(x, multiple):
    """`x` (n,) with zeros appended up to a multiple of `multiple`."""
    extra = -x.size % multiple
    return nd.concat(x, nd.zeros((extra,), ctx=x.context), dim=0) if extra else x


def pack(codes, bits):
    """(n,) float codes in [0, 2**bits) -> uint8 bytes, 8/bits codes a byte, the first in the
    highest bits (MXNet's order)."""
    per = 8 // bits
    weights = nd.array([2 ** (bits * (per - 1 - j)) for j in range(per)], ctx=codes.context)
    return nd.dot(padded(codes, per).reshape((-1, per)), weights).astype("uint8")   # (ceil(n/per),)


def unpack(packed, bits, n, ctx):
    """The inverse of pack: (n,) float codes on `ctx`."""
    per, b = 8 // bits, packed.as_in_context(ctx).astype("float32")
    digits = [nd.floor(b / 2 ** (bits * (per - 1 - j))) % 2 ** bits for j in range(per)]
    return nd.stack(*digits, axis=1).reshape((-1,))[:n]


class FP16:
    """Half precision; the rounding error is the residual."""
    name = "fp16"

    def spec(self, n):
        return [((n,), "float16")]

    def encode(self, grad, residual):
        residual += grad
        half = residual.astype("float16")
        residual -= half.astype("float32")
        return [half]

    def decode(self, payload, n, ctx):
        return payload[0].as_in_context(ctx).astype("float32")


class TwoBit:
    """MXNet's 2bit gradient compression (src/kvstore/gradient_compression-inl.h, quantize_2bit):
    residual >= T sends +T (bits 11), residual <= -T sends -T (10), else 0 (00)."""
    name = "2bit"

    def __init__(self, threshold=0.5):
        self.threshold = float(threshold)

    def spec(self, n):
        return [((-(-n // 16) * 4,), "uint8")]          # MXNet's ceil(n/16) float32 blocks

    def encode(self, grad, residual):
        residual += grad
        pos, neg = residual >= self.threshold, residual <= -self.threshold
        residual -= pos * self.threshold - neg * self.threshold
        return [pack(padded(pos * 3 + neg * 2, 16), 2)]

    def decode(self, payload, n, ctx):
        codes = unpack(payload[0], 2, n, ctx)
        return (codes == 3) * self.threshold - (codes == 2) * self.threshold


class OneBit:
    """The sign of the residual (bit 1: >= 0), scaled by its mean magnitude: one float32 header
    per segment (per parameter of the flat buffer when `sizes` lists them; else one)."""
    name = "1bit"

    def __init__(self, sizes=None):
        self.sizes = list(sizes) if sizes else None

    def segments(self, n):
        """[(start, stop)] of each segment of an n-element gradient."""
        sizes = self.sizes if self.sizes and sum(self.sizes) == n else [n]
        o = np.cumsum([0] + sizes)
        return list(zip(o[:-1], o[1:]))

    def spec(self, n):
        return [((-(-n // 8),), "uint8"), ((len(self.segments(n)),), "float32")]

    def spread(self, scales, n):
        """(n,): each segment's scale repeated over it."""
        return nd.concat(*[nd.broadcast_to(scales[j:j + 1], (int(b - a),))
                           for j, (a, b) in enumerate(self.segments(n))], dim=0)

    def encode(self, grad, residual):
        residual += grad
        n = residual.size
        scales = nd.concat(*[nd.mean(nd.abs(residual[int(a):int(b)])).reshape((1,))
                             for a, b in self.segments(n)], dim=0)
        positive = residual >= 0
        residual -= (positive * 2 - 1) * self.spread(scales, n)
        return [pack(positive, 1), scales]

    def decode(self, payload, n, ctx):
        signs = unpack(payload[0], 1, n, ctx) * 2 - 1
        return signs * self.spread(payload[1].as_in_context(ctx), n)


class TopK:
    """The K entries of largest magnitude (all of them when K >= n), sent as (index, value)."""
    name = "topk"

    def __init__(self, k):
        self.k = int(k)

    def spec(self, n):
        k = min(self.k, n)
        return [((k,), "int32"), ((k,), "float32")]

    def encode(self, grad, residual):
        residual += grad
        k = min(self.k, residual.size)
        index = nd.topk(nd.abs(residual), k=k, ret_typ="indices", dtype="int32")
        values = nd.take(residual, index)
        residual -= nd.scatter_nd(values, index.reshape((1, k)), shape=residual.shape)
        return [index, values]

    def decode(self, payload, n, ctx):
        index, values = (p.as_in_context(ctx) for p in payload)
        return nd.scatter_nd(values, index.reshape((1, -1)), shape=(n,))


def payload_bytes(spec):
    """Bytes of a payload of `spec` ([(shape, dtype)])."""
    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in spec)


def to_bytes(payload):
    """The payload's arrays, their bytes end to end (a host copy)."""
    return b"".join(p.asnumpy().tobytes() for p in payload)


def from_bytes(data, spec, ctx):
    """The inverse of to_bytes: the payload of `spec` on `ctx`."""
    out, offset = [], 0
    for shape, dtype in spec:
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        value = np.frombuffer(data[offset:offset + size], dtype=dtype).reshape(shape)
        out.append(nd.array(value, ctx=ctx, dtype=dtype))
        offset += size
    return out


def gather_bytes(world, data, key, ctx):
    """Every rank's `data` (bytes, one length on every rank), in rank order. Each rank's bytes go,
    as 16-bit halves (integers, exact in float32: no NaN or denormal patterns to lose), into its
    own slots of one array that the engine sums across processes: a sum with zeros is a gather."""
    halves = np.frombuffer(data + b"\0" * (len(data) % 2), dtype=np.uint16).astype(np.float32)
    m = len(halves)
    slots = np.zeros(world.size * m, dtype=np.float32)
    slots[world.rank * m:(world.rank + 1) * m] = halves
    summed = nd.array(slots, ctx=ctx)
    world.allreduce(summed, key)
    every = summed.asnumpy().astype(np.uint16)
    return [every[r * m:(r + 1) * m].tobytes()[:len(data)] for r in range(world.size)]


class GatherAllreduce:
    """An all-reduce with the lesson's contract that sends compressed gradients: each replica
    encodes its gradient with its own residual; every payload (of every process) is decoded on
    the first context and the decoded gradients are added there in replica order; the sum is
    copied back. `world`: a multiprocess World (None or size 1: this process alone)."""

    def __init__(self, compressor, world=None):
        self.compressor, self.world = compressor, world
        self.residuals, self.n = [], None

    @property
    def name(self):
        return self.compressor.name

    def prepare(self, arrays):
        """A zero residual per replica, (n,) on the replica's context."""
        self.n = arrays[0].size
        self.residuals = [nd.zeros((self.n,), ctx=a.context) for a in arrays]

    def bytes_per_replica(self):
        """Bytes one replica sends per all-reduce (its payload)."""
        return payload_bytes(self.compressor.spec(self.n))

    def __call__(self, arrays):
        """Afterwards every arrays[i] holds the sum of the decoded payloads of every replica."""
        if not self.residuals:
            self.prepare(arrays)
        if len(arrays) != len(self.residuals) or arrays[0].size != self.n:
            raise ValueError(f"{self.name} holds residuals for {len(self.residuals)} arrays of "
                             f"{self.n}; got {len(arrays)} of {arrays[0].size}")
        flats, home = [a.reshape((-1,)) for a in arrays], arrays[0].context
        payloads = [self.compressor.encode(g, r) for g, r in zip(flats, self.residuals)]
        if self.world is not None and self.world.size > 1:
            payloads = self.gather(payloads, home)
        decoded = [self.compressor.decode(p, self.n, home) for p in payloads]
        if len(decoded) > 1:
            nd.add_n(*decoded, out=flats[0])
        else:
            decoded[0].copyto(flats[0])
        for a in flats[1:]:
            flats[0].copyto(a)

    def gather(self, payloads, ctx):
        """Every process's payloads, in the order of the global replicas, on `ctx`."""
        spec = self.compressor.spec(self.n)
        data = gather_bytes(self.world, b"".join(map(to_bytes, payloads)),
                            f"compress.{self.name}.{self.n}x{len(payloads)}", ctx)
        size = payload_bytes(spec)
        return [from_bytes(d[i * size:(i + 1) * size], spec, ctx)
                for d in data for i in range(len(payloads))]

    def state(self):
        """{"residual": [host copy per replica]}: this process's share of the state."""
        return {"residual": [r.asnumpy() for r in self.residuals]}

    def load(self, state):
        """Residuals from `state` (this process's replicas, as state() gives them)."""
        for r, value in zip(self.residuals, state["residual"]):
            r[:] = nd.array(value, ctx=r.context)


def make_reducer(spec, allreduce_fn, shapes, world=None):
    """The all-reduce of --compress `spec` for flat gradients laid out as `shapes`: the quantisers
    gathered (across `world`'s processes too), powersgd:R with `allreduce_fn`; None for "none"."""
    name, arg = parse_compress(spec)
    if name == "none":
        return None
    if name == "powersgd":
        return PowerSGDAllreduce(arg, shapes, allreduce_fn)
    if name == "1bit":
        return GatherAllreduce(OneBit([int(np.prod(s)) for s in shapes]), world)
    compressor = FP16() if name == "fp16" else {"2bit": TwoBit, "topk": TopK}[name](arg)
    return GatherAllreduce(compressor, world)
