"""One benchmark measurement in a fresh process (`python -m manual_dp.bench.worker SPEC_JSON`).

The thread settings an implementation runs under must be in the environment before MXNet or
PyTorch loads, so manual_dp.bench starts one of these per measurement with its own environment.
Prints the records as one JSON line.
"""
import json
import sys

import numpy as np


def training_data(spec):
    """spec['images'] training images: the first of Fashion-MNIST, or random ones (spec['data'])."""
    n = spec["images"]
    if spec.get("data") == "fashion":
        from ..datasets.fashion_mnist import load_fashion_mnist
        (X, y), _ = load_fashion_mnist(spec.get("data_dir"), train_size=n, test_size=1,
                                       allow_download=False)
        return np.ascontiguousarray(X), y
    rng = np.random.RandomState(0)
    return rng.rand(n, 1, 28, 28).astype(np.float32), rng.randint(0, 10, n).astype(np.int32)


def train_record(spec, times, final_loss):
    """The record of one training measurement: medians over the timed passes, warm-up dropped.

    cpu_ms_per_image is the CPU time the process spent per image, all threads: on a machine
    shared with other work it moves much less than the wall-clock figures do.
    """
    wall, cpu = (float(np.median([t[i] for t in times[1:]])) for i in (0, 1))
    ips = spec["images"] / wall
    return {"bench": "train", "impl": spec["impl"], "devices": spec["devices"], "env": spec["env"],
            "options": spec.get("options", {}), "batch": spec["batch"], "images": spec["images"],
            "images_per_sec": ips, "sec_per_epoch": 60000 / ips, "step_ms": 1e3 * wall * spec["batch"] / spec["images"],
            "cpu_ms_per_image": 1e3 * cpu / spec["images"], "pass_sec": [t[0] for t in times],
            "final_loss": final_loss}


def run(spec):
    if spec["bench"] == "allreduce":
        from .comm import run as run_comm
        return run_comm(spec)
    if spec["bench"] == "overlap":
        from .overlap import run as run_overlap
        return run_overlap(spec)
    if spec["bench"] == "buckets":
        from .overlap import run_buckets
        return run_buckets(spec)
    if spec["bench"] == "autotune":
        from ..fast import autotune
        pad = autotune.conv_pad(say=lambda line: print(line, file=sys.stderr))
        return [{"bench": "autotune", "impl": "conv_pad", "devices": 1, "conv_pad": pad,
                 "key": autotune.machine_key(), **autotune.read_cache().get(autotune.machine_key(), {})}]
    if spec["bench"] == "peak":
        from ..flops import gemm_peak
        cores = spec.get("cores", 1)         # > 1: one thread's product, times the cores
        return [{"bench": "peak", "impl": kernel if cores == 1 else f"{kernel}, one thread x {cores}",
                 "devices": 1, "gflops": g * cores}
                for kernel, g in gemm_peak(spec["n"], spec["repeats"]).items()]
    X, y = training_data(spec)
    if spec["impl"].startswith("torch"):
        from . import peer_torch
        from ..lesson import init_lenet_params
        params = [p.asnumpy() for p in init_lenet_params(spec.get("seed", 0))]
        go = peer_torch.ddp if spec["impl"] == "torch-ddp" else peer_torch.single_process
        times, final = go(params, X, y, spec)
        from .train import eval_loss
        return [train_record(spec, times, eval_loss(final, X[:1024], y[:1024]))]
    from .train import measure
    times, final_loss = measure(spec, X, y)
    return [train_record(spec, times, final_loss)]


def main(argv=None):
    spec = json.loads((argv or sys.argv[1:])[0])
    print(json.dumps(run(spec)), flush=True)


if __name__ == "__main__":
    main()
