"""Local SGD / DiLoCo (--mode local) against references of what it computes.

    H = 1, outer sgd, lr 1     the one-device step: bit for bit with one replica (every optimiser;
                               also in tests/test_contract.py), and with three replicas on uneven
                               shards sync's step for sgd and momentum to float rounding (the
                               examples-weighted average adds the same terms in another order)
    H > 1                      a hand reference: one one-device lesson model per replica, each
                               stepping on its own shards with its own optimiser state, the outer
                               step in numpy float64 (so the tolerance covers float32 rounding of G)
"""
import importlib.util
import json

import numpy as np
import pytest

from conftest import batch, cpus
from manual_dp import DataParallel, GradAccum, LocalSGD, checkpoint, init_lenet_params
from manual_dp.errors import CheckpointError
from manual_dp.lesson import shard_sizes
from manual_dp.train import main


class Reference:
    """Local SGD by hand: k one-device lesson models, each on its own rows of every batch and with
    its own optimiser state; at a sync, the examples-weighted average and the outer step in numpy."""

    def __init__(self, params, k, opt, H, outer="sgd", outer_lr=1.0, mu=0.9):
        self.reps = [DataParallel(params, cpus(1), opt, lesson=True) for _ in range(k)]
        self.H, self.outer, self.outer_lr, self.mu = H, outer, outer_lr, mu
        self.G = [p.asnumpy().astype(np.float64) for p in params]
        self.m = [np.zeros_like(g) for g in self.G]
        self.counts, self.pending, self.steps = [0] * k, [0] * k, 0

    def backward(self, X, y):
        start = 0
        for i, (r, n) in enumerate(zip(self.reps, shard_sizes(len(X), len(self.reps)))):
            r.backward(X[start:start + n], y[start:start + n])
            self.pending[i] += n
            start += n

    def update(self, lr):
        for r, n in zip(self.reps, self.pending):
            r.update(lr, n)
        self.counts = [c + n for c, n in zip(self.counts, self.pending)]
        self.pending, self.steps = [0] * len(self.reps), self.steps + 1
        if self.steps == self.H:
            self.sync()

    def step(self, X, y, lr):
        self.backward(X, y)
        self.update(lr)

    def sync(self):
        total = sum(self.counts)
        states = [r.state_dict() for r in self.reps]
        A = [sum(c / total * s["params"][i].astype(np.float64) for c, s in zip(self.counts, states))
             for i in range(len(self.G))]
        D = [g - a for g, a in zip(self.G, A)]
        if self.outer == "sgd":
            self.G = [g - self.outer_lr * d for g, d in zip(self.G, D)]
        else:
            self.m = [self.mu * m + d for m, d in zip(self.m, D)]
            self.G = [g - self.outer_lr * (d + self.mu * m) for g, d, m in zip(self.G, D, self.m)]
        for r, s in zip(self.reps, states):
            r.load_state_dict(dict(s, params=[g.astype(np.float32) for g in self.G]))
        self.counts, self.steps = [0] * len(self.reps), 0


