"""--link: every transfer of an all-reduce takes the cost model's time over the link, hop by hop, on
MXNet's engine, and changes no value. Times are checked as lower bounds (the machine is shared: a
transfer can only be slower than modelled), upper bounds only where the point is that two transfers
did NOT wait for each other, with a wide margin."""
import time

import mxnet as mx
import numpy as np
import pytest
from mxnet import nd

from conftest import run_main
from manual_dp import checkpoint
from manual_dp.costmodel import LINKS
from manual_dp.fast.collectives import make_allreduce
from manual_dp.fast.link import EmulatedLink, delayed
from manual_dp.lesson import init_lenet_params
from manual_dp.links import LINK_PRESETS, parse_link

SLOW = parse_link("0.5,1000")        # 0.5 GB/s, 1 ms: a 4 MB hop takes ~9 ms
TINY = ["--train-size", "96", "--test-size", "32", "--batch-size", "32", "--epochs", "1", "--no-progress"]


def replicas(k, n, seed=0):
    """k replicas of n float32 integers (their sums are exact in any order) and their numpy sum."""
    host = [np.random.RandomState(seed + i).randint(-100, 100, n).astype(np.float32) for i in range(k)]
    return [nd.array(h, ctx=mx.cpu(i)) for i, h in enumerate(host)], sum(host)


def timed(name, k=4, n=1 << 20, spec=SLOW, tries=2):
    """(best seconds of `tries` all-reduces `name` of k replicas of n floats over `spec`, every
    replica equal to the numpy sum after each)."""
    best, exact = float("inf"), True
    for _ in range(tries):
        arrays, want = replicas(k, n)
        fn = make_allreduce(name, EmulatedLink(spec))
        nd.waitall()
        start = time.perf_counter()
        fn(arrays)
        nd.waitall()
        best = min(best, time.perf_counter() - start)
        exact = exact and all((a.asnumpy() == want).all() for a in arrays)
    return best, exact


@pytest.mark.parametrize("name", ["lesson", "reduce_bcast", "ring", "tree", "scatter_gather", "prepared"])
def test_a_4mb_allreduce_takes_the_modelled_time_and_sums_exactly(name):
    seconds, exact = timed(name)
    modelled = SLOW.allreduce_seconds(name, 4, 4 << 20)
    assert exact
    assert seconds >= 0.85 * modelled, (seconds, modelled)


def test_ring_and_reduce_bcast_pay_their_own_hops():
    ring, _ = timed("ring", tries=3)
    star, _ = timed("reduce_bcast", tries=3)
    model_ring, model_star = (SLOW.allreduce_seconds(a, 4, 4 << 20) for a in ("ring", "reduce_bcast"))
    assert model_star > 2.5 * model_ring                # 2(k-1) hops of n against 2(k-1) of n/k
    assert ring >= 0.85 * model_ring and star >= 0.85 * model_star
    assert star > 1.2 * ring, (star, ring)


def test_a_delay_waits_on_the_engine_not_in_python():
    x, ports = nd.ones((4,)), [nd.zeros((1,)) for _ in range(2)]
    nd.waitall()
    start = time.perf_counter()
    y = delayed(x, 0.2, *ports) + 1
    issued = time.perf_counter() - start
    y.wait_to_read()
    assert issued < 0.05 and time.perf_counter() - start >= 0.19
    assert (y.asnumpy() == 2).all()


def test_transfers_on_other_ports_overlap_and_on_one_port_queue():
    link = EmulatedLink(parse_link("1000,50000"))    # 50 ms whatever the size
    xs = [nd.ones((8,), ctx=mx.cpu(i)) for i in range(4)]

    def seconds(pairs):
        nd.waitall()
        start = time.perf_counter()
        for out in [link.ship(xs[a], mx.cpu(b)) for a, b in pairs]:
            out.wait_to_read()
        return time.perf_counter() - start

    assert min(seconds([(0, 1), (2, 3)]) for _ in range(3)) < 0.09     # two links: ~50 ms
    assert seconds([(0, 1), (2, 1)]) >= 0.095                          # one receiving port: ~100 ms

    def together(pairs):                     # ship_all: one step's transfers as one operator where it can
        nd.waitall()
        start = time.perf_counter()
        outs = link.ship_all([(xs[a], mx.cpu(b)) for a, b in pairs])
        assert all((o.asnumpy() == 1).all() for o in outs) and len(outs) == len(pairs)
        return time.perf_counter() - start

    assert 0.045 <= min(together([(0, 1), (1, 2), (2, 3), (3, 0)]) for _ in range(3)) < 0.09   # a ring's step
    assert together([(0, 1), (0, 2)]) >= 0.095                          # one sending port: one after the other


def test_the_presets_and_the_cost_model_agree():
    assert set(LINK_PRESETS) == {"pcie3", "pcie4", "nvlink", "eth1", "eth10", "eth100", "ib"}
    assert LINK_PRESETS["pcie3"] == LINKS["PCIe 3.0 x16"] and LINK_PRESETS["nvlink"] == LINKS["NVLink (V100)"]
    for name, (latency, bandwidth) in LINK_PRESETS.items():
        spec = parse_link(name)
        assert spec.seconds(1e6) == pytest.approx(latency + 1e6 / bandwidth)
        assert spec.allreduce_seconds("ring", 4, 4e6) == pytest.approx(6 * spec.seconds(1e6))


def counting(monkeypatch):
    """A list that fills with the modelled seconds of every transfer shipped over a link from now on."""
    from manual_dp.fast import link
    calls, real, real_all = [], link.delayed, link.delayed_all
    monkeypatch.setattr(link, "delayed", lambda x, seconds, *a, **kw: calls.append(seconds) or real(x, seconds, *a, **kw))
    monkeypatch.setattr(link, "delayed_all", lambda xs, seconds, ports: calls.extend(seconds) or real_all(xs, seconds, ports))
    return calls


@pytest.mark.parametrize("k,flags,hops", [(2, [], 2), (3, ["--allreduce", "ring", "--bucket-mb", "0.02"], 12)],
                         ids=["fused-reduce_bcast", "ring-buckets"])
def test_a_link_delays_every_hop_of_sync_and_changes_no_value(capsys, data_dir, tmp_path, monkeypatch, k, flags, hops):
    """Every update ships 2(k-1) messages a bucket (a ring: k senders each), the fused gradient's
    bytes 2(k-1) times in all, as the cost model counts them; the parameters are plain's, bit for
    bit, and a straggler's too (--straggler 1:2 beside the link, fused)."""
    runs = {"plain": [], "link": ["--link", "eth10"]} | ({"straggler": ["--link", "pcie3", "--straggler", "1:2"]}
                                                          if not flags else {})
    states, calls = {}, []
    for name, extra in runs.items():
        ck = tmp_path / name
        shipped = counting(monkeypatch) if name == "link" else []
        code, _, err = run_main(capsys, ["--cpus", str(k), "--data-dir", str(data_dir), "--checkpoint-dir", str(ck),
                                         *TINY, *flags, *extra])
        assert code == 0, err
        states[name], calls = checkpoint.load(ck)[0], calls + shipped
        monkeypatch.undo()
    for name in runs:
        assert all(np.array_equal(a, b) for a, b in zip(states["plain"]["params"], states[name]["params"])), name
    updates, n, spec = 96 // 32, sum(p.size * 4 for p in init_lenet_params(0)), parse_link("eth10")
    assert len(calls) % (updates * hops) == 0 and (len(calls) > updates * hops) == bool(flags)   # buckets: several
    assert sum(calls) == pytest.approx(len(calls) * spec.latency + updates * 2 * (k - 1) * n / spec.bandwidth)


