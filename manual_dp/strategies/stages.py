"""LeNet cut in two for model parallelism, the boundary copy, and GPipe's clock schedule."""
from ..lesson import conv_block, dense, relu

# Which of lenet's 8 parameters each stage owns: [W1, b1, W2, b2] | [W3, b3, W4, b4].
STAGE_SLICES = [slice(0, 4), slice(4, 8)]


def conv_stage(X, params):
    """Stage 0, the convolutions: images (B, 1, 28, 28) -> feature maps (B, 50, 4, 4)."""
    W1, b1, W2, b2 = params
    h = conv_block(X, W1, b1)                          # (B, 20, 13, 13)
    return conv_block(h, W2, b2)                       # (B, 50, 4, 4)


def dense_stage(h, params):
    """Stage 1, the dense layers: feature maps (B, 50, 4, 4) -> class scores (B, 10)."""
    W3, b3, W4, b4 = params
    h = relu(dense(h, W3, b3))                         # (B, 128)
    return dense(h, W4, b4)                            # (B, 10)


STAGES = [conv_stage, dense_stage]


def split_params(params):
    """lenet's flat parameter list cut into one list per stage."""
    return [params[s] for s in STAGE_SLICES]


def send(h, ctx):
    """The boundary copy: `h` copied to the next stage's `ctx`, ready to receive its gradient."""
    h_next = h.copyto(ctx)
    h_next.attach_grad()
    return h_next


def gpipe_schedule(n_stages, n_micro):
    """GPipe's clock ticks: each a list of (phase, stage, micro-batch) that run side by side.

    All forwards first (stage s runs micro-batch m at tick s + m), then all backwards in
    reverse (the last stage starts with the last micro-batch, each stage one tick behind the next).
    """
    forward = [[("F", s, t - s) for s in range(n_stages) if 0 <= t - s < n_micro]
               for t in range(n_micro + n_stages - 1)]
    backward = [[("B", s, n_micro - 1 - (t - (n_stages - 1 - s))) for s in reversed(range(n_stages))
                 if 0 <= t - (n_stages - 1 - s) < n_micro]
                for t in range(n_micro + n_stages - 1)]
    return forward + backward


def bubble_fraction(schedule, n_stages):
    """Share of (tick, stage) slots in which a stage idles, if every slot takes the same time."""
    busy = sum(len(tick) for tick in schedule)
    return 1 - busy / (len(schedule) * n_stages)
