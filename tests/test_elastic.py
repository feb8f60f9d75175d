"""Elastic restart (--max-restarts) and the late rank named (the progress board, step times).

Stand-in programs check the launcher's restarts quickly; dist_sync workers on 127.0.0.1 check a
real job that loses a worker, by kill -9 or by SIGSTOP. Every job is bounded in time.
"""
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import write_dataset
from jobs import Job, assert_same_run, horovod_cmd, launch_cmd, read_log, run_job, train_cmd, trainer_pids, wait_for
from manual_dp import checkpoint
from manual_dp.errors import PEER_LOST
from manual_dp.multiprocess.board import Board, Reporter, verdict
from manual_dp.multiprocess import launcher as launch
from manual_dp.multiprocess.elastic import Elastic, lost
from test_launch import launcher, leftovers

# A synchronous step that keeps learning (plain SGD, small lr) over 3 epochs of 37 batches.
ARGS = ["--cpus", 1, "--epochs", 3, "--batch-size", 32, "--optimizer", "sgd", "--lr", 0.02]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("elastic_data"), n_train=1200, n_test=100)


# The board, by itself ------------------------------------------------------------------------

def test_verdict_names_the_silent_rank_else_the_one_behind():
    reports = {0: (52, 17, "allreduce g", "worker 0", 0.4), 1: (51, 17, "allreduce g", "worker 1", 3.2)}
    assert verdict(reports, 2, 0, 1.9) == ("rank 1 (worker 1) stopped: silent for 3.2 s, last entered "
                                          "collective #51 (allreduce g, step 17)")
    alive = {0: (52, 17, "allreduce g", "worker 0", 0.4), 1: (51, 17, "allreduce g", "worker 1", 0.3)}
    assert verdict(alive, 2, 0, 1.9) == ("rank 1 (worker 1) is behind: alive, last entered collective "
                                        "#51 (allreduce g, step 17)")
    level = {0: (52, 17, "x", "", 0.4), 1: (52, 17, "x", "", 0.3)}
    assert "every rank is alive and entered collective #52" in verdict(level, 2, 0, 1.9)
    assert verdict({0: level[0]}, 3, 0, 1.9) == "rank 1, rank 2 never reported to the board"
    assert verdict(None, 2, 0, 1.9) == "the board did not answer: the other ranks' progress is unknown here"
    assert verdict(None, 2, 1, 1.9, "no board here").startswith("no board here: ")


def test_reports_reach_the_board_and_come_back():
    board = Board("127.0.0.1")
    try:
        a, b = Reporter(f"127.0.0.1:{board.port}", "worker 0"), Reporter(f"127.0.0.1:{board.port}", "worker 1")
        a.report(0, 5, 2, "allreduce sum|odd")         # a bar in the operation survives
        b.report(1, 4, 2, "broadcast")
        got = wait_for(lambda: (lambda r: r if r and len(r) == 2 else None)(a.ask()), 5, "both reports")
        assert got[0][:4] == (5, 2, "allreduce sum|odd", "worker 0") and got[1][:4] == (4, 2, "broadcast", "worker 1")
        assert 0 <= got[0][4] < 5
        board.take("garbage")                           # ignored
        assert sorted(a.ask()) == [0, 1]
        time.sleep(0.3)
        assert sorted(board.silent(0.2)) == ["worker 0", "worker 1"] and board.silent(60) == []
        board.reset()
        assert a.ask() == {}
    finally:
        board.close()
    assert Reporter("", "").ask() is None               # no board: nothing sent, no answer


# The launcher's restarts, with stand-ins ---------------------------------------------------------

def test_a_lost_worker_restarts_the_job_on_the_others(tmp_path):
    cmd, marker = launcher(tmp_path, "--workers", "3", "--max-restarts", "2", "--grace", "1",
                           behaviour=["worker1=0.5,-9", "worker=2", "server=2", "scheduler=2"])
    code, out = run_job(cmd, tmp_path / "out.txt", timeout=60)
    assert code == 0, out
    assert ("manual_dp.launch: worker 1 was killed by SIGKILL; restart 1 of 2 without worker 1: "
            "2 worker(s) resume from the last checkpoint") in out.splitlines(), out
    # the second job: 2 workers (DMLC_NUM_WORKER), worker 1 left out, the others as before
    second = out.split("restart 1 of 2")[1].splitlines()
    workers = sorted(l for l in second if l.startswith("[worker"))
    assert [l.split()[:2] + l.split()[-3:] for l in workers] == [
        ["[worker", "0]", "2", "1", "0"], ["[worker", "2]", "2", "1", "2"]], out
    assert "error" not in out and not leftovers(marker)


