"""How a tensor group cuts values and what its contexts hold: a batch's copies, a parameter's shards
(shard, unshard), and for the memory report (Strategy.layout) each context's share of the group's
examples and what every rank holds whole (strategies/tensor/tensor.py, mesh_parallel.py)."""
import numpy as np


def copies(batch, row):
    """`batch` (an NDArray) on row[0] (copied there if it is elsewhere: on CPU contexts MXNet would
    run a grid row's first cell on the batch's context without a word) and a copy of it on every
    other context of `row`."""
    first = batch.as_in_context(row[0])
    return [first] + [first.copyto(c) for c in row[1:]]


def shard(value, axis, j, T):
    """Context j's piece of `value` (numpy) out of T along `axis` (None: the whole value)."""
    return value if axis is None else np.split(value, T, axis=axis)[j]


def unshard(pieces, axis):
    """The whole value from its T pieces (numpy), in order; the first if not split."""
    return pieces[0] if axis is None else np.concatenate(pieces, axis=axis)


def shard_of_whole(whole, j, i, axis, T):
    """Shard j's state of parameter i from the whole states of the copy groups: its own group's, or
    (a replicated parameter under sequence parallelism) shard j's piece of the one group's."""
    if (j, i) in whole:
        return whole[(j, i)]
    return [shard(v, axis, j, T) for v in whole[(None, i)]]


def group_layout(grid, T, batch_size):
    """[(context, stage, examples)]: each group of `grid` its share of the batch, 1/T per context."""
    out = []
    for row, n in zip(grid, even_split(batch_size, len(grid))):
        out += [(c, s, k) for c, k in zip(row, even_split(n, T)) for s in (0, 1)]
    return out


def grid_layout(grids, n_layers, batch_size):
    """[(context, every layer, examples)]: each grid of contexts (grids[r][c][t]) its share of the
    batch, 1/(C T) per context (a floor: nothing held whole is counted)."""
    out, every = [], tuple(range(n_layers))
    for grid, n in zip(grids, even_split(batch_size, len(grids))):
        cells = [c for row in grid for c in row]
        out += [(c, every, k) for c, k in zip(cells, even_split(n, len(cells)))]
    return out


def even_split(n, k):
    """k counts that add up to n and differ by at most one (zeros when n < k)."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def whole_layout(row, n, whole):
    """[(context, ("whole", whole), examples)]: each context of `row` holds `whole` elements whole
    for the examples of the group's n beyond its share (even_split); none where that is zero."""
    return [(c, ("whole", whole), n - k) for c, k in zip(row, even_split(n, len(row))) if whole and n > k]


def held_whole(net, ids, sp=False):
    """Per example elements every context of a tensor group running layers `ids` holds whole (for
    every example, not 1/T of them): its input (the images are copies; a stage's received input,
    unless sequence parallelism hands on a block of tokens between split layers), what f takes in
    and g gives out (Model.tensor_traffic; none under sp, which cuts them along the sequence), and
    the outputs of the layers that run whole outside the split runs (a model that splits itself,
    as LeNet, has none: its whole parts are its traffic)."""
    layers, ids = net.layers, list(ids)
    split = [bool(layer.split_forward) for layer in layers]
    if not any(split):
        return layers[0].inputs + (0 if sp else sum(e for _, e, _ in net.tensor_traffic()))
    first = ids[0]
    cut = sp and first > 0 and split[first] and split[first - 1]
    traffic = 0 if sp else sum(e for i in ids for _, e, _ in layers[i].extra.get("traffic", ()))
    return (0 if cut else layers[first].inputs) + sum(layers[i].acts for i in ids if not split[i]) + traffic
