"""`python -m manual_dp.timeline TRACE -o timeline.png`: a trace written by `--trace` drawn as a Gantt
chart, a lane per context for MXNet's operators and one for the trainer's spans (forward, backward
per bucket, each bucket's all-reduce, update), under them the cost model's predicted schedule of
the same step; and the overlap fraction, measured and predicted.

    overlap = |all-reduce time ∩ forward and backward time| / |all-reduce time|

over the union of every context's spans, step by step: the share of communication hidden under
compute. A span counts an all-reduce waiting in its context's queue behind backward as hidden;
the operators' overlap counts only the time its own operators ran while some context computed. The prediction (manual_dp.costmodel.bucketed_schedule) takes the measured forward and
backward times per bucket and prices each bucket's all-reduce on a link: the one fitted to this
trace's fastest all-reduces per bucket size, or a stated one (--link).
"""
import statistics
import sys
from pathlib import Path

from . import costmodel
from .tracefile import load
from .cli.options import OneLineParser
from .cli.output import ends_on_signals
from .errors import UsageError

# MXNet's names of the operators the all-reduce algorithms run (fast/collectives.py)
COMM_OPS = {"add_n", "elemwise_add", "_copyto", "CopyCPU2CPU", "CopyCPU2GPU", "CopyGPU2CPU", "CopyGPU2GPU",
            "ElementwiseSum", "_plus"}
BOOKKEEPING = {"DeleteVariable", "SetValueOp"}      # the engine's own, not compute
COLOURS = {"forward": "tab:blue", "backward": "tab:green", "allreduce": "tab:red", "update": "tab:purple"}


def op_spans(trace, pid):
    """(start, end, name) in microseconds of every operator on profiler process `pid`."""
    open_at, out = {}, []
    for e in trace["traceEvents"]:
        if e.get("pid") != pid:
            continue
        key = (e.get("tid"), e.get("name"))
        if e.get("ph") == "B":
            open_at.setdefault(key, []).append(e["ts"])
        elif e.get("ph") == "E" and open_at.get(key):
            out.append((open_at[key].pop(), e["ts"], e["name"]))
        elif e.get("ph") == "X":
            out.append((e["ts"], e["ts"] + e["dur"], e["name"]))
    return out


def busy_intervals(trace, pid):
    """Merged [start, end] microsecond intervals of the operators on profiler process `pid`."""
    return merge([(a, b) for a, b, _ in op_spans(trace, pid)])


def merge(spans):
    """Sorted, disjoint [start, end] intervals covering `spans`."""
    merged = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def overlap(u, v):
    """Total length of the intersection of two sorted lists of disjoint intervals."""
    i = j = total = 0
    while i < len(u) and j < len(v):
        total += max(0, min(u[i][1], v[j][1]) - max(u[i][0], v[j][0]))
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return total


def spans(trace):
    """The trainer's spans: dicts with kind, name, step, context, bucket, start, end (us)."""
    return [dict(e["args"], name=e["name"], start=e["ts"], end=e["ts"] + e["dur"])
            for e in trace["traceEvents"] if e.get("cat") == "trainer" and e.get("ph") == "X"]


def device_ops(trace):
    """{context: merged busy intervals of MXNet's operators on it}."""
    return {c: busy_intervals(trace, pid) for c, pid in device_pids(trace).items()}


