"""Memory before training: this run's peak per context, measured on a throwaway copy of its
strategy (manual_dp.memory), and --memory-per-device, which refuses a layout whose peak exceeds
the emulated device and names the modes that would fit.

With --memory-per-device every figure, this run's and the other modes', is measured in a fresh
process of its own (manual_dp.cli.memprobe) with one scratch buffer per device, as MXNet gives a
GPU: with manual_dp's 1024 shared CPU scratch buffers the reservation on cpu(0) grows with every
step (docs/design.md), so it would say more about the step count than about the layout.
"""
import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys

from .. import checks, config, memory
from ..errors import UsageError
from ..multiprocess.world import World
from .memprobe import PARENT_ENV

PROBE_ENV = {"MXNET_CPU_TEMP_COPY": "1"}    # one scratch buffer per device, as on a GPU


def measure_run(cfg, params, ctx, build, n_processes=1):
    """memory.measure of build(cfg, params, ctx, World()) on this process's share of a batch; in a
    job of several processes from the shapes, so that MXNet's profiler never runs beside Horovod's
    or ps-lite's threads (one run of 2 Horovod processes crashed there)."""
    def make():
        with contextlib.redirect_stdout(io.StringIO()):            # build's notes are printed once, later
            return build(cfg, params, ctx, World())
    return memory.measure(make, ctx, max(1, cfg.batch_size // n_processes), [p.shape for p in params],
                          counters=n_processes == 1)


def peak(report):
    """(context, bytes) of the report's largest peak."""
    return max(((c, r["peak_bytes"]) for c, r in report.items()), key=lambda cr: cr[1])


def as_mode(cfg, mode):
    """`cfg` in `mode`, its mode-specific flags back to their defaults, resolved; None if the
    mode cannot run these settings."""
    defaults = {f.name: f.default for f in config.fields() if f.name in config.APPLIES}   # mode-specific
    try:
        return config.resolve(dataclasses.replace(cfg, mode=mode, **defaults))
    except UsageError:
        return None


def start_probe(cfg, kind, n, env=None):
    """A fresh process measuring `cfg` on n contexts of `kind`, which dies with this one (read it
    with read_probe, or read_probes)."""
    cmd = [sys.executable, "-m", "manual_dp.cli.memprobe", json.dumps(dataclasses.asdict(cfg)), kind, str(n)]
    env = dict(os.environ if env is None else env, **PROBE_ENV, **{PARENT_ENV: str(os.getpid())})
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)


def end(proc):
    """Afterwards `proc` has ended: killed if it still ran."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def read_probe(proc):
    """The report a start_probe process printed; None if it failed. Afterwards it has ended:
    killed if reading it was interrupted (Ctrl-C, SIGTERM, SIGHUP)."""
    try:
        out, _ = proc.communicate()
    finally:
        end(proc)
    return json.loads(out.strip().splitlines()[-1]) if proc.returncode == 0 else None


def read_probes(probes, kind):
    """{key: report or None} of `probes` ({key: (cfg, n)}), each measured in a fresh process,
    started together and read in turn; afterwards, or on an interruption, none of them runs."""
    procs = {}
    try:
        for key, (cfg, n) in probes.items():
            procs[key] = start_probe(cfg, kind, n)
        return {key: read_probe(proc) for key, proc in procs.items()}
    finally:
        for proc in procs.values():
            end(proc)


def probe_modes(cfg, kind, n):
    """{mode: report} for every mode that can be laid out on n contexts and run cfg's model (a
    model with running statistics: sync alone), each measured in its own fresh process (started
    together, read in turn)."""
    probes = {}
    for mode in config.MODES:
        other = as_mode(cfg, mode)
        try:
            if other:
                checks.check_model(other)
                checks.check_layout(other, n)
        except UsageError:
            other = None
        if other:
            probes[mode] = (other, n)
    return {mode: r for mode, r in read_probes(probes, kind).items() if r}


def run_report(cfg, params, ctx, build, n_processes=1):
    """This run's memory report: measured here, or with --memory-per-device in a fresh process
    (one scratch buffer per device) and checked against it (check_limit)."""
    if not (cfg.memory_per_device or cfg.trace):
        return measure_run(cfg, params, ctx, build, n_processes)
    # in a fresh process; with --trace also because MXNet takes one profiler configuration per
    # process, and the trace needs this one's
    kind, n = ctx[0].device_type, len(ctx)
    share = dataclasses.replace(cfg, batch_size=max(1, cfg.batch_size // n_processes), trace=None,
                                backend="local")
    report = read_probes({0: (share, n)}, kind)[0] or measure_run(cfg, params, ctx, build, n_processes)
    check_limit(cfg, report, kind, n)
    return report


def check_limit(cfg, report, kind, n):
    """UsageError, naming the excess and the modes that would fit, if the largest peak of
    `report` exceeds --memory-per-device."""
    limit = checks.parse_bytes(cfg.memory_per_device) if cfg.memory_per_device else None
    where, most = peak(report)
    if limit is None or most <= limit:
        return
    fits = [m for m, r in probe_modes(cfg, kind, n).items() if peak(r)[1] <= limit]
    raise UsageError(
        f"--memory-per-device {cfg.memory_per_device}: --mode {cfg.mode} needs {memory.format_bytes(most)} on "
        f"{where} (measured), {memory.format_bytes(most - limit)} more than {memory.format_bytes(limit)}; "
        + (f"modes that fit, with their default settings (measured likewise): {', '.join(fits)}" if fits else
           f"no mode fits these contexts: {shrink(cfg)}"))


def shrink(cfg):
    """What would make cfg's run smaller: more contexts, a smaller batch, and the size flags of its
    model (manual_dp.config.MODEL_APPLIES: --width for LeNet, --layers, --d-model... for the
    transformer; none for a user's block)."""
    kind = cfg.model if cfg.model in config.MODELS else "PATH.py:FUNCTION"
    sizes = [f"--{name.replace('_', '-')}" for name, models in config.MODEL_APPLIES.items() if kind in models]
    return "use more contexts or a smaller --batch-size" + (f", or a smaller model ({', '.join(sizes)})" if sizes else "")
