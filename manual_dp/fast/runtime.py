"""Thread and engine settings the program chooses, put in the environment before MXNet loads.

MXNet, its OpenMP runtime and its OpenBLAS read these once, when the library loads, so the command
line entries (`python -m manual_dp.train`, `python -m manual_dp.bench`) call `configure` first.
A value already in the environment always wins.

    OMP_NUM_THREADS       cores / CPU contexts: contexts run side by side, each op uses its share
                          (MXNet alone would take half the cores, assuming hyper-threading)
    OPENBLAS_NUM_THREADS  the same for the dense layers' GEMMs
    OPENBLAS_CORETYPE     the bundled OpenBLAS does not know recent CPUs and falls back to a generic
                          kernel; name the AVX-512 or AVX2 kernels when the CPU has them
    MXNET_CPU_TEMP_COPY   all cpu(i) contexts draw scratch space round-robin from this many shared
                          buffers (default 4); two ops holding the same buffer wait for each other,
                          which serialises the contexts' convolutions. A cached graph keeps the
                          buffers it drew once, while every imperative scalar op, add_n or sum
                          draws the next one: with 64 buffers an update on cpu(0) lands on one that
                          cpu(1)'s graph holds about once a pass, and cpu(1) idles ~20 ms. 1024
                          makes that rare; a buffer takes memory only once an op uses it (+30 MB).
"""
import glob
import importlib.metadata
import os


def cpuinfo(field):
    """The first value of `field` in /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags():
    """The CPU's feature flags (empty where /proc/cpuinfo has none)."""
    return set(cpuinfo("flags").split())


def machine():
    """What a measurement ran on: CPU model, its widest vector unit, usable cores."""
    flags = cpu_flags()
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return {"cpu": cpuinfo("model name") or "unknown CPU", "vector": vector, "cores": usable_cores()}


def usable_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def thread_env(cpu_contexts, cores=None, flags=None):
    """Environment for `cpu_contexts` CPU contexts (0 when training on GPUs) on `cores` cores."""
    cores = cores or usable_cores()
    flags = cpu_flags() if flags is None else flags
    per_op = max(1, cores // cpu_contexts) if cpu_contexts else cores
    env = {"OMP_NUM_THREADS": str(per_op), "OPENBLAS_NUM_THREADS": str(per_op),
           "MXNET_CPU_TEMP_COPY": "1024"}
    if "avx512f" in flags:
        env["OPENBLAS_CORETYPE"] = "SKYLAKEX"
    elif {"avx2", "fma"} <= flags:
        env["OPENBLAS_CORETYPE"] = "HASWELL"
    return env


def visible_gpus():
    """How many GPUs MXNet will see, decided without loading it: the NVIDIA devices of this machine
    if a CUDA build of mxnet (mxnet-cu*) is installed, else none."""
    cuda = any((d.metadata["Name"] or "").lower().startswith("mxnet-cu")
               for d in importlib.metadata.distributions())
    return len(glob.glob("/dev/nvidia[0-9]*")) if cuda else 0


def configure(cpu_contexts, environ=None):
    """Fill in the settings for a run on `cpu_contexts` CPU contexts (0: on GPUs); returns those
    that were set here. Call before MXNet loads: afterwards they have no effect."""
    environ = os.environ if environ is None else environ
    chosen = {k: v for k, v in thread_env(cpu_contexts).items() if k not in environ}
    environ.update(chosen)
    return chosen