def test_restarts_run_out(tmp_path):
    cmd, marker = launcher(tmp_path, "--workers", "3", "--max-restarts", "1", "--grace", "1",
                           behaviour=["worker1=0.3,4", "worker0=1,4", "worker=5", "server=5", "scheduler=5"])
    code, out = run_job(cmd, tmp_path / "out.txt", timeout=60)
    assert code == PEER_LOST, out
    assert "manual_dp.launch: worker 1 exited with status 4; restart 1 of 1 without worker 1: 2 worker(s)" in out, out
    assert ("manual_dp.launch: error: worker 0 exited with status 4; stopping the job after 1 "
            "restart(s)") in out.splitlines(), out
    assert not leftovers(marker)


def test_a_failed_server_restarts_the_job_with_every_worker(tmp_path):
    cmd, marker = launcher(tmp_path, "--workers", "2", "--max-restarts", "1", "--grace", "1",
                           behaviour=["server=0.3,1", "worker=5", "scheduler=5"])
    code, out = run_job(cmd, tmp_path / "out.txt", timeout=60)
    assert code == 1, out
    assert ("manual_dp.launch: server 0 exited with status 1; restart 1 of 1: 2 worker(s) resume "
            "from the last checkpoint") in out.splitlines(), out
    assert "stopping the job after 1 restart(s)" in out and not leftovers(marker)


@pytest.mark.parametrize("status", [1, 2, 3, 143])
def test_a_workers_own_error_is_not_restarted(tmp_path, status):
    """Bad data or checkpoint (1), bad flags (2), divergence (3), SIGTERM handled (143)."""
    cmd, marker = launcher(tmp_path, "--workers", "2", "--max-restarts", "3", "--grace", "1",
                           behaviour=[f"worker1=0.3,{status}", "worker=5", "server=5", "scheduler=5"])
    code, out = run_job(cmd, tmp_path / "out.txt", timeout=60)
    assert code == status and "restart" not in out, out
    assert f"manual_dp.launch: error: worker 1 exited with status {status}; stopping the job" in out


def test_the_last_worker_lost_ends_the_job(tmp_path):
    cmd, _ = launcher(tmp_path, "--workers", "1", "--max-restarts", "2", "--grace", "1",
                      behaviour=["worker=0.3,-9", "server=5", "scheduler=5"])
    code, out = run_job(cmd, tmp_path / "out.txt", timeout=60)
    assert code == 1 and ("manual_dp.launch: error: worker 0 was killed by SIGKILL; no worker left to "
                          "restart on; stopping the job") in out, out


@pytest.mark.parametrize("label,status,expected", [
    ("worker 1", -9, True), ("worker 1", PEER_LOST, True), ("worker 1", None, True),
    ("worker 1", 1, False), ("worker 1", 2, False), ("worker 1", 3, False), ("worker 1", 137, False),
    ("server 0", 1, True), ("scheduler", -6, True), ("server 0", 2, False), ("scheduler", 130, False),
    ("worker 1 on h", 255, True), ("worker 1 on h", 137, True), ("worker 1 on h", 143, False),
    ("worker 1 on h", 1, False),
])
def test_a_lost_part_is_told_from_a_workers_own_error(label, status, expected):
    assert lost(label, status) is expected


class Ended:
    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code


def test_a_worker_that_lost_its_peer_is_not_named_when_the_peer_failed_too():
    """Both ended before the launcher looked: the peer's own error is the cause, not the loss."""
    job = launch.Job()
    job.procs = [("worker 0", Ended(PEER_LOST)), ("worker 1", Ended(1)), ("server 0", Ended(None))]
    assert job.failure(None) == ("worker 1", 1)
    job.procs = [("worker 0", Ended(PEER_LOST)), ("worker 1", Ended(None)), ("server 0", Ended(-9))]
    assert job.failure(None) == ("server 0", -9)
    job.procs = [("worker 0", Ended(0)), ("worker 1", Ended(PEER_LOST)), ("server 0", Ended(1))]
    assert job.failure(None) == ("server 0", 1) and job.failure(1.0) == ("worker 1", PEER_LOST)
    job.procs = [("worker 0", Ended(0)), ("server 0", Ended(0))]
    assert job.failure(None) is None


