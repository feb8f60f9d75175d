import gzip
import os
import tempfile
import struct

import manual_dp  # noqa: F401  (before mxnet: the thread settings, as a user's program gets them)
import mxnet as mx
import numpy as np
import pytest

from manual_dp.datasets.fashion_mnist import FILES


def write_idx(path, array, magic):
    """Write `array` (uint8) as a gzipped IDX file with the given magic number."""
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def synthetic(n, seed):
    """n learnable 28x28 images: class c lights up row band c, plus noise."""
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, 10, size=n).astype(np.uint8)
    images = rng.randint(0, 60, size=(n, 28, 28)).astype(np.uint8)
    for i, c in enumerate(labels):
        images[i, 2 + 2 * c:4 + 2 * c, 4:24] = 250
    return images, labels


def cpus(n):
    """CPU contexts cpu(0..n-1)."""
    return [mx.cpu(i) for i in range(n)]


def batch(n, seed):
    """n synthetic images (n, 1, 28, 28) float32 in [0, 1] and their int32 labels."""
    images, labels = synthetic(n, seed)
    return (images.astype(np.float32) / 255)[:, None], labels.astype(np.int32)


def straight_and_resumed(make, first, X, y, lr=0.01):
    """(make() after 3 steps on (X, y); another make() resumed from `first`'s state_dict after
    first took 1 step, then 2 more steps; that state): an interrupted run beside an uninterrupted one."""
    straight = make()
    for _ in range(3):
        straight.step(X, y, lr)
    first.step(X, y, lr)
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    for _ in range(2):
        resumed.step(X, y, lr)
    return straight, resumed, state


def after(strategy, steps=2, lr=0.01):
    """strategy's state_dict after `steps` steps on one batch of 24 synthetic images (the BatchNorm
    tests' setting: momentum steps at lr 0.01, where a summation order moves little)."""
    X, y = batch(24, 0)
    for _ in range(steps):
        strategy.step(X, y, lr)
    return strategy.state_dict()


def close(got, want, tol=1e-5):
    """Whether the arrays `got` equal `want` to tol of the largest value of `want`."""
    scale = max(float(np.abs(w).max()) for w in want)
    return max(float(np.abs(np.asarray(g) - w).max()) for g, w in zip(got, want)) <= tol * scale


def statistics_alike(model, contexts=None):
    """Whether `model`'s running statistics (its fingerprints) are the same bits on every context,
    and (if given) on `contexts` contexts."""
    prints = model.fingerprints()["running statistics"]
    return (contexts is None or len(prints) == contexts) and len({tuple(sums) for _, sums in prints}) == 1


def evaluates_alike(model, reference, sizes=(40,)):
    """Whether `model` and `reference` count the same correct predictions on the first n of 40
    synthetic examples, for each n of `sizes`, in training mode as loop.evaluate runs."""
    from mxnet import autograd, nd
    X, y = (nd.array(a) for a in batch(40, 5))
    autograd.set_training(True)
    try:
        return all(float(model.correct(X[:n], y[:n]).asscalar()) == float(reference.correct(X[:n], y[:n]).asscalar())
                   for n in sizes)
    finally:
        autograd.set_training(False)


def small_model(name):
    """The model `name` at test size: a transformer of one block, width 16, two heads."""
    from manual_dp import models
    return models.build(name, **({"layers": 1, "d_model": 16, "heads": 2} if name == "transformer" else {}))


def hand_grads(net, P, X, y):
    """One context's gradient of the loss summed over (X, y), by plain autograd through
    net.forward on copies of P: numpy arrays in the model's order."""
    from mxnet import autograd, nd
    from manual_dp.lesson import cross_entropy
    Q = [p.copy() for p in P]
    for q in Q:
        q.attach_grad()
    with autograd.record():
        loss = cross_entropy(net.forward(nd.array(X), Q), nd.array(y)).sum()
    loss.backward()
    return [q.grad.asnumpy() for q in Q]


def write_dataset(directory, n_train=600, n_test=200, seed=0):
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_test)):
        imgs_name, lbls_name, _ = FILES[split]
        images, labels = synthetic(n, seed + (split == "test"))
        write_idx(directory / imgs_name, images, 2051)
        write_idx(directory / lbls_name, labels, 2049)
    return directory


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A small synthetic Fashion-MNIST-shaped data set on disk."""
    return write_dataset(tmp_path_factory.mktemp("fashion"))


@pytest.fixture(params=[1, 2, 3, 4], ids=lambda k: f"{k}ctx")
def ctx(request):
    return [mx.cpu(i) for i in range(request.param)]


def run_main(capsys, argv):
    """(exit status, stdout, stderr lines) of `python -m manual_dp.train argv`, run in this process."""
    from manual_dp.train import main
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def assert_on(arrays, c):
    """Every array lives on context c (MXNet mixes cpu(0) and cpu(1) silently, so check)."""
    for a in arrays:
        assert a.context == c, f"{a.context} != {c}"


# The tests' numbers must not depend on what the autotune measured on this machine (or cached for
# it): the plain graph unless a test asks for padding; a cache of the test session's own.
os.environ.setdefault("MANUAL_DP_CONV_PAD", "1")
os.environ.setdefault("MANUAL_DP_CACHE", os.path.join(tempfile.mkdtemp(prefix="manual_dp_cache_"), "autotune.json"))


def params_after_steps(strategy, X, y, steps=2, accum=False, lr=0.05):
    """strategy's parameters (numpy) after `steps` updates on (X, y); accum: each update two
    half batches (a GradAccum of 2)."""
    n = len(X)
    for _ in range(steps):
        for part in ((slice(0, n // 2), slice(n // 2, n)) if accum else (slice(0, n),)):
            strategy.step(X[part], y[part], lr)
    return strategy.state_dict()["params"]


def assert_trained_as(got, want, start, tol):
    """got equals want to tol of want's largest value, and moved from `start` by far more."""
    scale = max(float(np.abs(w).max()) for w in want)
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, want)) <= tol * scale
    assert max(float(np.abs(g - w.asnumpy()).max()) for g, w in zip(got, start)) > 100 * tol * scale   # it trained
