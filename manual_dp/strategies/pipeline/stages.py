"""A model cut into pipeline stages, and the boundary copy between them.

A model is an ordered list of layers (models.contract); a cut of S stages gives each stage a run
of consecutive layers (Model.cuts: balanced by the layers' FLOPs; LeNet keeps the lesson's cuts).
For LeNet:

    layer 0 conv1   images (B, 1, 28, 28) -> (B, 20, 13, 13)      W1, b1
    layer 1 conv2   (B, 20, 13, 13)       -> (B, 50, 4, 4)        W2, b2
    layer 2 dense1  (B, 50, 4, 4)         -> (B, 128)             W3, b3
    layer 3 dense2  (B, 128)              -> class scores (B, 10) W4, b4

    2 stages: conv1 + conv2 | dense1 + dense2,  3: conv1 | conv2 | dense,  4: one layer a stage

Composed in order, the stages run the very ops of the model's forward, so any cut computes what
one device computes, bit for bit.
"""
from mxnet import nd

from ...models import as_model
from ...models.lenet import CUTS

MAX_STAGES = max(CUTS)          # LeNet's; a model has as many as it has layers


def make_stage(model, layer_ids):
    """The function (h, params, F=nd) -> output of the model's consecutive layers `layer_ids`; params:
    theirs, in order; F: the operators' namespace (Model.noisy's for dropout)."""
    layers = [model.layers[i] for i in layer_ids]

    def stage(h, params, F=nd):
        k = 0
        for layer in layers:
            own = params[k:k + len(layer.params)]
            h = layer.forward(h, own, F, [p.shape for p in own])
            k += len(layer.params)
        return h
    stage.__name__ = "+".join(layer.name for layer in layers)
    return stage


def param_slices(n_stages=2, model=None):
    """Which of the model's parameters each of the `n_stages` stages owns (default model: LeNet)."""
    model = as_model(model)
    slices = model.slices()
    return [slice(slices[ids[0]].start, slices[ids[-1]].stop) for ids in model.cuts(n_stages)]


def split_params(params, n_stages=2, model=None):
    """The model's flat parameter list cut into one list per stage."""
    return [params[s] for s in param_slices(n_stages, as_model(model, params))]


def make_stages(n_stages=2, model=None):
    """One function per stage of the `n_stages` cut."""
    model = as_model(model)
    return [make_stage(model, ids) for ids in model.cuts(n_stages)]


# The lesson's two-stage cut of LeNet by name (notebook 04 and the tests use these).
STAGE_SLICES = param_slices(2)
conv_stage, dense_stage = make_stages(2)   # (B, 1, 28, 28) -> (B, 50, 4, 4) -> (B, 10)
STAGES = [conv_stage, dense_stage]


def send(h, ctx):
    """The boundary copy: `h` copied to the next stage's `ctx`, ready to receive its gradient."""
    h_next = h.copyto(ctx)
    h_next.attach_grad()
    return h_next
