"""--perturb KIND:SEED: a run nudged by as little as floats allow, to see how far rounding alone moves
training. Two layouts add the same numbers in different orders, and training amplifies the last
bits they differ in; a run nudged here differs from the unnudged one by as little, so the spread of
a few nudged runs is the yardstick a gap between layouts is judged against (manual_dp.yardstick).

    weights:SEED   every initial parameter one ulp up or down (each direction drawn from SEED)
    inputs:SEED    every training input value one ulp up or down (not token ids: they are integers)
    order:SEED     the rows of every batch reshuffled (drawn from SEED): the same examples, their
                   gradients added in another order, as another layout adds them
"""
import numpy as np

from .errors import UsageError

KINDS = ("weights", "inputs", "order")


def parse(text):
    """(kind, seed) of --perturb KIND:SEED; UsageError (one line) if malformed."""
    kind, _, seed = (text or "").partition(":")
    if kind not in KINDS or not seed.isdigit() or not 0 <= int(seed) < 2 ** 32:
        raise UsageError(f"--perturb takes KIND:SEED, KIND one of {', '.join(KINDS)} and SEED a whole number "
                         f"below 2**32, got {text!r}")
    return kind, int(seed)


def one_ulp(a, seed):
    """`a` (float numpy) with every value moved one ulp up or down, each direction drawn from `seed`."""
    up = np.random.default_rng(seed).integers(0, 2, size=a.shape).astype(bool)
    return np.where(up, np.nextafter(a, np.inf), np.nextafter(a, -np.inf)).astype(a.dtype)


class WithinBatches:
    """A numpy Generator for loop.batches whose permutation reshuffles the rows within every batch
    of `batch_size` (drawn from `seed`): the same batches, each in another order. Everything else
    (bit_generator: the checkpoint's state) is the wrapped generator's."""

    def __init__(self, rng, batch_size, seed):
        self.rng, self.batch_size, self.shuffle = rng, batch_size, np.random.default_rng(seed)

    def permutation(self, n):
        order = self.rng.permutation(n)
        for start in range(0, n, self.batch_size):
            block = order[start:start + self.batch_size]
            order[start:start + self.batch_size] = block[self.shuffle.permutation(len(block))]
        return order

    def __getattr__(self, name):
        return getattr(self.rng, name)


def nudge(text, params, train, tokens):
    """(params, train data) of a run under --perturb `text` (None: as they are). `params`: MXNet
    arrays; `train`: (X, y); `tokens`: whether X holds token ids (then inputs:SEED is refused)."""
    return nudged_params(text, params), nudged_inputs(text, train, tokens)


def nudged_params(text, params):
    """`params` (MXNet arrays), under --perturb weights:SEED each value one ulp up or down."""
    kind, seed = parse(text) if text is not None else (None, 0)
    if kind != "weights":
        return params
    from mxnet import nd
    return [nd.array(one_ulp(p.asnumpy(), seed + i), ctx=p.context, dtype=p.dtype) for i, p in enumerate(params)]


def nudged_inputs(text, train, tokens):
    """The training data (X, y), under --perturb inputs:SEED every input value one ulp up or down."""
    kind, seed = parse(text) if text is not None else (None, 0)
    if kind != "inputs":
        return train
    if tokens:
        raise UsageError("--perturb inputs: this model reads token ids, which are integers: use weights or order")
    return one_ulp(train[0], seed), train[1]


def ordered(text, rng, batch_size):
    """The run's data-order generator `rng`, under --perturb order:SEED its batches reshuffled within."""
    kind, seed = parse(text) if text is not None else (None, 0)
    return WithinBatches(rng, batch_size, seed) if kind == "order" else rng
