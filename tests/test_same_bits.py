"""One bit pattern in every layout --deterministic reaches (strategies/sums/fixed_sums.py, issue 24): the
parameters and optimiser state after a few steps are the bits of --deterministic on one context,
for LeNet and the transformer, sgd, momentum and adam; across processes too.

Bit-identity needs every process to run its ops with the same thread count: the in-process tests
run in one process, and the jobs start every process with one thread per op (tests/jobs.py)."""
import hashlib

import pytest

from conftest import batch, cpus
from jobs import assert_same_run, horovod_cmd, launch_cmd, train_cmd
from manual_dp import models
from manual_dp.strategies.data.data_parallel import DataParallel
from manual_dp.strategies.sums.fixed_sums import FixedSums
from manual_dp.strategies.pipeline.pipeline import PipelineParallel
from manual_dp.strategies.tensor.tensor import TensorParallel
from manual_dp.strategies.zero.zero import ZeroRedundancy
from test_deterministic import data, run  # noqa: F401 (the data fixture; a logged, checkpointed run)
from test_distributed import needs_horovod


def pipeline(n, micro, stages, **kw):
    return lambda P, net, opt: PipelineParallel(P, cpus(n), opt, micro, stages=stages, model=net, sums=FixedSums(), **kw)


def tensor(n, T):
    return lambda P, net, opt: TensorParallel(P, cpus(n), opt, T, model=net, sums=FixedSums(tensor_pieces=4))


LAYOUTS = {
    "sync x3": lambda P, net, opt: DataParallel(P, cpus(3), opt, model=net, sums=FixedSums()),
    "zero-3 x2": lambda P, net, opt: ZeroRedundancy(P, cpus(2), opt, 3, model=net, sums=FixedSums()),
    "model 2 stages": pipeline(2, 1, 2),
    "gpipe 3 stages x 3 micro-batches": pipeline(3, 3, 3),
    "1f1b 2 stages x 4, recompute": pipeline(2, 4, 2, schedule="1f1b", recompute=True),
    "interleaved 2 x 2 chunks x 4": pipeline(2, 4, 2, schedule="interleaved", virtual_stages=2),
    "zb-h1 2 stages x 3": pipeline(2, 3, 2, schedule="zb-h1"),
    "hybrid 2 x 2 stages x 2": pipeline(4, 2, 2),
}


def digest(strategy, net, steps=2):
    """The SHA-256 of the parameters and optimiser state after `steps` steps on 200 rows (4 pieces:
    64, 64, 64, 8), and of the losses."""
    X, y = batch(200, 0)
    losses = [float(strategy.step(X, y, 0.05)[0][0].asscalar()) for _ in range(steps)]
    state = strategy.state_dict()
    arrays = state["params"] + [s for st in state["opt_state"] for s in st]
    return hashlib.sha256(b"".join(a.tobytes() for a in arrays) + repr(losses).encode()).hexdigest()


@pytest.fixture(scope="module")
def nets():
    return {"lenet": models.build("lenet"), "transformer": models.build("transformer", layers=2, d_model=16, heads=4)}


