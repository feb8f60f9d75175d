"""Two runs rebuilt in this process from their digest files' headers: their configuration, their
data, the batch of update t as the training loop drew it, the state both held after update t-1,
and each one's strategy (manual_dp.cli.build's build_model, so the very layout the run had).

The batch of update t: loop.run_epoch draws, every epoch, one permutation of the training set from
an rng seeded by --seed (datasets.contract.batches) and takes its batches in order, dropping a last batch
shorter than the strategy's min_batch; `batches_from` repeats that, counting A's updates.

The state after update t-1 (the runs agree until then, or diverge would name an earlier update):
A's checkpoint if its --checkpoint-dir holds one of exactly update t-1 (checkpoints are written at
the end of an epoch, so only for an update t that opens an epoch), else A retrained from its
initial parameters in this process, at most MAX_RETRAIN updates (a step of the small models takes
milliseconds to a few tenths of a second on a CPU).
"""
import contextlib
import dataclasses
import io
from pathlib import Path

import numpy as np

from .. import checkpoint, config, datasets, perturb
from ..cli.build import build_model, contexts, learning_rate, network
from ..datasets.contract import batches
from ..errors import CheckpointError
from ..multiprocess.world import World
from ..schedule import lr_at
from .verdict import ReplayError

MAX_RETRAIN = 200     # updates A is retrained for in this process, at most


def load_data(cfg):
    """(X, y) of cfg's training set, through the data contract as the run read it (--data, and
    --perturb's nudge of the inputs)."""
    data = datasets.load(cfg).cut(cfg.train_size, cfg.test_size)
    return perturb.nudged_inputs(cfg.perturb, data.train, data.spec.tokens)


def build(cfg, params):
    """cfg's strategy on its contexts, from the initial `params` (its printing kept quiet)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return build_model(cfg, params, contexts(cfg, World()), World())


def initial_params(cfg):
    """The run's initial parameters (--perturb's nudge of the weights too)."""
    return perturb.nudged_params(cfg.perturb, network(cfg).init_params(cfg.seed, cfg.init_scale))


def epoch_batches(X, y, cfg, rng, min_batch):
    """One epoch's batches in the loop's order (a short last batch dropped, as run_epoch does)."""
    return [(Xb, yb) for Xb, yb in batches(X, y, cfg.batch_size, rng) if len(Xb) >= min_batch]


def saved_state(cfg, t):
    """(state, rng state, what, batches of its epoch taken) of A's checkpoint if it holds exactly
    update t (a mid-epoch one: its rng state is the epoch's, cursor batches of it taken); None otherwise."""
    if not cfg.checkpoint_dir or not (Path(cfg.checkpoint_dir) / checkpoint.NAME).is_file():
        return None
    try:
        state, meta = checkpoint.load(cfg.checkpoint_dir)
    except CheckpointError:
        return None
    same = all(meta["config"].get(k) == getattr(cfg, k) for k in config.RUN_KEYS if k in meta["config"])
    if meta["t"] != t or not same:
        return None
    taken = meta["cursor"]["batches"] if meta.get("cursor") else 0
    return state, meta["rng_state"], f"A's checkpoint in {cfg.checkpoint_dir} (epoch {meta['epoch']}, update {t})", taken


def state_before(cfg, t, X, y):
    """(state after update t-1 or None for the initial one, the batch (Xb, yb) of update t, what the
    state came from); ReplayError if A would have to be retrained longer than MAX_RETRAIN."""
    model = build(cfg, initial_params(cfg))
    rng = perturb.ordered(cfg.perturb, np.random.default_rng(cfg.seed), cfg.batch_size)
    saved = saved_state(cfg, t - 1) if t > 1 else None
    if saved:
        model.load_state_dict(saved[0])
        rng.bit_generator.state = saved[1]
    elif t - 1 > MAX_RETRAIN:
        raise ReplayError(f"update {t}: A would be retrained for {t - 1} updates here (at most {MAX_RETRAIN}); "
                          f"run A with --checkpoint-dir so that it holds a checkpoint at update {t - 1}, "
                          f"the end of an epoch")
    lr, done, skip = learning_rate(cfg, len(X)), model.t, saved[3] if saved else 0
    while True:
        epoch = epoch_batches(X, y, cfg, rng, model.min_batch)
        for i, (Xb, yb) in enumerate(epoch[skip:]):
            if done == t - 1:
                what = saved[2] if saved else (f"A retrained from its start for {t - 1} updates" if t > 1 else
                                               "the initial parameters")
                return (model.state_dict() if t > 1 else None), (Xb, yb), what
            model.step(Xb, yb, lr_at(lr, model.t))
            done += 1
        if not epoch:
            raise ReplayError(f"--train-size {cfg.train_size}: no batch of at least {model.min_batch} rows")
        model.end_epoch(lr_at(lr, model.t))
        skip = 0


def without_graph(cfg):
    """cfg with --mode sync's cached graph off (None: it has none)."""
    return dataclasses.replace(cfg, graph=False) if cfg.mode == "sync" and cfg.graph else None
