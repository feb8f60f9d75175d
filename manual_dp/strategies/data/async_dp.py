"""Asynchronous data parallelism, parameter-server style, simulated deterministically on one machine.

A master copy of the parameters and the optimiser state lives on ctx[0]. Every device k keeps its
own replica, which it refreshes from the master only when `refresh_due(k, t, staleness)`: every
staleness + 1 updates, staggered by device (a fixed round-robin). Each batch is sharded over the
devices as in sync; device k's gradient is computed against its replica, however old, and pushed
to the master unchanged (no averaging, no staleness correction). The master applies what arrives
for one batch as one optimiser step on the summed gradients / the global batch. With staleness 0
every replica is refreshed after every update, so this is exactly the synchronous step.

A model with BatchNorm (strategies/running.py): its running statistics belong to the master, like
the parameters, and are kept, as every other strategy keeps them, the same bits on every context
(evaluation, fingerprints and checkpoints read them as elsewhere). In a step each device normalises
its shard with the batch statistics its own, possibly stale, replica gives (Gluon's per-context
default) and pushes them with its gradient; the master folds the mean of every device's into the
running statistics when it applies the step (Moments.fold, DataParallel's fold), once per batch
pushed. Evaluation normalises with the running statistics. With staleness 0 this is DataParallel
with per-context statistics. Not with --sync-batchnorm: statistics summed across replicas of
different ages are not one batch's.
"""
from mxnet import autograd, nd

from ...config import RunConfig
from ...errors import CheckpointError
from ...lesson import forward_backward, get_params, shard_sizes, split_and_load
from ...models.contract import count_correct, example_loss
from ...models import as_model
from ...optim import apply_update_and_clear, init_states
from ...replicas import fingerprint
from ..base import Strategy
from .data_parallel import host_state, load_into
from ..running import RunningStats


def refresh_due(k, t, staleness):
    """Whether device k pulls the master's parameters once the master has taken t updates."""
    return (t + k) % (staleness + 1) == 0


def last_refresh(k, t, staleness):
    """The master version (number of updates) that device k's replica holds after t updates."""
    return max(t - (t + k) % (staleness + 1), 0)


def reshard_replicas(saved, master, k, t, staleness):
    """The replicas k devices hold after t updates, from the `saved` replicas of len(saved) devices
    and the `master` parameters. Device j's replica is the master of version last_refresh(j, t, S),
    which depends on j only through (t + j) mod (S + 1): a saved replica of that version is taken
    (the run continues exactly as it would have on k devices from the start of the staggering);
    where none was saved (fewer devices than S + 1 before), the master: that replica is fresher
    than its schedule says, until its next refresh."""
    by_version = {last_refresh(j, t, staleness): copy for j, copy in enumerate(saved)}
    return [by_version.get(last_refresh(j, t, staleness), master) for j in range(k)]


