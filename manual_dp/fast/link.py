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
block Python and nothing overlaps them. Each delaying operator costs some 0.3-0.7 ms of its own (the
Python call on that thread): hops shorter than that are not resolved. One step's transfers on
disjoint ports (a ring's k sends) go as one operator (ship_all), so a ring on 8 contexts pays 14 such
calls a reduction instead of 112 (LeNet over eth1 on 8 contexts, loaded Zen 5: the ring's step 106.9
-> 75.2 ms, reduce_bcast's 78.6 -> 86.3 unchanged within noise, the tree's 61.1).
The operator's registration with MXNet (mx.operator.register, a table MXNet keeps by name) is the
one piece of global state, made on the first EmulatedLink, not at import.
"""
import functools
import time

import mxnet as mx
import numpy as np
from mxnet import nd

OP, OP_MANY = "manual_dp_link", "manual_dp_link_many"


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


class DelayMany(mx.operator.CustomOp):
    """Sleeps `seconds`, then out[i] = in[i] for every i: one step's transfers, which run at the same
    time on disjoint ports, in one operator (one Python call on MXNet's thread instead of one each)."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def forward(self, is_train, req, in_data, out_data, aux):
        time.sleep(self.seconds)
        for i, x in enumerate(in_data):
            self.assign(out_data[i], req[i], x)

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        time.sleep(self.seconds)
        for i, g in enumerate(out_grad):
            self.assign(in_grad[i], req[i], g)


class DelayManyProp(mx.operator.CustomOpProp):
    """n inputs and outputs of any shapes and types; m ports (1-element float32 auxiliary states)."""

    def __init__(self, seconds, n, m):
        super().__init__(need_top_grad=True)
        self.seconds, self.n, self.m = float(seconds), int(n), int(m)

    def list_arguments(self):
        return [f"data{i}" for i in range(self.n)]

    def list_outputs(self):
        return [f"output{i}" for i in range(self.n)]

    def list_auxiliary_states(self):
        return [f"port{j}" for j in range(self.m)]

    def infer_shape(self, in_shape):
        return list(in_shape), list(in_shape), [(1,)] * self.m

    def infer_type(self, in_type):
        return list(in_type), list(in_type), [np.float32] * self.m

    def create_operator(self, ctx, shapes, dtypes):
        return DelayMany(self.seconds)


@functools.lru_cache(maxsize=None)
def registered():
    """The operators' names, registered with MXNet on the first call only."""
    mx.operator.register(OP)(DelayProp)
    mx.operator.register(OP_MANY)(DelayManyProp)
    return OP


def delayed(x, seconds, sender, receiver, out=None):
    """x's values in `out` (default a new array on x's context) after `seconds`, on the engine, once
    the ports `sender` and `receiver` (1-element arrays) are free; they stay busy meanwhile."""
    kwargs = {"out": out} if out is not None else {}
    return nd.Custom(x, sender, receiver, op_type=registered(), seconds=repr(float(seconds)), **kwargs)


def delayed_all(xs, seconds, ports):
    """Every x's values (new arrays on their contexts) after the longest of `seconds` (one a
    message), on the engine, once every port (1-element arrays) is free; they stay busy meanwhile."""
    out = nd.Custom(*xs, *ports, op_type=OP_MANY, seconds=repr(float(max(seconds))), n=str(len(xs)),
                    m=str(len(ports)))
    return out if isinstance(out, list) else [out]


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

    def ship_all(self, pairs):
        """[(src, ctx)] shipped at once, each src's values after the link's time: transfers on
        disjoint ports (one step of a ring or a tree) as one operator that sleeps the longest of
        their times, holding every port involved; a src already on its ctx is itself. Other
        transfers, sharing a port, one after the other as ship does. One operator runs on one
        context, so the arrays it ships live on the first sender's: CPU contexts share one memory
        and --link is for CPU contexts only, so every reader reads them in place."""
        ports = [(self.port(src.context, "out"), self.port(ctx, "in")) for src, ctx in pairs if src.context != ctx]
        distinct = {id(p) for pair in ports for p in pair}
        moving = [src for src, ctx in pairs if src.context != ctx]
        if len(moving) < 2 or len(distinct) < 2 * len(moving):
            return [self.ship(src, ctx) for src, ctx in pairs]
        shipped = iter(delayed_all(moving, [self.seconds(src) for src in moving], [p for pair in ports for p in pair]))
        return [src if src.context == ctx else next(shipped) for src, ctx in pairs]

    def __repr__(self):
        return f"EmulatedLink({self.spec.name})"
