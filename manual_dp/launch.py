"""`python -m manual_dp.launch [options] -- COMMAND...`: see manual_dp.multiprocess.launcher."""
import sys

from .multiprocess.launcher import main

if __name__ == "__main__":
    sys.exit(main())
