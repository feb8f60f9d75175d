"""ZeRO under --precision bf16|fp16 in DeepSpeed's layout: per parameter a 16-bit copy (2 bytes), a
16-bit gradient (2) and float32 master weight, Adam's m and v (4 + 4 + 4 = 12), each sharded as the
stage says (ZeRO paper, section 3: "2 + 2 + K" bytes, K = 12 for mixed-precision Adam). Kept
between steps, per context, for N parameters over k contexts (n_i = N/k, shard i):

                 16-bit parameters   16-bit gradients   float32 master + optimiser state
    stage 1      2N                  2N                 (4 + 4c) n_i     (c: sgd 0, momentum 1, adam 2)
    stage 2      2N                  2 n_i              (4 + 4c) n_i
    stage 3      2 n_i               2 n_i              (4 + 4c) n_i

What moves, and in which dtype:

    forward      the layer reads its 16-bit parameters (stage 3: all-gathered per layer, 2 bytes an
                 element on the links) through a cast to float32 made at use (models.precise.
                 reading_stored): MXNet 1.9.1 on CPU has no float16 FullyConnected and no bf16
                 transpose or batch_dot, so the products keep computing as precision.Low rounds
                 them, on float32 copies that live only as long as the step needs them
    backward     each cast's backward writes its parameter's gradient rounded to 16 bits into the
                 16-bit buffer (stage 1's replica gradient, stages 2 and 3 a layer's gradient); the
                 reduce-scatter sums the 16-bit arrays (2 bytes an element on the links; every add
                 rounds to nearest: elemwise_add checked against numpy on an AVX-512 BF16 CPU), fp16
                 always, bf16 where the CPU has native bf16 (as precision.LowReduce); elsewhere bf16
                 is summed on float32 copies and the sum rounded (4 bytes an element on the links)
    update       each context's 16-bit owned gradient shard cast to float32 (summed across processes
                 in float32 and rounded once, as precision.Policy.rounding), clipped and unscaled
                 (strategies/clipping.py), the optimiser's step in float32 on the master shard, and
                 the master rounded into the 16-bit parameter shard; stages 1 and 2 all-gather the
                 16-bit parameters

state_dict() holds the float32 master weights and optimiser state, like every strategy's, so a
checkpoint resumes exactly (the 16-bit copies are the masters rounded) and moves to any layout.
"""
from mxnet import nd

from ...config import RunConfig
from ...fast.flat import FlatReplica
from ...fast.sharded import empty_shards
from ...models.precise import reading_stored
from ...optim import OPTIMIZERS, init_states
from ...precision import STORED, rounded, stored, widened
from .zero import ZeroRedundancy
from .zero_layers import hand_made


