"""The training loop around any strategy: epochs of steps, evaluation, one record per epoch.

fit() neither prints nor writes: it yields records, and the command line (manual_dp.cli) or a
notebook decides what to show. (It was called `train` before the package took its layers; the
command `python -m manual_dp.train` is the module manual_dp.train.)
"""
import collections
import dataclasses
import itertools
import math
import time

import numpy as np
from mxnet import autograd, nd

from .datasets.contract import batches
from .errors import DivergedError
from . import replicas
from .fast.prefetch import prefetch
from .models.contract import example_loss
from .models.dropout import training_batch
from .schedule import lr_at


def evaluate(model, X, y, batch_size):
    """Accuracy of `model` on (X, y), every batch sharded over all its contexts.

    In MXNet's training mode, though nothing is recorded: in inference mode MXNet's oneDNN
    convolution reorders a weight array in place into its blocked layout (once channels are a
    multiple of the vector block, e.g. --width 2's 40), which breaks parameters that are views of
    a flat buffer. Whether the model itself runs in inference mode is the strategy's: a model with
    BatchNorm normalises with its running statistics in `correct` (models.batchnorm), whatever
    MXNet's flag says."""
    with autograd.train_mode():
        total = sum(model.correct(nd.array(Xb), nd.array(yb))
                    for Xb, yb in batches(X, y, batch_size))
    return float(total.asscalar()) / len(X)


def validation_loss(model, X, y, batch_size):
    """The mean per-example loss (for a language model: per token, in nats) on (X, y) of the
    parameters `model` holds, gathered whole (Strategy.state_dict: any layout) and run on its first
    context, outside any training batch (no dropout); an MoE GPT's without its aux term (the
    scores' last row, models/moe.py): the task's loss alone."""
    net, home = model.net, model.ctx[0]
    params = [nd.array(p, ctx=home) for p in model.state_dict()["params"]]

    def scores(Xb, yb):
        s = net.forward(nd.array(Xb, ctx=home), params)
        return s[:, :yb.shape[1]] if net.aux else s
    total = sum(example_loss(scores(Xb, yb), nd.array(yb, ctx=home)).sum() for Xb, yb in batches(X, y, batch_size))
    return float(total.asscalar()) / len(X)


@dataclasses.dataclass
class Cursor:
    """Where an epoch stands: its first `batches` taken, the sums of their losses and correct
    predictions over `seen` examples (the whole job's), in `sec` seconds. A mid-epoch checkpoint
    holds one; an epoch resumed from it skips those batches of the same order and goes on."""
    batches: int = 0
    loss: float = 0.0
    correct: float = 0.0
    seen: int = 0
    sec: float = 0.0


