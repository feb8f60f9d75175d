"""A job's processes agree on their settings before any of them trains (issue 25): every process's
effective settings, everything that changes the numbers, are compared with rank 0's, and a
difference ends the whole job in one line per process, naming the setting and the ranks. Without
it two workers with --lr 0.05 and --lr 0.1 trained to the end and exited 0.

Rank 0's settings reach every rank (broadcast_object); each rank compares, and a flag per rank,
all-reduced, tells every rank which ones differ (dist_async's servers add pushes into parameters,
so there a differing rank stops alone and the others meet the job's failure detection).
"""
from mxnet import nd

from ..config import fields
from ..errors import UsageError

# Settings each process may hold its own of: paths on its machine, what only rank 0 writes, its terminal.
PER_PROCESS = ("data_dir", "log_json", "checkpoint_dir", "trace", "no_progress", "flight_record")


def settings(cfg):
    """{field: its value, as text} of every setting the job's processes must share."""
    return {f.name: repr(getattr(cfg, f.name)) for f in fields() if f.name not in PER_PROCESS}


def flag(name):
    return "--" + name.replace("_", "-")


def agree(cfg, world):
    """Return if every process of `world` runs with rank 0's settings; else UsageError (one line)
    on every rank: the differing ones name their settings, the others the differing ranks."""
    if world.size == 1:
        return
    mine = settings(cfg)
    root = world.broadcast_object(mine)
    differ = [k for k in mine if mine[k] != root.get(k)]
    ranks = [world.rank] if differ else []
    if getattr(world, "backend", "") != "dist_async":
        flags = nd.zeros((world.size,))
        flags[world.rank] = 1 if differ else 0
        world.allreduce(flags, "settings")
        ranks = [r for r, f in enumerate(flags.asnumpy()) if f]
    if differ:
        raise UsageError(f"rank {world.rank} runs with other settings than rank 0: " + ", ".join(
            f"{flag(k)} {mine[k]} here, {root[k]} on rank 0" for k in differ))
    if ranks:
        raise UsageError(f"rank(s) {', '.join(map(str, ranks))} of {world.size} run with other settings than "
                         f"rank 0 (their lines name them): every process of a job needs the same flags")
