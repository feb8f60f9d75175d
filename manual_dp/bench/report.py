"""What the benchmark's records say: scaling efficiency, the ratios the targets name, the tables,
the cost model fitted to the measured all-reduce, and results.json with its plots."""
import json
import statistics
from collections import defaultdict
from pathlib import Path

from .. import costmodel, costmodel_cpu
from ..flops import flops_per_image
from .plots import FAST, allreduce_plots, label, model_plot, scaling_plot


def ok(records, bench):
    return [r for r in records if r["bench"] == bench and "error" not in r]


def add_efficiency(records):
    """scaling_efficiency = T1 / (k Tk) = images/s on k / (k * images/s on 1), per implementation;
    gflops = the arithmetic LeNet's training needs (manual_dp.flops) done per second, and
    peak_share = gflops / the GEMM peak measured in the same run."""
    one = {label(r): r["images_per_sec"] for r in ok(records, "train") if r["devices"] == 1}
    peak = max([r["gflops"] for r in ok(records, "peak")] or [0])
    per_image = flops_per_image()[1]
    for r in ok(records, "train") + ok(records, "pair"):
        if label(r) in one and r["bench"] == "train":
            r["scaling_efficiency"] = r["images_per_sec"] / (r["devices"] * one[label(r)])
        r["gflops"] = r["images_per_sec"] * per_image / 1e9
        if peak:
            r["peak_share"] = r["gflops"] / peak


PEER_TARGET = 1.1          # issue 14: the fast step at least 1.1x PyTorch, in one process and DDP


def ratio(name, devices, value, target, higher_is_better=True, **extra):
    met = value >= target if higher_is_better else value <= target
    return dict({"bench": "summary", "impl": name, "devices": devices, "ratio": value,
                 "target": target, "higher_is_better": higher_is_better, "met": bool(met)}, **extra)


def in_adjacent_pairs(pairs, peer):
    """(the groups of `pairs` that measured both the fast step and `peer`, in order; the fast step's
    images/s over the peer's in each)."""
    groups = [p for _, p in sorted(pairs.items()) if {"manual_dp", peer} <= set(p)]
    return groups, [p["manual_dp"]["images_per_sec"] / p[peer]["images_per_sec"] for p in groups]


