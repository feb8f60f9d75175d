"""A user's Gluon block with BatchNorm children (models/gluon_block.py): each BatchNorm a layer with
running statistics, normalised by hand (models/batchnorm.py) in every strategy that carries
ResNet's.

References: MXNet's own Gluon BatchNorm for one context (the scores of a training forward and the
running statistics it leaves, to 1e-5 relative: the same float32 arithmetic in another order), and
one context of this package for 2 and 3 contexts, as tests/test_batchnorm_modes.py and with its
helpers (after 2 momentum steps, 1e-5 of the largest value; per-context statistics differ from one
context's by more than 1e-3, asserted, so the comparison can fail)."""
import re

import mxnet as mx
import pytest
from mxnet import autograd, nd

from conftest import after, batch, close, cpus, evaluates_alike, run_main, statistics_alike  # after: 2 steps; close: 1e-5
from manual_dp.models.batchnorm import Moments
from manual_dp.models.gluon_block import GluonModel, load_block
from manual_dp.strategies.data.async_dp import AsyncDataParallel
from manual_dp.strategies.data.data_parallel import DataParallel
from manual_dp.strategies.data.local_sgd import LocalSGD
from manual_dp.strategies.zero.zero import ZeroRedundancy

TINY = ["--train-size", "96", "--test-size", "32", "--batch-size", "32", "--no-progress", "--epochs", "1"]
BLOCKS = """from mxnet.gluon import nn
def net():
    b = nn.HybridSequential()
    b.add(nn.Conv2D(4, 3), nn.BatchNorm(), nn.Activation("relu"), nn.MaxPool2D(2), nn.Flatten(),
          nn.Dense(16), nn.BatchNorm(), nn.Activation("relu"), nn.Dense(10))
    return b
def momentum():
    b = nn.HybridSequential(); b.add(nn.Conv2D(2, 3), nn.BatchNorm(momentum=0.8), nn.Dense(10)); return b
def nested():
    inner = nn.HybridSequential(); inner.add(nn.Conv2D(2, 3), nn.BatchNorm())
    b = nn.HybridSequential(); b.add(inner, nn.Dense(10)); return b
def with_dropout():
    b = nn.HybridSequential(); b.add(nn.Dense(8), nn.BatchNorm(), nn.Dropout(0.2), nn.Dense(10)); return b
"""


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    path = tmp_path_factory.mktemp("block") / "blocks.py"
    path.write_text(BLOCKS)
    spec = f"{path}:net"
    net = GluonModel(spec)
    P = net.init_params(0)
    return spec, net, P, after(DataParallel(P, cpus(1), "momentum", lesson=True, model=net))


def test_the_layers_and_their_running_statistics(user):
    _, net, _, _ = user
    assert [layer.name for layer in net.layers][:3] == ["0:Conv2D", "1:BatchNorm", "2:Activation"]
    assert [p.name for p in net.stats()] == ["1.running_mean", "1.running_var", "6.running_mean", "6.running_var"]
    assert [p.shape for p in net.stats()] == [(4,), (4,), (16,), (16,)]


def test_a_training_forward_equals_gluons_own(user):
    """The same block in MXNet's Gluon, training mode on one context: the same scores, and the
    running statistics its BatchNorms leave (MXNet 1.9 on CPU updates them in the backward, with
    the biased variance) equal the ones this package folds."""
    spec, net, P, _ = user
    block = load_block(spec)
    mx.random.seed(0)
    block.initialize(ctx=mx.cpu(0))
    block(nd.zeros((2, 1, 28, 28)))
    mine = {p.name: v for p, v in zip(net.param_table(), P)}
    for i, child in enumerate(block):                  # the package's values, by their stable names
        for name, param in child.collect_params().items():
            key = f"{i}.{name[len(child.prefix):]}"
            if key in mine:
                param.set_data(mine[key])
    X = nd.array(batch(16, 3)[0])
    with autograd.record():
        want = block(X)
    want.backward()
    running = [net.init_stats()]
    moments = Moments(True, None)
    got = net.forward_group([X], [P], moments)[0]
    moments.fold(running)
    assert close([got.asnumpy()], [want.asnumpy()])
    gluon = [block[i].running_mean.data().asnumpy() for i in (1, 6)], [block[i].running_var.data().asnumpy() for i in (1, 6)]
    assert close([r.asnumpy() for r in running[0]], [gluon[k][j] for j in range(2) for k in range(2)])


@pytest.mark.parametrize("k", [2, 3])
def test_sync_batchnorm_equals_one_context(user, k):
    _, net, P, want = user
    got = after(DataParallel(P, cpus(k), "momentum", model=net, sync_batchnorm=True))
    assert close(got["params"], want["params"]) and close(got["extra"]["running"], want["extra"]["running"])


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_local_sgd_and_async_equal_sync_with_per_context_statistics(user, stage):
    _, net, P, whole = user
    want = after(DataParallel(P, cpus(2), "momentum", model=net))
    assert not close(want["params"], whole["params"], 1e-3)          # the statistics do differ
    zero = after(ZeroRedundancy(P, cpus(2), "momentum", stage, model=net))
    assert close(zero["params"], want["params"]) and close(zero["extra"]["running"], want["extra"]["running"])
    local = after(LocalSGD(P, cpus(2), "momentum", sync_every=1, model=net))
    assert close(local["params"], want["params"]) and close(local["extra"]["running"], want["extra"]["running"])
    asyn = after(AsyncDataParallel(P, cpus(2), "momentum", 0, model=net))
    assert close(asyn["params"], want["params"]) and close(asyn["extra"]["running"], want["extra"]["running"])


