"""The errors a run can end with, for the library and the command line alike.

The command line reports each as one line: UsageError with exit status 2, the others with 1
(DivergedError with 3, so that a script can tell a diverged run from a broken one; DistributedError
with PEER_LOST, so that a launcher can tell a process that lost a peer, and may run again without
it, from one whose own input is bad, which would fail again).
"""

PEER_LOST = 4     # exit status of a process whose peer failed or vanished (a collective failed, the watchdog)


class UsageError(Exception):
    """Bad input from the user: flags, device counts, combinations no run can use."""


class DataError(Exception):
    """The data set is missing, truncated or corrupt; the message says which file."""


class CheckpointError(Exception):
    """A checkpoint is missing, unreadable or does not fit the run."""


class DistributedError(Exception):
    """Another process of the job failed or vanished."""


class OutputError(Exception):
    """An output (log, checkpoint directory) cannot be written."""


class ReplicaMismatchError(Exception):
    """Copies of the parameters that must be identical are not: a reduction went wrong."""


class DivergedError(Exception):
    """Training went non-finite: the loss or the parameters are NaN or infinite."""


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: like Ctrl-C's KeyboardInterrupt it unwinds every `with` block
    (locks released, no file half-written) and ends the run with one line, exit 128 + signal."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum
