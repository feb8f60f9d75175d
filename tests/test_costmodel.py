"""The cost model against closed forms worked out by hand for small cases."""
import math

import numpy as np
import pytest

from manual_dp import costmodel as cm

A, B, G = 1e-5, 1e-9, 5e-10  # 10 us per message, 1 GB/s link, 2 GB/s adds


@pytest.mark.parametrize("alg,k,n,expected", [
    ("ring", 1, 1000, 0.0),
    ("ring", 2, 1000, 2 * A + 1000 * B + 500 * G),            # 2(k-1) messages of n/k, (k-1)/k n added
    ("ring", 4, 1000, 6 * A + 1500 * B + 750 * G),
    ("scatter_gather", 4, 1000, 6 * A + 1500 * B + 750 * G),  # k-1 chunks in per half, as the ring
    ("tree", 2, 1000, 2 * A + 2000 * B + 1000 * G),            # 1 round up, 1 down, whole array each
    ("tree", 5, 1000, 6 * A + 6000 * B + 3000 * G),            # ceil(log2 5) = 3 rounds each way
    ("lesson", 3, 1000, 4 * A + 4000 * B + 2000 * G),          # k-1 in and k-1 out through device 0
    ("reduce_bcast", 3, 1000, 4 * A + 4000 * B + 2000 * G),
])
def test_allreduce_time_matches_closed_forms(alg, k, n, expected):
    assert cm.allreduce_time(alg, k, n, A, B, G) == pytest.approx(expected, abs=1e-15)


def test_ring_bytes_per_link_approach_twice_the_array():
    for k in (2, 8, 1024):
        _, nbytes, _ = cm.terms("ring", k, 1.0)
        assert nbytes == pytest.approx(2 * (k - 1) / k)
    with pytest.raises(ValueError, match="no cost model"):
        cm.terms("bogus", 2, 1)


@pytest.mark.parametrize("alg", ["ring", "tree", "reduce_bcast", "scatter_gather"])
def test_fit_recovers_the_parameters_that_made_the_data(alg):
    points = [(k, n, cm.allreduce_time(alg, k, n, A, B, G)) for k in (2, 3, 4, 8) for n in (4e3, 1e5, 4e6, 6.4e7)]
    a, b, g = cm.fit(points, alg)
    # bytes added are half the bytes over the link in every algorithm: only B + G/2 is identifiable
    assert (a, b, g) == pytest.approx((A, B + G / 2, 0.0), rel=1e-6)
    assert all(cm.allreduce_time(alg, k, n, a, b, g) == pytest.approx(t, rel=1e-6) for k, n, t in points)


def test_fit_never_returns_negative_costs():
    # noise that would pull an unconstrained latency below zero
    points = [(2, n, 1e-9 * n * (1.3 if n < 1e5 else 1.0)) for n in (1e3, 1e4, 1e6, 1e7)]
    assert min(cm.fit(points, "ring")) >= 0


def test_step_time_and_efficiency_closed_forms():
    w = cm.Workload("toy", 1000, 4, 0.01, 0.001, 10)  # compute: 10 ms + 1 ms per image
    comm = cm.allreduce_time("ring", 2, 1000, A, B)
    assert cm.step_time(w, 2, A, B) == pytest.approx(0.02 + comm)                   # weak: 10 images each
    assert cm.step_time(w, 2, A, B, scaling="strong") == pytest.approx(0.015 + comm)  # strong: 5 each
    assert cm.step_time(w, 2, A, B, fused=False) == pytest.approx(
        0.02 + 4 * cm.allreduce_time("ring", 2, 250, A, B))                          # 4 arrays of 250 B
    assert cm.efficiency(w, 1, A, B) == 1.0
    assert cm.efficiency(w, 2, A, B) == pytest.approx(0.02 / (0.02 + comm))
    assert cm.efficiency(w, 2, A, B, scaling="strong") == pytest.approx(0.02 / (2 * (0.015 + comm)))


def test_without_communication_strong_scaling_is_capped_by_the_fixed_cost():
    w = cm.Workload("launch-bound", 1, 1, 0.002, 0.0, 256)  # like LeNet on a GPU
    assert cm.efficiency(w, 2, 0.0, 0.0, scaling="strong") == pytest.approx(0.5)
    w = cm.Workload("compute-bound", 1, 1, 0.0, 1e-3, 256)
    assert cm.efficiency(w, 8, 0.0, 0.0, scaling="strong") == pytest.approx(1.0)