@pytest.mark.parametrize("k", [2, 3])
def test_with_dropout_children_too_k_contexts_equal_one(user, k):
    """BatchNorm and Dropout children together: each context's Dropout draws its examples' masks
    (models/dropout.py) inside the step that runs every context at once, so with --sync-batchnorm k
    contexts (sync, and ZeRO-3 layer by layer with its recomputation) equal one context; the
    masks do drop (the result differs from a step without them)."""
    from manual_dp.models.dropout import training_batch
    net = GluonModel(user[0].replace(":net", ":with_dropout"))
    P = net.init_params(0)
    plain = after(DataParallel(P, cpus(1), "momentum", lesson=True, model=net))
    with training_batch(net.noise, 0):
        want = after(DataParallel(P, cpus(1), "momentum", lesson=True, model=net))
        assert not close(want["params"], plain["params"], 1e-3)
        for strategy in (DataParallel(P, cpus(k), "momentum", model=net, sync_batchnorm=True),
                         ZeroRedundancy(P, cpus(k), "momentum", 3, model=net, sync_batchnorm=True)):
            got = after(strategy)
            assert close(got["params"], want["params"]) and close(got["extra"]["running"], want["extra"]["running"])


def test_cli_trains_it_in_zero_and_a_pipeline_with_recompute(capsys, data_dir, user):
    spec = user[0]
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--model", spec, "--cpus", "2",
                                       "--mode", "zero", "--zero-stage", "2", "--sync-batchnorm"])
    assert code == 0, err
    pipeline = ["--data-dir", str(data_dir), *TINY, "--model", spec, "--cpus", "2", "--mode", "pipeline",
                "--micro-batches", "2"]
    for extra in [], ["--recompute"]:
        code, _, err = run_main(capsys, pipeline + extra)
        assert code == 0, err
    code, _, err = run_main(capsys, pipeline + ["--sync-batchnorm"])
    assert code == 2 and len(err) == 1 and "--sync-batchnorm applies only to --mode sync or zero" in err[0], err


@pytest.mark.parametrize("function,message", [
    ("momentum", r"BatchNorm\(axis=1, eps=1e-05, momentum=0.8, .*only Gluon's defaults are supported"),
    ("nested", "inside it; a BatchNorm is supported as a child of the HybridSequential itself")])
def test_what_is_refused_in_one_line(capsys, data_dir, user, function, message):
    spec = user[0].replace(":net", f":{function}")
    code, _, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--model", spec])
    assert code == 2 and len(err) == 1, err
    assert re.search(message, err[0]), err


DENSE = """from mxnet.gluon import nn
def net():
    b = nn.HybridSequential()
    b.add(nn.Dense(32, activation="relu"), nn.Dense(16), nn.BatchNorm(), nn.Activation("relu"),
          nn.Dense(32, activation="relu"), nn.Dense(10))
    return b
"""


@pytest.fixture(scope="module")
def dense_user(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense_block") / "dense.py"
    path.write_text(DENSE)
    net = GluonModel(f"{path}:net")
    return f"{path}:net", net, net.init_params(0)


@pytest.mark.parametrize("contexts,T", [(2, 2), (4, 2)])
def test_tensor_parallelism_normalises_each_group_as_a_data_parallel_replica(dense_user, contexts, T):
    """AutoTP splits the Dense pairs; the BatchNorm between them runs whole on every context of a
    group, each with its own Moments: a group is a data-parallel replica with per-context
    statistics, so T x G contexts compute what data parallelism on G contexts computes (1e-5), its
    running statistics on every context alike; evaluation reads them; a checkpoint carries them."""
    from manual_dp.strategies.tensor.tensor import TensorParallel
    _, net, P = dense_user
    model = TensorParallel(P, cpus(contexts), "momentum", T, model=net)
    reference = DataParallel(P, cpus(contexts // T), "momentum", model=net, graph=False)
    got, want = after(model), after(reference)
    assert close(got["params"], want["params"]) and close(got["extra"]["running"], want["extra"]["running"])
    if contexts // T > 1:
        # the whole batch's variance differs from the shards' mean variance by more than 10x the tolerance
        one = after(DataParallel(P, cpus(1), "momentum", model=net))
        assert not close(got["extra"]["running"], one["extra"]["running"], 1e-4)
    assert statistics_alike(model, contexts)
    assert evaluates_alike(model, reference)
    again = TensorParallel(P, cpus(contexts), "momentum", T, model=net)
    again.load_state_dict(got)
    assert [r.asnumpy().tolist() for r in again.running[-1]] == [r.tolist() for r in got["extra"]["running"]]


def test_cli_trains_it_under_tensor_parallelism(capsys, data_dir, dense_user):
    """And refuses --deterministic there in one line (a split layer's pieces do not carry the statistics)."""
    argv = ["--data-dir", str(data_dir), *TINY, "--model", dense_user[0], "--cpus", "2", "--mode", "tensor"]
    code, out, err = run_main(capsys, argv)
    assert code == 0, err
    code, out, err = run_main(capsys, argv + ["--deterministic"])
    assert code == 2 and len(err) == 1 and "not --mode tensor or --tensor-pieces yet" in err[0], err


def test_two_dist_sync_workers_of_tensor_groups_train_it_as_one_process(data_dir, tmp_path, dense_user):
    """2 workers x a tensor group of 2 against one process of 2 groups: the statistics' sums cross
    the processes with the gradients' (to float rounding)."""
    from jobs import two_workers_as_one_process
    two_workers_as_one_process(tmp_path, 2, "--model", dense_user[0], "--mode", "tensor", "--tensor-parallel", 2,
                               "--data-dir", data_dir, "--train-size", 96, "--test-size", 32, "--batch-size", 32,
                               "--epochs", 1, "--optimizer", "momentum", "--lr", 0.01)