@pytest.mark.parametrize("argv,message", [
    (["--max-restarts", "-1", "--", "true"], "--max-restarts must be at least 0, got -1"),
    (["--max-restarts", "one", "--", "true"], "argument --max-restarts: invalid int value: 'one'"),
    (["--max-restarts", "1", "--", "python", "-m", "manual_dp.train", "--checkpoint-dir", "ck"],
     "--max-restarts 1: a restarted job must continue from the checkpoint: give manual_dp.train "
     "--checkpoint-dir DIR --resume"),
    (["--max-restarts", "1", "--", "python", "-m", "manual_dp.train", "--resume"],
     "give manual_dp.train --checkpoint-dir DIR --resume"),
])
def test_bad_restart_input_is_one_line_and_exit_2(argv, message):
    done = subprocess.run([sys.executable, "-m", "manual_dp.launch", *argv], capture_output=True,
                          text=True, timeout=30)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and done.stdout == "", done.stderr
    assert lines[0].startswith("manual_dp.launch: error: ") and message in lines[0], lines[0]


# Real dist_sync jobs ---------------------------------------------------------------------------

def start_then_signal(tmp_path, data, sig, *extra):
    """A 2-worker job with --max-restarts 1; `sig` to the trainer the launcher calls "worker 1"
    once rank 0's first checkpoint exists. Returns (job, checkpoint dir, log, wall times of the
    start and of the signal)."""
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    cmd = launch_cmd(2, "dist_sync", *ARGS, "--data-dir", data, "--checkpoint-dir", ck, "--resume",
                     "--log-json", log, *extra)
    cmd[cmd.index("--workers") + 2:cmd.index("--workers") + 2] = ["--max-restarts", "1"]
    started_at = time.time()
    job = Job(cmd, tmp_path / "out.txt")
    wait_for(lambda: (ck / checkpoint.NAME).exists(), 120, "the first checkpoint")
    victim, = wait_for(lambda: trainer_pids(str(ck), MANUAL_DP_WORKER="worker 1"), 30, "worker 1")
    os.kill(victim, sig)
    return job, ck, log, started_at, time.time()


def resumed_epoch(out):
    return int(re.search(r"\[worker 0\] resumed from \S+ after epoch (\d+)", out).group(1))


def test_a_workers_bad_data_ends_the_job_at_once(tmp_path):
    """--data-dir missing: every worker's own one-line error, exit 1, no restart (issue 25): a
    restart would fail the same way, and did, until no worker was left."""
    cmd = launch_cmd(2, "dist_sync", "--cpus", 1, "--data-dir", tmp_path / "nodata", "--checkpoint-dir",
                     tmp_path / "ck", "--resume")
    cmd[cmd.index("--workers"):cmd.index("--workers")] = ["--max-restarts", "1", "--grace", "1"]
    code, out = run_job(cmd, tmp_path / "out.txt", timeout=120)
    assert code == 1 and "restart" not in out, out
    named = [l for l in out.splitlines() if f"error: --data-dir {tmp_path / 'nodata'} does not exist" in l]
    assert named and all(l.startswith("[worker ") and "manual_dp.train: error: " in l for l in named), out
    assert re.search(r"^manual_dp\.launch: error: worker \d exited with status 1; stopping the job$", out, re.M), out


def test_a_killed_worker_restarts_the_job_which_ends_as_an_uninterrupted_one(data, tmp_path):
    """kill -9 of a worker: the job goes on, on one worker, from the last checkpoint, keeping the
    global batch, and with --deterministic ends with the very bits of an uninterrupted run (1
    process with 2 contexts), though the restarted job sums every batch on one worker instead of
    two (issue 12, item 4)."""
    ref_log, ref_ck = tmp_path / "ref.jsonl", tmp_path / "ref_ck"
    code, out = run_job(train_cmd(*ARGS, "--cpus", 2, "--deterministic", "--data-dir", data, "--log-json",
                                  ref_log, "--checkpoint-dir", ref_ck), tmp_path / "ref.txt")
    assert code == 0, out
    job, ck, log, started_at, killed_at = start_then_signal(tmp_path, data, signal.SIGKILL, "--deterministic")
    try:
        code = job.wait(180)
        out = job.output()
    finally:
        job.close()
    assert code == 0, out
    assert "manual_dp.launch: worker 1 was killed by SIGKILL; restart 1 of 1 without worker 1: " \
           "1 worker(s) resume from the last checkpoint" in out.splitlines(), out
    records, after = read_log(log), resumed_epoch(out)
    assert [r["epoch"] for r in records] == [1, 2, 3] and 1 <= after < 3
    assert all(len(r["step_sec_median"]) == len(r["step_sec_max"]) == (2 if r["epoch"] <= after else 1)
               for r in records), records
    assert all(0 < m <= x for r in records for m, x in zip(r["step_sec_median"], r["step_sec_max"]))
    assert_same_run(ref_log, ref_ck, log, ck, exact=True)
    took, first = records[after]["first_step_at"] - killed_at, records[0]["first_step_at"] - started_at
    assert 0 < took < 120
    print(f"dist_sync: kill -9 of a worker to the restarted job's first step: {took:.2f} s "
          f"(the first job's start to its first step: {first:.2f} s)")


