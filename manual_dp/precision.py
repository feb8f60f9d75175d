"""Mixed precision (issue 23): float32 master weights, products in bf16 or fp16, fp16's loss scale.

What `--precision bf16|fp16` changes, and what it leaves in float32, as PyTorch's autocast and
MXNet's AMP divide it:

    low precision   every product: FullyConnected, Convolution, batch_dot, dot (the GEMMs). Their
                    inputs (activations and parameters) are rounded to the precision, they
                    accumulate in float32 and their output is rounded again; in the backward the
                    gradient into and out of each product is rounded the same way (a cast's
                    gradient is the cast back), so each context's parameter gradient holds values
                    of the precision
    float32         the master weights, the optimiser and its state, the loss, softmax, sums and
                    layer norms' statistics (the places low precision loses most)

Kept between steps: float32 parameters, gradients and state (PyTorch AMP's layout), but under
--mode zero 16-bit parameter and gradient copies beside float32 master shards (DeepSpeed's layout:
STORED dtypes, `stored` and `widened`; strategies/zero/zero_mixed.py).

`Low(F, precision)` is the namespace a layer's forward sees instead of `nd` or `mx.sym` (every
model's layers take F, models/contract.py), so every model and layout gets it without a line of
its own. On a CPU with AVX-512 BF16, bf16 FullyConnected and Convolution run natively (oneDNN, in
the bfloat16 dtype); everywhere else, and for every other product (MXNet 1.9.1's bf16 transpose
and batch_dot abort or fail), the same rounding is emulated on float32 arrays, so the numbers mean
the same on every CPU. float16 products are CUDA-only in MXNet: fp16 is always emulated on CPU.

fp16's range ends at 65504 and its small gradients underflow, so its loss is scaled (`LossScale`):
the gradient leaving the loss is multiplied by the scale S, every gradient then carries S, an
update divides by S (strategies/clipping.py), and a gradient with an inf or NaN skips the update
on every context (the check reads the reduced gradient, which every replica holds alike) and
halves S; after `window` good updates S doubles. bf16 has float32's range and needs no scale.
"""
import functools

import mxnet as mx
import numpy as np
from mxnet import nd

from .config import PRECISION_BYTES as BYTES, PRECISIONS
from .loss_scale import MIN_SCALE, LossScale  # noqa: F401  (fp16's loss scale, named here too)

BF16 = np.dtype([("bfloat16", np.uint16)])     # MXNet's bfloat16 (oneDNN)
GEMMS = ("FullyConnected", "Convolution", "batch_dot", "dot")
NATIVE_OPS = ("FullyConnected", "Convolution")  # bf16 kernels that MXNet 1.9.1 runs on CPU
STORED = {"bf16": BF16, "fp16": np.float16}    # the dtype a precision keeps its 16-bit arrays in


def native_bf16(cpuinfo="/proc/cpuinfo"):
    """Whether this CPU has AVX-512 BF16 (oneDNN's native bf16 kernels)."""
    try:
        with open(cpuinfo) as f:
            return any(line.startswith("flags") and "avx512_bf16" in line.split() for line in f)
    except OSError:
        return False


def rounded(x, precision, F=nd):
    """x (float32) with every element rounded to the nearest `precision` value (ties to even;
    denormals flushed to zero, as oneDNN does), still float32; its gradient is rounded alike.
    (to_bf16 says why bf16 takes three casts.)"""
    if precision == "bf16":
        return F.amp_cast(to_bf16(x, F), dtype="float32")
    if precision == "fp16":
        return F.cast(F.cast(x, dtype="float16"), dtype="float32")
    return x


