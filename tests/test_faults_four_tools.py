"""Issue 41, item 5: the tools that read files (manual_dp.timeline, manual_dp.flight, --digests
resumed, diverge --replay) and the planner refuse malformed input with one line and exit 2 (a
--digests file that cannot be continued: 1, the file kept), without reading without bound or
hanging. Each command runs in a process of its own, its memory and time bounded."""
import json
import resource
import subprocess
import sys

import pytest

from manual_dp.multiprocess.flight import FORMAT
from conftest import run_main

TINY = ["--train-size", "100", "--test-size", "64", "--batch-size", "32", "--no-progress", "--cpus", "1"]


def tool(*args):
    """(exit status, stderr lines) of `python -m *args`, in at most 4 GB and 60 s."""
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))   # noqa: E731
    done = subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True, timeout=60,
                          preexec_fn=limit)
    return done.returncode, done.stderr.strip().splitlines()


# manual_dp.flight -------------------------------------------------------------------------------

def entry(seq, state="completed", **changes):
    return dict(dict(seq=seq, op="allreduce", key="sum", step=seq, bytes=40, site="loop.py:1", start=100.0 + seq,
                     end=101.0 + seq, state=state), **changes)


def record(rank, entries, size=2, **changes):
    return dict(dict(format=FORMAT, rank=rank, size=size, job="j", reason="watchdog", dumped_at=200.0,
                     entries=entries), **changes)


def flight(directory, *records):
    for r in records:
        (directory / f"flight-{r['rank']}.json").write_text(json.dumps(r))
    return tool("manual_dp.flight", directory)


@pytest.mark.parametrize("changes, words", [
    ({"dumped_at": "late"}, "the record's dumped_at is not a number"),
    ({"entries": [entry(1, bytes="forty")]}, "an entry's bytes is not a whole number"),
    ({"entries": [entry(1, state="started", start="early")]}, "an entry's start is not a number"),
    ({"reason": [[["deep"]]]}, "its job or reason is neither a name nor a number"),
], ids=["dumped_at", "bytes", "start", "reason"])
def test_flight_a_string_where_a_number_belongs_is_refused(tmp_path, changes, words):
    code, err = flight(tmp_path, dict(record(0, [entry(1, state="started")]), **changes), record(1, [entry(1)]))
    assert code == 2 and len(err) == 1 and words in err[0], err


def test_flight_a_deeply_nested_record_is_refused(tmp_path):
    deep = "[" * 100000 + "]" * 100000
    (tmp_path / "flight-0.json").write_text('{"format": "' + FORMAT + '", "entries": ' + deep + "}")
    code, err = flight(tmp_path, record(1, [entry(1)]))
    assert code == 2 and len(err) == 1 and "nested deeper than the JSON parser goes" in err[0], err


def test_flight_a_job_of_ten_billion_ranks_is_refused(tmp_path):
    code, err = flight(tmp_path, record(0, [entry(1)], size=10 ** 10))
    assert code == 2 and len(err) == 1 and "rank 0 of 10000000000 is not a rank of a job" in err[0], err


def test_flight_sequence_gaps_on_every_rank_are_skipped_not_counted_through(tmp_path):
    seqs = [1, 3, 10 ** 12]
    code, err = flight(tmp_path, *(record(r, [entry(s) for s in seqs]) for r in (0, 1)))
    assert code == 0 and not err, err


def test_flight_a_record_linked_to_dev_zero_is_refused(tmp_path):
    (tmp_path / "flight-0.json").symlink_to("/dev/zero")
    code, err = flight(tmp_path, record(1, [entry(1)]))
    assert code == 2 and len(err) == 1 and "flight-0.json: not a readable flight record" in err[0], err
    assert "not a regular file" in err[0]


# manual_dp.timeline -----------------------------------------------------------------------------

