"""--deterministic --mode tensor: the same bits on any contexts, any T dividing the 4 channel pieces,
and 2 processes (issue 12, item 1, in tensor mode).

Bit-identity holds when every process runs its ops with the same thread count: the in-process tests
run in one process (one thread count for every layout), the command-line ones start every process
with one thread per op (jobs.PINNED, and what the command line sets for --deterministic). Equality
with the one-device step (float tolerance) is tests/test_contract.py's "tensor-deterministic T2 x4".
"""
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
from mxnet import autograd, nd

from conftest import batch, cpus, write_dataset
from jobs import assert_same_run, horovod_cmd, launch_cmd, run_job, saved_arrays, train_cmd
from manual_dp import DataParallel, GradAccum, init_lenet_params
from manual_dp.config import PIECE_ROWS
from manual_dp.strategies.sums.fixed_sums import FixedSums, root_of, tree_sum
from manual_dp.strategies.tensor.tensor import TensorParallel
from manual_dp import models
from manual_dp.strategies.tensor.tensor_pieces import TreeF, TreeG, cut, join, tree_reduce
from test_distributed import needs_horovod

LAYOUTS = [(1, 1), (2, 1), (2, 2), (3, 1), (4, 1), (4, 2), (4, 4)]     # (contexts, T)


def fixed(params, ctx, optimizer, T=None, piece=PIECE_ROWS):
    """TensorParallel under --deterministic: every split layer in 4 pieces, the batch in pieces of `piece` rows."""
    return TensorParallel(params, ctx, optimizer, T, sums=FixedSums(piece, tensor_pieces=4))


def digest(arrays):
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


# The channel pieces -------------------------------------------------------------------------------

