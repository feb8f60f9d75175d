"""One pipeline replica's run of a schedule, action by action: ReplicaPass (F and an unsplit B) and
SplitPass (ZB-H1's B and W), the boundary copies by hand, and the activation bytes each device
holds as it goes (strategies/pipeline/pipeline.py runs them)."""
from time import perf_counter

import numpy as np
from mxnet import autograd, nd

from ...lesson import shard_sizes
from ...models.contract import example_loss, count_correct
from ...memory import FLOAT_BYTES
from .stages import send


def stage_params(params, ctx):
    """Copies of `params` on `ctx` whose gradients add up over backward passes until zeroed."""
    copies = [p.copyto(ctx) for p in params]
    for p in copies:
        p.attach_grad(grad_req="add")
    return copies


def cut(X, n):
    """X split along axis 0 into min(n, len(X)) micro-batches that differ in size by at most one."""
    ends = np.cumsum(shard_sizes(X.shape[0], min(n, X.shape[0])))
    return [X[int(a):int(b)] for a, b in zip(np.r_[0, ends[:-1]], ends)]


class ReplicaPass:
    """One replica's run of a schedule over micro-batches Xs (on ctx[0]) and ys (on ctx[-1]), action
    by action, counting the activation bytes each device holds as it goes (`peak`). Stage s runs on
    ctx[s], device s % n_devices (interleaved: several stages a device).

    Afterwards params[s][i].grad holds (adds) the gradient of the loss summed over all micro-batches.
    recompute: a forward keeps only the stage's input; its backward runs the forward again, recorded.
    measure: each action timed between nd.waitall()s, in `durations` (seconds, by (phase, stage)).
    Fs[m]: the operators' namespace of micro-batch m's stages (Model.noisy: its dropout masks).
    collect(s, m, grads): called with stage s's gradients of micro-batch m alone as soon as they are
    made (--deterministic's leaves; the stage's parameters then take grad_req "write"); metrics[m]
    is micro-batch m's (loss sum, number correct), once its last stage ran.
    """

    def __init__(self, Xs, ys, params, ctx, stages, elems, recompute, n_devices=None, measure=False, Fs=None,
                 collect=None):
        self.Xs, self.ys, self.params, self.ctx, self.stages = Xs, ys, params, ctx, stages
        self.Fs, self.collect = Fs or [nd] * len(Xs), collect
        self.elems, self.recompute, self.last, M = elems, recompute, len(stages) - 1, len(Xs)
        self.n_devices = n_devices or len(stages)
        self.received = [[None] * M for _ in stages]   # received[s][m]: stage s's input for micro-batch m
        self.produced = [[None] * M for _ in stages]   # produced[s][m]: its output; losses on the last stage
        self.held, self.peak, self.metrics = [0] * self.n_devices, [0] * self.n_devices, {}
        self.durations = {} if measure else None

    def hold(self, s, nbytes):
        """Stage s's device holds nbytes more (fewer, if negative); its peak is kept."""
        d = s % self.n_devices
        self.held[d] += nbytes
        self.peak[d] = max(self.peak[d], self.held[d])

    def run_stage(self, s, m):
        """Stage s's forward on micro-batch m: its output, or on the last stage its losses (B,)."""
        out = self.stages[s](self.received[s][m], self.params[s], self.Fs[m])
        if s < self.last:
            return out
        losses = example_loss(out, self.ys[m])
        self.metrics[m] = (losses.sum(), count_correct(out, self.ys[m]))
        return losses

    def forward(self, s, m):
        """Stage s's forward on micro-batch m, recorded unless recomputed later."""
        self.received[s][m] = self.Xs[m] if s == 0 else send(self.produced[s - 1][m], self.ctx[s])
        if self.recompute:
            if s > 0:
                self.produced[s - 1][m] = None                          # copied: stage s - 1 drops it
            with autograd.train_mode():
                self.produced[s][m] = self.run_stage(s, m)
            self.hold(s, self.received[s][m].size * FLOAT_BYTES)     # the input alone stays
        else:
            with autograd.record():
                self.produced[s][m] = self.run_stage(s, m)
            self.hold(s, self.full_bytes(s, m))

    def full_bytes(self, s, m):
        """Bytes of every activation stage s's recorded forward on micro-batch m keeps."""
        return self.Xs[m].shape[0] * self.elems[s] * FLOAT_BYTES

    def rerun(self, s, m):
        """Recompute: stage s's forward on micro-batch m again, recorded (its metrics counted once)."""
        self.hold(s, self.full_bytes(s, m))
        with autograd.record():
            out = self.stages[s](self.received[s][m], self.params[s], self.Fs[m])
            self.produced[s][m] = example_loss(out, self.ys[m]) if s == self.last else out

    def backward(self, s, m):
        """Stage s's backward on micro-batch m; then it holds nothing of m."""
        if self.recompute:
            self.rerun(s, m)                                           # recomputed, for one backward
            self.hold(s, -self.full_bytes(s, m) - self.received[s][m].size * FLOAT_BYTES)
        else:
            self.hold(s, -self.full_bytes(s, m))
        if s == self.last:
            self.produced[s][m].backward()
        elif s > 0 or self.params[s]:  # the gradient crosses the boundary back, copied by hand (a first
            # stage without parameters, a Flatten alone, has nothing to differentiate)
            self.produced[s][m].backward(self.received[s + 1][m].grad.copyto(self.ctx[s]))
        if self.collect:
            self.collected(s, m, [p.grad for p in self.params[s]])
        self.produced[s][m] = None
        if s < self.last:
            self.received[s + 1][m] = None

    def collected(self, s, m, grads):
        """collect(s, m, arrays): stage s's gradients of micro-batch m, on the last stage followed by
        its loss sum and correct count."""
        self.collect(s, m, list(grads) + (list(self.metrics[m]) if s == self.last else []))

    def act(self, phase, s, m):
        """Runs one action: "F" forward, "B" backward (SplitPass: B and W)."""
        (self.forward if phase == "F" else self.backward)(s, m)

    def run(self, actions):
        """Every (phase, stage, micro-batch) of `actions`, in order; returns (loss sum, number correct)
        on the last stage's context."""
        for action in actions:
            if self.durations is None:
                self.act(*action)
                continue
            nd.waitall()                                 # measuring: the action's own time only
            start = perf_counter()
            self.act(*action)
            nd.waitall()
            self.durations.setdefault(action[:2], []).append(perf_counter() - start)
        return nd.add_n(*[l for l, _ in self.metrics.values()]), nd.add_n(*[c for _, c in self.metrics.values()])

    def median_durations(self):
        """{(phase, stage): median seconds} of the measured actions (a median: one action the
        machine interrupted moves it little)."""
        return {k: float(np.median(v)) for k, v in self.durations.items()}


