"""Optimisers written by hand: state per parameter, living where the parameter lives."""
from mxnet import nd


def sgd_init(p):
    return []


def sgd_update(p, g, state, lr, t):
    """p <- p - lr * g."""
    p[:] -= lr * g


def momentum_init(p):
    return [nd.zeros(p.shape, ctx=p.context, dtype=p.dtype)]


def momentum_update(p, g, state, lr, t, beta=0.9):
    """v <- beta * v + g;  p <- p - lr * v."""
    v, = state
    v[:] = beta * v + g
    p[:] -= lr * v


def adam_init(p):
    return [nd.zeros(p.shape, ctx=p.context, dtype=p.dtype) for _ in range(2)]


def adam_update(p, g, state, lr, t, beta1=0.9, beta2=0.999, eps=1e-8):
    """Adam (Kingma & Ba) with bias correction; t counts updates from 1."""
    m, v = state
    m[:] = beta1 * m + (1 - beta1) * g
    v[:] = beta2 * v + (1 - beta2) * g * g
    m_hat = m / (1 - beta1 ** t)
    v_hat = v / (1 - beta2 ** t)
    p[:] -= lr * m_hat / (nd.sqrt(v_hat) + eps)


OPTIMIZERS = {
    "sgd": (sgd_init, sgd_update),
    "momentum": (momentum_init, momentum_update),
    "adam": (adam_init, adam_update),
}


def init_states(params, name):
    """Fresh optimiser state for each parameter of one replica."""
    init, _ = OPTIMIZERS[name]
    return [init(p) for p in params]


def apply_update(params, states, name, lr, t, batch_size):
    """One update of every parameter from its gradient summed over a batch of `batch_size`."""
    _, update = OPTIMIZERS[name]
    for p, s in zip(params, states):
        update(p, p.grad / batch_size, s, lr, t)


def apply_update_and_clear(params, states, name, lr, t, batch_size):
    """apply_update, then zero the gradients, ready for the next accumulation; batch_size None:
    a skipped update (fp16's overflow, manual_dp.precision), the gradients only zeroed."""
    if batch_size is not None:
        apply_update(params, states, name, lr, t, batch_size)
    for p in params:
        p.grad[:] = 0
