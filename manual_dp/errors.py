"""The errors a run can end with, for the library and the command line alike.

The command line reports each as one line: UsageError with exit status 2, the others with 1.
"""


class UsageError(Exception):
    """Bad input from the user: flags, device counts, combinations no run can use."""


class DataError(Exception):
    """The data set is missing, truncated or corrupt; the message says which file."""


class CheckpointError(Exception):
    """A checkpoint is missing, unreadable or does not fit the run."""


class DistributedError(Exception):
    """Another process of the job failed or vanished."""
