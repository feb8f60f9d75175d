"""A pipeline stage run on a group of contexts (strategies/mesh/mesh_parallel.py): the stage's layers on a
tensor group (tensor_stage: Megatron's split, layer by layer), on a context-parallel group
(sequence_stage: each layer's sequence_forward) or on a C x T grid of both (grid_stage: each
layer as Model.grid_forward runs it; group_runs picks one), and one replica's pass of a schedule
over such stages (GroupPass; under --deterministic PiecePass, whose micro-batches are batch pieces),
activations and gradients sent rank by rank between the groups. What a mesh refuses: groups that
do not divide the contexts or run the model (check_groups), schedules it does not run (check_schedule)."""
from mxnet import autograd, nd

from ...models.contract import example_loss, count_correct
from ...models.contract import grid_layer
from ..zero.dp_zero import backward
from ..pipeline.schedules import check_micro, check_name
from ..pipeline.stages import send
from ..tensor.tensor_layout import copies


def group_name(C, T):
    """A stage's group as the mesh names it: "tp=T", "cp=C" or "cp=C x tp=T"."""
    return " x ".join(f"{d}={k}" for d, k in (("cp", C), ("tp", T)) if k > 1) or "tp=1"


def group_refusal(net, C, T, sequence_parallel, attention):
    """Why the model cannot run on a stage's group of C x T, or None."""
    if C == 1:
        return net.tensor_refusal(T) or (net.sequence_refusal(T, None) if sequence_parallel else None)
    return net.grid_refusal(C, T, attention) if T > 1 else net.sequence_refusal(C, attention)


def check_groups(net, n, S, C, T, sequence_parallel, attention):
    """ValueError (one line) unless pipelines of S stages, each on a group of C x T contexts (Megatron-SP
    inside it if sequence_parallel), divide the n contexts and run the model (MeshParallel without sums)."""
    if C > 1 and sequence_parallel:
        raise ValueError("cp with --sequence-parallel inside a pipeline: not yet")
    if n % (S * C * T):
        raise ValueError(f"pp={S} x {group_name(C, T)} does not divide the {n} contexts")
    if C == 1 and not net.splits_by_layer():
        raise ValueError(f"{net.name} splits as a whole model; tp x pp needs layers that split on their own")
    refusal = group_refusal(net, C, T, sequence_parallel, attention)
    if refusal:
        raise ValueError(f"tensor degree {refusal}" if C == 1 else f"{group_name(C, T)}: {refusal}")


def check_schedule(net, schedule, S, micro_batches, V, dim):
    """ValueError (one line) unless S stages x V virtual stages of net's layers run `schedule` on
    groups of dimension `dim` ("tp" or "cp"): gpipe, 1f1b or interleaved (zb-h1's split backward is
    not written for groups)."""
    check_name(schedule, S, max(micro_batches, 1), V)
    check_micro(schedule, S, micro_batches)
    if schedule == "zb-h1" or S * V > len(net.layers):
        raise ValueError(f"zb-h1 with {dim}: not yet (gpipe, 1f1b or interleaved)" if schedule == "zb-h1" else
                         f"{S} stages x {V} virtual stages need {S * V} layers; {net.name} has {len(net.layers)}")


def sequence_stage(net, ids, seq):
    """The function (hs, params, F=nd) -> hs of the model's layers `ids` on a context-parallel group:
    hs one block of tokens per context, params[j] context j's copy of those layers' parameters; each
    layer's sequence_forward, or a token-wise layer on each block (Model.sequence_forward's loop)."""
    layers, slices = net.layers, net.slices()
    first = slices[ids[0]].start

    def run(hs, params, F=nd):
        for i in ids:
            own = [P[slices[i].start - first:slices[i].stop - first] for P in params]
            hs = layers[i].sequence_forward(hs, own, seq, F) if layers[i].sequence_forward else \
                [layers[i].forward(h, q, F, [p.shape for p in q]) for h, q in zip(hs, own)]
        return hs
    return run


def grid_stage(net, ids, join, seq, T):
    """The function (hs, params, F=nd) -> hs of the model's layers `ids` on a grid of C x T contexts,
    given flat, block by block (rank c T + t: block c of the tokens, tensor rank t): each row a tensor
    group (join), each column a context-parallel group (seq); params[c T + t] that context's shards."""
    layers, slices = net.layers, net.slices()
    first = slices[ids[0]].start

    def rows(xs):
        return [xs[c:c + T] for c in range(0, len(xs), T)]

    def run(hs, params, F=nd):
        hs, params = rows(hs), rows(params)
        for i in ids:
            own = [[P[slices[i].start - first:slices[i].stop - first] for P in row] for row in params]
            hs = grid_layer(layers[i], hs, own, join, seq, F)
        return [h for row in hs for h in row]
    return run