class SplitPass(ReplicaPass):
    """ReplicaPass with the backward split as ZB-H1 asks: B, the gradient with respect to the stage's
    input only (what the previous stage waits for), sent back; W, later, the weight gradients from the
    same graph and the same output gradient, added into params[s][i].grad.

    What W costs here: MXNet's autograd.grad walks the stage's recorded graph from its output each
    time, so B runs the backward chain inside the stage (without the weight gradients' own ops) and
    W runs it again: the stage's backward is done once and a half, not once (a real ZB splits each
    operator, so that B + W cost one backward). The graph stays recorded from F until W: the stage
    holds all its activations until W, not only until B. Stage 0 has no input gradient: its B is
    empty (unless it recomputes), its W the whole backward.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        M = len(self.Xs)
        self.sent = [[None] * M for _ in self.stages]    # sent[s][m]: B's gradient of stage s's input
        self.heads = [[None] * M for _ in self.stages]   # heads[s][m]: the gradient of its output, for W

    def act(self, phase, s, m):
        {"F": self.forward, "B": self.backward_input, "W": self.weight}[phase](s, m)

    def backward_input(self, s, m):
        """B: the gradient of stage s's input for micro-batch m, kept for stage s - 1."""
        if self.recompute:
            self.rerun(s, m)                                           # kept until W
        if s < self.last:   # the gradient crosses the boundary back, copied by hand
            self.heads[s][m], self.sent[s + 1][m] = self.sent[s + 1][m].copyto(self.ctx[s]), None
        if s > 0:
            self.sent[s][m] = autograd.grad(self.produced[s][m], [self.received[s][m]], head_grads=self.heads[s][m],
                                            retain_graph=True)[0]

    def weight(self, s, m):
        """W: stage s's weight gradients for micro-batch m, added in; then it holds nothing of m."""
        P = self.params[s]
        grads = autograd.grad(self.produced[s][m], P, head_grads=self.heads[s][m]) if P else []
        if self.collect:
            self.collected(s, m, grads)
        else:
            for p, g in zip(P, grads):
                p.grad[:] += g
        self.hold(s, -self.full_bytes(s, m) - (self.received[s][m].size * FLOAT_BYTES if self.recompute else 0))
        self.produced[s][m] = self.received[s][m] = self.heads[s][m] = None


def piece_actions(order, parts):
    """`order` (actions of micro-batches) with each action repeated for every piece of its
    micro-batch, in order: parts[m] is micro-batch m's pieces (--deterministic runs a stage piece
    by piece, the kernels of one piece's shape, whatever the micro-batching)."""
    return [(phase, s, q) for phase, s, m in order for q in parts[m]]
