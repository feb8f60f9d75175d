"""`python -m manual_dp.launch [options] -- COMMAND...`: see manual_dp.multiprocess.launcher and
manual_dp.multiprocess.elastic (--max-restarts)."""
import sys

from .multiprocess.elastic import main

if __name__ == "__main__":
    sys.exit(main())
