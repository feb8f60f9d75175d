"""Bytes per context: the arrays a strategy keeps, and the activations one step holds until backward.

Parameter and state bytes are measured: the sizes of the NDArrays the strategy holds, grouped by
their `.context`. Activation bytes are computed from the layer shapes (see `stage_activation_elems`):
MXNet exposes no per-context memory counter on CPU.
"""
import numpy as np

from .lesson import LENET_SHAPES

FLOAT_BYTES = 4


def stage_activation_elems(image=(1, 28, 28), shapes=None):
    """Per-example element counts that each stage keeps for its backward: [convs, dense], for
    LeNet's parameters of `shapes` (default the lesson's).

    Counted: the stage's input and every op's output (convolution, ReLU, pooling; dot, bias add,
    ReLU, log-softmax, the picked loss), which autograd holds until the backward pass.
    """
    shapes = shapes or [shape for _, shape in LENET_SHAPES]
    c, h, w = image
    convs = [c * h * w]                                        # the input images
    for out_c, _, k, _ in (shapes[0], shapes[2]):
        h, w = h - k + 1, w - k + 1
        convs += [out_c * h * w] * 2                           # convolution, ReLU
        h, w = h // 2, w // 2
        convs.append(out_c * h * w)                            # 2x2 average pooling
    (d_in, hidden), (_, classes) = shapes[4], shapes[6]
    dense = [d_in] + [hidden] * 3 + [classes] * 3 + [1]        # input, dot, +b, ReLU, dot, +b, log-softmax, loss
    return [sum(convs), sum(dense)]


def per_context(model, batch_size, shapes=None):
    """{context name: {"param_bytes", "state_bytes", "activation_bytes"}} for a step on `batch_size`
    (activations of LeNet's parameters of `shapes`, default the lesson's)."""
    report = {str(c): {"param_bytes": 0, "state_bytes": 0, "activation_bytes": 0} for c in model.ctx}
    for kind, arrays in model.arrays().items():
        for a in arrays:
            report[str(a.context)][f"{kind}_bytes"] += a.size * np.dtype(a.dtype).itemsize
    elems = stage_activation_elems(shapes=shapes)
    for c, s, n in model.layout(batch_size):
        per_example = elems[s] if isinstance(s, int) else part_activation_elems(s, shapes=shapes)
        report[str(c)]["activation_bytes"] += n * per_example * FLOAT_BYTES
    return report


def piece_activation_elems(image=(1, 28, 28), shapes=None):
    """[(input, kept)] per-example elements for LeNet's pieces conv1, conv2, dense1, dense2
    (strategies/stages.py): the piece's input, and the outputs of its ops (as counted in
    stage_activation_elems; the loss goes with dense2). A stage of pieces i..j keeps the input of
    piece i and the `kept` of each: pieces 0-1 and 2-3 give stage_activation_elems()."""
    shapes = shapes or [shape for _, shape in LENET_SHAPES]
    (c, h, w), pieces = image, []
    for out_c, _, k, _ in (shapes[0], shapes[2]):
        h2, w2 = h - k + 1, w - k + 1
        pieces.append((c * h * w, 2 * out_c * h2 * w2 + out_c * (h2 // 2) * (w2 // 2)))
        c, h, w = out_c, h2 // 2, w2 // 2
    (d_in, hidden), (_, classes) = shapes[4], shapes[6]
    return pieces + [(d_in, 3 * hidden), (hidden, 3 * classes + 1)]


def part_activation_elems(part, image=(1, 28, 28), shapes=None):
    """Per-example elements a stage keeps for `part`: a tuple of consecutive piece indices (their
    activations), or ("input", i) (only piece i's input, as under --recompute)."""
    pieces = piece_activation_elems(image, shapes)
    if part[0] == "input":
        return pieces[part[1]][0]
    return pieces[part[0]][0] + sum(pieces[i][1] for i in part)


def format_report(report):
    """One line: parameters + state, and activations, per context, in KiB."""
    return "; ".join(f"{c}: {r['param_bytes'] / 1024:.0f} KiB params + {r['state_bytes'] / 1024:.0f} KiB "
                     f"grads/state, {r['activation_bytes'] / 1024:.0f} KiB activations"
                     for c, r in report.items())
