"""The lesson's call path, one all-reduce per gradient, with Python's cost paid once per replica list.

A small all-reduce is mostly not arithmetic: each engine call made from Python (nd.add_n, copyto)
goes through argument parsing, wrapper objects and a ctypes call, some 10-20 us, before the engine
sees it. kvstore('device') makes its calls from C++, once pushpull is called. reduce_bcast over k
contexts makes k calls from Python per gradient: one add_n on the first context, k-1 copies back.

PreparedAllreduce makes the same k engine calls, but builds each once per list of replicas, as a
ready C call (MXImperativeInvokeEx with its operator, input and output handles fixed); every later
all-reduce of the same replicas replays them. The engine sees exactly what reduce_bcast gives it,
so the sums are reduce_bcast's, bit for bit (tests/test_collectives.py). The replicas are known by
their memory (each one's data pointer): `param.grad` returns a new wrapper on every access, always
of the same memory. A plan keeps its replicas alive, so no other array can take that memory while
the plan exists; at most MAX_PLANS plans are kept (least recently used dropped).

MXNet gives an array's address on CPU only: elsewhere (GPUs) a plan is built for each call and not
kept, with the other replicas first copied to the first context into buffers of the plan's, as
reduce_bcast's fetch does: correct there, not faster.
"""
import ctypes
from collections import OrderedDict

from mxnet import nd
from mxnet.base import NDArrayHandle, OpHandle, _LIB, c_handle_array, c_str, c_str_array, check_call

MAX_PLANS = 256


def op_handle(name):
    """MXNet's handle of the operator `name` (e.g. "add_n", "_copyto")."""
    handle = OpHandle()
    check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(handle)))
    return ctypes.c_void_p(handle.value)


class Call:
    """One engine call made ready: `op` on NDArrays `inputs` writing `outputs`, with `attrs`."""

    def __init__(self, op, inputs, outputs, **attrs):
        self.arrays = (inputs, outputs)                     # keeps the handles valid
        self.op, self.n_in, self.inputs = op_handle(op), ctypes.c_int(len(inputs)), c_handle_array(inputs)
        self.n_out = ctypes.c_int(len(outputs))
        self.outputs = ctypes.cast(c_handle_array(outputs), ctypes.POINTER(NDArrayHandle))
        self.n_attrs, self.keys = ctypes.c_int(len(attrs)), c_str_array(list(attrs))
        self.values = c_str_array([str(v) for v in attrs.values()])
        self.stypes = ctypes.POINTER(ctypes.c_int)()

    def __call__(self):
        check_call(_LIB.MXImperativeInvokeEx(self.op, self.n_in, self.inputs, ctypes.byref(self.n_out),
                                             ctypes.byref(self.outputs), self.n_attrs, self.keys,
                                             self.values, ctypes.byref(self.stypes)))


def plan(arrays):
    """[Call]: reduce_bcast's engine calls for these replicas (see the module docstring)."""
    home = arrays[0].context
    inputs, calls = [arrays[0]], []
    for a in arrays[1:]:
        if a.context.device_type == "cpu" and home.device_type == "cpu":
            inputs.append(a)                                # CPU contexts share one memory
        else:
            buffer = nd.empty(a.shape, ctx=home, dtype=a.dtype)
            calls.append(Call("_copyto", [a], [buffer]))
            inputs.append(buffer)
    calls.append(Call("add_n", inputs, [arrays[0]], num_args=len(inputs)))
    calls += [Call("_copyto", [arrays[0]], [a]) for a in arrays[1:]]
    return calls


def data_pointer(array):
    """Where `array`'s elements live (the same for every wrapper of the same memory)."""
    pointer = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(array.handle, ctypes.byref(pointer)))
    return pointer.value


class PreparedAllreduce:
    """The lesson's contract (afterwards every replica holds the sum), reduce_bcast's engine calls,
    built once per list of replicas and replayed."""

    def __init__(self):
        self.plans = OrderedDict()

    def __call__(self, arrays):
        on_cpu = all(a.context.device_type == "cpu" for a in arrays)
        key = tuple(data_pointer(a) for a in arrays) if on_cpu else None
        calls = self.plans.get(key)                         # never a plan under None
        if calls is None:
            calls = self.prepare(arrays, key)
        else:
            self.plans.move_to_end(key)
        for call in calls:
            call()

    def prepare(self, arrays, key):
        """A plan for `arrays`, kept under `key` unless it is None (replicas of different shapes:
        ValueError, as for every algorithm)."""
        shapes = [a.shape for a in arrays]
        if any(s != shapes[0] for s in shapes):
            raise ValueError(f"all-reduce of replicas of different shapes: {', '.join(map(str, shapes))}")
        if len(arrays) < 2 or 0 in shapes[0]:
            calls = []                                      # nothing to add, or nothing to add up
        else:
            calls = plan([a.reshape((1,)) for a in arrays] if shapes[0] == () else arrays)
        if key is not None:
            self.plans[key] = calls
            if len(self.plans) > MAX_PLANS:
                self.plans.popitem(last=False)
        return calls


def prepared_allreduce(arrays):
    """Afterwards every `arrays[i]` holds the sum (a plan used once: make_allreduce("prepared")
    keeps plans across calls, as a trainer does)."""
    PreparedAllreduce()(arrays)
