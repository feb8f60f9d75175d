"""LeNet cut into 1 to 4 pipeline stages, and the boundary copy between them.

LeNet is four pieces, each owning two parameters (a weight and its bias):

    piece 0 conv1   images (B, 1, 28, 28) -> (B, 20, 13, 13)      W1, b1
    piece 1 conv2   (B, 20, 13, 13)       -> (B, 50, 4, 4)        W2, b2
    piece 2 dense1  (B, 50, 4, 4)         -> (B, 128)             W3, b3
    piece 3 dense2  (B, 128)              -> class scores (B, 10) W4, b4

A cut of S stages gives each stage a run of consecutive pieces (CUTS[S]). Composed in order, the
stages run the very ops of `lenet`, so any cut computes what one device computes, bit for bit.
"""
from ..lesson import conv_block, dense, relu

PIECE_NAMES = ("conv1", "conv2", "dense1", "dense2")
CUTS = {1: ((0, 1, 2, 3),),
        2: ((0, 1), (2, 3)),                   # convolutions | dense layers (the lesson's cut)
        3: ((0,), (1,), (2, 3)),               # conv1 | conv2 | dense
        4: ((0,), (1,), (2,), (3,))}           # one piece a stage
MAX_STAGES = max(CUTS)


def piece(i, h, W, b):
    """LeNet's piece i (see the table above) on input h with its two parameters."""
    if i < 2:
        return conv_block(h, W, b)             # convolution, ReLU, 2x2 average pooling
    return relu(dense(h, W, b)) if i == 2 else dense(h, W, b)


def make_stage(pieces):
    """The function (h, params) -> output of the consecutive `pieces`; params: theirs, in order."""
    def stage(h, params):
        for k, i in enumerate(pieces):
            h = piece(i, h, params[2 * k], params[2 * k + 1])
        return h
    stage.__name__ = "+".join(PIECE_NAMES[i] for i in pieces)
    return stage


def param_slices(n_stages=2):
    """Which of lenet's 8 parameters each of the `n_stages` stages owns."""
    return [slice(2 * pieces[0], 2 * pieces[-1] + 2) for pieces in CUTS[n_stages]]


def split_params(params, n_stages=2):
    """lenet's flat parameter list cut into one list per stage."""
    return [params[s] for s in param_slices(n_stages)]


def make_stages(n_stages=2):
    """One function per stage of the `n_stages` cut."""
    return [make_stage(pieces) for pieces in CUTS[n_stages]]


# The lesson's two-stage cut by name (notebook 04 and the tests use these).
STAGE_SLICES = param_slices(2)
conv_stage, dense_stage = make_stages(2)   # (B, 1, 28, 28) -> (B, 50, 4, 4) -> (B, 10)
STAGES = [conv_stage, dense_stage]


def send(h, ctx):
    """The boundary copy: `h` copied to the next stage's `ctx`, ready to receive its gradient."""
    h_next = h.copyto(ctx)
    h_next.attach_grad()
    return h_next
