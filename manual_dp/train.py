"""`python -m manual_dp.train [flags]` (and the `manual-dp-train` script): train from the command line.

The flags are read first, without MXNet; then the thread settings for the devices they name go
into the environment (manual_dp.fast.runtime), and only then does MXNet load, through manual_dp.cli.run.
"""
import sys

from .cli.options import parse
from .cli.output import fail, interrupted
from .config import device_request
from .errors import UsageError
from .fast.runtime import configure


def main(argv=None):
    """Exits 0, or with one line on stderr: 2 for bad input, 1 for bad data, checkpoints or peers."""
    try:
        cfg = parse(argv)
        kind, n = device_request(cfg)
        configure(n if kind == "cpu" else 0, per_op=1 if cfg.deterministic else None)
        from .cli.run import run_or_exit   # MXNet loads here, with the settings above
    except UsageError as e:
        sys.exit(fail(e, 2))
    except KeyboardInterrupt:             # Ctrl-C while MXNet is still loading
        interrupted()
    run_or_exit(cfg)


if __name__ == "__main__":
    main()