def test_a_stopped_worker_is_named_by_the_watchdog_and_left_out_at_the_restart(data, tmp_path):
    """SIGSTOP: the other worker's watchdog names the stopped one (rank, launcher name, its last
    collective); the launcher restarts without it, and the job ends."""
    job, ck, log, _, stopped_at = start_then_signal(tmp_path, data, signal.SIGSTOP, "--timeout", 3)
    try:
        line = wait_for(lambda: next((l for l in job.output().splitlines()
                                      if "no progress for 3 s" in l), None), 60, "the watchdog")
        took = time.time() - stopped_at
        code = job.wait(180)
        out = job.output()
    finally:
        job.close()
    assert code == 0, out
    assert re.search(r"\[worker 0\] manual_dp\.train: error: rank \d of 2 \(dist_sync\): no progress "
                     r"for 3 s; last entered collective #\d+ \(\w+ \S+, step \d+\); rank \d \(worker 1\) "
                     r"stopped: silent for \d+\.\d s, last entered collective #\d+ \(\w+ \S+, step \d+\); "
                     r"giving up", line), line
    assert "restart 1 of 1 without worker 1: 1 worker(s) resume from the last checkpoint" in out, out
    assert [r["epoch"] for r in read_log(log)] == [1, 2, 3]
    assert 3 <= took < 30
    print(f"dist_sync: SIGSTOP of a worker to the watchdog's line naming it (--timeout 3): {took:.2f} s")


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="horovod is not installed")
@pytest.mark.parametrize("victim,named", [
    (1, r"rank 0 of 2 \(horovod\): no progress for 3 s; last entered collective #\d+ \(\w+ \S+, step "
        r"\d+\); rank 1 \(on localhost\) stopped: silent for \d+\.\d s, last entered collective #\d+"),
    (0, r"rank 1 of 2 \(horovod\): no progress for 3 s; last entered collective #\d+ \(\w+ \S+, step "
        r"\d+\); the board on rank 0 did not answer: rank 0 has probably stopped"),
])
def test_under_horovodrun_rank_0s_board_names_a_stopped_rank(data, tmp_path, victim, named):
    """No launcher of ours: rank 0 keeps the board. SIGSTOP of one rank; the other's watchdog
    names it (rank 0, stopped, names itself by not answering)."""
    ck = tmp_path / "ck"
    job = Job(horovod_cmd(2, *ARGS, "--data-dir", data, "--checkpoint-dir", ck, "--timeout", 3),
              tmp_path / "out.txt")
    try:
        wait_for(lambda: (ck / checkpoint.NAME).exists(), 120, "the first checkpoint")
        pid, = wait_for(lambda: trainer_pids(str(ck), HOROVOD_RANK=str(victim)), 30, "the victim")
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        line = wait_for(lambda: next((l for l in job.output().splitlines()
                                      if "no progress for 3 s" in l), None), 60, "the watchdog")
        took = time.time() - stopped_at
        assert job.wait(60) != 0
    finally:
        job.close()
    assert re.search(named, line), line
    assert 3 <= took < 30
    print(f"horovod: SIGSTOP of rank {victim} to the other's watchdog line (--timeout 3): {took:.2f} s")



def test_a_signal_while_the_job_starts_waits_until_the_process_is_recorded(tmp_path, monkeypatch):
    """SIGTERM's handler runs just after a process was forked, before the launcher recorded it:
    the interruption comes once every started process is in the job, so that all are stopped."""
    args, command = launch.parse(["--workers", "2", "--", sys.executable, "-c",
                                  "import time; time.sleep(60)", f"marker={tmp_path}"])
    elastic, started, real = Elastic(args, command), [], subprocess.Popen

    def popen(*a, **k):
        started.append(real(*a, **k))
        if len(started) == 2:
            elastic.interrupt(signal.SIGTERM, None)   # as the handler would, inside Popen
        return started[-1]

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    try:
        with pytest.raises(KeyboardInterrupt):
            elastic.attempt()
        assert len(started) == 4 and [p for _, p in elastic.job.procs] == started
    finally:
        elastic.stop()
    assert all(p.poll() is not None for p in started)