@pytest.mark.parametrize("argv,message", [
    (["--link", "pcie9"], "--link pcie9: give a preset"),
    (["--link", "fast"], "--link fast: give a preset"),
    (["--link", "12"], "--link 12: give a preset"),
    (["--link", "12,10,3"], "--link 12,10,3: give a preset"),
    (["--link", "0,10"], "must be positive and finite"),
    (["--link=-5,10"], "must be positive and finite"),
    (["--link", "12,0"], "must be positive and finite"),
    (["--link", "inf,10"], "must be positive and finite"),
    (["--link", "nan,10"], "must be positive and finite"),
    (["--link", "eth10", "--allreduce", "kvstore"], "kvstore moves its data inside MXNet"),
    (["--link", "eth10", "--mode", "async"], "not --mode async"),
    (["--link", "eth10", "--compress", "fp16"], "--compress fp16 gathers its payloads"),
    (["--link", "eth10", "--deterministic"], "not --deterministic"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_links_are_one_line_and_exit_2(capsys, data_dir, argv, message):
    code, out, err = run_main(capsys, ["--cpus", "2", "--data-dir", str(data_dir), *TINY, *argv])
    assert code == 2 and len(err) == 1 and message in err[0] and "Traceback" not in err[0], err
    assert out == ""


def test_the_benchmark_prints_measured_beside_predicted(capsys):
    from manual_dp.bench.link import main
    main(["--devices", "2", "--links", "eth1", "0.5,1000", "--algorithms", "ring", "--steps", "1", "--rounds", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:4] == ["devices", "link", "algorithm", "plain"] and len(lines) == 3
    row = lines[2].split()
    assert row[0] == "2" and "ring" in row and float(row[-4]) > float(row[-5])      # predicted > plain


@pytest.mark.parametrize("name", ["all_gather", "reduce_scatter", "all_to_all", "ring_shift"])
def test_the_mesh_collectives_pay_their_hops_and_keep_their_values(name):
    from manual_dp.fast import mesh_ops
    k, n = 4, 1 << 18                                   # a 1 MB piece from each of 4 contexts
    host = [np.random.RandomState(i).randint(-9, 9, (2, n)).astype(np.float32) for i in range(k)]
    run = {"all_gather": lambda xs, w: mesh_ops.all_gather(xs, 1, wire=w),
           "reduce_scatter": lambda xs, w: mesh_ops.reduce_scatter(xs, 1, wire=w),
           "all_to_all": lambda xs, w: mesh_ops.all_to_all(xs, 1, 0, wire=w),
           "ring_shift": lambda xs, w: mesh_ops.ring_shift(xs, wire=w)}[name]
    plain = run([nd.array(h, ctx=mx.cpu(i)) for i, h in enumerate(host)], mesh_ops.DIRECT)
    xs = [nd.array(h, ctx=mx.cpu(i)) for i, h in enumerate(host)]
    nd.waitall()
    start = time.perf_counter()
    linked = run(xs, EmulatedLink(SLOW))
    nd.waitall()
    seconds = time.perf_counter() - start
    x_bytes = 2 * n * 4
    # the cost model's half of a ring (k-1 hops of total / k) over the array all of it spans; a shift: one hop
    total = {"all_gather": k * x_bytes, "reduce_scatter": x_bytes, "all_to_all": x_bytes}.get(name)
    modelled = SLOW.seconds(x_bytes) if total is None else SLOW.allreduce_seconds("ring", k, total) / 2
    assert seconds >= 0.85 * modelled, (seconds, modelled)
    assert all(np.array_equal(a.asnumpy(), b.asnumpy()) for a, b in zip(plain, linked))


@pytest.mark.parametrize("collective", ["ring", "naive"])
@pytest.mark.parametrize("name", ["reduce_scatter", "all_gather"])
def test_the_sharded_collectives_pay_their_hops_and_keep_their_values(name, collective):
    """ZeRO's halves of an all-reduce (fast/sharded.py) over a link: at least the cost model's half of
    the ring or of reduce_bcast (everything through the first context), the values DIRECT's."""
    from manual_dp.fast import sharded
    k, n = 4, 1 << 20                                   # 4 MB on each of 4 contexts
    run = (sharded.REDUCE_SCATTER if name == "reduce_scatter" else sharded.ALL_GATHER)[collective]
    host = [np.random.RandomState(i).randint(-9, 9, n).astype(np.float32) for i in range(k)]
    plain, linked = ([nd.array(h, ctx=mx.cpu(i)) for i, h in enumerate(host)] for _ in range(2))
    run(plain)
    nd.waitall()
    start = time.perf_counter()
    run(linked, wire=EmulatedLink(SLOW))
    nd.waitall()
    seconds = time.perf_counter() - start
    modelled = SLOW.allreduce_seconds("ring" if collective == "ring" else "reduce_bcast", k, 4 * n) / 2
    assert seconds >= 0.85 * modelled, (seconds, modelled)
    bounds = sharded.chunk_bounds(n, k)
    mine = [(a.asnumpy(), b.asnumpy()) for a, b in zip(plain, linked)]
    if name == "reduce_scatter":                        # in place: only chunk i of array i is defined
        mine = [(a[bounds[i]:bounds[i + 1]], b[bounds[i]:bounds[i + 1]]) for i, (a, b) in enumerate(mine)]
    assert all(np.array_equal(a, b) for a, b in mine)


@pytest.mark.parametrize("stage,passes", [("1", (2, 2)), ("3", (2.9, 3 + 1 / 3))])
def test_zero_under_a_link_ships_its_traffic_and_ends_with_plain_zeros_parameters(capsys, data_dir, tmp_path,
                                                                                  monkeypatch, stage, passes):
    """The gradient's bytes x (k-1) that cross links an update: stage 1 sync's 2 (a reduce-scatter and
    an all-gather), stage 3 about 3 (the parameters gathered in forward and again in backward, but
    the last layer's, the gradients reduce-scattered; evaluation's one gather adds a third over 3
    updates); the parameters are plain ZeRO's, bit for bit."""
    states, k = {}, 2
    for name, extra in {"plain": [], "link": ["--link", "eth10"]}.items():
        calls = counting(monkeypatch) if name == "link" else []
        code, _, err = run_main(capsys, ["--cpus", str(k), "--data-dir", str(data_dir), "--checkpoint-dir",
                                         str(tmp_path / name), *TINY, "--mode", "zero", "--zero-stage", stage, *extra])
        assert code == 0, err
        states[name] = checkpoint.load(tmp_path / name)[0]
        monkeypatch.undo()
    assert all(np.array_equal(a, b) for a, b in zip(states["plain"]["params"], states["link"]["params"]))
    updates, n, spec = 96 // 32, sum(p.size * 4 for p in init_lenet_params(0)), parse_link("eth10")
    shipped = (sum(calls) - len(calls) * spec.latency) * spec.bandwidth / (updates * (k - 1) * n)
    assert passes[0] - 1e-6 <= shipped <= passes[1] + 1e-6, shipped


def test_the_header_names_the_link_and_the_straggler(capsys, data_dir):
    code, out, err = run_main(capsys, ["--cpus", "2", "--data-dir", str(data_dir), *TINY, "--mode", "local",
                                       "--link", "eth10", "--straggler", "1:2"])
    header = [line for line in out.splitlines() + err if line.startswith("mode local:")]
    assert code == 0 and len(header) == 1, (out, err)
    assert header[0].split("; lr")[0].endswith("every transfer over an emulated 1.25 GB/s, 50 us link (eth10), "
                              "context 1 2x as slow (--straggler)")


def test_the_benchmark_prints_sync_beside_zero(capsys):
    from manual_dp.bench.link import main
    main(["--zero", "--devices", "2", "--links", "1,50000", "--steps", "1", "--rounds", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[2:] == ["sync", "linked", "zero1", "linked", "zero3", "linked"] and len(lines) == 2
    times = [float(v) for v in lines[1].split()[-6:]]
    assert all(linked > plain for plain, linked in zip(times[::2], times[1::2]))     # 50 ms a hop at least


def test_a_tensor_parallel_run_over_a_link_exits(tmp_path):
    """The link's delays recorded into tensor parallelism's backward: still queued at exit, they left
    MXNet's shutdown waiting forever (cli/run.py's settle drains them first)."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "manual_dp.train", "--model", "transformer", "--layers", "1",
                           "--d-model", "16", "--heads", "2", "--epochs", "1", "--train-size", "64", "--test-size", "32",
                           "--batch-size", "32", "--no-progress", "--cpus", "2", "--mode", "tensor",
                           "--tensor-parallel", "2", "--link", "0.05,100"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "done: test acc" in done.stdout, done.stderr
