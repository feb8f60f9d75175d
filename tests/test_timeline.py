"""--trace and the timeline: a trace recorded here, parsed, measured, predicted and drawn; the
overlap fraction worked out by hand on spans made up for it."""
import json

import mxnet as mx
import pytest
from mxnet import nd

from conftest import batch
from manual_dp import DataParallel, init_lenet_params, timeline
from manual_dp.train import main as train_main


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A trace of updates 2 and 3 of a 2-context step with 3 buckets, and the model's buckets."""
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    model = DataParallel(init_lenet_params(0), [mx.cpu(0), mx.cpu(1)], "momentum", conv_pad=1, bucket_mb=0.001)
    model.trace(path, skip=1, steps=2, algorithm="reduce_bcast")
    for step in range(4):
        model.step(*batch(16, step), 0.05)
    nd.waitall()
    return timeline.load(path), model.buckets


def test_trace_holds_every_span_of_every_step_in_order(recorded):
    trace, buckets = recorded
    spans = timeline.spans(trace)
    assert trace["otherData"]["manual_dp"]["bytes"] == buckets.bytes and len(buckets.plan) == 4
    assert {s["step"] for s in spans} == {0, 1}
    for step in (0, 1):
        for c in ("cpu(0)", "cpu(1)"):
            mine = [s for s in spans if s["step"] == step and s["context"] == c]
            kinds = [(s["kind"], s.get("bucket")) for s in mine]
            assert sorted(kinds, key=str) == sorted([("forward", None)] + [(k, b) for b in range(4) for k in
                                                    ("backward", "allreduce", "update")], key=str)
            at = {(s["kind"], s.get("bucket")): s for s in mine}
            assert all(s["end"] >= s["start"] for s in mine)
            for b in range(4):
                # a bucket is reduced after its gradients are ready everywhere, updated after that
                # (marks on one array: their order is the engine's)
                ready = max(s["end"] for s in spans if s["step"] == step and s["kind"] == "backward"
                            and s["bucket"] == b)
                assert at[("allreduce", b)]["start"] == ready
                assert at[("allreduce", b)]["end"] <= at[("update", b)]["end"]
    # MXNet's own operator events are in the same file, on both contexts
    assert set(timeline.device_ops(trace)) >= {"cpu(0)", "cpu(1)"}
    assert all(timeline.device_ops(trace)[c] for c in ("cpu(0)", "cpu(1)"))


def test_overlap_measured_and_predicted_are_fractions(recorded, tmp_path):
    trace, _ = recorded
    assert 0.0 <= timeline.measured_overlap(timeline.spans(trace)) <= 1.0
    _, plan = timeline.predicted(trace)
    assert 0.0 <= plan["overlap"] <= 1.0 and len(plan["allreduce"]) == 4
    _, pcie = timeline.predicted(trace, "PCIe 3.0 x16")
    assert pcie["allreduce"][0][0] == pytest.approx(pcie["backward"][0][1])   # bucket 0 starts when ready
    timeline.draw(trace, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_measured_overlap_by_hand():
    def s(kind, start, end, step=0):
        return {"kind": kind, "start": start, "end": end, "step": step}
    spans = [s("forward", 0, 10), s("backward", 10, 30), s("allreduce", 20, 40), s("allreduce", 25, 35),
             s("backward", 0, 5, step=1), s("allreduce", 5, 15, step=1)]
    # step 0: comm [20, 40] with 10 under compute; step 1: comm [5, 15], none hidden
    assert timeline.measured_overlap(spans) == pytest.approx(10 / 30)


def test_operator_overlap_by_hand():
    """cpu(0) runs an add_n in its all-reduce span while cpu(1) runs a backward op for half of it."""
    def op(pid, name, a, b):
        return [{"ph": "B", "pid": pid, "tid": 0, "name": name, "ts": a},
                {"ph": "E", "pid": pid, "tid": 0, "name": name, "ts": b}]

    def span(kind, c, a, b):
        return {"ph": "X", "cat": "trainer", "pid": 99, "name": kind, "ts": a, "dur": b - a,
                "args": {"kind": kind, "context": c, "step": 0, "bucket": 0}}
    events = [{"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "cpu/0"}},
              {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "cpu/1"}},
              span("backward", "cpu(0)", 0, 10), span("allreduce", "cpu(0)", 10, 30),
              span("backward", "cpu(1)", 0, 25), span("allreduce", "cpu(1)", 25, 30),
              *op(0, "_backward_Convolution", 0, 10), *op(0, "add_n", 12, 22), *op(0, "DeleteVariable", 22, 30),
              *op(1, "_backward_Convolution", 5, 17), *op(1, "CopyCPU2CPU", 26, 28)]
    trace = {"traceEvents": events}
    # add_n [12, 22] and the copy [26, 28] are communication; only [12, 17] runs beside compute
    assert timeline.operator_overlap(trace) == pytest.approx(5 / 12)
    assert timeline.measured_overlap(timeline.spans(trace)) == pytest.approx(15 / 20)   # spans: [10, 25]


def test_the_command_lines(recorded, tmp_path, capsys, data_dir):
    """Also a second trace in a process that recorded one (MXNet appends to its first dump)."""
    trace = tmp_path / "run.json"
    train_main(["--data-dir", str(data_dir), "--cpus", "2", "--epochs", "1", "--train-size", "192",
                "--test-size", "32", "--batch-size", "32", "--no-progress", "--no-autotune",
                "--bucket-mb", "0.2", "--trace", str(trace)])
    assert json.loads(trace.read_text())["otherData"]["manual_dp"]["algorithm"] == "reduce_bcast"
    capsys.readouterr()
    timeline.main([str(trace), "-o", str(tmp_path / "t.png")])
    out = capsys.readouterr().out
    assert "3 step(s) on cpu(0), cpu(1), 2 bucket(s)" in out and "overlap:" in out
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        timeline.main([str(tmp_path / "junk.json")])
    assert e.value.code == 2 and "not a trace written by --trace" in capsys.readouterr().err