class MixedZero(ZeroRedundancy):
    """ZeroRedundancy keeping 16-bit parameters and gradients and float32 master shards (the module's
    table); precision: "bf16" or "fp16"; model: the network in that precision (models.precise.Precise,
    whose layers all take their gradient from autograd); native: this CPU adds bf16 (sums in 16 bits)."""

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, stage=1, collective="ring",
                 cross_sum=None, model=None, precision="bf16", native=False, wire=None):
        if precision not in STORED:
            raise ValueError(f"16-bit ZeRO keeps bf16 or fp16, not {precision}")
        if model is None or any(hand_made(layer, True) for layer in model.layers):
            raise ValueError("16-bit ZeRO needs the model in its precision (models.precise.Precise)")
        self.precision, self.pending, self.adds16 = precision, False, precision == "fp16" or native
        super().__init__(params, ctx, optimizer, stage, collective, cross_sum, reading_stored(model), wire=wire)

    def keep(self, params, flat):
        """Make the module's table: 16-bit replicas (stage 1, their gradients written by backward),
        flats (stage 2) or shards (stage 3), 16-bit gradient shards, float32 master shards and
        their optimiser state."""
        parts = list(zip(self.ctx, self.bounds, self.bounds[1:]))
        self.masters = [nd.array(flat[a:b], ctx=c) for c, a, b in parts]                   # (n_i,) float32
        self.replicas = [FlatReplica([stored(p.as_in_context(c), self.precision) for p in params], c)
                         for c in self.ctx] if self.stage == 1 else None
        for r in self.replicas or ():
            r.mark("write")                        # a cast's backward cannot add (precision.widened)
        self.flats = [r.flat for r in self.replicas] if self.stage == 1 else (
            [stored(nd.array(flat, ctx=c), self.precision) for c in self.ctx] if self.stage == 2 else None)
        self.shards = [f[a:b] for f, (_, a, b) in zip(self.flats, parts)] if self.flats \
            else [stored(m, self.precision) for m in self.masters]
        self.grad_shards = None if self.stage == 1 else empty_shards(len(flat), self.ctx, STORED[self.precision])
        self.states = [init_states([m], self.optimizer)[0] for m in self.masters]

    def backward(self, X, y):
        """ZeroRedundancy's backward; in stage 1 (whose backward writes) the gradients of earlier
        calls since the last update added back, in 16 bits (gradient accumulation)."""
        held = [r.grad.copy() for r in self.replicas] if self.stage == 1 and self.pending else None
        metrics = super().backward(X, y)
        for r, h in zip(self.replicas or (), held or ()):
            nd.elemwise_add(r.grad, h, out=r.grad)
        self.pending = True
        return metrics

    def summed_here(self):
        """ZeroRedundancy's, in 16 bits; without 16-bit adds stage 1's gradients are summed on
        float32 copies (transient) and chunk i of replica i's gradient holds the sum rounded."""
        if self.adds16 or self.stage > 1:
            return super().summed_here()
        wide = [widened(r.grad) for r in self.replicas]                             # (N,) float32 each
        self.reduce_scatter(wide)
        for r, w, a, b in zip(self.replicas, wide, self.bounds, self.bounds[1:]):
            r.grad[a:b] = stored(w[a:b], self.precision)
        return [r.grad[a:b] for r, a, b in zip(self.replicas, self.bounds, self.bounds[1:])]

    def add_sum(self, local, piece, i):
        """ZeroRedundancy's, in 16 bits; without 16-bit adds on float32 copies, `piece` then holds
        itself plus the sum, rounded."""
        if self.adds16:
            return super().add_sum(local, piece, i)
        wide = nd.zeros(piece.shape, ctx=piece.context)                              # float32
        super().add_sum([widened(g) for g in local], wide, i)
        piece[:] = stored(nd.elemwise_add(widened(piece), wide), self.precision)

    def owned_grads(self):
        """Per context, its shard's gradient as float32 (a transient copy): summed over this
        process's contexts in 16 bits, across processes in float32 and rounded to the precision."""
        grads = [widened(g) for g in self.summed_here()]
        for i, g in enumerate(grads) if self.cross_sum else ():
            self.cross_sum(g, f"zero-grad-{i}")
            g[:] = rounded(g, self.precision)
        return grads

    def apply(self, lr, n_examples):
        """Afterwards each master shard took the optimiser's step in float32 and the 16-bit
        parameter shard holds it rounded."""
        _, rule = OPTIMIZERS[self.optimizer]
        for m, g, state, low in zip(self.masters, self.owned, self.states, self.shards):
            rule(m, g / n_examples, state, lr, self.t)
            low[:] = stored(m, self.precision)

    def clear_grads(self):
        """Afterwards every kept 16-bit gradient is zero and no backward is pending."""
        super().clear_grads()
        self.pending = False

    def arrays(self):
        """ZeroRedundancy's split: the 16-bit parameters and gradients; the state is the float32
        master shards and their optimiser state."""
        held = super().arrays()
        return dict(held, state=self.masters + held["state"])

    def load_params(self, flat):
        """Afterwards the master shards hold `flat` (N,) and the 16-bit parameters it rounded."""
        self.scatter(self.masters, flat)
        for f in self.flats or ():
            f[:] = stored(nd.array(flat, ctx=f.context), self.precision)
        for low, m in zip(self.shards if not self.flats else (), self.masters):
            low[:] = stored(m, self.precision)