def device_pids(trace):
    """{context: profiler pid} of MXNet's device lanes ("cpu/0" in MXNet's names is cpu(0))."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M" and "args" in e}
    out = {}
    for pid, name in names.items():
        kind, _, index = name.partition("/")
        if kind in ("cpu", "gpu") and index.isdigit():
            out[f"{kind}({index})"] = pid
    return out


def operator_overlap(trace):
    """Share of the communication operators' time (COMM_OPS run inside an all-reduce span of their
    context) during which some context ran a forward or backward operator: what was really
    hidden, where the spans count an all-reduce queued behind backward as hidden too."""
    spans_, comm, compute = spans(trace), [], []
    for c, pid in device_pids(trace).items():
        mine = [s for s in spans_ if s["context"] == c]
        windows = {kind: merge([(s["start"], s["end"]) for s in mine if s["kind"] in kinds])
                   for kind, kinds in (("comm", ("allreduce",)), ("compute", ("forward", "backward")))}
        for a, b, name in op_spans(trace, pid):
            if name in COMM_OPS and overlap([[a, b]], windows["comm"]):
                comm.append((a, b))
            elif name not in COMM_OPS | BOOKKEEPING and overlap([[a, b]], windows["compute"]):
                compute.append((a, b))
    comm, compute = merge(comm), merge(compute)
    total = sum(b - a for a, b in comm)
    return overlap(comm, compute) / total if total else 0.0


def measured_overlap(spans_):
    """Share of all-reduce time, summed over steps, during which some context ran forward or backward."""
    hidden = total = 0.0
    for step in sorted({s["step"] for s in spans_}):
        of = [s for s in spans_ if s["step"] == step]
        comm = merge([(s["start"], s["end"]) for s in of if s["kind"] == "allreduce"])
        compute = merge([(s["start"], s["end"]) for s in of if s["kind"] in ("forward", "backward")])
        hidden += overlap(comm, compute)
        total += sum(b - a for a, b in comm)
    return hidden / total if total else 0.0


def step_times(spans_, step, n_buckets):
    """(step start us, forward s, backward s per bucket) of one step, slowest context each time."""
    of = [s for s in spans_ if s["step"] == step]
    start = min(s["start"] for s in of)
    fwd = [s["end"] for s in of if s["kind"] == "forward"]
    forward_end = max(fwd) if fwd else start
    ready = [max((s["end"] for s in of if s["kind"] == "backward" and s["bucket"] == b), default=None)
             for b in range(n_buckets)]
    if None in ready:
        raise UsageError(f"step {step} of the trace holds no backward span of bucket {ready.index(None)}")
    ready = [max(ready[:b + 1]) for b in range(n_buckets)]
    backward = [(r - p) / 1e6 for r, p in zip(ready, [forward_end] + ready[:-1])]
    return start, (forward_end - start) / 1e6, backward


def fitted_link(spans_, meta):
    """(alpha, beta) fitted to the fastest measured all-reduce of each bucket."""
    k, fastest = len(meta["contexts"]), {}
    for s in spans_:
        if s["kind"] == "allreduce":
            b = s["bucket"]
            fastest[b] = min(fastest.get(b, float("inf")), max(s["end"] - s["start"], 1.0) / 1e6)
    points = [(k, meta["bytes"][b], t) for b, t in fastest.items()]
    alpha, beta, _ = costmodel.fit(points, meta.get("algorithm", "reduce_bcast"))
    return alpha, beta


def predicted(trace, link=None):
    """(step start us, the cost model's schedule) for the trace's first complete step."""
    meta, spans_ = trace["otherData"]["manual_dp"], spans(trace)
    alpha, beta = costmodel.LINKS[link] if link else (None, None)
    if link:
        beta = 1 / beta
    else:
        alpha, beta = fitted_link(spans_, meta)
    step = min(s["step"] for s in spans_)
    start, forward, backward = step_times(spans_, step, len(meta["bytes"]))
    schedule = costmodel.bucketed_schedule(forward, backward, meta["bytes"], len(meta["contexts"]), alpha,
                                           beta, 0.0, meta.get("algorithm", "reduce_bcast"))
    return start, dict(schedule, alpha=alpha, beta=beta, step=step)


def draw(trace, out, link=None):
    """A Gantt chart of the trace's first recorded step per context, the prediction under it, in `out`
    (a span shorter than 0.3% of the chart drawn that wide, so that it can be seen)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    start, plan = predicted(trace, link)
    of = [s for s in spans(trace) if s["step"] == plan["step"]]
    end = max(s["end"] for s in of)
    lanes = []                                  # (label, [(start ms, length ms, colour)])
    for c, busy in device_ops(trace).items():
        cut = [(max(a, start), min(b, end)) for a, b in busy if b > start and a < end]
        lanes.append((f"{c} MXNet ops", [((a - start) / 1e3, (b - a) / 1e3, "0.6") for a, b in cut]))
        for label, kinds in (("forward, backward", ("forward", "backward")), ("all-reduce, update", ("allreduce", "update"))):
            lanes.append((f"{c} {label}", [((s["start"] - start) / 1e3, (s["end"] - s["start"]) / 1e3, COLOURS[s["kind"]])
                                           for s in of if s["context"] == c and s["kind"] in kinds]))
    lanes.append(("predicted compute", [(a * 1e3, (b - a) * 1e3, COLOURS[kind]) for kind, spans_ in
                                        (("forward", [plan["forward"]]), ("backward", plan["backward"]))
                                        for a, b in spans_]))
    lanes.append(("predicted all-reduce", [(a * 1e3, (b - a) * 1e3, COLOURS["allreduce"]) for a, b in plan["allreduce"]]))
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(lanes) + 1.5))
    least = 0.003 * max((a + w for _, bars in lanes for a, w, _ in bars), default=1)   # a span drawn at least this wide
    for y, (_, bars) in enumerate(reversed(lanes)):
        ax.broken_barh([(a, max(w, least)) for a, w, _ in bars], (y - 0.4, 0.8), facecolors=[c for _, _, c in bars],
                       edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(lanes)), [label for label, _ in reversed(lanes)])
    ax.set_xlabel("ms from the step's start")
    ax.set_title(f"step {plan['step']}: overlap measured {measured_overlap(of):.0%} (operators "
                 f"{operator_overlap(trace):.0%}), predicted "
                 f"{plan['overlap']:.0%} ({link or 'link fitted to this trace'})")
    ax.legend(handles=[matplotlib.patches.Patch(color=c, label=k) for k, c in COLOURS.items()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def summary(trace, link=None):
    """Lines on the trace: contexts, buckets, overlap measured and predicted, step times."""
    meta, spans_ = trace["otherData"]["manual_dp"], spans(trace)
    _, plan = predicted(trace, link)
    steps = sorted({s["step"] for s in spans_})
    lengths = [(max(s["end"] for s in spans_ if s["step"] == t) - min(s["start"] for s in spans_ if s["step"] == t)) / 1e3
               for t in steps]
    gbps = 1e-9 / plan["beta"] if plan["beta"] else float("inf")
    where = link or f"alpha {plan['alpha'] * 1e6:.1f} us, {gbps:.2f} GB/s fitted to this trace"
    return [f"{len(steps)} step(s) on {', '.join(meta['contexts'])}, {len(meta['bytes'])} bucket(s) of "
            f"{', '.join(f'{n / 1024:.1f}' for n in meta['bytes'])} KB ({meta.get('algorithm', '?')})",
            f"step {statistics.median(lengths):.1f} ms measured (median), {plan['step_s'] * 1e3:.1f} ms predicted",
            f"overlap: {measured_overlap(spans_):.0%} of all-reduce time hidden under compute measured "
            f"({operator_overlap(trace):.0%} of the all-reduce operators' own time), "
            f"{plan['overlap']:.0%} predicted ({where})"]


def main(argv=None):
    """Draws the trace; Ctrl-C, SIGTERM or SIGHUP end it with one line and 130 or 128 + signal."""
    with ends_on_signals("manual_dp.timeline"):
        draw_trace(argv)


def draw_trace(argv):
    p = OneLineParser(prog="python -m manual_dp.timeline", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a trace written by python -m manual_dp.train --trace")
    p.add_argument("-o", "--out", default="timeline.png", help="the PNG to write")
    p.add_argument("--link", choices=sorted(costmodel.LINKS), help="predict with this stated link instead "
                                                                    "of the one fitted to the trace")
    try:
        args = p.parse_args(argv)
        if not args.out.lower().endswith(".png"):
            raise UsageError(f"-o {args.out}: the drawing is a PNG, name it NAME.png")
        trace = load(args.trace)
        if not spans(trace):
            raise UsageError(f"{args.trace}: holds no trainer spans")
        print("\n".join(summary(trace, args.link)))
        draw(trace, args.out, args.link)
    except UsageError as e:
        print(f"manual_dp.timeline: error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        print(f"manual_dp.timeline: error: {args.out}: {e.strerror}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
