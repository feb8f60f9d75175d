"""The flight recorder (issue 25): every process's last collectives, written when a job fails, and
`python -m manual_dp.flight DIR` naming the first collective where the ranks part and the late rank.

The reader on hand-made records (agreeing, a rank behind, a rank that skipped one, different sizes,
corrupt or missing input), the recorder by itself, then real jobs: one that ends well with
--flight-record, and jobs in which one process skips a collective (the test-only fault
$MANUAL_DP_TEST_SKIP_COLLECTIVE) and hangs the others until the watchdog gives up.
"""
import importlib.util
import json
import re
import signal
import time

import mxnet as mx
import pytest

from conftest import run_main, write_dataset
from jobs import Job, horovod_cmd, launch_cmd, run_job, wait_for
from manual_dp.flight import main
from manual_dp.multiprocess.flight import FORMAT, SKIP, Recorder, skipped_seq

HAVE_HOROVOD = importlib.util.find_spec("horovod") is not None and \
    importlib.util.find_spec("horovod.mxnet") is not None


def entry(seq, op="allreduce", key="sum10", step=1, size=40, state="completed"):
    return dict(seq=seq, op=op, key=key, step=step, bytes=size, site="manual_dp/loop.py:64",
                start=100.0 + seq, end=100.5 + seq if state == "completed" else None, state=state)


def steps(n, first=1):
    """n collectives as a sync job enters them: a gradient sum per step."""
    return [entry(s, step=s) for s in range(first, first + n)]


def write(directory, rank, entries, size=2, job="job-1", dumped_at=200.0):
    directory.mkdir(parents=True, exist_ok=True)
    record = dict(format=FORMAT, rank=rank, size=size, backend="dist_sync", job=job, reason="watchdog",
                  host="here", dumped_at=dumped_at, pid=1, capacity=512, entries=entries)
    (directory / f"flight-{rank}.json").write_text(json.dumps(record))


def read(capsys, directory):
    """(exit status, stdout lines, stderr lines) of python -m manual_dp.flight `directory`."""
    with pytest.raises(SystemExit) as done:
        main([str(directory)])
    out, err = capsys.readouterr()
    return done.value.code, out.strip().splitlines(), err.strip().splitlines()


# The reader ------------------------------------------------------------------------------------

def test_identical_records_agree(tmp_path, capsys):
    for rank in (0, 1):
        write(tmp_path, rank, steps(5))
    code, out, err = read(capsys, tmp_path)
    assert code == 0 and not err
    assert out[-1] == "the ranks agree: 2 rank(s) entered the same collectives #1 to #5", out
    assert out[0].startswith("rank 0 (watchdog): last started #5 allreduce sum10 (step 5, 40 bytes)")


def test_a_rank_behind_is_named_late_at_the_first_collective_it_never_entered(tmp_path, capsys):
    write(tmp_path, 0, steps(6)[:-1] + [entry(6, step=6, state="started")])
    write(tmp_path, 1, steps(5))
    code, out, _ = read(capsys, tmp_path)
    assert code == 1
    assert "not completed: #6 allreduce sum10 (step 6, 40 bytes)" in out[0], out
    assert out[-1].startswith("the ranks part at collective #6: rank 1 never entered it (rank 1's last is #5)")
    assert out[-1].endswith("late: rank 1"), out


def test_a_rank_that_skipped_a_collective_is_named_late(tmp_path, capsys):
    write(tmp_path, 0, steps(6))
    write(tmp_path, 1, steps(3) + [entry(4, step=5), entry(5, step=6)])   # step 4's sum never entered
    code, out, _ = read(capsys, tmp_path)
    assert code == 1
    assert "the ranks part at collective #4:" in out[-1] and "rank 1 never entered rank 0's #4 (its #4 is " \
           "rank 0's #5" in out[-1] and out[-1].endswith("late: rank 1"), out


@pytest.mark.parametrize("size,late", [(2, "which rank is late the records cannot tell"), (3, "late: rank 2")])
def test_another_size_at_a_sequence_number(tmp_path, capsys, size, late):
    for rank in range(size):
        write(tmp_path, rank, steps(2) + [entry(3, step=3, size=80 if rank == size - 1 else 40)], size=size)
    code, out, _ = read(capsys, tmp_path)
    assert code == 1 and out[-1].startswith("the ranks part at collective #3:"), out
    assert f"rank {size - 1} entered #3 allreduce sum10 (step 3, 80 bytes)" in out[-1] and out[-1].endswith(late)


