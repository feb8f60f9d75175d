"""One replayed update in a process of its own: `python -m manual_dp.replay.worker ROLE FILE T DIR`.

A kernel's bits may depend on how many threads run it, and MXNet reads its thread settings once,
when it loads; so each run is replayed in a process started with that run's settings (as
`python -m manual_dp.train` would choose them, manual_dp.replay.verdict.run_env).

    ROLE A   rebuild run FILE, bring it to the state after update T-1 (rebuild.state_before), save
             that state (a checkpoint in DIR/state) and the batch of update T (DIR/batch.npz), then
             replay update T
    ROLE B   rebuild run FILE, load DIR/state and DIR/batch.npz, replay update T

and write DIR/ROLE.npz: every layer's output ("out<i>") and output gradient ("grad<i>") over the
batch in its row order, the notes on layers that could not be captured and the update's digest
line (both JSON in "meta"). Its lines go to stdout; bad input to stderr, one line, exit 2.
"""
import json
import sys
from pathlib import Path

import numpy as np

from .. import checkpoint
from ..cli.build import learning_rate, network
from ..digests import config_of, read_header
from ..digests import compare
from ..errors import CheckpointError, DataError, UsageError
from ..schedule import lr_at
from ..strategies.wrappers.digested import Digested
from .capture import Recorder
from .rebuild import build, initial_params, load_data, state_before, without_graph
from .verdict import ReplayError


class Lines:
    """A DigestFile that keeps its lines in memory."""

    def __init__(self):
        self.lines = []

    def write(self, line):
        self.lines.append(line)


def step_once(cfg, state, Xb, yb, n_train, rec):
    """(digest line, outputs, grads, notes) of one update of cfg's layout from `state` on (Xb, yb)."""
    model = build(cfg, initial_params(cfg))
    if state:
        model.load_state_dict(state)
    sink = Lines()
    model = Digested(model, sink)
    with rec.capturing():
        model.step(Xb, yb, lr_at(learning_rate(cfg, n_train), model.t))
    return (sink.lines[-1],) + rec.whole(Xb, len(network(cfg).layers))


def starting_point(role, cfg, t, X, y, directory):
    """(state, (Xb, yb)): A's computed and saved in `directory`, B's read from there."""
    if role == "A":
        state, batch, what = state_before(cfg, t, X, y)
        print(f"replaying update {t} ({len(batch[0])} rows) from {what}", flush=True)
        if state:
            checkpoint.save(directory / "state", state, {"epoch": 0, "history": [], "config": {},
                                                         "rng_state": np.random.default_rng(cfg.seed).bit_generator.state,
                                                         "model": network(cfg).describe()})
        np.savez(directory / "batch.npz", X=batch[0], y=batch[1])
        return state, batch
    state = checkpoint.load(directory / "state")[0] if (directory / "state" / checkpoint.NAME).is_file() else None
    with np.load(directory / "batch.npz") as z:
        return state, (z["X"], z["y"])


def replay_update(role, path, t, directory):
    """Replay update t of the run of digest file `path` as `role`; its results in directory/ROLE.npz."""
    run, directory = read_header(path), Path(directory)
    cfg = config_of(run)
    X, y = load_data(cfg)
    state, batch = starting_point(role, cfg, t, X, y, directory)
    rec, net = Recorder(), network(cfg)
    with rec.installed(net):
        line, outputs, grads, notes = step_once(cfg, state, *batch, len(X), rec)
        plain = without_graph(cfg)
        graph_note = None
        if all(notes) and plain:
            line_plain, outputs, grads, notes = step_once(plain, state, *batch, len(X), rec)
            graph_note = compare([line_plain], [line])[0] == 0
    arrays = {f"out{i}": a for i, a in enumerate(outputs) if a is not None}
    arrays.update({f"grad{i}": g for i, g in enumerate(grads) if g is not None})
    meta = {"line": line, "notes": notes, "names": [layer.name for layer in net.layers],
            "param_layers": {p.name: layer.name for layer in net.layers for p in layer.params},
            "graph_off_same": graph_note}
    np.savez(directory / f"{role}.npz", meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)


def main(argv=None):
    role, path, t, directory = argv or sys.argv[1:]
    try:
        replay_update(role, path, int(t), directory)
    except (ReplayError, DataError, CheckpointError, UsageError) as e:
        sys.stderr.write(f"{e}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
