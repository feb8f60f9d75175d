"""Settings whose best value depends on the CPU, chosen by measuring every candidate once per machine.

Today one setting: conv_pad, the multiple the cached graph pads LeNet's convolution channels to
(manual_dp.fast.graph): 1 (no padding), 8 (the AVX2 vector block) or 16 (AVX-512's). No CPU is
named anywhere: each candidate's fast step is timed here, on this machine, and the fastest wins.

The choice is cached in $MANUAL_DP_CACHE (default ~/.cache/manual_dp/autotune.json) under this
machine's key (CPU model, vector unit, cores, MXNet version): another machine measures again.
$MANUAL_DP_CONV_PAD names the value outright; --no-autotune (enabled=False) takes the plain graph.
"""
import json
import os
import time
from pathlib import Path

import mxnet as mx
import numpy as np
from mxnet import autograd, nd

from ..lesson import init_lenet_params
from .flat import FlatReplica
from .graph import ModelGraph
from .runtime import PAD_ENV, machine, pad_problem

CONV_PADS = (1, 8, 16)


def machine_key():
    """What a cached choice is valid for."""
    m = machine()
    return f"{m['cpu']} | {m['vector']} | {m['cores']} cores | mxnet {mx.__version__}"


def cache_path():
    return Path(os.environ.get("MANUAL_DP_CACHE") or "~/.cache/manual_dp/autotune.json").expanduser()


def read_cache():
    """{machine key: {setting: value, ...}}; empty if there is no readable cache."""
    try:
        cache = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def write_cache(cache):
    """Replace the cache file (atomically; a cache that cannot be written is only not kept)."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}-{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


def graph_steps(conv_pad, batch=128, model=None, timed=False):
    """A function of n that runs n forward and backward passes of `model`'s cached graph (None:
    the lesson's LeNet, with `conv_pad`) on cpu(0), over `batch` random examples of what the model
    reads (its Spec: images, or token ids and their targets), and waits for them.
    timed: every operator its own engine operation (ModelGraph's `timed`)."""
    rng = np.random.RandomState(0)
    spec = getattr(model, "spec", None)
    if spec is None or not spec.tokens:
        X = nd.array(rng.rand(batch, *(spec.shape if spec else (1, 28, 28))).astype(np.float32))
    else:
        X = nd.array(rng.randint(0, spec.vocab, (batch,) + tuple(spec.shape)).astype(np.float32))
    y = nd.array(rng.randint(0, spec.classes if spec else 10, (batch,) + (spec.targets if spec else ())).astype(np.float32))
    params = init_lenet_params(0) if model is None else model.init_params(0)
    replica, graph = FlatReplica(params, mx.cpu(0)), ModelGraph(conv_pad, model=model, timed=timed)

    def run(n):
        for _ in range(n):
            with autograd.record():
                loss = graph(X, y, replica.params)[0]
            loss.backward()
        nd.waitall()
    return run


def cpu_ms_per_image(conv_pad, batch=128, steps=4, repeats=3):
    """CPU milliseconds per image of the cached graph's forward and backward with `conv_pad`, on
    cpu(0), best of `repeats` timings of `steps` steps after a warm-up (CPU time, not wall time:
    it moves less when other work shares the machine)."""
    run, best = graph_steps(conv_pad, batch), float("inf")
    for _ in range(repeats + 1):
        start = sum(os.times()[:2])
        run(steps)
        best = min(best, (sum(os.times()[:2]) - start) * 1e3 / (steps * batch))
    return best


def conv_pad(enabled=True, measure=cpu_ms_per_image, say=print):
    """The conv_pad to use: $MANUAL_DP_CONV_PAD if set; 1 if not `enabled`; else this machine's
    cached choice, measured (and said, and cached) the first time."""
    given = os.environ.get(PAD_ENV)
    if given:
        if pad_problem(os.environ):
            raise ValueError(pad_problem(os.environ))
        return int(given)
    if not enabled:
        return 1
    key, cache = machine_key(), read_cache()
    if isinstance(cache.get(key), dict) and cache[key].get("conv_pad") in CONV_PADS:
        return cache[key]["conv_pad"]
    times = {pad: measure(pad) for pad in CONV_PADS}
    best = min(times, key=times.get)
    cache[key] = {"conv_pad": best, "cpu_ms_per_image": {str(p): round(t, 4) for p, t in times.items()},
                  "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_cache(cache)
    say(f"autotune ({key}): convolution channels padded to multiples of {best}; CPU ms per image "
        + ", ".join(f"{p}: {t:.3f}" for p, t in times.items()) + f" (cached in {cache_path()})")
    return best
