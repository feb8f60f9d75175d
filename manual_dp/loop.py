"""The training loop around any strategy: epochs of steps, evaluation, one record per epoch.

fit() neither prints nor writes: it yields records, and the command line (manual_dp.cli) or a
notebook decides what to show. (It was called `train` before the package took its layers; the
command `python -m manual_dp.train` is the module manual_dp.train.)
"""
import collections
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


def run_epoch(model, X, y, batch_size, lr, rng, on_batch=None, lookahead=2, check_replicas=0, first_batch=0):
    """One pass over (X, y) in `rng`'s order; returns (mean loss, accuracy). With check_replicas N,
    every copy of the parameters is compared every N updates (manual_dp.replicas). The batches are
    the run's first_batch, first_batch + 1, ... (what dropout's masks are drawn for).

    Metrics stay on the devices until the end of the epoch; the host waits only on the batch
    `lookahead` steps back, so that MXNet's queue stays full but bounded, and reads its running
    loss: DivergedError at the first step whose loss is not finite.
    """
    totals, seen, pending = None, 0, collections.deque()
    n_batches, noise = -(-len(X) // batch_size), model.net.noise if model.net else None
    for i, (Xb, yb) in enumerate(prefetch(batches(X, y, batch_size, rng))):
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
    for step, running_loss in pending:
        check_loss(step, running_loss)
    if not seen:
        return float("nan"), float("nan")
    totals = model.job_metrics(totals)
    return (sum(float(l.asscalar()) for l, _ in totals) / seen,
            sum(float(c.asscalar()) for _, c in totals) / seen)


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
        start_epoch=0, on_batch=None, check_replicas=0):
    """Train for epochs start_epoch+1..epochs, yielding one record per epoch (no printing)."""
    (Xtr, ytr), (Xte, yte) = train_data, test_data
    for epoch in range(start_epoch + 1, epochs + 1):
        start = time.perf_counter()
        try:
            train_loss, train_acc = run_epoch(model, Xtr, ytr, batch_size, lr, rng, on_batch,
                                              check_replicas=check_replicas,
                                              first_batch=(epoch - 1) * -(-len(Xtr) // batch_size))
        except DivergedError as e:
            raise DivergedError(f"epoch {epoch}, {e}") from None
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