def targets(records):
    """Summary records: the ratios the issue asks for, measured in this run."""
    out, train = [], ok(records, "train")
    at2 = [r for r in train if r["devices"] == 2]
    manual = max((r for r in at2 if r["impl"] == "manual_dp"), key=lambda r: r["images_per_sec"], default=None)
    lesson = next((r for r in at2 if r["impl"] == "lesson" and r["env"] == "default"), None)
    torch = max((r for r in train if r["impl"].startswith("torch")), key=lambda r: r["images_per_sec"], default=None)
    if manual and lesson:
        out.append(ratio(f"{label(manual)} / lesson (img/s)", 2, manual["images_per_sec"] / lesson["images_per_sec"], 2.0,
                         loss_difference=abs(manual["final_loss"] - lesson["final_loss"])))
    fast = next((r for r in at2 if r["impl"] == "manual_dp" and r.get("options") == FAST), None)
    deterministic = next((r for r in at2 if r.get("options", {}).get("deterministic")), None)
    if fast and deterministic:     # issue 12: the same bits on any count, at most 15% slower
        out.append(ratio("deterministic / fast step (img/s)", 2,
                         deterministic["images_per_sec"] / fast["images_per_sec"], 0.85))
    pairs = defaultdict(dict)
    for r in ok(records, "pair"):
        pairs[r["pair"]][r["impl"]] = r
    both, in_pairs = in_adjacent_pairs(pairs, "torch")
    if in_pairs:
        out.append(ratio(f"{label(both[0]['manual_dp'])} / torch on 1 (img/s), median of {len(in_pairs)} adjacent pairs",
                         2, statistics.median(in_pairs), PEER_TARGET, pair_ratios=in_pairs,
                         loss_difference=abs(both[0]["manual_dp"]["final_loss"] - both[0]["torch"]["final_loss"])))
    if manual and torch and not in_pairs:  # adjacent pairs, where measured, decide this target
        out.append(ratio(f"{label(manual)} / {label(torch)} on {torch['devices']} (img/s)", 2,
                         manual["images_per_sec"] / torch["images_per_sec"], PEER_TARGET,
                         loss_difference=abs(manual["final_loss"] - torch["final_loss"])))
    with_ddp, ddp_ratios = in_adjacent_pairs(pairs, "torch-ddp")
    if ddp_ratios:                # the same 2 workers' worth of cores: 2 contexts against 2 processes
        out.append(ratio(f"{label(with_ddp[0]['manual_dp'])} / torch DDP, 2 contexts / 2 processes (img/s), "
                         f"median of {len(ddp_ratios)} adjacent pairs", 2, statistics.median(ddp_ratios),
                         PEER_TARGET, pair_ratios=ddp_ratios))
    ddp = next((r for r in at2 if r["impl"] == "torch-ddp"), None)
    if fast and ddp and not ddp_ratios:
        out.append(ratio(f"{label(fast)} / torch DDP, 2 contexts / 2 processes (img/s)", 2,
                         fast["images_per_sec"] / ddp["images_per_sec"], PEER_TARGET))
    lenet = defaultdict(dict)
    for r in ok(records, "allreduce_lenet"):
        lenet[r["devices"]][(r["impl"], r["fused"])] = r["us"]
    for k, us in sorted(lenet.items()):
        ours = min((t, impl, f) for (impl, f), t in us.items() if impl != "kvstore")
        kv = min(t for (impl, _), t in us.items() if impl == "kvstore")
        out.append(ratio(f"kvstore us / fastest ({ours[1]}{' fused' if ours[2] else ''}) us, LeNet grads", k,
                         kv / ours[0], 1.0))
        per_array = [(t, impl) for (impl, f), t in us.items() if impl != "kvstore" and not f]
        if per_array and ("kvstore", False) in us:    # the lesson's call path: one call per gradient
            t, impl = min(per_array)
            out.append(ratio(f"kvstore us / fastest one call per gradient ({impl}) us, LeNet grads", k,
                             us[("kvstore", False)] / t, 1.0))
    copy = {r["bytes"]: r["gbps"] for r in ok(records, "memcpy")}
    best = {}
    for r in ok(records, "allreduce"):
        if r["bytes"] >= 4 * 2 ** 20 and r["devices"] > 1 and r["bytes"] in copy:
            key = (r["devices"], r["bytes"])
            if key not in best or r["busbw_gbps"] > best[key]["busbw_gbps"]:
                best[key] = r
    floor = {(r["devices"], r["bytes"]): r["busbw_gbps"] for r in ok(records, "memfloor")}
    for (k, nbytes), r in sorted(best.items()):
        extra = {"floor": copy[nbytes] / floor[k, nbytes]} if (k, nbytes) in floor else {}
        out.append(ratio(f"copy GB/s / {r['impl']} bus GB/s at {nbytes // 2 ** 20} MB", k,
                         copy[nbytes] / r["busbw_gbps"], 3.0, higher_is_better=False, **extra))
    return out


def report(records):
    """Adds efficiencies, prints the tables, returns the summary records."""
    add_efficiency(records)
    peak = max([r["gflops"] for r in ok(records, "peak")] or [0])
    print(f"\ntraining (median images/s, first pass dropped; {flops_per_image()[1] / 1e6:.2f} MFLOP an image; "
          f"peak: GEMM at {peak:.0f} GFLOP/s)")
    print(f"  {'implementation':42} {'dev':>3} {'img/s':>7} {'s/epoch':>8} {'eff':>5} {'cpu ms/img':>10} "
          f"{'GFLOP/s':>8} {'% peak':>6} {'loss':>7}")
    for r in sorted(ok(records, "train"), key=lambda r: (r["devices"], -r["images_per_sec"])):
        eff, share = r.get("scaling_efficiency"), r.get("peak_share")
        print(f"  {label(r):42} {r['devices']:>3} {r['images_per_sec']:>7.0f} {r['sec_per_epoch']:>8.1f} "
              f"{'' if eff is None else f'{eff:.2f}':>5} {r['cpu_ms_per_image']:>10.3f} {r['gflops']:>8.1f} "
              f"{'' if share is None else f'{share:.0%}':>6} {r['final_loss']:>7.4f}")
    lenet = ok(records, "allreduce_lenet")
    if lenet:
        print("\nall-reduce of LeNet's 8 gradients (516 KB), microseconds: per array / fused")
        for k in sorted({r["devices"] for r in lenet}):
            cells = {(r["impl"], r["fused"]): r["us"] for r in lenet if r["devices"] == k}
            row = "  ".join(f"{impl} {cells[(impl, False)]:.0f}/{cells[(impl, True)]:.0f}"
                            for impl in sorted({i for i, _ in cells}))
            print(f"  {k} contexts: {row}")
    summary = targets(records) + model_targets(records)
    print("\ntargets")
    for s in summary:
        floor = f"; memory floor {s['floor']:.2f}" if "floor" in s else ""
        print(f"  {s['impl']}, {s['devices']} dev: {s['ratio']:.2f} (target "
              f"{'>=' if s['higher_is_better'] else '<='} {s['target']}{floor}) {'met' if s['met'] else 'NOT met'}")
    errors = [r for r in records if "error" in r]
    for r in errors:
        print(f"  failed: {r['bench']} {r['impl']} {r['devices']}: {r['error']}")
    return summary


