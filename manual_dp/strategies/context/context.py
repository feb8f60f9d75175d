"""Context parallelism: the sequence of tokens cut into C blocks, one per context of a group; groups
of C contexts are data parallel to each other (the mesh dp x cp, manual_dp.mesh).

Every context of a group holds the whole parameters and the group's examples, but only its own
block of tokens: context j embeds tokens bounds[j]:bounds[j+1], runs every token-wise layer (layer
norms, MLPs, the projections) on them alone, and meets the other blocks only where the model says
(Model.sequence_forward, models/contract.py): in attention (seq.attend: ring attention or Ulysses,
manual_dp.fast.attention) and where it pools over tokens (seq.sum). So activations per context are
about 1/C of one context's, attention's T x T scores included: the point, for long sequences.

The gradient. After seq.sum every context holds the same pooled vector and scores; each computes
the loss and backpropagates 1/C of it. seq.sum's backward adds every context's gradient (each
output depends on every input), so each block receives the whole gradient of the pooled vector;
the gradients of keys and values come home through the collectives' backward. Each context's
parameter gradient is then its block's share of the whole (1/C of it for the layers after the
pooling), and the sum over the group is the one-context gradient: one all-reduce over all dp x cp
contexts sums the group and the replicas at once, as data parallelism does.
"""
import functools

from mxnet import autograd, nd

from ...config import FAST_STEP, SEQUENCE_PIECES, RunConfig
from ...fast.attention import ATTENTION
from ...fast.causal_attention import CAUSAL, chunks_of
from ...fast.collectives import chunk_bounds, make_allreduce
from ...fast.prefetch import host
from ...fast.tensor_ops import sum_everywhere
from ...lesson import split_and_load
from ...models.contract import example_loss, count_correct
from ...models import stateless
from ...optim import apply_update_and_clear, init_states
from ...replicas import fingerprint
from ...errors import CheckpointError
from ..base import Strategy, placed
from ..zero.dp_zero import DataShardedOptimizer, backward, gathered, peak
from ..data.data_parallel import host_state, load_into
from ..tensor.tensor_layout import copies, even_split
from .context_sums import FixedContext


class Sequence:
    """What a context-parallel group's layers join their blocks with: `bounds` (C + 1 token
    offsets), `attend` (ring or Ulysses attention over the blocks) and `sum` (an all-reduce whose
    backward is an all-reduce). causal: a causal model's (Model.causal): each context holds
    `chunks` of the balanced cut (fast/causal_attention.py) and attend is causal; otherwise its one
    chunk, bounds[j]:bounds[j + 1]."""

    def __init__(self, n_tokens, C, attention, allreduce, causal=False):
        self.tokens, self.bounds = n_tokens, chunk_bounds(n_tokens, C)
        self.chunks = chunks_of(n_tokens, C, balanced=causal)
        self.attend = functools.partial(CAUSAL[attention], chunks=self.chunks) if causal else ATTENTION[attention]
        self.allreduce = allreduce

    def sum(self, xs):
        return sum_everywhere(xs, self.allreduce)