def numpy_rounded(x, precision):
    """The reference for `rounded`, in numpy: bf16 by the bits (round to nearest even on the top 16
    bits of float32, denormals to zero), fp16 by numpy's float16."""
    x = np.asarray(x, dtype=np.float32)
    if precision == "fp16":
        return x.astype(np.float16).astype(np.float32)
    if precision != "bf16":
        return x
    tiny, zero = np.finfo(np.float32).tiny, np.copysign(np.float32(0), x)
    x = np.where(np.abs(x) < tiny, zero, x).astype(np.float32)             # denormals in: zero
    bits, k = x.view(np.uint32).astype(np.uint64), np.uint64(16)
    up = ((bits >> k) & np.uint64(1)) + np.uint64(0x7FFF)                  # ties to even
    out = np.where(np.isfinite(x), ((bits + up) >> k) << k, bits).astype(np.uint32).view(np.float32)
    return np.where(np.abs(out) < tiny, zero, out).astype(np.float32)      # denormals out: zero


def float32_ops(F):
    """The namespace under F: F itself, or a Low's float32 one (for what must stay float32, such as
    a layer norm built of products, models/transformer.py)."""
    return F.F if isinstance(F, Low) else F


def stored(x, precision):
    """x (float32) as a new array of the precision's 16-bit dtype (STORED), rounded to nearest even:
    what ZeRO keeps of a parameter between steps (strategies/zero/zero_mixed.py)."""
    return to_bf16(x) if precision == "bf16" else nd.cast(x, dtype="float16")


def widened(x):
    """A 16-bit x (STORED) as float32, exactly; recorded, its backward writes the float32 gradient
    rounded to x's dtype (grad_req "write" only: MXNet 1.9.1's casts drop a gradient to add)."""
    return nd.amp_cast(x, dtype="float32") if x.dtype == BF16 else nd.cast(x, dtype="float32")


def to_bf16(x, F=nd):
    """x in the bfloat16 dtype, rounded to nearest even. amp_cast rounds (Cast truncates), but its
    backward drops a gradient that should be added (grad_req "add", with which the strategies
    accumulate; MXNet 1.9.1): so a float32 Cast first, whose backward adds."""
    return F.amp_cast(F.cast(x, dtype="float32"), dtype=BF16)


class Low:
    """The namespace F (nd or mx.sym) with its products in `precision` (the module's table); every
    other name is F's own. native: run bf16 FullyConnected and Convolution in the bf16 dtype."""

    def __init__(self, F, precision, native=False):
        self.F, self.precision, self.native = F, precision, native and precision == "bf16"

    def __getattr__(self, name):
        op = getattr(self.F, name)
        return functools.partial(self.product, op, name) if name in GEMMS else op

    def array(self, a):
        return isinstance(a, (nd.NDArray, mx.sym.Symbol))

    def product(self, op, name, *args, **kwargs):
        if self.native and name in NATIVE_OPS:
            cast = lambda a: to_bf16(a, self.F) if self.array(a) else a
            out = op(*map(cast, args), **{k: cast(v) for k, v in kwargs.items()})
            return self.F.amp_cast(out, dtype="float32")
        low = lambda a: rounded(a, self.precision, self.F) if self.array(a) else a
        return rounded(op(*map(low, args), **{k: low(v) for k, v in kwargs.items()}), self.precision, self.F)


class LowReduce:
    """An all-reduce (manual_dp.fast.collectives) of float32 gradients run on copies in the
    precision, so every link carries 2 bytes an element instead of 4: fp16 always (CPU float16 adds
    exist); bf16 where this CPU adds bf16 natively, else the float32 sum rounded to bf16 (the same
    values as one bf16 add of two contexts; 4 bytes on the links, said in the header). `moved`
    counts the bytes of the arrays the collective was handed, per context."""

    def __init__(self, allreduce_fn, precision, native):
        self.allreduce_fn, self.precision, self.moved = allreduce_fn, precision, 0
        self.low = precision == "fp16" or (precision == "bf16" and native)

    def __call__(self, arrays):
        if len(arrays) < 2:                               # one context: no link to cross
            return self.allreduce_fn(arrays)
        if not self.low:                                  # bf16 without native adds: round the sum
            self.allreduce_fn(arrays)
            self.moved += sum(a.size * 4 for a in arrays)
            for a in arrays:
                a[:] = rounded(a, self.precision)
            return
        low = [a.astype("float16") if self.precision == "fp16" else to_bf16(a) for a in arrays]
        self.allreduce_fn(low)
        self.moved += sum(a.size * 2 for a in low)
        for a, b in zip(arrays, low):
            a[:] = b.astype("float32") if self.precision == "fp16" else nd.amp_cast(b, dtype="float32")

    def describe(self):
        return (f"gradients all-reduced in {self.precision} (2 bytes an element on every link)" if self.low else
                f"gradients all-reduced in float32 and rounded to {self.precision} (this CPU has no native bf16 adds)")


