"""The planner's table: every layout of the model with its predictions, those that fit marked, one
recommended, and the layouts the model cannot run named in one line; under --verify the top ones
measured on CPU contexts beside their predictions."""
from ..config import MODEL_APPLIES, MODELS, RunConfig
from .layouts import enumerate_layouts, left_out, name, train_flags
from .predict import Setting, gpu, memory, net_of, step_time

MiB = 2 ** 20
NAME_WIDTH = 44          # the layout column's width; wider if a layout's name is longer


def plan(devices, budget, setting, device):
    """Rows {"layout", "memory", "time", "fits"} of every layout, ranked: those that fit first,
    then by predicted step time, then by memory (ties keep enumeration order)."""
    rows = [{"layout": l, "memory": memory(l, setting), "time": step_time(l, setting, device)}
            for l in enumerate_layouts(devices, setting.batch, setting.width, setting.model)]
    for r in rows:
        r["fits"] = r["memory"]["total"] <= budget
    return sorted(rows, key=lambda r: (not r["fits"], r["time"]["total"], r["memory"]["total"]))


def recommend(rows, budget, setting):
    """One line: the recommended layout and the command that trains it, or why none fits."""
    if not rows[0]["fits"]:
        least = min(rows, key=lambda r: r["memory"]["total"])
        return (f"no layout fits in {budget / MiB:.1f} MiB per device: the smallest, "
                f"{name(least['layout'])}, needs {least['memory']['total'] / MiB:.1f} MiB")
    l = rows[0]["layout"]
    flags = (f"{train_flags(l)} {model_flags(net_of(setting))} --batch-size {setting.batch} --optimizer "
             f"{setting.optimizer}{'' if setting.precision == 'fp32' else ' --precision ' + setting.precision}")
    why = refused(flags)
    return f"recommended: {name(l)}: python -m manual_dp.train {flags}" + (
        f" (predicted only: this build's manual_dp.train refuses it: {why})" if why else "")


def refused(flags):
    """Why manual_dp.train's parser refuses `flags` (one line), or None: a layout whose flags are not
    wired into this build is still ranked, and said to be predicted only."""
    from ..cli.options import parse
    from ..errors import UsageError
    try:
        parse(flags.split())
    except UsageError as e:
        return str(e)
    return None


def model_flags(net):
    """The train flags that build `net`: its sizes (--width for LeNet), after --model unless it is
    the default model."""
    kind = net.name if net.name in MODELS else "PATH.py:FUNCTION"
    sizes = [f"--{key.replace('_', '-')} {net.config[key]}" for key, models in MODEL_APPLIES.items()
             if kind in models and key in net.config]
    return " ".join(([] if net.name == RunConfig.model else [f"--model {net.name}"]) + sizes)


def describe(net):
    """The model in a few words: its name, sizes, parameters and layers."""
    sizes = ", ".join(f"{k} {v}" for k, v in net.config.items() if k != "source")
    return f"{net.name}{f' ({sizes})' if sizes else ''}: {net.summary()}"


def name_width(layouts):
    """The layout column's width: NAME_WIDTH, or the longest name of `layouts`."""
    return max([NAME_WIDTH] + [len(name(l)) for l in layouts])


def format_table(rows):
    """The rows as text: MiB per device (state + activations), ms per step (compute, bubble, comm)."""
    w = name_width(r["layout"] for r in rows)
    lines = [f"{'#':>2} {'layout':{w}} {'state':>8} {'activ.':>8} {'MiB/dev':>8} {'fits':>4} "
             f"{'compute':>8} {'bubble':>8} {'comm':>8} {'step ms':>8}"]
    for i, r in enumerate(rows, 1):
        m, t = r["memory"], r["time"]
        lines.append(f"{i:>2} {name(r['layout']):{w}} {m['state'] / MiB:8.2f} {m['activations'] / MiB:8.2f} "
                     f"{m['total'] / MiB:8.2f} {'yes' if r['fits'] else 'no':>4} {t['compute'] * 1e3:8.3f} "
                     f"{t['bubble'] * 1e3:8.3f} {t['comm'] * 1e3:8.3f} {t['total'] * 1e3:8.3f}")
    return "\n".join(lines)


def verify_rows(rows, setting, top, steps):
    """The first `top` ranked layouts that have a strategy, each measured, then predicted on CPU
    contexts at the rate measured beside it: [(layout, predicted memory, predicted time, measured)]."""
    from .predict import cpu
    from .verify import BUILDERS, measure
    out = []
    for l in [r["layout"] for r in rows if r["layout"].kind in BUILDERS][:top]:
        got = measure(l, setting, steps)
        out.append((l, memory(l, setting), step_time(l, setting, cpu(got["rate"])), got))
    return out


def format_verify(checked):
    w = name_width(l for l, *_ in checked)
    lines = ["verified on CPU contexts (predicted at the rate of a one-context step on one device's share "
             "of the batch, timed beside each layout; the contexts' work taken to run one after another):",
             f"{'layout':{w}} {'pred MiB':>9} {'meas MiB':>9} {'ratio':>6} {'GFLOP/s':>8} {'pred ms':>9} "
             f"{'meas ms':>9} {'ratio':>6}"]
    for l, m, t, got in checked:
        lines.append(f"{name(l):{w}} {m['total'] / MiB:9.2f} {got['total'] / MiB:9.2f} "
                     f"{got['total'] / m['total']:6.3f} {got['rate'] / 1e9:8.1f} {t['total'] * 1e3:9.2f} "
                     f"{got['seconds'] * 1e3:9.2f} {got['seconds'] / t['total']:6.2f}")
    return "\n".join(lines)


def run(args, machine, net):
    """The planner's whole output for parsed arguments and the model they name."""
    setting = Setting(args.width, args.batch_size, args.optimizer, net, args.precision)
    device = gpu(args.link)
    rows = plan(args.devices, args.memory_per_device, setting, device)
    skipped = left_out(args.devices, args.batch_size, model=net)
    out = [f"{describe(net)}; batch {args.batch_size}, {args.optimizer}, {args.precision}, {args.devices} devices of "
           f"{args.memory_per_device / MiB:.1f} MiB; {device.name}",
           format_table(rows)] + ([skipped] if skipped else []) + [recommend(rows, args.memory_per_device, setting)]
    if args.verify:
        checked = verify_rows(rows, setting, args.top, args.steps)
        out += [f"machine: {machine['cpu']}, {machine['cores']} cores", format_verify(checked)]
        if args.plot:
            plot_verify(checked, f"{out[0]}; verified on {machine['cpu']}, {machine['cores']} cores "
                                 f"(shared machine)", args.plot)
    return "\n".join(out)


def plot_verify(checked, title, out):
    """A PNG at `out`: per verified layout, predicted beside measured MiB (left) and ms (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [name(l) for l, *_ in checked]
    x = range(len(names))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    panels = [("MiB on the busiest device", lambda m, t, g: (m["total"] / MiB, g["total"] / MiB)),
              ("ms per step", lambda m, t, g: (t["total"] * 1e3, g["seconds"] * 1e3))]
    for ax, (label, values) in zip(axes, panels):
        pairs = [values(m, t, g) for _, m, t, g in checked]
        ax.bar([i - 0.2 for i in x], [p for p, _ in pairs], 0.4, label="predicted")
        ax.bar([i + 0.2 for i in x], [g for _, g in pairs], 0.4, label="measured")
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=15, fontsize=7)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
