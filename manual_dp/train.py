"""`python -m manual_dp.train [flags]` (and the `manual-dp-train` script): train from the command line.

The flags are read first, without MXNet; then the thread settings for the devices they name go
into the environment (manual_dp.fast.runtime), and only then does MXNet load, through manual_dp.cli.run.
"""
import os
import signal
import sys

from .cli.options import parse
from .cli.output import fail, interrupted, terminate
from .config import device_request
from .errors import Terminated, UsageError
from .fast.runtime import configure, environment_problem


def main(argv=None):
    """Exits 0, or with one line on stderr: 2 for bad input, 1 for bad data or checkpoints, 3 for
    divergence, 4 for a lost peer, 130 for Ctrl-C, 128 + N for signal N (SIGTERM, SIGHUP); SIGTERM
    and SIGHUP raise Terminated (output.terminate), which manual_dp.cli.run ends the run with."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, terminate)
    try:
        problem = environment_problem()
        if problem:
            raise UsageError(problem)
        cfg = parse(argv)
        kind, n = device_request(cfg)
        configure(n if kind == "cpu" else 0, per_op=1 if cfg.deterministic else None, model=cfg.model)
        if cfg.bucket_mb is not None and not cfg.graph:   # see manual_dp.fast.buckets: ready per layer
            os.environ.setdefault("MXNET_EXEC_BULK_EXEC_TRAIN", "0")
        from .cli.run import run_or_exit   # MXNet loads here, with the settings above
    except UsageError as e:
        sys.exit(fail(e, 2))
    except KeyboardInterrupt:             # Ctrl-C while MXNet is still loading
        interrupted()
    except Terminated as e:
        interrupted(e.signum)
    run_or_exit(cfg)


if __name__ == "__main__":
    main()