def test_ranks_whose_ring_buffers_start_apart_are_compared_where_both_reach(tmp_path, capsys):
    write(tmp_path, 0, steps(4, first=10))
    write(tmp_path, 1, steps(6, first=8))
    code, out, _ = read(capsys, tmp_path)
    assert code == 0 and "#10 to #13 (older ones left the ring buffer before #10)" in out[-1], out


def test_an_earlier_jobs_records_are_noted_and_ignored(tmp_path, capsys):
    """A job restarted on one worker (--max-restarts) over the records of the job of two."""
    write(tmp_path, 0, steps(3), size=1, job="job-2", dumped_at=300.0)
    write(tmp_path, 1, steps(5))
    code, out, _ = read(capsys, tmp_path)
    assert code == 0 and out[0] == "flight-1.json ignored: an earlier job's (job-1, 2 ranks)", out
    assert out[-1] == "the ranks agree: 1 rank(s) entered the same collectives #1 to #3", out


@pytest.mark.parametrize("make,message", [
    (lambda d: None, "no such directory"),
    (lambda d: d.mkdir(), "holds no flight record"),
    (lambda d: (write(d, 0, steps(3)), (d / "flight-1.json").write_text('{"format": "manual_dp.fl')),
     "flight-1.json: not a readable flight record (JSONDecodeError"),
    (lambda d: (write(d, 0, steps(3)), (d / "flight-1.json").write_text("[1, 2]")), "not a flight record"),
    (lambda d: (write(d, 0, steps(3)), write(d, 1, [{"seq": "x"}])), "its entries are malformed"),
    (lambda d: write(d, 0, steps(3)), "1 of job job-1's 2 ranks left no record (flight-1.json)"),
    (lambda d: (write(d, 0, steps(3), job="job-2", dumped_at=300.0), write(d, 1, steps(3))),
     "1 of job job-2's 2 ranks left no record (flight-1.json)"),
    (lambda d: (d.parent.mkdir(exist_ok=True), d.write_text("x")), "not a directory"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, make, message):
    directory = tmp_path / "records"
    make(directory)
    code, out, err = read(capsys, directory)
    assert code == 2 and not out and len(err) == 1, (out, err)
    assert err[0].startswith("manual_dp.flight: error:") and message in err[0], err


# The recorder ------------------------------------------------------------------------------------

def test_the_recorder_is_a_bounded_ring_whose_dump_the_reader_reads(tmp_path, capsys):
    recorder = Recorder(capacity=8)
    for seq in range(1, 21):
        recorder.complete(recorder.start(seq, "allreduce", "sum10", seq, 40))
    entries = recorder.snapshot()
    assert [e["seq"] for e in entries] == list(range(13, 21))
    assert entries[0]["site"].startswith("tests/test_flight.py:") and entries[0]["state"] == "completed"
    for rank in (0, 1):
        path = recorder.dump(tmp_path, rank=rank, size=2, backend="dist_sync", job="j", reason="end of run")
        assert path == tmp_path / f"flight-{rank}.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flight-0.json", "flight-1.json"]   # no temporary left
    code, out, _ = read(capsys, tmp_path)
    assert code == 0 and "#13 to #20" in out[-1], out


def test_an_entry_completes_when_the_engine_has_its_result():
    recorder = Recorder()
    a = mx.nd.ones((300, 300))
    result = mx.nd.dot(a, a)                     # asynchronous: the engine computes it later
    e = recorder.start(1, "allreduce", "sum", 1, 4 * result.size)
    recorder.complete_when_ready(e, result)
    result.wait_to_read()
    mx.nd.waitall()
    assert e["state"] == "completed" and e["end"] >= e["start"]


def test_the_fault_names_a_rank_and_a_sequence_number():
    assert skipped_seq(1, {SKIP: "1:14"}) == 14 and skipped_seq(0, {SKIP: "1:14"}) is None
    assert skipped_seq(0, {}) is None
    with pytest.raises(ValueError, match="RANK:SEQ"):
        skipped_seq(0, {SKIP: "x"})


# Real jobs ---------------------------------------------------------------------------------------

ARGS = ["--cpus", 1, "--train-size", 256, "--test-size", 64, "--batch-size", 64, "--epochs", 2]
SKIPPED = 14                   # a gradient sum of epoch 2 (#6 to #9 and #13 to #16 are the steps' sums)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("flight_data"), n_train=256, n_test=64)


def test_a_job_that_ends_well_writes_records_that_agree(data, tmp_path, capsys):
    code, out = run_job(launch_cmd(2, "dist_sync", *ARGS, "--data-dir", data, "--flight-record", tmp_path / "fr"),
                        tmp_path / "out.txt", timeout=120)
    assert code == 0, out
    status, lines, _ = read(capsys, tmp_path / "fr")
    assert status == 0 and re.fullmatch(r"the ranks agree: 2 rank\(s\) entered the same collectives #1 to #\d+", lines[-1])
    assert all(e["state"] == "completed" for r in (0, 1)
               for e in json.loads((tmp_path / "fr" / f"flight-{r}.json").read_text())["entries"])


def test_one_process_has_nothing_to_record(data, tmp_path, capsys):
    code, _, err = run_main(capsys, ["--data-dir", str(data), "--cpus", "1", "--flight-record", str(tmp_path / "fr")])
    assert code == 2 and len(err) == 1 and "one process has no collectives between processes" in err[0], err


def hung_job(tmp_path, cmd, env):
    """Run a job with rank 1 skipping collective #SKIPPED; returns (directory its lines name, output)."""
    code, out = run_job(cmd, tmp_path / "out.txt", timeout=120, env={SKIP: f"1:{SKIPPED}", **env})
    assert code != 0, out
    lines = [l for l in out.splitlines() if "no progress for 3 s" in l]
    assert lines, out
    named = re.search(r"flight record in \S+: python -m manual_dp\.flight (\S+) compares every rank's; ", lines[0])
    assert named, lines[0]
    return named.group(1), out


def assert_names_the_skip(capsys, directory):
    status, lines, err = read(capsys, directory)
    assert status == 1 and not err, (lines, err)
    assert lines[-1].startswith(f"the ranks part at collective #{SKIPPED}:") and lines[-1].endswith("late: rank 1"), lines
    print("\n".join(lines))


def test_a_skipped_collective_is_named_with_the_late_rank_dist_sync(data, tmp_path, capsys):
    """Three jobs: the first writes where a failing job writes without --flight-record (TMPDIR),
    the others into --flight-record DIR."""
    for run in range(3):
        where = tmp_path / f"run{run}"
        where.mkdir()
        extra = [] if run == 0 else ["--flight-record", where / "fr"]
        directory, out = hung_job(where if run else tmp_path, launch_cmd(
            2, "dist_sync", *ARGS, "--data-dir", data, "--timeout", 3, *extra), {"TMPDIR": str(tmp_path)})
        assert directory.startswith(str(tmp_path / "manual_dp-flight-") if run == 0 else str(where / "fr")), directory
        assert_names_the_skip(capsys, directory)


def test_a_hung_job_stopped_by_sigterm_leaves_every_ranks_record(data, tmp_path, capsys):
    """The launcher's SIGTERM reaches workers that wait inside MXNet, where Python's handler cannot
    run: each still writes its record (the signal wakes the recorder's thread)."""
    job = Job(launch_cmd(2, "dist_sync", *ARGS, "--data-dir", data, "--timeout", 60, "--flight-record",
                         tmp_path / "fr"), tmp_path / "out.txt", env={SKIP: f"1:{SKIPPED}"})
    try:
        wait_for(lambda: "epoch 1/2" in job.output(), 120, "the first epoch")
        time.sleep(3)                                          # epoch 2 hangs at its last sum
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait(60) != 0
    finally:
        job.close()
    reasons = {json.loads((tmp_path / "fr" / f"flight-{r}.json").read_text())["reason"] for r in (0, 1)}
    assert reasons == {"stopped by SIGTERM"}, reasons
    assert_names_the_skip(capsys, tmp_path / "fr")


@pytest.mark.skipif(not HAVE_HOROVOD, reason="horovod.mxnet is not importable (bash setup.sh --test installs it)")
def test_a_skipped_collective_is_named_with_the_late_rank_horovod(data, tmp_path, capsys):
    directory, _ = hung_job(tmp_path, horovod_cmd(2, *ARGS, "--data-dir", data, "--timeout", 3,
                                                  "--flight-record", tmp_path / "fr"), {})
    assert_names_the_skip(capsys, directory)
