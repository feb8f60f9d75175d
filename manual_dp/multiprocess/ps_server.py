"""What the parameter servers run under --backend dist_async (unpickled there by MXNet).

A server becomes one while MXNet itself is still being imported, so this module imports only
the one piece of MXNet it needs.
"""
from mxnet.optimizer import Optimizer


class AddDelta(Optimizer):
    """The servers' update under dist_async: stored += pushed (workers push parameter changes)."""

    def create_state(self, index, weight):
        return None

    def update(self, index, weight, grad, state):
        weight[:] += grad
