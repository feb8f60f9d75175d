"""Emulated links on MXNet's engine: every transfer between contexts takes the time the link would.

CPU contexts share one memory, so a transfer between them is nearly free and no technique that hides
or shrinks communication can be seen paying off. EmulatedLink(spec).ship(src, ctx) returns src's
values (really copied) after the delay the cost model gives one message of that size over the link
(manual_dp.links.LinkSpec.seconds: latency + bytes / bandwidth). The delay sits on the engine's
dependency graph, not in Python: ship pushes one custom operator (`manual_dp_link`) whose forward
sleeps, then copies. Python returns at once; whatever reads the shipped array waits for the delay,
while other engine work (the backward of other layers, other transfers) goes on meanwhile.

Contention, as the cost model prices it: each context has one full-duplex port, so a transfer
occupies its sender's outgoing port and its receiver's incoming port for its whole delay. Transfers
sharing a port run one after the other (reduce_bcast's k-1 sends into the root pay k-1 delays, its
k-1 copies back another k-1); transfers on disjoint ports run at the same time (a ring's k sends of
one step pay one delay). The ports are 1-element arrays given to the operator as auxiliary states,
which the engine treats as written: that is what orders the operators sharing one.

Custom operators run on MXNet's own threads, not the engine's workers. Measured on MXNet 1.9.1 (2 cores):
8, 16 and 24 independent 50 ms delays end together in 54-65 ms, with MXNET_CUSTOM_OP_NUM_THREADS unset
or set to 2 alike, so independent ports are not serialised by those threads (tests/test_link.py
checks 2). Under MXNET_ENGINE_TYPE=NaiveEngine every operator runs as it is issued: the delays then
block Python and nothing overlaps them. Each delayed transfer costs some 0.3-0.7 ms of its own (the
Python call on that thread): hops shorter than that are not resolved.
The operator's registration with MXNet (mx.operator.register, a table MXNet keeps by name) is the
one piece of global state, made on the first EmulatedLink, not at import.
"""
import functools
import time

import mxnet as mx
import numpy as np
from mxnet import nd

OP = "manual_dp_link"


class Delay(mx.operator.CustomOp):
    """Sleeps `seconds`, then out = in (backward: the same delay, then the gradient passed on)."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def forward(self, is_train, req, in_data, out_data, aux):
        time.sleep(self.seconds)
        self.assign(out_data[0], req[0], in_data[0])

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        time.sleep(self.seconds)
        self.assign(in_grad[0], req[0], out_grad[0])


class DelayProp(mx.operator.CustomOpProp):
    """One input and output of any shape and type; two ports (1-element float32 auxiliary states)."""

    def __init__(self, seconds):
        super().__init__(need_top_grad=True)
        self.seconds = float(seconds)

    def list_arguments(self):
        return ["data"]

    def list_auxiliary_states(self):
        return ["sender", "receiver"]

    def infer_shape(self, in_shape):
        return [in_shape[0]], [in_shape[0]], [(1,), (1,)]

    def infer_type(self, in_type):
        return [in_type[0]], [in_type[0]], [np.float32, np.float32]

    def create_operator(self, ctx, shapes, dtypes):
        return Delay(self.seconds)


@functools.lru_cache(maxsize=None)
def registered():
    """The operator's name, registered with MXNet on the first call only."""
    mx.operator.register(OP)(DelayProp)
    return OP


def delayed(x, seconds, sender, receiver, out=None):
    """x's values in `out` (default a new array on x's context) after `seconds`, on the engine, once
    the ports `sender` and `receiver` (1-element arrays) are free; they stay busy meanwhile."""
    kwargs = {"out": out} if out is not None else {}
    return nd.Custom(x, sender, receiver, op_type=registered(), seconds=repr(float(seconds)), **kwargs)


class EmulatedLink:
    """Transfers between CPU contexts priced by `spec` (a manual_dp.links.LinkSpec), one full-duplex
    port per context (see the module docstring). Passed to the all-reduces of
    manual_dp.fast.collectives as their `wire`; ship is all they call."""

    def __init__(self, spec):
        self.spec, self.ports = spec, {}
        registered()

    def port(self, ctx, direction):
        """Context ctx's port `direction` ("out", "in"): a 1-element array, made on first use."""
        key = (str(ctx), direction)
        if key not in self.ports:
            self.ports[key] = nd.zeros((1,), ctx=mx.cpu(0))
        return self.ports[key]

    def seconds(self, x):
        """The link's time for one message holding x."""
        return self.spec.seconds(x.size * np.dtype(x.dtype).itemsize)

    def ship(self, src, ctx):
        """src's values after the time the link takes to carry them to `ctx` (an array on src's
        context; src itself when ctx is src's own: nothing crosses a link)."""
        if src.context == ctx:
            return src
        return delayed(src, self.seconds(src), self.port(src.context, "out"), self.port(ctx, "in"))

    def __repr__(self):
        return f"EmulatedLink({self.spec.name})"