class ContextParallel(FixedContext, Strategy):
    """len(ctx) // C data-parallel groups of C contexts; group r's block j on ctx[r * C + j].
    attention: "ring" or "ulysses"; allreduce_fn sums the gradients over every context (and, under
    a multi-process world, the processes); cp_allreduce is seq.sum's, inside a group. zero_stage 1:
    each context keeps the optimiser state of 1/N of every parameter (strategies/zero/dp_zero.py); 2: and
    1/N of its summed gradient; 3: and 1/N of it between steps (gathered whole for a use).
    sums: None, the fast sums above; or --deterministic's FixedSums (strategies/sums/fixed_sums.py):
    the sequence in `sequence_pieces` lanes, K/C a context, every sum over the lanes and the batch's
    pieces in fixed trees: the bits of one context's step (context_sums.py)."""

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, context_parallel=None, attention="ring",
                 allreduce_fn=None, cp_allreduce=None, model=None, zero_stage=0, sums=None,
                 sequence_pieces=SEQUENCE_PIECES):
        self.ctx, self.optimizer, self.sums = list(ctx), optimizer, sums
        self.net = stateless(model, "--deterministic --mode context" if sums else "--mesh cp") \
            if model is not None else None
        C = self.C = context_parallel or len(self.ctx)
        if attention not in ATTENTION:
            raise ValueError(f"unknown attention {attention!r}: choose from {', '.join(ATTENTION)}")
        self.attention = attention
        if sums:
            self.hold_lanes(params, sequence_pieces)
            return
        refusal = self.net.sequence_refusal(C, attention) if self.net else "LeNet has no sequence of tokens to cut"
        if len(self.ctx) % C or refusal:
            raise ValueError(f"context degree {C} does not divide {len(self.ctx)} contexts"
                             if len(self.ctx) % C else f"--mesh cp={C}: {refusal}")
        self.allreduce_fn = allreduce_fn or make_allreduce(FAST_STEP["allreduce"])
        self.seq = Sequence(self.net.tokens, C, attention, cp_allreduce or make_allreduce(FAST_STEP["allreduce"]),
                            self.net.causal)
        self.grid = [self.ctx[r:r + C] for r in range(0, len(self.ctx), C)]      # grid[group][block]
        values = [p.asnumpy() for p in params]
        self.params = [[placed(values, c) for c in row] for row in self.grid]
        groups = [[P[i] for P in self.copies] for i in range(len(values))]
        self.zero = DataShardedOptimizer(groups, optimizer, zero_stage) if zero_stage else None
        self.states = None if self.zero else [[init_states(P, optimizer) for P in row] for row in self.params]
        self.t = 0

    @property
    def copies(self):
        """Every context's parameters, in rank order."""
        return [P for row in self.params for P in row]

    @property
    def batch_places(self):
        """A context-parallel group a place (strategies/base.py)."""
        return len(self.grid)

    def scores(self, row, P, X):
        return self.net.sequence_forward(copies(X, row), P, self.seq)

    def backward(self, X, y):
        """Every group runs its shard of the batch, each context on its block of tokens."""
        if self.sums:
            return self.fixed_backward(X, y)
        heads, metrics = [], []
        firsts = [r[0] for r in self.grid]
        with gathered(self.zero):
            with autograd.record():
                for row, P, Xg, yg in zip(self.grid, self.params, split_and_load(host(X), firsts),
                                          split_and_load(host(y), firsts)):
                    ys, scores = copies(yg, row), self.scores(row, P, Xg)
                    losses = [example_loss(s, yj).sum() for s, yj in zip(scores, ys)]
                    heads += [l * (1 / self.C) for l in losses]
                    metrics.append((losses[0], count_correct(scores[0], ys[0])))
            backward(heads, [p for P in self.copies for p in P], self.zero)
        return metrics

    def update(self, lr, n_examples):
        """Sum every parameter's gradient over all contexts, then one optimiser step on each (under
        ZeRO: a chunk on each, then gathered; --deterministic: the tree's total on each)."""
        if self.sums:
            return self.fixed_update(lr, n_examples)
        if self.zero:
            self.t += 1
            self.zero.step(lr, self.t, self.counted(n_examples))
            return
        copies_ = self.copies
        for i in range(len(copies_[0])):
            self.allreduce_fn([P[i].grad for P in copies_])
        self.t += 1
        n_examples = self.counted(n_examples)
        for P, S in zip(copies_, [S for row in self.states for S in row]):
            apply_update_and_clear(P, S, self.optimizer, lr, self.t, n_examples)

    def reduced_grads(self):
        """The summed gradient, on the first context (under ZeRO summed here: the update
        reduce-scatters it instead; --deterministic: the tree's, flat)."""
        if self.sums:
            return self.fixed_grads()
        if self.zero:
            home = self.ctx[0]
            return [self.zero.total(i, home) for i in range(len(self.copies[0]))]
        return [p.grad for p in self.params[0][0]]

    def correct(self, X, y):
        """Correct predictions on (X, y), sharded over the groups (--deterministic: in pieces)."""
        if self.sums:
            return self.fixed_correct(X, y)
        rows = self.grid[:min(len(self.grid), X.shape[0])]
        counts = []
        with gathered(self.zero):
            for row, P, Xg, yg in zip(rows, self.params, split_and_load(X, [r[0] for r in rows]),
                                      split_and_load(y, [r[0] for r in rows])):
                counts.append(count_correct(self.scores(row, P, Xg)[0], yg).copyto(self.ctx[0]))
        return nd.add_n(*counts) if len(counts) > 1 else counts[0]

    def fingerprints(self):
        """Every context's copy of the parameters: one group, all equal."""
        names = self.net.names()
        with gathered(self.zero):
            return {"replicas": [fingerprint(c, P, names) for c, P in zip(self.ctx, self.copies)]}

    def layout(self, batch_size):
        """Each context of a group holds the group's examples but 1/C of their tokens: priced as
        1/C of the group's examples each (manual_dp.memory counts per example), and what it holds
        whole: the images of the group's other examples (copied to every context) and, for every
        example, what attention keeps beyond one block's share (attention_held; ring's is
        negative: it keeps no scores)."""
        out, every = [], tuple(range(len(self.net.layers)))
        images, extra = self.net.layers[0].inputs, attention_held(self.net, self.C, self.attention)
        for row, n in zip(self.grid, even_split(batch_size, len(self.grid))):
            for c, k in zip(row, even_split(n, self.C)):
                out += [(c, every, k)] + [(c, ("whole", e), m) for e, m in ((images, n - k), (extra, n)) if e and m]
        return out

    def arrays(self):
        params = [p for P in self.copies for p in P] + (self.zero.param_arrays() if self.zero else [])
        state = self.zero.state_arrays() if self.zero else [s for row in self.states for S in row for st in S for s in st]
        return {"param": params, "grad": self.zero.grad_arrays() if self.zero else [p.grad for p in params],
                "state": state}

    def peak_arrays(self):
        return peak(self.arrays(), self.zero)

    def state_dict(self):
        with gathered(self.zero):
            if self.zero:
                whole = [[nd.array(v) for v in self.zero.whole_state(i)] for i in range(len(self.copies[0]))]
                return host_state(self.params[0][0], whole, self.t)
            return host_state(self.params[0][0], self.states[0][0], self.t)

    def load_state_dict(self, state):
        with gathered(self.zero, keep=True):
            self.load_wholes(state)

    def load_wholes(self, state):
        if not self.zero:
            for P, S in zip(self.copies, [S for row in self.states for S in row]):
                load_into(P, S, state)
            self.t = state["t"]
            return
        if [len(s) for s in state["opt_state"]] != [len(s) for s in self.state_dict()["opt_state"]]:
            raise CheckpointError("the checkpoint's parameters or optimiser state do not fit this run")
        for P in self.copies:                                  # the parameters; the state goes to its chunks
            load_into(P, [[] for _ in P], dict(state, opt_state=[[] for _ in P]))
        for i, values in enumerate(state["opt_state"]):
            self.zero.load_state(i, values)
        self.t = state["t"]


def attention_layers(net):
    """[(tokens T, width d, heads H)] of each attention layer (a layer with a head_dim)."""
    T = getattr(net, "tokens", 0)
    return [(T, layer.inputs // T, layer.inputs // T // layer.extra["head_dim"])
            for layer in net.layers if T and "head_dim" in layer.extra]


def attention_held(net, C, attention):
    """Per example elements a context of C keeps for attention's backward beyond 1/C of one
    context's, per attention layer (negative: short of it). Ring (fast/ring_attention.py): its own
    q, k, v and output, as one context keeps them, and each row's log-sum-exp (H T_j) instead of
    the scores and softmax weights (2 H T_j T: the second ring recomputes them); Ulysses: the
    all-to-all's q, k, v of all T tokens on H/C heads and the output sent back (3 T d/C + T_j d),
    its scores 1/C of one context's. T_j: the largest block, ceil(T/C)."""
    out = 0
    for T, d, H in attention_layers(net):
        Tj = -(-T // C)
        out += H * Tj - 2 * H * Tj * T if attention == "ring" else 3 * T * d // C + Tj * d
    return out
