"""The benchmark's pictures, drawn from its records (matplotlib, no screen needed)."""
from collections import defaultdict

from ..config import FAST_STEP

# The fast step's options (manual_dp.config.FAST_STEP) in the bench's spec names.
FAST = {"allreduce": FAST_STEP["allreduce"], "fused": FAST_STEP["fuse_grads"], "graph": FAST_STEP["graph"]}


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def log_ticks(axis, values):
    """Plain labels at 1, 2, 5 x 10^n on a log axis spanning `values`, none on the minor ticks."""
    import math
    import matplotlib.ticker as mticker
    lo, hi = min(values), max(values)
    ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1) for m in (1, 2, 5)]
    axis.set_major_locator(mticker.FixedLocator([t for t in ticks if lo / 1.05 <= t <= hi * 1.05]))
    axis.set_major_formatter(mticker.FuncFormatter(lambda v, _: f"{v:,.6g}"))
    axis.set_minor_formatter(mticker.NullFormatter())


def allreduce_plots(records, out):
    """allreduce_us.png (time vs payload) and allreduce_bw.png (bus bandwidth vs the copy bound
    and the memory floor), one panel per context count."""
    plt = _plt()
    ks = sorted({r["devices"] for r in records if r["bench"] == "allreduce" and r["devices"] > 1})
    copy = sorted((r["bytes"], r["gbps"]) for r in records if r["bench"] == "memcpy")
    paths = []
    for figure, key, ylabel in (("allreduce_us.png", "us", "microseconds"),
                                ("allreduce_bw.png", "busbw_gbps", "bus bandwidth, GB/s")):
        fig, axes = plt.subplots(1, len(ks), figsize=(4.5 * len(ks), 3.6), squeeze=False)
        for ax, k in zip(axes[0], ks):
            series = defaultdict(list)
            for r in records:
                if r["bench"] == "allreduce" and r["devices"] == k:
                    series[r["impl"]].append((r["bytes"], r[key]))
            for impl, pts in sorted(series.items()):
                ax.plot(*zip(*sorted(pts)), marker="o", label=impl)
            if key == "busbw_gbps" and copy:
                ax.plot(*zip(*copy), "k--", label="copy bound (one copyto)")
                floor = sorted((r["bytes"], r["busbw_gbps"]) for r in records
                               if r["bench"] == "memfloor" and r["devices"] == k)
                if floor:
                    ax.plot(*zip(*floor), "k:", label=f"memory floor ({k} copies at once)")
            ax.set(xscale="log", yscale="log", xlabel="payload, bytes", ylabel=ylabel, title=f"{k} contexts")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / figure, dpi=110)
        plt.close(fig)
        paths.append(out / figure)
    return paths


def label(r):
    o = r.get("options", {})
    parts = [r["impl"]]
    if r["impl"] == "manual_dp":
        parts += ["deterministic"] if o.get("deterministic") else \
            [o.get("allreduce", "lesson")] + [f for f in ("fused", "graph") if o.get(f)]
        if o.get("graph") and "conv_pad" in o:
            parts.append(f"pad {o['conv_pad']}")
    if r["impl"] == "gluon" and o.get("hybrid"):
        parts.append("hybrid")
    if r.get("env") == "default":
        parts.append("default env")
    return " ".join(parts)


def scaling_plot(records, out):
    """train_scaling.png: images/s against the number of devices, one line per implementation."""
    plt = _plt()
    series = defaultdict(list)
    for r in records:
        if r["bench"] == "train":
            series[label(r)].append((r["devices"], r["images_per_sec"]))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, pts in sorted(series.items()):
        ax.plot(*zip(*sorted(pts)), marker="o", label=name)
    ax.set(xlabel="devices (contexts or processes)", ylabel="images / s", title="LeNet training throughput",
           xticks=sorted({k for pts in series.values() for k, _ in pts}))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "train_scaling.png", dpi=110)
    plt.close(fig)
    return out / "train_scaling.png"


def model_plot(rows, out):
    """costmodel.png: predicted scaling efficiency against devices, per workload and link."""
    plt = _plt()
    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        series = defaultdict(list)
        for r in rows:
            if r["workload"] == w:
                series[f"{r['link']}, {r['algorithm']}"].append((r["devices"], r["efficiency"]))
        for name, pts in sorted(series.items()):
            ax.plot(*zip(*sorted(pts)), marker=".", label=name)
        ax.set(xscale="log", ylim=(0, 1.05), xlabel="devices", ylabel="scaling efficiency",
               title=f"{w}: predicted (weak scaling)")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "costmodel.png", dpi=110)
    plt.close(fig)
    return out / "costmodel.png"