def write(records, out):
    out = Path(out)
    (out / "results.json").write_text(json.dumps(records, indent=1))
    paths = [out / "results.json"]
    if ok(records, "allreduce"):
        paths += allreduce_plots(records, out)
    if ok(records, "train"):
        paths.append(scaling_plot(records, out))
    print("\nwrote " + ", ".join(str(p) for p in paths))


COST_TARGET = 0.25          # issue 26: the cost model's worst relative error per algorithm


def fitted_cache(records):
    """The last-level cache bytes of the machine that measured `records` (its meta record), else this one's."""
    return next((r["cache_bytes"] for r in records if r["bench"] == "meta" and "cache_bytes" in r), None) \
        or costmodel_cpu.cache_bytes()


def fits(records):
    """{algorithm: (params as costmodel_cpu.PARAMETERS, points, worst relative error)}:
    costmodel_cpu fitted to the measured all-reduce of each algorithm over 2 or more contexts."""
    points, cache = defaultdict(list), fitted_cache(records)
    for r in ok(records, "allreduce"):
        if r["devices"] > 1:
            points[r["impl"]].append((r["devices"], r["bytes"], r["us"] * 1e-6))
    result = {}
    for alg, pts in sorted(points.items()):
        params = costmodel_cpu.fit(pts, alg, cache)
        result[alg] = (params, len(pts), costmodel_cpu.worst_error(pts, alg, params, cache))
    return result


def model_targets(records):
    """Summary records: each algorithm's worst relative error under the fitted CPU form."""
    return [ratio(f"cost model's worst relative error, {alg} ({n} points, {len(costmodel_cpu.PARAMETERS)} "
                  f"parameters)", max(r["devices"] for r in ok(records, "allreduce")), err, COST_TARGET,
                  higher_is_better=False) for alg, (_, n, err) in fits(records).items()]


def model_section(out, records=None):
    """The cost model as text: the CPU form fitted to this machine's all-reduce, then the link form
    on the stated links."""
    out = Path(out)
    path = out / "results.json"
    if records is None:
        records = json.loads(path.read_text()) if path.is_file() else []
    fitted = fits(records)
    if fitted:
        cache = fitted_cache(records)
        lines = ["cost model of CPU contexts (manual_dp/costmodel_cpu.py): time = c + max(alpha * calls, latency * "
                 "calls + bytes moved",
                 f"  * (beta_cache * s + beta_memory * (1 - s))), s = min(1, {cache / 2 ** 20:.0f} MiB last-level "
                 "cache / bytes touched);",
                 f"  {len(costmodel_cpu.PARAMETERS)} parameters per algorithm fitted to this run's all-reduce "
                 "figures, minimising the worst relative error:",
                 f"  {'algorithm':14} {'c us':>6} {'alpha us':>8} {'latency us':>10} {'cache GB/s':>10} "
                 f"{'memory GB/s':>11} {'points':>6} {'worst error':>11}"]
        for alg, ((c, a, lat, bc, bm), n, err) in fitted.items():
            lines.append(f"  {alg:14} {c * 1e6:6.1f} {a * 1e6:8.1f} {lat * 1e6:10.1f} {gbps(bc):>10} {gbps(bm):>11} "
                         f"{n:>6} {err:>10.0%}{'' if err <= COST_TARGET else '  (over 25%)'}")
        faulting = [r for r in ok(records, "allreduce") if r.get("page_faults", 0) >= 1]
        if faulting:    # fresh memory every call (measure.fresh_pages): part of the algorithm's bytes moved
            lines.append("  pages mapped fresh per call (new arrays of 1 MiB or more; measure.fresh_pages): "
                         + ", ".join(f"{r['impl']} {r['devices']} x {r['bytes'] >> 10} KB {r['page_faults']:.0f}"
                                     for r in faulting))
    else:
        lines = [f"(no all-reduce figures in {path}: run `python -m manual_dp.bench` first to fit them)"]
    rows = costmodel.table()
    lines += ["", "link model (manual_dp/costmodel.py): time = alpha * messages + beta * bytes on the busiest link,",
              "predicted on stated links (weak scaling, fused gradients):", costmodel.format_table(rows)]
    out.mkdir(parents=True, exist_ok=True)
    lines.append(f"\nwrote {model_plot(rows, out)}")
    return "\n".join(lines)


def gbps(seconds_per_byte):
    return f"{1 / seconds_per_byte / 1e9:.1f}" if seconds_per_byte else "inf"