class ScaleOp(mx.operator.CustomOp):
    """Identity forward; the backward multiplies the gradient by the loss scale's current value."""

    def __init__(self, scaler):
        super().__init__()
        self.scaler = scaler

    def forward(self, is_train, req, in_data, out_data, aux):
        self.assign(out_data[0], req[0], in_data[0])

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        self.assign(in_grad[0], req[0], out_grad[0] * self.scaler.scale)


SCALERS = {}        # key -> LossScale, for the custom operator (its parameters are strings)


class ScaleProp(mx.operator.CustomOpProp):
    def __init__(self, key):
        super().__init__(need_top_grad=True)
        self.key = key

    def list_arguments(self):
        return ["data"]

    def list_outputs(self):
        return ["output"]

    def infer_shape(self, in_shape):
        return in_shape, [in_shape[0]], []

    def create_operator(self, ctx, shapes, dtypes):
        return ScaleOp(SCALERS[self.key])


@functools.lru_cache(maxsize=1)
def register():
    mx.operator.register("manual_dp_loss_scale")(ScaleProp)


def scaled(scores, scaler, F=nd):
    """`scores`, whose gradient the backward multiplies by scaler.scale (None: scores)."""
    if scaler is None:
        return scores
    register()
    SCALERS[str(id(scaler))] = scaler
    return F.Custom(scores, key=str(id(scaler)), op_type="manual_dp_loss_scale")


class Policy:
    """A run's precision: `precision`, whether bf16 products run natively, and fp16's loss scale."""

    def __init__(self, precision="fp32", native=None, loss_scale=2.0 ** 16, window=200):
        if precision not in PRECISIONS:
            raise ValueError(f"--precision {precision}: choose from {', '.join(PRECISIONS)}")
        self.precision = precision
        self.native = (native_bf16() if native is None else native) and precision == "bf16"
        self.scaler = LossScale(loss_scale, window) if precision == "fp16" else None
        self.reduction = None       # the LowReduce of the run's gradients, once `reducer` made it

    def low(self, F):
        return Low(F, self.precision, self.native)

    def reducer(self, allreduce_fn, algorithm=None):
        """allreduce_fn summing gradients in the precision (LowReduce); itself under fp32. bf16's
        scatter_gather has no bf16 kernel in MXNet 1.9.1: it rounds the float32 sum instead."""
        if self.precision == "fp32":
            return allreduce_fn
        self.reduction = LowReduce(allreduce_fn, self.precision, self.native and algorithm != "scatter_gather")
        return self.reduction

    def rounding(self, allreduce_fn):
        """allreduce_fn, then every sum rounded to the precision: across processes the sum is taken
        in float32 by the engine (Horovod, KVStore), and rounding once afterwards gives the bits one
        process gets from its 16-bit sum of one gradient per context."""
        if self.precision == "fp32":
            return allreduce_fn

        def reduce_and_round(arrays):
            allreduce_fn(arrays)
            for a in arrays:
                a[:] = rounded(a, self.precision)
        return reduce_and_round

    def describe(self):
        """The header's words: which precision, native or emulated, the loss scale."""
        if self.precision == "fp32":
            return "fp32"
        how = ("native bf16 FullyConnected and Convolution (AVX-512 BF16), other products emulated"
               if self.native else f"{self.precision} emulated (products rounded on float32 arrays)")
        scale = f"; loss scale {self.scaler.scale:g}, doubled after {self.scaler.window} good updates" \
            if self.scaler else ""
        reduction = f"; {self.reduction.describe()}" if self.reduction else ""
        return f"{self.precision}: {how}; float32 master weights and optimiser{scale}{reduction}"