def close(got, want, atol):
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_h1_outer_sgd_lr1_equals_sync_over_uneven_shards(optimizer):
    """13 rows over 3 replicas (5, 4, 4): the weights 5/13, 4/13, 4/13 make the average the global
    mean gradient's step; sgd and momentum are linear, so sync's step to float32 rounding (1e-6)."""
    local = LocalSGD(init_lenet_params(seed=3), cpus(3), optimizer, sync_every=1)
    sync = DataParallel(init_lenet_params(seed=3), cpus(1), optimizer, lesson=True)
    for step in range(4):
        X, y = batch(13, step)
        got, want = local.step(X, y, 0.05), sync.step(X, y, 0.05)
        np.testing.assert_allclose(sum(l.asscalar() for l, _ in got), sum(l.asscalar() for l, _ in want), rtol=1e-5)
    close(local.state_dict()["params"], sync.state_dict()["params"], atol=1e-6)
    assert local.end_epoch(0.05) == {"comm_rounds": 4}


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("outer", [("sgd", 1.0), ("sgd", 0.5), ("nesterov", 0.7)], ids=["avg", "sgd0.5", "nesterov"])
def test_h3_equals_the_hand_reference(optimizer, outer):
    """8 steps at H = 3: syncs after steps 3 and 6, then an open period of two steps that end_epoch
    syncs. The replicas' own steps are the lesson's one-device step on their shards, bit for bit
    with the reference's until the first sync; from then on G differs by float32 rounding (the
    reference keeps it in float64): 1e-6 (seen: 6e-7), and 1e-5 for adam, whose m / sqrt(v) can
    magnify it."""
    k, H = 3, 3
    local = LocalSGD(init_lenet_params(seed=5), cpus(k), optimizer, H, *outer)
    ref = Reference(init_lenet_params(seed=5), k, optimizer, H, *outer)
    atol = 1e-5 if optimizer == "adam" else 1e-6
    for step in range(8):
        X, y = batch(14, step)
        local.step(X, y, 0.05), ref.step(X, y, 0.05)
        if step < 2:                                     # before any sync: exactly the lesson's steps
            for W, r in zip(local.state_dict()["extra"]["local_replicas"], ref.reps):
                np.testing.assert_array_equal(W, np.concatenate([p.ravel() for p in r.state_dict()["params"]]))
    replicas = local.state_dict()["extra"]["local_replicas"]           # mid-period: they differ
    assert not np.array_equal(replicas[0], replicas[1])
    for W, r in zip(replicas, ref.reps):
        np.testing.assert_allclose(W, np.concatenate([p.ravel() for p in r.state_dict()["params"]]),
                                   rtol=1e-5, atol=atol)
    assert local.end_epoch(0.05) == {"comm_rounds": 3}
    ref.sync()
    close(local.state_dict()["params"], ref.G, atol)
    assert {str(c) for c in local.ctx} == {p for p, _ in local.fingerprints()["global parameters"]}


def test_resume_through_a_checkpoint_file_is_exact(tmp_path):
    """H = 2 with nesterov: saved mid-period after a sync (outer momentum non-zero, replicas apart),
    written to disk and read back, the next steps are the very same."""
    a = LocalSGD(init_lenet_params(seed=1), cpus(2), "adam", 2, "nesterov", 0.7, 0.9)
    for step in range(3):
        a.step(*batch(10, step), 0.05)
    checkpoint.save(tmp_path, a.state_dict(), {"epoch": 0, "history": [], "config": {}, "rng_state": np.random.default_rng(0).bit_generator.state})
    b = LocalSGD(init_lenet_params(seed=2), cpus(2), "adam", 2, "nesterov", 0.7, 0.9)
    b.load_state_dict(checkpoint.load(tmp_path)[0])
    for step in range(3, 6):
        got, want = b.step(*batch(10, step), 0.05), a.step(*batch(10, step), 0.05)
        assert [(l.asscalar(), c.asscalar()) for l, c in got] == [(l.asscalar(), c.asscalar()) for l, c in want]
    assert b.end_epoch(0.05) == a.end_epoch(0.05)
    for x, y in zip(b.state_dict()["params"], a.state_dict()["params"]):
        np.testing.assert_array_equal(x, y)


def test_checkpoints_move_between_sync_and_local():
    """A sync checkpoint starts every replica from its parameters and optimiser state; a local one
    taken at a sync continues with another replica count; one between syncs does not."""
    sync = DataParallel(init_lenet_params(seed=1), cpus(2), "momentum")
    sync.step(*batch(10, 0), 0.05)
    local = LocalSGD(init_lenet_params(seed=2), cpus(3), "momentum", 2)
    local.load_state_dict(sync.state_dict())
    for x, y in zip(local.state_dict()["params"], sync.state_dict()["params"]):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(sum(local.state_dict()["opt_state"], []), sum(sync.state_dict()["opt_state"], [])):
        np.testing.assert_array_equal(x, y)
    local.step(*batch(10, 1), 0.05)
    with pytest.raises(CheckpointError, match="between syncs of 3 local SGD replicas; this run has 2"):
        LocalSGD(init_lenet_params(seed=2), cpus(2), "momentum", 2).load_state_dict(local.state_dict())
    local.end_epoch(0.05)
    two = LocalSGD(init_lenet_params(seed=2), cpus(2), "momentum", 2)
    two.load_state_dict(local.state_dict())
    sync.load_state_dict(local.state_dict())
    for x, y, z in zip(two.state_dict()["params"], sync.state_dict()["params"], local.state_dict()["params"]):
        np.testing.assert_array_equal(x, z)
        np.testing.assert_array_equal(y, z)


