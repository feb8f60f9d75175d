"""--check-replicas: a planted faulty all-reduce is caught, naming the update, the copy and the
parameter, before a checkpoint of the bad state is written; correct runs never trip it."""
import json
import re

import mxnet as mx
import numpy as np
import pytest

from manual_dp import DataParallel, checkpoint, fit, init_lenet_params
from manual_dp.errors import ReplicaMismatchError
from manual_dp.fast.collectives import reduce_bcast
from manual_dp.train import main
from test_bad_input import TINY, run
from test_step import batch


def faulty(bad_call, delta=1e-3):
    """reduce_bcast, except that its `bad_call`-th call leaves the last replica off by `delta`."""
    calls = []

    def allreduce(arrays):
        reduce_bcast(arrays)
        calls.append(1)
        if len(calls) == bad_call:
            arrays[-1][:] += delta
    return allreduce


def test_a_faulty_allreduce_is_caught_at_the_next_check():
    ctx = [mx.cpu(i) for i in range(3)]
    model = DataParallel(init_lenet_params(seed=0), ctx, "sgd", faulty(bad_call=3))
    X, y = batch(60, seed=1)
    with pytest.raises(ReplicaMismatchError, match=r"update 3: the replica on cpu\(2\) differs from "
                                                   r"the one on cpu\(0\) in W1 \(checksum"):
        list(fit(model, (X, y), (X[:8], y[:8]), 1, 12, 0.1, None, check_replicas=1))


def test_checks_every_n_updates_only():
    model = DataParallel(init_lenet_params(seed=0), [mx.cpu(0), mx.cpu(1)], "sgd", faulty(bad_call=3))
    X, y = batch(48, seed=1)   # 4 updates: checked after 2 and 4; the fault of update 3 at 4
    with pytest.raises(ReplicaMismatchError, match="update 4"):
        list(fit(model, (X, y), (X[:8], y[:8]), 1, 12, 0.1, None, check_replicas=2))


def test_the_cli_stops_and_keeps_the_last_good_checkpoint(capsys, monkeypatch, data_dir, tmp_path):
    from manual_dp.cli import build as cli_build
    monkeypatch.setattr(cli_build, "make_allreduce", lambda name, wire=None: faulty(bad_call=6))   # epoch 2 of 4 updates
    ck = tmp_path / "ck"
    code, lines = run(capsys, ["--data-dir", str(data_dir), *TINY, "--cpus", "2", "--epochs", "3",
                               "--check-replicas", "1", "--checkpoint-dir", str(ck), "--log-json", str(tmp_path / "log")])
    assert code == 1 and len(lines) == 1, lines
    assert re.search(r"update 6: the replica on cpu\(1\) differs from the one on cpu\(0\)", lines[0]), lines[0]
    assert checkpoint.load(ck)[1]["epoch"] == 1
    assert [json.loads(r)["epoch"] for r in (tmp_path / "log").read_text().splitlines()] == [1]