def tensor_stage(net, ids, join):
    """The function (hs, shards, F=nd) -> hs of the model's layers `ids` on a tensor group: hs one array
    per context, shards[j] context j's pieces of those layers' parameters (in order). A run of
    split layers is entered through join.shard and left through join.unshard, as Model.split_forward
    does for the whole model, so the stages compose to it."""
    layers, slices = net.layers, net.slices()
    first = slices[ids[0]].start

    def run(hs, shards, F=nd):
        for i in ids:
            own = [P[slices[i].start - first:slices[i].stop - first] for P in shards]
            now, before = bool(layers[i].split_forward), bool(i and layers[i - 1].split_forward)
            if now != before:
                hs = join.shard(hs) if now else join.unshard(hs)
            hs = layers[i].split_forward(hs, own, join, F) if now else \
                [layers[i].forward(h, q, F, [p.shape for p in q]) for h, q in zip(hs, join.leads(own))]
        return join.unshard(hs) if ids[-1] == len(layers) - 1 and layers[-1].split_forward else hs
    return run


def group_runs(net, cuts, T, join, seq):
    """The stages of net's `cuts` on groups of T tensor ranks (join: f and g) or, given seq (the
    Sequence between a context-parallel group's blocks), of C blocks or C x T: grid_stage,
    sequence_stage or tensor_stage."""
    if seq is not None and T > 1:
        return [grid_stage(net, ids, join, seq, T) for ids in cuts]
    if seq is not None:
        return [sequence_stage(net, ids, seq) for ids in cuts]
    return [tensor_stage(net, ids, join) for ids in cuts]


class GroupPass:
    """One pipeline replica's run of a schedule: stage k on the contexts groups[k] (a tensor group),
    micro-batches Xs (on groups[0][0]) and ys (on groups[-1][0]); scale: what each context's loss
    is multiplied by before its backward; Fs[m]: micro-batch m's namespace (Model.noisy: dropout);
    zero: the mesh's DataShardedOptimizer, whose stage 2 takes each stage's micro-batch gradients
    as they are made (dp_zero.backward)."""

    def __init__(self, Xs, ys, params, groups, stages, scale, Fs=None, zero=None):
        self.Xs, self.ys, self.params, self.groups, self.stages, self.scale = Xs, ys, params, groups, stages, scale
        self.zero = zero
        self.Fs = Fs or [nd] * len(Xs)
        self.last, M = len(stages) - 1, len(Xs)
        self.received = [[None] * M for _ in stages]
        self.produced = [[None] * M for _ in stages]
        self.sent = [[None] * M for _ in stages]        # sent[k][m]: the gradient of stage k's input, per rank
        self.metrics = []

    def forward(self, k, m):
        group = self.groups[k]
        self.received[k][m] = copies(self.Xs[m], group) if k == 0 else \
            [send(h, c) for h, c in zip(self.produced[k - 1][m], group)]
        with autograd.record():
            out = self.stages[k](self.received[k][m], self.params[k], self.Fs[m])
            if k == self.last:
                ys = copies(self.ys[m], group)
                losses = [example_loss(o, y).sum() for o, y in zip(out, ys)]
                self.metrics.append((losses[0], count_correct(out[0], ys[0])))
                out = [l * self.scale for l in losses] if self.scale != 1 else losses
        self.produced[k][m] = out

    def backward(self, k, m):
        head_grads = None if k == self.last else [g.copyto(c) for g, c in zip(self.sent[k + 1][m], self.groups[k])]
        self.sent[k][m] = backward(self.produced[k][m], [p for P in self.params[k] for p in P], self.zero,
                                   head_grads, self.received[k][m] if k > 0 else ())
        if k < self.last:
            self.received[k + 1][m] = self.sent[k + 1][m] = None
        self.produced[k][m] = None

    def run(self, actions):
        for phase, k, m in actions:
            (self.forward if phase == "F" else self.backward)(k, m)
        return nd.add_n(*[l for l, _ in self.metrics]), nd.add_n(*[c for _, c in self.metrics])


class PiecePass(GroupPass):
    """GroupPass whose micro-batches are single batch pieces (--deterministic, mesh_sums.py): as soon
    as stage k's backward of piece m ran, collect(k, m, [arrays of place j]) takes every place's
    gradients (the parameters' grad_req "write": each backward overwrites), the last stage's followed
    by the piece's loss sum and correct count, copied to each place of the group."""

    def __init__(self, *args, collect):
        super().__init__(*args)
        self.collect, self.done = collect, {}

    def forward(self, k, m):
        super().forward(k, m)
        if k == self.last:
            self.done[m] = self.metrics[-1]

    def backward(self, k, m):
        super().backward(k, m)
        self.collect(k, m, [[p.grad for p in P] + ([a.as_in_context(c) for a in self.done[m]] if k == self.last
                                                   else []) for P, c in zip(self.params[k], self.groups[k])])
