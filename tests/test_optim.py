"""The hand-written optimisers against closed forms on tiny problems."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import nd

from conftest import assert_on
from manual_dp.optim import OPTIMIZERS, apply_update, init_states

P0 = np.array([1.5, -2.0, 0.25, 3.0], dtype=np.float32)


def run(name, grad_of, steps, lr, ctx=mx.cpu(0)):
    """`steps` updates of P0 with gradient grad_of(p) (numpy), through apply_update; returns p."""
    p = nd.array(P0, ctx=ctx)
    p.attach_grad()
    states = init_states([p], name)
    for t in range(1, steps + 1):
        p.grad[:] = nd.array(grad_of(p.asnumpy()), ctx=ctx)
        apply_update([p], states, name, lr, t, batch_size=1)
    return p, states[0]


@pytest.mark.parametrize("steps", [1, 5, 20])
def test_sgd_on_a_quadratic_is_geometric(steps):
    a, lr = np.float32(0.7), 0.3       # f(p) = a p^2 / 2: p_t = (1 - lr a)^t p_0
    p, _ = run("sgd", lambda p: a * p, steps, lr)
    np.testing.assert_allclose(p.asnumpy(), (1 - lr * a) ** steps * P0, rtol=1e-5)


@pytest.mark.parametrize("steps", [1, 2, 10])
def test_momentum_with_constant_gradient(steps):
    g, lr, beta = np.float32(0.5), 0.1, 0.9
    # v_t = g (1 - beta^t) / (1 - beta);  p_t = p_0 - lr sum_{s<=t} v_s
    v = g * (1 - beta ** steps) / (1 - beta)
    shift = lr * g / (1 - beta) * (steps - beta * (1 - beta ** steps) / (1 - beta))
    p, (v_got,) = run("momentum", lambda p: np.full_like(p, g), steps, lr)
    np.testing.assert_allclose(v_got.asnumpy(), np.full_like(P0, v), rtol=1e-5)
    np.testing.assert_allclose(p.asnumpy(), P0 - shift, rtol=1e-5)


def test_momentum_on_a_quadratic_follows_its_linear_recurrence():
    a, lr, beta, steps = 0.7, 0.3, 0.9, 12
    # [v; p] <- [[beta, a], [-lr beta, 1 - lr a]] [v; p]: closed form as a matrix power.
    A = np.array([[beta, a], [-lr * beta, 1 - lr * a]])
    want = (np.linalg.matrix_power(A, steps) @ np.stack([np.zeros_like(P0), P0]))[1]
    p, _ = run("momentum", lambda p: a * p, steps, lr)
    np.testing.assert_allclose(p.asnumpy(), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("steps", [1, 3, 50])
def test_adam_with_constant_gradient_moves_lr_per_step(steps):
    g, lr, eps = np.array([0.5, -2.0, 1e-3, 4.0], dtype=np.float32), 0.01, 1e-8
    # bias correction makes m_hat = g and v_hat = g^2 exactly: each step is lr g / (|g| + eps).
    p, (m, v) = run("adam", lambda p: g, steps, lr)
    np.testing.assert_allclose(p.asnumpy(), P0 - steps * lr * g / (np.abs(g) + eps), rtol=1e-5)
    np.testing.assert_allclose(m.asnumpy(), (1 - 0.9 ** steps) * g, rtol=1e-5)
    np.testing.assert_allclose(v.asnumpy(), (1 - 0.999 ** steps) * g * g, rtol=1e-4)


def test_adam_on_a_quadratic_matches_the_paper_step_by_step():
    a, lr, b1, b2, eps = 0.7, 0.05, 0.9, 0.999, 1e-8
    p_ref, m, v = P0.astype(np.float64), 0.0, 0.0
    for t in range(1, 8):   # Kingma & Ba, Algorithm 1
        g = a * p_ref
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        p_ref = p_ref - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    p, _ = run("adam", lambda p: a * p, 7, lr)
    np.testing.assert_allclose(p.asnumpy(), p_ref, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_lives_with_its_parameter_and_gradient_is_averaged(name):
    p, states = run(name, lambda p: np.ones_like(p), 1, 0.1, ctx=mx.cpu(3))
    assert p.context == mx.cpu(3)
    assert_on(states, mx.cpu(3))
    assert len(states) == {"sgd": 0, "momentum": 1, "adam": 2}[name]
    q = nd.array(P0)
    q.attach_grad()
    q.grad[:] = 8.0
    apply_update([q], init_states([q], "sgd"), "sgd", 0.1, 1, batch_size=4)   # gradient of a loss sum
    np.testing.assert_allclose(q.asnumpy(), P0 - 0.1 * 2.0, rtol=1e-6)
