"""The contract every parallel strategy keeps. The training loop, the checkpoints, the memory report,
gradient accumulation and the multi-process wrapper rely on these methods and nothing else.

A step is two phases, so that strategies compose:

    backward(X, y)          forward and backward on one batch; its gradients are ADDED to those
                            the strategy holds since the last update
    update(lr, n_examples)  one optimiser step on (held gradients) / n_examples, then the held
                            gradients are zero again

    step(X, y, lr) = backward(X, y) + update(lr, len(X))      (one batch, one update)

GradAccum calls backward on several batches before one update; the multi-process wrapper feeds
backward this process's rows of every global batch and update the global count.
"""

from mxnet import nd

from ..lesson import shard_sizes
from .clipping import NormLog


def rank_rows(n, rank, size, k):
    """Rows [start, stop) of a batch of n that contexts rank*k .. rank*k+k-1 take when one
    process splits it over size*k contexts with shard_sizes."""
    sizes = shard_sizes(n, size * k)
    return sum(sizes[:rank * k]), sum(sizes[:(rank + 1) * k])


def placed(values, ctx):
    """NDArrays of `values` (host arrays) on `ctx` whose gradients add up over backward passes until
    zeroed (grad_req "add"): a strategy's own copy of parameters it holds."""
    arrays = [nd.array(v, ctx=ctx, dtype=v.dtype) for v in values]
    for a in arrays:
        a.attach_grad(grad_req="add")
    return arrays


class Strategy:
    """Base class: a parallel strategy over the contexts `ctx`.

    Attributes every strategy sets:
        ctx     the contexts it computes on
        t       optimiser updates taken so far (from 0; checkpointed)
        net     the model it trains (manual_dp.models.Model), read only through its contract
    """
    ctx = ()
    t = 0
    net = None
    per_process_extra = ()     # names of state_dict()["extra"] entries that differ between processes
    norm_log = None            # NormLog: the global gradient norms, and clipping (strategies/clipping.py)
    sums = None                # how sums over the batch are taken: None, the layout's own fast sums; or
                               # --deterministic's FixedSums, passed in (strategies/sums/)

    @property
    def batch_places(self):
        """The places a batch is split over, a row each at least: the contexts (a layout of groups
        or pipelines: one place per group)."""
        return len(self.ctx)

    @property
    def min_batch(self):
        """The smallest batch `backward` can take (the loop drops a shorter last batch): a row per
        place; under a FixedSums a piece of any size (the tree leaves no place idle)."""
        return 1 if self.sums else self.batch_places

    def backward(self, X, y):
        """Forward and backward on the batch (X, y) (numpy arrays or NDArrays); add its gradients to
        those held. Returns [(loss sum, number correct)] as NDArrays, one pair per placement,
        left on their devices (the loop adds them up without waiting)."""
        raise NotImplementedError

    def update(self, lr, n_examples):
        """One optimiser step with learning rate `lr` on the held gradients divided by `n_examples`
        (the examples they were summed over); then zero them and count the update in `t`."""
        raise NotImplementedError

    def step(self, X, y, lr):
        """One batch, one update; returns what backward returns."""
        metrics = self.backward(X, y)
        self.update(lr, X.shape[0])
        return metrics

    def rows(self, n, rank, size):
        """Rows [start, stop) of a global batch of n that this strategy takes in `backward` as
        process `rank` of `size` (manual_dp.multiprocess): by default the rows its contexts would
        take if one process split the batch over every process's contexts (rank_rows); under a
        FixedSums every row: each process picks its own pieces of the global batch."""
        return (0, n) if self.sums else rank_rows(n, rank, size, self.min_batch)

    def correct(self, X, y):
        """Number of correct predictions on (X, y) with the current parameters, a 1-element NDArray."""
        raise NotImplementedError

    def job_metrics(self, metrics):
        """The (loss sum, number correct) pairs of the whole job, from this process's `metrics`:
        the same list in one process (the multi-process wrapper gathers every process's)."""
        return metrics

    def fingerprints(self):
        """{group: [(place, [(parameter, checksum)])]}: a checksum of every parameter of every copy
        that must be identical to the others of its group (the replicas of data parallelism, one
        group per pipeline stage), so that a wrong reduction is caught (manual_dp.replicas)."""
        raise NotImplementedError

    def end_epoch(self, lr):
        """Called after an epoch's last batch; returns what the strategy measured ({} if nothing)."""
        return {}

    def reduced_grads(self):
        """The model's gradient summed over the batch (and every context and process), one NDArray
        per parameter of the model, in its order, each element once: read inside `update`, after
        the reduction and before the optimiser (strategies/clipping.py). A strategy without one
        gradient (async, local SGD) does not clip."""
        raise NotImplementedError

    def counted(self, n_examples):
        """What `update` divides the reduced gradient by: n_examples, or more under --clip-norm,
        times fp16's loss scale; None: skip this update (fp16's overflow), only zero the gradients.
        The norm is logged either way (NormLog)."""
        self.norm_log = self.norm_log or NormLog()
        return self.norm_log.count(self.reduced_grads(), n_examples)

    def clip(self, clip_norm, scaler=None):
        """Afterwards every update scales the gradient by min(1, clip_norm / global norm); None:
        only log the norm. scaler: fp16's precision.LossScale, which the gradient carries and
        which decides whether an update is skipped. Returns the strategy."""
        self.norm_log = NormLog(clip_norm, scaler, self.norm_log.watch if self.norm_log else None)
        return self

    def observe(self, watch):
        """Afterwards every update calls watch(reduced_grads()) after the reduction and before the
        optimiser (--digests). Returns the strategy."""
        self.norm_log = self.norm_log or NormLog()
        self.norm_log.watch = watch
        return self

    def grad_norms(self):
        """{"grad_norm_mean", "grad_norm_max"} of the updates since the last call (and fp16's
        "loss_scale" and "skipped_steps")."""
        return self.norm_log.epoch_stats() if self.norm_log else {}

    def layout(self, batch_size):
        """[(context, stage, examples)]: for each placement of a stage of the network, how many
        examples of a `batch_size` batch it holds activations for at the step's peak (stage 0: the
        convolutions, 1: the dense layers; manual_dp.memory prices them)."""
        raise NotImplementedError

    def arrays(self):
        """{"param": [...], "grad": [...], "state": [...]}: every parameter array the strategy
        keeps, every gradient array, every optimiser-state array, each on the context that holds
        it. "grad" may be left out, the gradients then listed in "state" (the older contract);
        manual_dp.memory subtracts these from the measured peak to leave the activations."""
        raise NotImplementedError

    def peak_arrays(self):
        """arrays() and, where a strategy holds arrays only during a step (ZeRO's gathered parameters
        and per-layer gradients), those held at the step's largest moment: NDArrays or records
        with .context, .shape, .size, .dtype."""
        return self.arrays()

    def state_dict(self):
        """Host (numpy) copies of what a resumed run needs: {"params": [arrays in the model's
        order], "opt_state": [[arrays] per parameter], "t": updates, "extra": {name: [arrays]}}.
        params and opt_state are the same for every strategy, so a checkpoint moves between them;
        extra holds what only this strategy has (e.g. async's stale replicas)."""
        raise NotImplementedError

    def load_state_dict(self, state):
        """Overwrite parameters, optimiser state and t with `state` (from any strategy's
        state_dict); refuse, with CheckpointError, state this strategy cannot continue from."""
        raise NotImplementedError

    def job_state(self, state):
        """`state`, this process's state_dict with every process's per_process_extra gathered (a
        job of several processes), as the job's state: by default unchanged."""
        return state