def test_the_channel_tree_is_the_same_bits_on_1_2_and_4_contexts():
    """4 pieces of float32 noise of mixed magnitudes: the sum is numpy's (p0 + p1) + (p2 + p3) on
    any T, and lands on the group's first context."""
    rng = np.random.RandomState(0)
    values = [rng.randn(3000).astype(np.float32) * 10 ** rng.randint(-3, 4) for _ in range(4)]
    want = (values[0] + values[1]) + (values[2] + values[3])
    for T in (1, 2, 4):
        row = cpus(T)
        got = tree_reduce([nd.array(v, ctx=row[q // (4 // T)]) for q, v in enumerate(values)], row, 4 // T)
        assert got.context == row[0]
        np.testing.assert_array_equal(got.asnumpy(), want)
    leaves = {(0, q): v for q, v in enumerate(values)}
    np.testing.assert_array_equal(tree_sum(root_of(4), 4, leaves, np.add), want)


@pytest.mark.parametrize("T", [1, 2, 4])
def test_tree_g_and_tree_f_are_conjugate_across_contexts(T):
    """TreeG sums the pieces forward and hands each piece its context's gradient; TreeF copies a
    context's input to its pieces and sums the pieces' gradients; every array on its own context."""
    row, k, rng = cpus(T), 4 // T, np.random.RandomState(T)
    parts = [rng.randn(2, 5).astype(np.float32) for _ in range(4)]
    heads = [rng.randn(2, 5).astype(np.float32) for _ in range(T)]
    xs = [nd.array(v, ctx=row[q // k]) for q, v in enumerate(parts)]
    for x in xs:
        x.attach_grad()
    with autograd.record():
        ys = TreeG(row, k)(*xs)
    autograd.backward(list(ys), [nd.array(h, ctx=c) for h, c in zip(heads, row)])
    assert [y.context for y in ys] == row and [x.grad.context for x in xs] == [row[q // k] for q in range(4)]
    for y in ys:
        np.testing.assert_array_equal(y.asnumpy(), (parts[0] + parts[1]) + (parts[2] + parts[3]))
    for q, x in enumerate(xs):
        np.testing.assert_array_equal(x.grad.asnumpy(), heads[q // k])
    hs = [nd.array(h, ctx=c) for h, c in zip(heads, row)]
    for h in hs:
        h.attach_grad()
    with autograd.record():
        outs = TreeF(row, k)(*hs)
    autograd.backward(list(outs), [nd.array(v, ctx=row[q // k]) for q, v in enumerate(parts)])
    assert [o.context for o in outs] == [row[q // k] for q in range(4)]
    for q, o in enumerate(outs):
        np.testing.assert_array_equal(o.asnumpy(), heads[q // k])
    for h in hs:
        np.testing.assert_array_equal(h.grad.asnumpy(), (parts[0] + parts[1]) + (parts[2] + parts[3]))


@pytest.mark.parametrize("T", [1, 2, 4])
def test_cut_and_join_are_inverse(T):
    values = [p.asnumpy() for p in init_lenet_params(seed=1, width=2)]
    split = [p.split for p in models.build("lenet", width=2).param_table()]
    back = join([cut(values, split, 4, T, j) for j in range(T)], split, 4 // T)
    for a, b in zip(back, values):
        np.testing.assert_array_equal(a, b)


# One process, any layout ---------------------------------------------------------------------------

def test_the_same_bits_on_every_layout():
    """Three adam updates on batches of 100 (batch pieces 32, 32, 32, 4) on 1-4 contexts and
    T = 1, 2, 4: parameters, optimiser state and reported losses the same bits, every shard on its
    own context, every copy of a shard position and of b2, b4 the same."""
    seen = {}
    for k, T in LAYOUTS:
        model = fixed(init_lenet_params(seed=2), cpus(k), "adam", T)
        losses = [model.step(*batch(100, seed=s), 0.05)[0][0].asscalar() for s in range(3)]
        assert [{p.context for p in P} for row in model.shards for P in row] == [{c} for c in cpus(k)]
        for copies in model.fingerprints().values():
            assert len({repr(sums) for _, sums in copies}) == 1
        state = model.state_dict()
        seen[(k, T)] = (digest(state["params"]), digest(sum(state["opt_state"], [])), losses)
    assert len({repr(v) for v in seen.values()}) == 1, seen


def test_grad_accumulation_and_a_checkpoint_moved_between_layouts_keep_the_bits():
    """Two batches per update on 1 context vs 4 contexts x T=2; and 2 updates on T=4 resumed on
    2 contexts x T=1 for 2 more: all end on the same bits."""
    runs = []
    for k, T in ((1, 1), (4, 2)):
        model = GradAccum(fixed(init_lenet_params(seed=1), cpus(k), "momentum", T, piece=8), 2)
        for s in range(4):
            model.step(*batch(20, seed=s), 0.05)
        runs.append(digest(model.state_dict()["params"]))
    assert runs[0] == runs[1]
    whole = fixed(init_lenet_params(seed=1), cpus(1), "momentum", piece=8)
    first = fixed(init_lenet_params(seed=1), cpus(4), "momentum", 4, piece=8)
    for s in range(2):
        first.step(*batch(20, seed=s), 0.05)
    moved = fixed(init_lenet_params(seed=5), cpus(2), "momentum", 1, piece=8)
    moved.load_state_dict(first.state_dict())
    for s in range(4):
        whole.step(*batch(20, seed=s), 0.05)
        if s >= 2:
            moved.step(*batch(20, seed=s), 0.05)
    assert moved.t == whole.t == 4
    assert digest(moved.state_dict()["params"]) == digest(whole.state_dict()["params"])


def test_its_checkpoint_moves_to_and_from_sync_and_plain_tensor():
    """state_dict is the whole, unsharded state: loaded into DataParallel and TensorParallel (T=4)
    and back, every array comes through bit for bit."""
    model = fixed(init_lenet_params(seed=3), cpus(4), "adam", 2, piece=8)
    model.step(*batch(20, seed=0), 0.05)
    state = model.state_dict()
    for other in (DataParallel(init_lenet_params(seed=7), cpus(2), "adam"),
                  TensorParallel(init_lenet_params(seed=7), cpus(4), "adam", 4)):
        other.load_state_dict(state)
        back = fixed(init_lenet_params(seed=9), cpus(1), "adam")
        back.load_state_dict(other.state_dict())
        for got in (other.state_dict(), back.state_dict()):
            assert got["t"] == 1
            for a, b in zip(got["params"] + sum(got["opt_state"], []), state["params"] + sum(state["opt_state"], [])):
                np.testing.assert_array_equal(a, b)


def test_a_tensor_degree_that_does_not_divide_the_pieces_is_refused():
    with pytest.raises(ValueError, match="must divide 3 contexts and the 4 pieces"):
        fixed(init_lenet_params(seed=0, width=3), cpus(3), "sgd", 3)


# The command line ------------------------------------------------------------------------------------

SMALL = ["--train-size", "537", "--batch-size", "67", "--optimizer", "momentum", "--lr", "0.002",
         "--epochs", "2", "--test-size", "199", "--mode", "tensor", "--deterministic"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("tdet_data"))


@pytest.fixture(scope="module")
def one(data, tmp_path_factory):
    """The reference run: 1 process, 1 context (so T = 1)."""
    return run(tmp_path_factory.mktemp("tdet_one"), "one", train_cmd("--cpus", 1, "--data-dir", data, *SMALL))


def run(tmp_path, name, cmd):
    log, ck = tmp_path / f"{name}.jsonl", tmp_path / f"{name}_ck"
    code, out = run_job([*cmd, "--log-json", log, "--checkpoint-dir", ck], tmp_path / f"{name}.txt")
    assert code == 0, out
    print(f"{name}: parameters and optimiser state sha256 {digest(saved_arrays(ck))[:16]}")
    return log, ck


def test_cli_the_same_bits_on_1_context_4_contexts_t2_and_2_dist_sync_workers(data, one, tmp_path):
    """Batches of 67 in pieces of 64 (64, 3): --cpus 1, --cpus 4 --tensor-parallel 2, and 2
    dist_sync workers x 2 contexts --tensor-parallel 2 log the same losses and accuracies and save
    the same bits."""
    four = run(tmp_path, "four_t2", train_cmd("--cpus", 4, "--tensor-parallel", 2, "--data-dir", data, *SMALL))
    workers = run(tmp_path, "kv", launch_cmd(2, "dist_sync", "--cpus", 2, "--tensor-parallel", 2,
                                             "--data-dir", data, *SMALL))
    assert_same_run(*one, *four, exact=True)
    assert_same_run(*one, *workers, exact=True)


@needs_horovod
def test_cli_the_same_bits_under_horovod_2_processes(data, one, tmp_path):
    """2 horovod processes x 2 contexts, T = 2 (every context of a process one group)."""
    hvd = run(tmp_path, "hvd", horovod_cmd(2, "--cpus", 2, "--data-dir", data, *SMALL))
    assert_same_run(*one, *hvd, exact=True)


def test_cli_gives_one_thread_per_op_in_tensor_mode_too(data):
    """On 1 context the default is every core per op; --deterministic sets 1 before MXNet loads."""
    script = ("import os, builtins\n"
              "seen = {}\n"
              "real_import = builtins.__import__\n"
              "def spy(name, *a, **k):\n"
              "    if name.startswith('mxnet') and not seen:\n"
              "        seen.update(omp=os.environ.get('OMP_NUM_THREADS'))\n"
              "    return real_import(name, *a, **k)\n"
              "builtins.__import__ = spy\n"
              "from manual_dp.train import main\n"
              f"main(['--cpus', '1', '--epochs', '0', '--mode', 'tensor', '--deterministic', "
              f"'--data-dir', {str(data)!r}])\n"
              "print('AT_LOAD', seen['omp'])\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "AT_LOAD 1"