def test_grad_accum_adds_each_replicas_shards_then_steps():
    """GradAccum around local SGD: two batches, one inner step per replica on its rows of both,
    divided by its own count of them (as the reference's one-device models do)."""
    local = GradAccum(LocalSGD(init_lenet_params(seed=4), cpus(2), "momentum", 2, "nesterov", 0.7), 2)
    ref = Reference(init_lenet_params(seed=4), 2, "momentum", 2, "nesterov", 0.7)
    for step in range(0, 8, 2):
        (X1, y1), (X2, y2) = batch(7, step), batch(6, step + 1)
        local.step(X1, y1, 0.05), local.step(X2, y2, 0.05)
        ref.backward(X1, y1), ref.backward(X2, y2)
        ref.update(0.05)
    assert local.t == 4
    close(local.state_dict()["params"], ref.G, atol=1e-6)


def test_cli_logs_communication_rounds_and_resumes_exactly(tmp_path, data_dir):
    """100 images in batches of 32: 4 updates an epoch; H = 3 syncs after the 3rd and at the end of
    the epoch: 2 rounds. Two epochs straight equal one epoch, a checkpoint and --resume."""
    common = ["--data-dir", str(data_dir), "--train-size", "100", "--test-size", "64", "--batch-size", "32",
              "--no-progress", "--cpus", "2", "--mode", "local", "--sync-every", "3", "--outer-optimizer",
              "nesterov", "--outer-lr", "0.7"]
    main(common + ["--epochs", "2", "--log-json", str(tmp_path / "straight.jsonl")])
    main(common + ["--epochs", "1", "--checkpoint-dir", str(tmp_path / "ck")])
    main(common + ["--epochs", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
                   "--log-json", str(tmp_path / "resumed.jsonl")])
    straight, resumed = ([json.loads(line) for line in (tmp_path / f"{n}.jsonl").read_text().splitlines()]
                         for n in ("straight", "resumed"))
    assert [r["comm_rounds"] for r in straight] == [2, 2]
    keys = ("epoch", "train_loss", "train_acc", "test_acc", "comm_rounds")
    assert [[r[k] for k in keys] for r in straight] == [[r[k] for k in keys] for r in resumed]


@pytest.mark.parametrize("backend", ["dist_sync", "horovod"])
def test_two_workers_equal_one_process_with_two_contexts(tmp_path, data_dir, backend):
    """Local SGD composes with the world like every strategy: World.reducer sums the weighted
    parameters across processes, MultiProcess feeds each process its rows. 2 workers x 1 context
    against 1 process x 2: each average is one sum of two terms, so bit for bit; every rank's
    global parameters compared after every update, and the checkpoints array by array: momentum's
    inner state is the mean over every process's replicas (Strategy.job_state)."""
    from jobs import assert_same_run, horovod_cmd, launch_cmd, run_job, train_cmd
    if backend == "horovod" and importlib.util.find_spec("horovod") is None:
        pytest.skip("horovod is not installed (bash setup.sh --test installs it)")
    small = ["--data-dir", data_dir, "--train-size", "300", "--test-size", "100", "--batch-size", "30",
             "--optimizer", "momentum", "--lr", "0.05", "--epochs", "2", "--mode", "local", "--sync-every", "3",
             "--outer-optimizer", "nesterov", "--outer-lr", "0.7"]
    ref_log, ref_ck = tmp_path / "one.jsonl", tmp_path / "one_ck"
    code, out = run_job(train_cmd("--cpus", 2, *small, "--log-json", ref_log, "--checkpoint-dir", ref_ck),
                        tmp_path / "one.txt")
    assert code == 0, out
    log, ck = tmp_path / "kv.jsonl", tmp_path / "kv_ck"
    argv = ["--cpus", 1, *small, "--check-replicas", 1, "--log-json", log, "--checkpoint-dir", ck]
    cmd = launch_cmd(2, "dist_sync", *argv) if backend == "dist_sync" else horovod_cmd(2, *argv)
    code, out = run_job(cmd, tmp_path / "kv.txt")
    assert code == 0, out
    assert_same_run(ref_log, ref_ck, log, ck, exact=True)
    assert [r["comm_rounds"] for r in map(json.loads, log.read_text().splitlines())] == [4, 4]