def innermost(model):
    """The strategy inside every Wrapper around `model` (the world's, accumulation's, the loss scale's)."""
    while isinstance(model, Wrapper):
        model = model.model
    return model


class Wrapper(Strategy):
    """A strategy around another, `model`: every method passes through to it unless overridden
    (gradient accumulation, the multi-process wrappers)."""

    def __init__(self, model):
        self.model, self.ctx = model, model.ctx

    @property
    def t(self):
        return self.model.t

    @property
    def net(self):
        return self.model.net

    @property
    def per_process_extra(self):
        return self.model.per_process_extra

    def job_state(self, state):
        return self.model.job_state(state)

    @property
    def min_batch(self):
        return self.model.min_batch

    def backward(self, X, y):
        return self.model.backward(X, y)

    def update(self, lr, n_examples):
        self.model.update(lr, n_examples)

    def rows(self, n, rank, size):
        return self.model.rows(n, rank, size)

    def correct(self, X, y):
        return self.model.correct(X, y)

    def job_metrics(self, metrics):
        return self.model.job_metrics(metrics)

    def fingerprints(self):
        return self.model.fingerprints()

    def end_epoch(self, lr):
        return self.model.end_epoch(lr)

    def clip(self, clip_norm, scaler=None):
        self.model.clip(clip_norm, scaler)
        return self

    def observe(self, watch):
        self.model.observe(watch)
        return self

    def grad_norms(self):
        return self.model.grad_norms()

    def layout(self, batch_size):
        return self.model.layout(batch_size)

    def arrays(self):
        return self.model.arrays()

    def peak_arrays(self):
        return self.model.peak_arrays()

    def state_dict(self):
        return self.model.state_dict()

    def load_state_dict(self, state):
        self.model.load_state_dict(state)
