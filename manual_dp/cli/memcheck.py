"""Memory before training: this run's peak per context, measured on a throwaway copy of its
strategy (manual_dp.memory), and --memory-per-device, which refuses a layout whose peak exceeds
the emulated device and names the modes that would fit.

Every figure, this run's and the other modes', is measured in a fresh process of its own
(manual_dp.cli.memprobe) with one scratch buffer per device, as MXNet gives a GPU, and the
graph's padding chosen before (autotune's timing is no part of a step): with manual_dp's 64
shared CPU scratch buffers the reservation on cpu(0) grows with every buffer drawn, and in this
process with whatever ran before (docs/design.md), so it would say more about the steps taken
than about the layout, and differ from run to run. Only a GPU's own run, whose pool is one buffer
already and untouched by autotune (cpu(0)), and the processes of a job, which count from the
shapes, measure in this process. What a fresh process measured is kept for the settings it
depends on (read_probes), so a second run of them in one process (a notebook, the tests) starts none.
"""
import contextlib
import copy
import dataclasses
import io
import json
import os
import subprocess
import sys

from .. import checks, config, datasets, memory, modes
from ..errors import UsageError
from ..fast import autotune
from ..multiprocess.world import World

PROBE_ENV = {"MXNET_CPU_TEMP_COPY": "1"}    # one scratch buffer per device, as on a GPU
UNREAD = ("epochs", "train_size", "test_size", "data_dir", "log_json", "digests", "checkpoint_dir", "resume",
          "no_progress", "timeout", "flight_record", "memory_per_device", "check_replicas", "dry_run")
MEASURED = {}       # probe_key -> report: a cache of what fresh processes measured (read_probes)


def measure_run(cfg, params, ctx, build, n_processes=1, where="this process"):
    """memory.measure of build(cfg, params, ctx, World()) on this process's share of a batch; in a
    job of several processes from the shapes, so that MXNet's profiler never runs beside Horovod's
    or ps-lite's threads (one run of 2 Horovod processes crashed there). Each context's report
    says `where` it was measured."""
    def make():
        with contextlib.redirect_stdout(io.StringIO()):            # build's notes are printed once, later
            return build(cfg, params, ctx, World())
    report = memory.measure(make, ctx, max(1, cfg.batch_size // n_processes), [p.shape for p in params],
                            counters=n_processes == 1, spec=datasets.spec_of(cfg))
    return {c: dict(r, process=where) for c, r in report.items()}


def peak(report):
    """(context, bytes) of the report's largest peak."""
    return max(((c, r["peak_bytes"]) for c, r in report.items()), key=lambda cr: cr[1])


def as_mode(cfg, mode):
    """`cfg` in `mode`, its mode-specific flags back to their defaults, resolved; None if the
    mode cannot run these settings."""
    defaults = {f.name: f.default for f in config.fields() if f.name in modes.FLAGS}   # mode-specific
    try:
        return modes.resolve(dataclasses.replace(cfg, mode=mode, **defaults))
    except UsageError:
        return None


def start_probe(cfg, kind, n, env=None, pad=None):
    """A fresh process measuring `cfg` on n contexts of `kind` (its graph padded to `pad`, if
    given), which dies with this one (read it with read_probe, or read_probes)."""
    cmd = [sys.executable, "-m", "manual_dp.cli.memprobe", json.dumps(dataclasses.asdict(cfg)), kind, str(n),
           str(os.getpid())]
    env = dict(os.environ if env is None else env, **PROBE_ENV, **({autotune.PAD_ENV: str(pad)} if pad else {}))
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


def run_probes(probes, kind, pad=None):
    """{key: report or None} of `probes` ({key: (cfg, n)}), each measured in a fresh process,
    started together and read in turn; afterwards, or on an interruption, none of them runs."""
    procs = {}
    try:
        for key, (cfg, n) in probes.items():
            procs[key] = start_probe(cfg, kind, n, pad=pad)
        return {key: read_probe(proc) for key, proc in procs.items()}
    finally:
        for proc in procs.values():
            end(proc)


def probe_key(cfg, kind, n, pad):
    """All a fresh process's report depends on: cfg less the flags no measured step reads, the
    contexts, the padding and the variables MXNet or the padding read."""
    unread = {f.name: f.default for f in config.fields() if f.name in UNREAD}
    mxnet_env = sorted((k, v) for k, v in os.environ.items() if k.startswith("MXNET_") or k == autotune.PAD_ENV)
    return json.dumps([dataclasses.asdict(dataclasses.replace(cfg, **unread)), kind, n, pad, mxnet_env])


def read_probes(probes, kind, pad=None, measured=MEASURED):
    """run_probes' reports, each measured once per process: the same settings in a fresh process
    give the same figure, so a second run in this one (a notebook, the tests) reuses it."""
    keys = {key: probe_key(cfg, kind, n, pad) for key, (cfg, n) in probes.items()}
    todo = {keys[key]: probe for key, probe in probes.items() if keys[key] not in measured}
    measured.update((k, r) for k, r in run_probes(todo, kind, pad).items() if r)
    return {key: copy.deepcopy(measured.get(keys[key])) for key in probes}


def probe_modes(cfg, kind, n):
    """{mode: report} for every mode that can be laid out on n contexts and run cfg's model (a
    model with running statistics: the modes that carry them, checks.check_running), each measured
    in its own fresh process (started together, read in turn), LeNet's graph padded as by default."""
    probes = {}
    for mode in modes.MODES:
        other = as_mode(cfg, mode)
        try:
            if other:
                checks.check_model(other)
                checks.check_layout(other, n)
        except UsageError:
            other = None
        if other:
            probes[mode] = (other, n)
    return {mode: r for mode, r in read_probes(probes, kind, default_pad(cfg)).items() if r}


def default_pad(cfg):
    """The padding LeNet's graph takes by default on this machine, chosen before any measuring
    (autotune's own timing is no part of a step); None for another model."""
    try:
        return autotune.conv_pad() if cfg.model == "lenet" else None
    except ValueError as e:
        raise UsageError(str(e)) from None


def measured_here(cfg, ctx, n_processes):
    """True if this process measures its own run: the processes of a job (from the shapes), or a
    GPU run, whose scratch pool is one buffer a device already; never with --memory-per-device
    (compared with other modes' fresh processes) or --trace (one profiler configuration a process)."""
    if cfg.memory_per_device or cfg.trace:
        return False
    return n_processes > 1 or ctx[0].device_type != "cpu" and memory.scratch_buffers(str(ctx[0])) == 1


def run_report(cfg, params, ctx, build, n_processes=1, pad=None):
    """This run's memory report, measured with one scratch buffer per device (in a fresh process
    unless measured_here; its graph padded to `pad`), checked against --memory-per-device."""
    kind, n = ctx[0].device_type, len(ctx)
    if measured_here(cfg, ctx, n_processes):
        report = measure_run(cfg, params, ctx, build, n_processes)
    else:
        share = dataclasses.replace(cfg, batch_size=max(1, cfg.batch_size // n_processes), trace=None,
                                    backend="local")
        report = read_probes({0: (share, n)}, kind, pad)[0] or measure_run(cfg, params, ctx, build, n_processes)
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
