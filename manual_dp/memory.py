"""Bytes per context: the peak one training step holds on each context, split into parameters,
gradients, optimiser state and activations/temporaries.

`measure` reads the peak from what MXNet allocates (manual_dp.fast.memtrack: the storage manager's
per-device counters, through its profiler): a fresh copy of the strategy is built, warmed up and
stepped inside one window, and the most bytes held at once during its last step, counted from
the window's start, are that context's peak. Parameters, gradients and optimiser state are the
sizes of the arrays the strategy keeps (Strategy.arrays), on the context that holds them;
activations/temporaries = peak - those: autograd's saved outputs, the input shards, gradients of
activations in flight, the cached graph's planned memory, operators' scratch space, copies.
Limits (see memtrack, docs/design.md): the bytes are those MXNet reserves, which on CPU the OS
backs only where touched; MXNet's CPU scratch space is one pool registered on cpu(0), so cpu(0)
carries every CPU context's scratch; bytes outside MXNet's storage (oneDNN's own buffers) are
not counted; scratch space grown earlier in the same process is not counted again, so the figure
is exact only in a fresh process (the command line measures in one of its own, with one scratch
buffer per device: manual_dp.cli.memcheck).

Where the profiler cannot count a context (cpu(i) past the processors + 2) `per_context`
computes activations from the layer shapes instead (`stage_activation_elems`, the hand count of
what autograd keeps); every report says which ("method").
"""
import os

import numpy as np

from .fast import memtrack
from .models import as_model

FLOAT_BYTES = 4
KINDS = ("param", "grad", "state")


def piece_activation_elems(image=(1, 28, 28), shapes=None, model=None):
    """[(input, kept)] per-example elements for each layer of the model (models.contract: a
    layer's `inputs` and `acts`): the layer's input, and the outputs of its ops (the loss goes with
    the last). A stage of layers i..j keeps the input of layer i and the `kept` of each. For LeNet
    (default, of `shapes`): conv1, conv2, dense1, dense2."""
    return [(layer.inputs, layer.acts) for layer in as_model(model, shapes).layers]


def part_activation_elems(part, image=(1, 28, 28), shapes=None, model=None):
    """Per-example elements a stage keeps for `part`: a tuple of consecutive layer indices (their
    activations), ("input", i) (only layer i's input, as under --recompute), or ("whole", E): E
    elements, what the strategy counted that a context holds whole for examples beyond its share
    (a tensor rank's images and what f and g join; a context block's images and what attention
    keeps beyond its share, negative for ring attention, which keeps no scores)."""
    if part[0] == "whole":
        return part[1]
    pieces = piece_activation_elems(image, shapes, model)
    if part[0] == "input":
        return pieces[part[1]][0]
    return pieces[part[0]][0] + sum(pieces[i][1] for i in part)


def stage_activation_elems(image=(1, 28, 28), shapes=None, model=None):
    """Per-example element counts that each half of the model (its 2-stage cut: for LeNet the
    convolutions and the dense layers) keeps for its backward when one context runs both halves
    (a data-parallel replica, a tensor rank); [whole, 0] for a one-layer model. Their sum counts
    every layer's output once: the second half's input is the first half's output, already
    counted there (a pipeline stage on a context of its own keeps a received copy: that is
    part_activation_elems of its layers).

    Counted: the network's input and every op's output (convolution, ReLU, pooling; dot, bias add,
    ReLU, log-softmax, the picked loss), which autograd holds until the backward pass.
    """
    net = as_model(model, shapes)
    if len(net.layers) < 2:
        return [part_activation_elems((0,), image, shapes, net), 0]
    first, second = net.cuts(2)
    pieces = piece_activation_elems(image, shapes, net)
    return [part_activation_elems(first, image, shapes, net),
            part_activation_elems(second, image, shapes, net) - pieces[second[0]][0]]


def held_bytes(model):
    """{context name: {"param_bytes", "grad_bytes", "state_bytes"}}: the arrays the strategy keeps
    (gradients listed under "state" by an older strategy count as state); and, for an MoE's
    experts, "experts" {"held", "of", "bytes", "whole_bytes"} (expert_layout)."""
    report = {str(c): {f"{k}_bytes": 0 for k in KINDS} for c in model.ctx}
    for kind, arrays in model.arrays().items():
        for a in arrays:
            report[str(a.context)][f"{kind}_bytes"] += a.size * np.dtype(a.dtype).itemsize
    for c, layout in expert_layout(model).items():
        report[c]["experts"] = layout
    return report


def expert_layout(model):
    """{context name: {"held": experts of each MoE block the context holds, "of": E, "bytes": the
    bytes of expert parameters it holds, "whole_bytes": those of all E (what a replica holds)}}
    for a strategy keeping one parameter list a context (`replicas` or `params`) of a model with experts; {}
    for any other. Under --mode expert a context holds E/N; under sync, all E."""
    net = getattr(model, "net", None)
    lists = getattr(model, "replicas", None) or getattr(model, "params", None)     # sync's, or expert's
    experts = getattr(getattr(net, "experts", None), "experts", None)
    shapes = [shape for _, shape in net.shapes()] if experts else ()
    if not experts or not lists or len(lists) != len(model.ctx) or \
            any(not cut_by_experts(P, shapes, net) for P in lists):
        return {}
    which = net.expert_params()
    whole = sum(int(np.prod(shapes[i])) for i in which) * FLOAT_BYTES
    return {str(P[which[0]].context): {"held": P[which[0]].shape[0], "of": experts, "whole_bytes": whole,
                                       "bytes": sum(P[i].size * np.dtype(P[i].dtype).itemsize for i in which)}
            for P in lists}