def run_epoch(model, X, y, batch_size, lr, rng, on_batch=None, lookahead=2, check_replicas=0, first_batch=0,
              cursor=None, after_update=None):
    """One pass over (X, y) in `rng`'s order; returns (mean loss, accuracy). With check_replicas N,
    every copy of the parameters is compared every N updates (manual_dp.replicas). The batches are
    the run's first_batch, first_batch + 1, ... (what dropout's masks are drawn for).

    From `cursor` (a Cursor) the epoch's first cursor.batches are skipped and its sums go on from
    the cursor's. After every update, `after_update(where)` may save (where() is the Cursor now,
    every loss so far checked) and returns True to end the epoch there: run_epoch returns None.

    Metrics stay on the devices until the end of the epoch; the host waits only on the batch
    `lookahead` steps back, so that MXNet's queue stays full but bounded, and reads its running
    loss: DivergedError at the first step whose loss is not finite.
    """
    cursor, start = cursor or Cursor(), time.perf_counter()
    totals, seen, pending = None, 0, collections.deque()
    n_batches, noise = -(-len(X) // batch_size), model.net.noise if model.net else None

    def where():
        while pending:
            check_loss(*pending.popleft())
        loss, correct = sums(model.job_metrics(totals))
        return Cursor(i + 1, cursor.loss + loss, cursor.correct + correct, cursor.seen + seen,
                      cursor.sec + time.perf_counter() - start)

    ordered = itertools.islice(batches(X, y, batch_size, rng), cursor.batches, None)
    for i, (Xb, yb) in enumerate(prefetch(ordered), start=cursor.batches):
        if len(Xb) < model.min_batch:
            break  # a tail smaller than the device count is dropped, never crashes
        t = model.t
        with training_batch(noise, first_batch + i):
            metrics = model.step(Xb, yb, lr_at(lr, model.t))
        if check_replicas and model.t != t and model.t % check_replicas == 0:
            replicas.check(model.fingerprints(), model.t)
        totals = accumulate(totals, metrics)
        seen += len(Xb)
        pending.append((i + 1, totals[0][0]))
        if len(pending) > lookahead:
            check_loss(*pending.popleft())
        if on_batch:
            on_batch(i + 1, n_batches)
        if after_update and model.t != t and after_update(where):
            return None
    for step, running_loss in pending:
        check_loss(step, running_loss)
    if not seen and not cursor.seen:
        return float("nan"), float("nan")
    loss, correct = sums(model.job_metrics(totals)) if totals else (0.0, 0.0)
    return (cursor.loss + loss) / (cursor.seen + seen), (cursor.correct + correct) / (cursor.seen + seen)


def sums(totals):
    """(loss, correct) summed over the per-context pairs, on the host."""
    return (sum(float(l.asscalar()) for l, _ in totals), sum(float(c.asscalar()) for _, c in totals))


def check_loss(step, running_loss):
    """DivergedError if the running loss sum (one context's, up to `step`) is not finite."""
    value = float(running_loss.asscalar())
    if not math.isfinite(value):
        raise DivergedError(f"step {step}: the training loss is {value}")


def check_params(model):
    """DivergedError naming the first parameter that holds a NaN or an infinity, or a value past
    the largest its model's products can hold (Model.largest: fp16's 65504 under --precision fp16)."""
    names = model.net.names() if model.net else [f"parameter {i}" for i in range(len(model.state_dict()["params"]))]
    largest = model.net.largest if model.net else math.inf
    for name, p in zip(names, model.state_dict()["params"]):
        if not np.isfinite(p).all():
            raise DivergedError(f"parameter {name} holds {'NaN' if np.isnan(p).any() else 'infinite'} values")
        if p.size and np.abs(p).max() > largest:
            raise DivergedError(f"parameter {name} holds {np.abs(p).max():.3g}, past {largest:g}, the largest its "
                                f"products can hold: every product that reads it overflows")


def accumulate(totals, metrics):
    """Running per-context (loss sum, correct), each added on its own device: no copies per batch."""
    if totals is not None and len(totals) != len(metrics):  # a strategy whose context count varies
        home = totals[0][0].context
        totals, metrics = fold(totals, home), fold(metrics, home)
    return list(metrics) if totals is None else [(L + l, C + c) for (L, C), (l, c) in zip(totals, metrics)]


def fold(pairs, home):
    """[(sum of losses, sum of corrects)] of per-context pairs, on `home`."""
    return [tuple(nd.add_n(*[pair[j].copyto(home) for pair in pairs]) for j in (0, 1))]


def fit(model, train_data, test_data, epochs, batch_size, lr, rng,
        start_epoch=0, on_batch=None, check_replicas=0, cursor=None, after_update=None):
    """Train for epochs start_epoch+1..epochs, yielding one record per epoch (no printing). The
    first of them goes on from `cursor` (run_epoch); `after_update(epoch, where)` is called after
    every update, and ends the run there (no record of that epoch) when it returns True."""
    (Xtr, ytr), (Xte, yte) = train_data, test_data
    for epoch in range(start_epoch + 1, epochs + 1):
        start = time.perf_counter() - (cursor.sec if cursor else 0.0)
        hook = (lambda where, epoch=epoch: after_update(epoch, where)) if after_update else None
        try:
            result = run_epoch(model, Xtr, ytr, batch_size, lr, rng, on_batch, check_replicas=check_replicas,
                               first_batch=(epoch - 1) * -(-len(Xtr) // batch_size), cursor=cursor,
                               after_update=hook)
        except DivergedError as e:
            raise DivergedError(f"epoch {epoch}, {e}") from None
        if result is None:
            return
        (train_loss, train_acc), cursor = result, None
        extras = model.end_epoch(lr_at(lr, model.t))   # e.g. an open accumulation window applied
        try:
            extras.update(model.grad_norms())          # the global gradient norm's mean and max (fp16: diverged
            epoch_sec = time.perf_counter() - start    # if every update overflowed)
            check_params(model)
        except DivergedError as e:
            raise DivergedError(f"epoch {epoch}: {e}") from None
        test_acc = evaluate(model, Xte, yte, batch_size)
        if model.net is not None and model.net.spec.task == "next-token":    # a language model's
            extras.update(val_loss=validation_loss(model, Xte, yte, batch_size),
                          tokens_per_sec=ytr[0].size * len(Xtr) / epoch_sec)
        yield {"epoch": epoch, "train_loss": train_loss, "train_acc": train_acc,
               "test_acc": test_acc, "epoch_sec": epoch_sec,
               "images_per_sec": len(Xtr) / epoch_sec, "devices": [str(c) for c in model.ctx],
               **extras}
