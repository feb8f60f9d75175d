"""Thread and engine settings the program chooses, put in the environment before MXNet loads.

MXNet, its OpenMP runtime and its OpenBLAS read these once, when the library loads. Importing
manual_dp before MXNet puts them in the environment for the default devices (on_import), so a
notebook or a library call runs as fast as the command line; the command lines then `configure`
them for the devices they were given. A value the user set always wins; manual_dp's own may be
replaced while MXNet is not loaded yet. MANUAL_DP_RUNTIME=off leaves MXNet's defaults alone.

    OMP_NUM_THREADS       cores / CPU contexts: contexts run side by side, each op uses its share
                          (MXNet alone would take half the cores, assuming hyper-threading)
    OPENBLAS_NUM_THREADS  the same for the dense layers' GEMMs
    OPENBLAS_CORETYPE     the bundled OpenBLAS does not know recent CPUs and falls back to a generic
                          kernel; name the AVX-512 or AVX2 kernels when the CPU has them
    MXNET_CPU_TEMP_COPY   all cpu(i) contexts draw scratch space round-robin from this many shared
                          buffers (default 4); two ops holding the same buffer wait for each other,
                          which serialises the contexts. A cached graph keeps the buffers it drew
                          once (each context's graph, and a new copy of its state for every step in
                          flight), while every imperative scalar op, add_n or sum draws the next
                          one: with too few, one context's graph holds a buffer the other's also
                          holds, and waits behind that context's whole queue. But a buffer, once
                          drawn, stays allocated at the size of the largest scratch an op asked of
                          it: with the graph's padded convolutions (fast.autotune) about 9 MB, so
                          1024 buffers grew a default LeNet run to 10.7 GB resident in 3 epochs.
                          So 64 for a model with convolutions (LeNet, ResNet, a user's block, which
                          may hold some: 0.9 GB) and 1024 for one without (the MLP, the
                          transformer: their scratch is small, and the transformer's graphs draw
                          about 20 buffers each; 64 cost its fast step 12% of its speed)
"""
import glob
import importlib.metadata
import os
import sys
import warnings

THREADS_MAX = 1024               # OMP_NUM_THREADS and the like at most (100000 ran for ever; 2048: 50 s on 2 cores)
SCRATCH_BUFFERS = 64             # MXNET_CPU_TEMP_COPY for a model with convolutions (or an unknown one)
SCRATCH_BUFFERS_NO_CONV = 1024   # ... for a model without: the built-in ones named here
CONVOLUTION_FREE = ("mlp", "transformer")
OURS = "MANUAL_DP_SETTINGS"      # "pid:NAME,NAME": what manual_dp put in this process's environment


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


