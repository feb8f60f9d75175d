"""What each pipeline action takes on this machine, timed before a run: the third price a dry run
puts on a schedule, beside one unit an action and the model's FLOPs (strategies/pipeline/stage_costs.py).

One micro-batch of random images goes through a pipeline's first replica alone, every action of
the schedule in the order it runs them (each F, then each B, and ZB-H1's W), each action timed
between nd.waitall()s by the pipeline's own code (strategies/pipeline/pipeline_pass.py, measure=True): the
same stages, boundary copies, loss and metrics as in training. `repeats` such passes, one more
first (dropped: allocation and first calls), the median of each (phase, stage). The gradients they
leave are cleared.

What this price sees that FLOPs do not: each operator's own cost (at the sizes a CPU trains here a
transformer block's forward on one example takes most of its time on sixteen), a backward whose
cost is not two forwards (MXNet's autograd computes an operator's gradients together: ZB-H1's B,
the input gradient alone, costs about a whole backward), the loss and metrics on the last stage.
What it cannot see: what the schedule itself changes, such as GPipe holding every micro-batch's
activations before its first backward (measured: a longer backward than 1F1B's, on this CPU).
"""
import numpy as np
from mxnet import nd

from ...memory import random_batch
from .pipeline_pass import ReplicaPass, SplitPass
from .schedules import plan, run_order


def stage_times(pipe, micro, repeats=5, seed=0):
    """{(phase, stage): seconds} of PipelineParallel `pipe`'s actions on one micro-batch of `micro`
    random images (see the module's docstring)."""
    p = plan(pipe.schedule, pipe.S, 1, pipe.V)
    X, y = random_batch(micro, seed, pipe.net.spec)
    places, params = pipe.places[0], pipe.params[0]
    Xs, ys = [nd.array(X, ctx=places[0])], [nd.array(y, ctx=places[-1])]
    took = {}
    for r in range(repeats + 1):
        run = (SplitPass if p.split else ReplicaPass)(Xs, ys, params, places, pipe.stages, pipe.elems,
                                                      pipe.recompute, pipe.S, measure=True)
        run.run(run_order(p))
        for action, seconds in run.durations.items() if r else ():
            took.setdefault(action, []).extend(seconds)
    for q in (q for P in params for q in P):
        q.grad[:] = 0
    return {action: float(np.median(s)) for action, s in took.items()}