def scratch_buffers(ctx_name):
    """How many scratch buffers MXNet shares among this kind of context (its defaults: 4 on CPU, 1
    per GPU); on CPU they all count on cpu(0)."""
    cpu = ctx_name.startswith("cpu")
    return int(os.environ.get("MXNET_CPU_TEMP_COPY" if cpu else "MXNET_GPU_TEMP_COPY", 4 if cpu else 1))


def finish(report, peaks, method):
    """`report` with "activation_bytes" = peak - kept arrays, "peak_bytes", "method" and
    "scratch_buffers" added."""
    for c, r in report.items():
        r["activation_bytes"] = peaks[c] - sum(r[f"{k}_bytes"] for k in KINDS)
        r["peak_bytes"], r["method"], r["scratch_buffers"] = peaks[c], method, scratch_buffers(c)
    return report


def per_context(model, batch_size, shapes=None):
    """The computed report for a step on `batch_size`: kept arrays measured, activations from the
    layers of the strategy's model (Strategy.net; or LeNet of `shapes`)."""
    net = as_model(getattr(model, "net", None), shapes)
    report, elems = held_bytes(model), stage_activation_elems(model=net)
    peaks = {c: sum(r[f"{k}_bytes"] for k in KINDS) for c, r in report.items()}
    for c, s, n in model.layout(batch_size):
        per_example = elems[s] if isinstance(s, int) else part_activation_elems(s, model=net)
        peaks[str(c)] += n * per_example * FLOAT_BYTES
    return finish(report, peaks, "shapes")


def random_batch(batch_size, seed=0, spec=None):
    """Examples of `spec` (a datasets.Spec; default Fashion-MNIST's images (batch_size, 1, 28, 28))
    and labels (batch_size,) (next-token: (batch_size, T)) as the loop feeds them: values in [0, 1), or
    token ids below the vocabulary."""
    from .datasets import IMAGES
    spec, rng = spec or IMAGES, np.random.default_rng(seed)
    shape = (batch_size,) + tuple(spec.shape)
    X = rng.integers(0, spec.vocab, shape).astype(np.float32) if spec.tokens else rng.random(shape, dtype=np.float32)
    return X, rng.integers(0, spec.classes, (batch_size,) + spec.targets).astype(np.float32)


def steps_to_update(model, X, y, lr, updates=1):
    """Steps on (X, y) until `updates` more optimiser updates are taken (gradient accumulation
    takes several batches per update)."""
    target, steps = model.t + updates, 0
    while model.t < target:
        model.step(X, y, lr)
        steps += 1
        if steps > 10_000:
            raise RuntimeError(f"{type(model).__name__} took no update in {steps} steps")


def measure(build, ctx, batch_size, shapes=None, lr=1e-3, counters=True, spec=None):
    """The report of a step on `batch_size` examples of `spec` (default images) of the strategy
    `build()` makes on `ctx`: measured peak (method "profiler") where MXNet can count every context
    (and `counters`), else `per_context`'s."""
    X, y = random_batch(batch_size, spec=spec)
    if not counters or memtrack.counter_names(ctx) is None or not memtrack.configured():
        return per_context(build(), batch_size, shapes)
    with memtrack.Window(ctx) as window:
        model = build()
        steps_to_update(model, X, y, lr, updates=2)            # warm-up: graphs built, state made
        window.mark()
        steps_to_update(model, X, y, lr)
        report = held_bytes(model)
    return finish(report, window.peak, "profiler")


def format_bytes(n):
    """n bytes as "12.3 MiB" (powers of 1024)."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def counted(r):
    """What a context's report counts, in words: how it was measured and with which scratch pool."""
    if r["method"] == "shapes":
        return "activations computed from the layer shapes"
    pool = ("one scratch buffer per device, as a GPU has" if r["scratch_buffers"] == 1 else
            f"{r['scratch_buffers']} scratch buffers shared by the CPU contexts: those drawn so far count on cpu(0)")
    return f"one step's MXNet allocations, measured in {r.get('process', 'this process')} with {pool}"


def format_report(report):
    """One line: per context, the peak and its split, then what the figures count."""
    return "; ".join(f"{c}: peak {format_bytes(r['peak_bytes'])} = {format_bytes(r['param_bytes'])} params + "
                     f"{format_bytes(r['grad_bytes'])} grads + {format_bytes(r['state_bytes'])} optimiser state "
                     f"+ {format_bytes(r['activation_bytes'])} activations/temporaries"
                     + experts_held(r) for c, r in report.items()) + f" ({counted(next(iter(report.values())))})"


def cut_by_experts(P, shapes, net):
    """Whether the parameter list P holds the model's parameters, whole or its expert ones cut
    along the experts alone (not flattened shards, as ZeRO stage 3's)."""
    return len(P) == len(shapes) and all(tuple(P[i].shape[1:]) == tuple(shapes[i][1:]) for i in net.expert_params())


def experts_held(r):
    """", experts 2 of 4 (1.0 MiB of expert parameters; all 4: 2.0 MiB)" for a context's report
    that counts an MoE's experts; "" for any other."""
    e = r.get("experts")
    return (f", experts {e['held']} of {e['of']} ({format_bytes(e['bytes'])} of expert parameters; all "
            f"{e['of']}: {format_bytes(e['whole_bytes'])})") if e else ""