def thread_env(cpu_contexts, cores=None, flags=None, per_op=None, model=None):
    """Environment for `cpu_contexts` CPU contexts (0 when training on GPUs) on `cores` cores;
    `per_op` threads per operator if given (--deterministic: 1, whatever the context count);
    `model` the --model to be trained (its scratch buffers), if known."""
    cores = cores or usable_cores()
    flags = cpu_flags() if flags is None else flags
    per_op = per_op or (max(1, cores // cpu_contexts) if cpu_contexts else cores)
    env = {"OMP_NUM_THREADS": str(per_op), "OPENBLAS_NUM_THREADS": str(per_op),
           "MXNET_CPU_TEMP_COPY": str(scratch_buffers(model))}
    if "avx512f" in flags:
        env["OPENBLAS_CORETYPE"] = "SKYLAKEX"
    elif {"avx2", "fma"} <= flags:
        env["OPENBLAS_CORETYPE"] = "HASWELL"
    return env


def scratch_buffers(model):
    """MXNET_CPU_TEMP_COPY for `model` (a --model value, or None): see the module's table."""
    return SCRATCH_BUFFERS_NO_CONV if model in CONVOLUTION_FREE else SCRATCH_BUFFERS


THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "MXNET_CPU_TEMP_COPY",
                    "MXNET_GPU_TEMP_COPY", "MXNET_CPU_WORKER_NTHREADS", "MXNET_CPU_PRIORITY_NTHREADS",
                    "MXNET_GPU_WORKER_NTHREADS", "MXNET_GPU_COPY_NTHREADS")   # a worker count of 0 hangs MXNet
PAD_ENV = "MANUAL_DP_CONV_PAD"       # the cached graph's padding named outright (manual_dp.fast.autotune)
PAD_MAX = 64                         # at most (AVX-512's block is 16; 100000 overflowed a shape inside MXNet)
ENGINES = ("NaiveEngine", "ThreadedEngine", "ThreadedEnginePerDevice")     # MXNet 1.9.1's MXNET_ENGINE_TYPE
BOOLEANS = ("MXNET_EXEC_BULK_EXEC_TRAIN", "MXNET_EXEC_BULK_EXEC_INFERENCE")
PS_LITE = ("DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER")


def environment_problem(environ=None):
    """What is wrong with the variables MXNet reads when it loads, or manual_dp's own (one line), or
    None: each would otherwise end the process inside MXNet, with a traceback or an abort, or run
    it for ever."""
    environ = os.environ if environ is None else environ
    return thread_problem(environ) or engine_problem(environ) or role_problem(environ) or pad_problem(environ)


def pad_problem(environ):
    """$MANUAL_DP_CONV_PAD a whole number from 1 to PAD_MAX, checked up front even where no cached
    graph reads it (--deterministic, --mode zero...)."""
    given = environ.get(PAD_ENV)
    if given and not (given.isdigit() and 1 <= int(given) <= PAD_MAX):
        return f"the environment variable {PAD_ENV}={given!r} must be a whole number from 1 to {PAD_MAX} (or unset)"
    return None


def thread_problem(environ):
    """Each thread variable a whole number from 1 to THREADS_MAX (OMP_NUM_THREADS=abc aborts)."""
    for name in THREAD_VARIABLES:
        value = environ.get(name)
        if value is not None and not (value.strip().isdigit() and 1 <= int(value) <= THREADS_MAX):
            return f"the environment variable {name}={value!r} must be a whole number from 1 to {THREADS_MAX} (or unset)"
    return None


def engine_problem(environ):
    """MXNET_ENGINE_TYPE one of MXNet's engines; its bulk-execution switches booleans."""
    engine = environ.get("MXNET_ENGINE_TYPE")
    if engine is not None and engine not in ENGINES:
        return f"the environment variable MXNET_ENGINE_TYPE={engine!r} names no engine of MXNet: {', '.join(ENGINES)}"
    for name in BOOLEANS:
        value = environ.get(name)
        if value is not None and value.strip().lower() not in ("0", "1", "true", "false"):
            return f"the environment variable {name}={value!r} must be 0, 1, true or false (or unset)"
    return None


def role_problem(environ):
    """A parameter server's role (DMLC_ROLE server or scheduler, which MXNet takes up as it loads)
    only with the rest of its job's environment, as the launcher gives it."""
    if environ.get("DMLC_ROLE") not in ("server", "scheduler"):
        return None
    missing = [name for name in PS_LITE if not environ.get(name)]
    if missing:
        return (f"the environment variable DMLC_ROLE={environ['DMLC_ROLE']!r} makes this process a parameter "
                f"server's {environ['DMLC_ROLE']}, but {', '.join(missing)} are unset: unset DMLC_ROLE, or start "
                f"the job with python -m manual_dp.launch")
    bad = [name for name in PS_LITE[1:] if not environ[name].strip().isdigit()]
    return f"the environment variable {bad[0]}={environ[bad[0]]!r} must be a whole number" if bad else None


def visible_gpus():
    """How many GPUs MXNet will see, decided without loading it: the NVIDIA devices of this machine
    if a CUDA build of mxnet (mxnet-cu*) is installed, else none."""
    devices = len(glob.glob("/dev/nvidia[0-9]*"))
    if not devices:                      # the common case here: no need to scan the installed packages
        return 0
    cuda = any((d.metadata["Name"] or "").lower().startswith("mxnet-cu")
               for d in importlib.metadata.distributions())
    return devices if cuda else 0


def configure(cpu_contexts, environ=None, per_op=None, model=None):
    """Put the settings for `cpu_contexts` CPU contexts (0: on GPUs) and `model` (thread_env) in the
    environment, except where the user set a value; returns those set here. Before MXNet loads
    only: afterwards a warning says that they no longer reach it."""
    environ = os.environ if environ is None else environ
    pid, _, names = environ.get(OURS, "").partition(":")
    ours = set(filter(None, names.split(","))) if pid == str(os.getpid()) else set()  # a child's are given
    chosen = {k: v for k, v in thread_env(cpu_contexts, per_op=per_op, model=model).items()
              if k not in environ or k in ours}
    changed = {k: v for k, v in chosen.items() if environ.get(k) != v}
    if changed and environ is os.environ and "mxnet" in sys.modules:   # too late for this process
        warnings.warn(f"MXNet is already loaded, so it keeps its thread settings; "
                      f"{', '.join(f'{k}={v}' for k, v in changed.items())} would apply only to a new "
                      f"process (import manual_dp before mxnet)", RuntimeWarning, stacklevel=2)
        return {}
    environ.update(chosen)
    environ[OURS] = f"{os.getpid()}:" + ",".join(sorted(ours | set(chosen)))
    return chosen


def user_environment(environ=None):
    """A copy of the environment without the settings manual_dp put in it in this process (configure's,
    OURS): what a child `python -m manual_dp.train` should start from to choose its own, keeping the
    variables the user set."""
    env = dict(os.environ if environ is None else environ)
    pid, _, names = env.pop(OURS, "").partition(":")
    for name in names.split(",") if pid == str(os.getpid()) else ():
        env.pop(name, None)
    return env


def on_import(cpu_contexts, environ=None):
    """What importing manual_dp does: configure for the default devices if MXNet is not loaded yet;
    if it is, warn when it runs without manual_dp's settings (a notebook that imported mxnet first
    runs at MXNet's defaults, up to half the speed on CPU contexts)."""
    environ = os.environ if environ is None else environ
    if environ.get("MANUAL_DP_RUNTIME") == "off":
        return {}
    if "mxnet" not in sys.modules:
        return configure(cpu_contexts, environ)
    missing = [k for k in thread_env(cpu_contexts) if k not in environ]
    if missing:
        warnings.warn(f"MXNet was imported before manual_dp and runs without {', '.join(missing)}: "
                      f"import manual_dp first (or set them yourself) for its speed", RuntimeWarning,
                      stacklevel=3)
    return {}