@pytest.fixture(scope="module")
def references(nets):
    return {(name, opt): digest(DataParallel(net.init_params(0), cpus(1), opt, model=net, sums=FixedSums()), net)
            for name, net in nets.items() for opt in ("sgd", "momentum", "adam")}


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("name", ["lenet", "transformer"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_has_one_contexts_bits(nets, references, layout, name, optimizer):
    net = nets[name]
    assert digest(LAYOUTS[layout](net.init_params(0), net, optimizer), net) == references[name, optimizer]


PIECED = {     # --tensor-pieces 4: every split layer in 4 pieces, in every layout, tensor parallelism included
    "sync x3": lambda P, net, opt: DataParallel(P, cpus(3), opt, model=net, sums=FixedSums(tensor_pieces=4)),
    "zero-3 x2": lambda P, net, opt: ZeroRedundancy(P, cpus(2), opt, 3, model=net, sums=FixedSums(tensor_pieces=4)),
    "tensor T=1": tensor(1, 1),
    "tensor T=2": tensor(2, 2),
    "tensor T=2 x data 2": tensor(4, 2),
    "tensor T=4": tensor(4, 4),
    "1f1b 2 stages x 3 (layer-split models)": lambda P, net, opt: PipelineParallel(
        P, cpus(2), opt, 3, stages=2, schedule="1f1b", model=net, sums=FixedSums(tensor_pieces=4)),
}


@pytest.fixture(scope="module")
def pieced_references(nets):
    return {(name, opt): digest(DataParallel(net.init_params(0), cpus(1), opt, model=net, sums=FixedSums(tensor_pieces=4)), net)
            for name, net in nets.items() for opt in ("sgd", "adam")}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("name", ["lenet", "transformer"])
@pytest.mark.parametrize("layout", list(PIECED))
def test_with_tensor_pieces_tensor_parallelism_joins_the_bits(nets, pieced_references, layout, name, optimizer):
    net = nets[name]
    if layout.startswith("1f1b") and not net.splits_by_layer():
        pytest.skip("LeNet splits as a whole: a pipeline cannot cut its pairs (refused)")
    assert digest(PIECED[layout](net.init_params(0), net, optimizer), net) == pieced_references[name, optimizer]


def test_tensor_pieces_change_the_bits_and_lenet_pipelines_refuse_them(nets, references, pieced_references):
    assert pieced_references["transformer", "adam"] != references["transformer", "adam"]
    net = nets["lenet"]
    with pytest.raises(ValueError, match="splits as a whole"):
        PipelineParallel(net.init_params(0), cpus(2), "sgd", 2, stages=2, model=net, sums=FixedSums(tensor_pieces=4))


def test_the_fast_layouts_do_not(nets, references):
    """Without the fixed tree a pipeline adds its micro-batches as they come: other bits (so the
    equality above is not vacuous)."""
    net = nets["transformer"]
    fast = PipelineParallel(net.init_params(0), cpus(2), "momentum", 4, stages=2, model=net)
    assert digest(fast, net) != references["transformer", "momentum"]


TINY = ["--train-size", "300", "--batch-size", "100", "--optimizer", "adam", "--lr", "0.002", "--epochs", "2",
        "--test-size", "64", "--deterministic", "--model", "transformer", "--layers", "1", "--d-model", "16",
        "--heads", "2"]


def test_cli_pipelines_and_two_dist_sync_workers_of_hybrid_have_one_contexts_bits(data, tmp_path):
    one = run(tmp_path, "one", train_cmd("--cpus", 1, "--data-dir", data, *TINY))
    for name, argv in (("gpipe", ["--mode", "pipeline", "--cpus", 2, "--micro-batches", 3]),
                       ("zb", ["--mode", "pipeline", "--cpus", 2, "--micro-batches", 3, "--schedule", "zb-h1"])):
        assert_same_run(*one, *run(tmp_path, name, train_cmd("--data-dir", data, *TINY, *argv)), exact=True)
    workers = run(tmp_path, "kv", launch_cmd(2, "dist_sync", "--mode", "hybrid", "--cpus", 4, "--micro-batches", 2,
                                             "--data-dir", data, *TINY))
    assert_same_run(*one, *workers, exact=True)


def test_cli_tensor_parallelism_with_tensor_pieces_has_one_contexts_bits(data, tmp_path):
    pieced = [a if a != "2" or TINY[i - 1] != "--heads" else "4" for i, a in enumerate(TINY)] + ["--clip-norm", "0.5"]
    one = run(tmp_path, "one", train_cmd("--cpus", 1, "--data-dir", data, *pieced, "--tensor-pieces", 4))
    for name, argv in (("t2", ["--mode", "tensor", "--cpus", 2]), ("t2x2", ["--mode", "tensor", "--cpus", 4,
                                                                          "--tensor-parallel", 2])):
        assert_same_run(*one, *run(tmp_path, name, train_cmd("--data-dir", data, *pieced, *argv)), exact=True)


@needs_horovod
def test_cli_model_parallelism_on_two_horovod_processes_has_one_contexts_bits(data, tmp_path):
    one = run(tmp_path, "one", train_cmd("--cpus", 1, "--data-dir", data, *TINY))
    hvd = run(tmp_path, "hvd", horovod_cmd(2, "--mode", "model", "--cpus", 2, "--data-dir", data, *TINY))
    assert_same_run(*one, *hvd, exact=True)