class AsyncDataParallel(RunningStats, Strategy):
    """A master copy on ctx[0]; a replica per context, up to `staleness` updates behind it."""

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, staleness=0, model=None):
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.ctx, self.optimizer, self.staleness = list(ctx), optimizer, staleness
        self.net = as_model(model, params)
        self.keep_running(False, None)                         # per device: no statistics across replicas
        self.pushed = []                                       # batch statistics (Moments) the next update folds
        self.master = get_params(params, self.ctx[0])          # .grad: where pushes arrive
        self.master_states = init_states(self.master, optimizer)
        self.replicas = [get_params(params, c) for c in self.ctx]
        self.versions = [0] * len(self.ctx)                    # master version each replica holds
        self.t, self.seen, self.unpushed = 0, [], False
        for p in self.master:
            p.grad[:] = 0

    def backward(self, X, y):
        """Every device computes its shard's gradient on its replica, to push to the master when the
        next backward or update begins (with a model with BatchNorm, its shard's batch statistics
        too): whatever delays a device's gradient after its backward (a straggler) delays its push."""
        self.push()
        X_shards, y_shards = split_and_load(X, self.ctx), split_and_load(y, self.ctx)
        if self.running:
            metrics, moments = self.unfolded_forward_backward(X_shards, y_shards, self.replicas)
            self.pushed.append(moments)
        else:
            metrics = forward_backward(X_shards, y_shards, self.replicas, self.net.forward, example_loss,
                                           count_correct)
        self.seen.extend(self.t - version for version in self.versions)
        self.unpushed = True
        return metrics

    def push(self):
        """Afterwards the master's gradients hold every replica's of the last backward, added once."""
        if self.unpushed:
            for W in self.replicas:
                for p, q in zip(self.master, W):
                    p.grad[:] += q.grad.copyto(p.context)
        self.unpushed = False

    def update(self, lr, n_examples):
        """The master applies the pushed gradients and folds each pushed batch's statistics into the
        running ones; the devices whose turn it is pull the result."""
        self.push()
        self.t += 1
        apply_update_and_clear(self.master, self.master_states, self.optimizer, lr, self.t, n_examples)
        pushed, self.pushed = self.pushed, []
        for moments in pushed:
            self.fold(moments)
        for k, W in enumerate(self.replicas):
            if refresh_due(k, self.t, self.staleness):
                self.pull(k)

    def grad_buffers(self, i):
        """The arrays holding context i's gradients: its replica's, one per parameter."""
        return [q.grad for q in self.replicas[i]]

    def pull(self, k):
        for p, q in zip(self.master, self.replicas[k]):
            p.copyto(q)
        self.versions[k] = self.t

    def end_epoch(self, lr):
        """The staleness the epoch's gradients actually had (in updates), then forget it."""
        seen, self.seen = self.seen, []
        if not seen:
            return {}
        return {"staleness_mean": sum(seen) / len(seen), "staleness_max": max(seen)}

    def correct(self, X, y):
        """Correct predictions of the master's parameters, on the master's context (BatchNorm with
        the running statistics)."""
        home = self.ctx[0]
        X, y = X.as_in_context(home), y.as_in_context(home)
        if not self.running:
            return count_correct(self.net.forward(X, self.master), y)
        with autograd.train_mode():        # as DataParallel.correct (loop.evaluate)
            return count_correct(self.net.forward_group([X], [self.master], self.moments(False, 1))[0], y)

    def fingerprints(self):
        """Only the master: the replicas differ from it by design (they are stale); and every
        context's running statistics, which do not."""
        return {"master": [fingerprint(self.ctx[0], self.master, self.net.names())], **self.running_fingerprints()}

    def layout(self, batch_size):
        """Every device runs both stages on its shard of the batch."""
        sizes = shard_sizes(batch_size, len(self.ctx))
        return [(c, s, n) for c, n in zip(self.ctx, sizes) for s in (0, 1)]

    def arrays(self):
        params = self.master + [q for W in self.replicas for q in W]
        states = [s for st in self.master_states for s in st] + self.running_arrays()
        return {"param": params, "grad": [p.grad for p in params], "state": states}

    def state_dict(self):
        """The master's parameters and optimiser state, and every replica's (possibly stale) copy of
        the parameters: part of the algorithm's state, resuming without them changes the run; and
        the running statistics, if the model keeps any."""
        return host_state(self.master, self.master_states, self.t,
                          replicas=[p.asnumpy() for W in self.replicas for p in W], **self.running_state())

    def load_state_dict(self, state):
        self.load_running(state)
        load_into(self.master, self.master_states, state)
        self.t = state["t"]
        self.versions = [last_refresh(k, self.t, self.staleness) for k in range(len(self.ctx))]
        saved = state.get("extra", {}).get("replicas")
        if saved is None and self.staleness == 0:  # another strategy's: fresh replicas are exact
            saved = [p for _ in self.replicas for p in state["params"]]
        if saved is None:
            raise CheckpointError("the checkpoint holds no async replicas (it is another mode's)")
        n = len(self.master)
        if len(saved) % n:
            raise CheckpointError("the checkpoint's async replicas do not fit LeNet's parameters")
        copies = reshard_replicas([saved[i:i + n] for i in range(0, len(saved), n)], state["params"],
                                  len(self.replicas), self.t, self.staleness)
        for W, copy in zip(self.replicas, copies):
            for p, value in zip(W, copy):
                p[:] = nd.array(value, ctx=p.context)