def test_table_covers_the_stated_range():
    rows = cm.table()
    assert {r["devices"] for r in rows} == {8, 64, 1024}
    assert {r["link"] for r in rows} == set(cm.LINKS)
    assert {r["workload"] for r in rows} == {"LeNet", "ResNet-50"}
    assert all(0 < r["efficiency"] <= 1 for r in rows)
    # more devices never make a ring step faster under weak scaling
    ring = sorted((r["devices"], r["step_ms"]) for r in rows
                  if r["algorithm"] == "ring" and r["workload"] == "ResNet-50" and r["link"] == "PCIe 3.0 x16")
    assert [t for _, t in ring] == sorted(t for _, t in ring)
    assert math.isclose(cm.LINKS["25 Gb/s Ethernet"][1], 3.125e9)


def test_bucketed_schedule_by_hand():
    # k=2 ring with alpha=0: an all-reduce of n bytes takes n * beta (2(k-1)/k = 1)
    s = cm.bucketed_schedule(1.0, [2.0, 3.0], [1e9, 4e9], 2, 0.0, 1e-9)
    assert s["backward"] == [(1.0, 3.0), (3.0, 6.0)]
    assert s["allreduce"] == [(3.0, 4.0), (6.0, 10.0)]   # the first hidden, the second after compute
    assert s["step_s"] == 10.0 and s["overlap"] == pytest.approx(1 / 5)
    s = cm.bucketed_schedule(1.0, [2.0, 1.0], [3e9, 1e9], 2, 0.0, 1e-9)
    assert s["allreduce"] == [(3.0, 6.0), (6.0, 7.0)]    # the second waits for the link
    assert s["overlap"] == pytest.approx(1 / 4)
    one = cm.bucketed_schedule(1.0, [3.0], [4e9], 2, 0.0, 1e-9)
    assert one["allreduce"] == [(4.0, 8.0)] and one["overlap"] == 0.0 and one["step_s"] == 8.0


def test_overlap_prediction_hides_communication_of_a_large_model():
    w = cm.WORKLOADS["ResNet-50"]
    alpha, bw = cm.LINKS["PCIe 3.0 x16"]
    flat, bucketed, hidden = cm.overlap_prediction(w, 8, alpha, 1 / bw, 25 * 2 ** 20)
    assert bucketed < flat and 0 < hidden <= 1
    assert flat == pytest.approx(cm.step_time(w, 8, alpha, 1 / bw, 0.0, "ring", True))


# The CPU contexts' form (manual_dp/costmodel_cpu.py) and its fit (manual_dp/minimax.py).
from manual_dp import costmodel_cpu as cpu                     # noqa: E402
from manual_dp.minimax import minimax                          # noqa: E402

MiB = 1 << 20
# c, alpha (issue per call), latency (run per call), s/byte within the cache and beyond it
P = np.array([20e-6, 10e-6, 4e-6, 1 / 50e9, 1 / 20e9])


@pytest.mark.parametrize("alg,k,ledger", [
    ("ring", 2, (4, 5, 2)),              # 2 steps x 2 transfers; adds 3 x n/2 twice, copies 2 x n/2 twice
    ("ring", 4, (24, 15, 4)),
    ("tree", 8, (14, 35, 8)),            # 7 adds up (3n), 7 copies down (2n)
    ("reduce_bcast", 4, (4, 5 + 6, 4)),  # add_n of 4 in one pass (4 read, 1 written), 3 copies back
    ("reduce_bcast", 8, (8, 23 + 14, 8)),  # add_n of 8: a copy (2), then 7 passes of +=(3)
    ("lesson", 3, (6, 14, 4)),           # per other replica: copy in (2n), add (3n), copy back (2n)
    ("kvstore", 2, (5, 8 + 3, 4)),
    ("scatter_gather", 4, (16, 5 + 6, 4)),
])
def test_ledger_by_hand(alg, k, ledger):
    assert cpu.LEDGER[alg](k) == ledger


def test_add_n_reads_in_one_pass_up_to_four_arrays():
    assert [cpu.add_n_moves(m) for m in (2, 3, 4, 5, 8)] == [3, 4, 5, 14, 23]


