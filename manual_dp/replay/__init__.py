"""`python -m manual_dp.diverge A B --replay`: where inside one update two runs part.

diverge names the first update t and tensor where two --digests files differ; --replay rebuilds
both runs in this process from the files' headers and runs update t once in A's layout and once in
B's, from the same state after update t-1, on the same batch, and names the first layer whose
output (forward order) or whose output's gradient (backward order) differs.

    verdict.py   the two replays, each in a process with its run's thread settings, and the
                 first difference (no MXNet in this process)
    worker.py    one replay: rebuild, bring to update t-1, run update t captured, save
    rebuild.py   the runs' configurations, data, the batch of update t, the state after t-1
    capture.py   every layer's output and its gradient, recorded during one step, in row order

What it cannot do: runs of several processes or with --grad-accum; layers a strategy runs without
Layer.forward (tensor-split layers, context-parallel layers, a user's Gluon block) or inside
--mode sync's cached graph (captured with --no-graph instead, saying whether that keeps the bits);
retraining more than rebuild.MAX_RETRAIN updates (give A a --checkpoint-dir). It says when a
replay does not give its run's digests.
"""
from .verdict import ReplayError, replay_runs

__all__ = ["replay_runs", "ReplayError"]
