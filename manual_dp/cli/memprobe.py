"""`python -m manual_dp.cli.memprobe CONFIG_JSON KIND N PARENT`: one run's memory report per
context, measured in this fresh process (manual_dp.cli.memcheck starts it), printed as one JSON line.

The process dies with the one that started it (process id PARENT), however that one ends:
on Linux the kernel sends it SIGKILL when its parent ends, even by SIGKILL (prctl's
PR_SET_PDEATHSIG); elsewhere, and on an interruption anywhere, memcheck.run_probes kills it.
"""
import ctypes
import json
import os
import signal
import sys

from ..config import RunConfig
from ..fast.runtime import configure

PR_SET_PDEATHSIG = 1                       # linux/prctl.h


def die_with_parent(parent):
    """Afterwards this process gets SIGKILL when process `parent` (its parent) ends, on Linux;
    if `parent` has already ended, this process has ended too."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):        # no prctl: not Linux
        pass
    if parent and os.getppid() != parent:     # it ended before the prctl: this one was adopted
        os._exit(1)


def main(argv):
    """Prints the report of the RunConfig given as JSON, on contexts cpu|gpu(0..N-1)."""
    die_with_parent(int(argv[3]))
    fields, kind, n = json.loads(argv[0]), argv[1], int(argv[2])
    configure(n if kind == "cpu" else 0, model=fields.get("model"))
    import mxnet as mx                                            # loads with the settings above
    from .memcheck import measure_run
    from .build import build_model, network
    cfg = RunConfig(**fields)
    ctx = [mx.cpu(i) if kind == "cpu" else mx.gpu(i) for i in range(n)]
    params = network(cfg).init_params(cfg.seed, cfg.init_scale)
    print(json.dumps(measure_run(cfg, params, ctx, build_model, where="a fresh process")))


if __name__ == "__main__":
    main(sys.argv[1:])