def test_time_by_hand_within_and_beyond_the_cache():
    c, alpha, latency, b_in, b_out = P
    n = 16 * MiB                           # ring on 2 contexts: 4 calls, 5n moved, 2n touched
    run = c + 4 * latency + 5 * n * b_in   # all of it in a 64 MiB cache: engine-bound
    assert cpu.allreduce_time("ring", 2, n, P, 64 * MiB) == pytest.approx(run)
    run = c + 4 * latency + 5 * n * (b_in + b_out) / 2   # a 16 MiB cache holds half of the 32 touched
    assert cpu.allreduce_time("ring", 2, n, P, 16 * MiB) == pytest.approx(run)
    assert cpu.allreduce_time("ring", 2, 4096, P, 64 * MiB) == pytest.approx(c + 4 * alpha)   # issue-bound
    assert cpu.allreduce_time("ring", 1, n, P, 64 * MiB) == 0.0
    with pytest.raises(ValueError, match="no CPU cost model"):
        cpu.allreduce_time("bogus", 2, n, P, 64 * MiB)


def test_small_payloads_cost_their_calls_and_large_ones_their_bytes():
    t = [cpu.allreduce_time("reduce_bcast", 4, n, P, 8 * MiB) for n in (4096, 65536, 4 * MiB, 16 * MiB)]
    assert t[0] == t[1] == pytest.approx(P[0] + 4 * P[1])   # the engine's bytes hide behind issuing
    assert t[3] > 3 * t[2] > 3 * t[1]                          # beyond: bytes, at memory speed past the cache
    # the bytes beyond the cache cost beta_memory: a slower memory slows only what the cache cannot hold
    slow = P * [1, 1, 1, 1, 2]
    assert cpu.allreduce_time("reduce_bcast", 4, 256 * 1024, slow, 8 * MiB) == \
        cpu.allreduce_time("reduce_bcast", 4, 256 * 1024, P, 8 * MiB)
    assert cpu.allreduce_time("reduce_bcast", 4, 16 * MiB, slow, 8 * MiB) > t[3]


@pytest.mark.parametrize("alg", sorted(cpu.LEDGER))
def test_fit_recovers_the_parameters_that_made_the_points(alg):
    cache = 8 * MiB                        # the payloads straddle it, and both bounds occur
    points = [(k, n, cpu.allreduce_time(alg, k, n, P, cache)) for k in (2, 4, 8)
              for n in (4096, 65536, MiB, 4 * MiB, 16 * MiB)]
    params = cpu.fit(points, alg, cache)
    assert cpu.worst_error(points, alg, params, cache) < 1e-6
    assert params == pytest.approx(tuple(P), rel=1e-3)


def test_fit_is_non_negative_and_no_worse_than_the_truth_on_noisy_points():
    rng = np.random.RandomState(0)
    points = [(k, n, cpu.allreduce_time("tree", k, n, P, 8 * MiB) * rng.uniform(0.8, 1.25))
              for k in (2, 4, 8) for n in (4096, 65536, MiB, 4 * MiB, 16 * MiB)]
    params = cpu.fit(points, "tree", 8 * MiB)
    assert min(params) >= 0
    assert cpu.worst_error(points, "tree", params, 8 * MiB) <= cpu.worst_error(points, "tree", P, 8 * MiB)


def test_minimax_by_hand():
    x, err = minimax([[1.0], [2.0]])        # max(|x - 1|, |2x - 1|) is least at x = 2/3
    assert x == pytest.approx([2 / 3]) and err == pytest.approx(1 / 3)
    x, err = minimax([[1.0, 1.0], [1.0, 3.0], [1.0, 5.0]])   # the line through (1, 1), (5, 1) is exact
    assert x == pytest.approx([1.0, 0.0], abs=1e-12) and err == pytest.approx(0.0, abs=1e-12)
    x, err = minimax([[1.0, -1.0], [1e6, 0.0]])      # a negative second term would help: kept at 0
    assert x[1] == 0.0 and x[0] == pytest.approx(2 / (1 + 1e6)) and err == pytest.approx(1 - 2 / (1 + 1e6))


def test_cache_size_is_the_largest_data_or_unified_cache(tmp_path):
    for i, (kind, size) in enumerate([("Data", "48K"), ("Instruction", "64M"), ("Unified", "1024K"),
                                      ("Unified", "32768K")]):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "type").write_text(kind + "\n")
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    assert cpu.cache_bytes(tmp_path) == 32 * MiB
    from manual_dp.config import CACHE_BYTES_UNKNOWN
    assert cpu.cache_bytes(tmp_path / "absent") == CACHE_BYTES_UNKNOWN