def trace(**changes):
    """A trace of one step on one context, one bucket."""
    def span(kind, ts, **args):
        return {"ph": "X", "cat": "trainer", "pid": 7, "tid": 0, "name": kind, "ts": ts, "dur": 10.0,
                "args": dict(kind=kind, step=0, context="cpu(0)", **args)}
    events = [{"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "cpu/0"}},
              span("forward", 0.0), span("backward", 10.0, bucket=0), span("allreduce", 20.0, bucket=0),
              span("update", 30.0, bucket=0)]
    return dict({"traceEvents": events, "otherData": {"manual_dp": {"contexts": ["cpu(0)"], "bytes": [4096],
                                                                     "algorithm": "ring"}}}, **changes)


def timeline(path, tmp_path):
    return tool("manual_dp.timeline", path, "-o", tmp_path / "t.png")


@pytest.mark.parametrize("changes, words", [
    ({"traceEvents": 12}, "traceEvents is a int, not a list"),
    ({"traceEvents": trace()["traceEvents"][:1] + [dict(trace()["traceEvents"][1], ts="0")]},
     "its ts '0' is not a time in microseconds"),
    ({"traceEvents": trace()["traceEvents"][:2] + [dict(trace()["traceEvents"][2], args={
        "kind": "backward", "step": 0, "context": "cpu(0)", "bucket": 10 ** 10})]}, "no bucket of the trace's 1"),
], ids=["events-a-number", "ts-a-string", "bucket-10e10"])
def test_timeline_a_malformed_trace_is_refused(tmp_path, changes, words):
    (tmp_path / "t.json").write_text(json.dumps(trace(**changes)))
    code, err = timeline(tmp_path / "t.json", tmp_path)
    assert code == 2 and len(err) == 1 and words in err[0], err


def test_timeline_a_deeply_nested_trace_is_refused(tmp_path):
    (tmp_path / "t.json").write_text('{"traceEvents": ' + "[" * 100000 + "]" * 100000 + "}")
    code, err = timeline(tmp_path / "t.json", tmp_path)
    assert code == 2 and len(err) == 1 and "nested deeper than the JSON parser goes" in err[0], err


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_timeline_a_device_is_refused_unread(tmp_path, device):
    code, err = timeline(device, tmp_path)
    assert code == 2 and len(err) == 1 and "not a regular file" in err[0], err


# --digests resumed, diverge --replay, the planner ---------------------------------------------------

@pytest.mark.parametrize("content", [b'{"epoch": 1}\n{"epoch": 2}\n', bytes(range(256)) * 8],
                         ids=["a-log", "binary"])
def test_digests_resumed_over_another_file_end_with_one_line_and_keep_it(capsys, data_dir, tmp_path, content):
    ck = ["--checkpoint-dir", str(tmp_path / "ck")]
    assert run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--epochs", "1", *ck])[0] == 0
    other = tmp_path / "other.txt"
    other.write_bytes(content)
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--epochs", "2", *ck, "--resume",
                                       "--digests", str(other)])
    assert code == 1 and len(err) == 1 and "--digests: cannot continue" in err[0], err
    assert other.read_bytes() == content and "epoch 2/2" not in out


def test_replay_of_a_header_naming_100000_contexts_is_refused(tmp_path):
    run = {"model": "lenet", "seed": 0, "mode": "sync", "cpus": 100000, "processes": 1, "batch_size": 200000}
    for name, digest in (("a", "0" * 16), ("b", "1" * 16)):
        (tmp_path / name).write_text(json.dumps({"run": run}) + "\n" + json.dumps(
            {"update": 1, "tensors": [["param", "W1", digest, 1.0, 1.0]]}) + "\n")
    code, err = tool("manual_dp.diverge", tmp_path / "a", tmp_path / "b", "--replay")
    assert code == 2 and len(err) == 1 and "names 100000 cpu contexts: --replay rebuilds 1 to 256" in err[0], err


@pytest.mark.parametrize("argv, words", [
    (["--top", "0", "--verify"], "--top must be >= 1, got 0"),
    (["--steps", "0", "--verify"], "--steps must be >= 1, got 0"),
    (["--model", "transformer", "--layers", "1000000"], "--layers 1000000: at most 256"),
], ids=["top", "steps", "layers"])
def test_the_planner_refuses_what_would_do_nothing_or_never_end(argv, words):
    code, err = tool("manual_dp.plan", "--devices", "2", "--memory-per-device", "1G", *argv)
    assert code == 2 and len(err) == 1 and words in err[0], err
