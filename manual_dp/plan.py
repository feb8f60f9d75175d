"""`python -m manual_dp.plan`: every layout of N devices as a mesh (data, ZeRO 1/2/3, tensor with and
without sequence parallelism, context parallelism with ring or Ulysses attention, pipelines on every
schedule, and their products with data parallelism; dp x pp x tp with and without sequence
parallelism; dp x cp x tp, dp x pp x cp and dp x pp x cp x tp) of any model, with predicted memory
per device and step time, those that fit marked, one recommended, those the model cannot run named;
--verify runs the top ones on CPU contexts.

    python -m manual_dp.plan --devices 4 --memory-per-device 300MiB --width 16 [--link nvlink] [--verify]
    python -m manual_dp.plan --devices 8 --memory-per-device 1GiB --model transformer --layers 4 --d-model 256

The models behind the numbers: manual_dp/planner/predict.py, sequence.py (context and sequence
parallelism, cp x tp), pipelines.py (schedules, dp x pp x tp, and with cp) (docstrings); docs/design.md
"The planner".
"""
import os
from pathlib import Path

from . import modes
from .checks import check_model, parse_bytes
from .cli.options import OneLineParser
from .cli.output import ends_on_signals, parsed_or_exit
from .config import (MODEL_APPLIES, MODELS, OPTIMIZERS, PRECISIONS, PLAN_MAX_BATCH, PLAN_MAX_DEVICES, PLAN_STEPS, PLAN_TOP,
                     TRANSFORMER, RunConfig)
from .errors import UsageError
from .fast.runtime import configure, machine

LINKS = ("pcie", "nvlink", "eth25", "eth100")


def build_parser():
    p = OneLineParser(prog="python -m manual_dp.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, required=True, help="devices to lay the model out on")
    p.add_argument("--memory-per-device", required=True, help="bytes each device has, e.g. 300MiB, 2G")
    p.add_argument("--model", default=RunConfig.model, help=f"{', '.join(MODELS)} or PATH.py:FUNCTION, as "
                                                            f"manual_dp.train takes it (default {RunConfig.model})")
    p.add_argument("--width", type=int, default=RunConfig.width,
                   help=f"{', '.join(MODEL_APPLIES['width'])}: the width multiplier (default {RunConfig.width})")
    for flag in ("layers", "d_model", "heads", "patch"):
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None,
                       help=f"transformer: as manual_dp.train takes it (default {TRANSFORMER[flag]})")
    p.add_argument("--batch-size", type=int, default=RunConfig.batch_size,
                   help=f"global batch (default {RunConfig.batch_size})")
    p.add_argument("--optimizer", default=RunConfig.optimizer,
                   help=f"{', '.join(OPTIMIZERS)} (default {RunConfig.optimizer})")
    p.add_argument("--precision", default=RunConfig.precision, choices=PRECISIONS,
                   help="fp32, bf16 or fp16 as manual_dp.train takes it: data parallelism's and pipelines' gradients "
                        "cross the links in 2 bytes (master weights, gradients and state stay float32)")
    p.add_argument("--link", default="pcie", help=f"{', '.join(LINKS)} (default pcie): the link of "
                                                  "manual_dp.costmodel.LINKS the devices share")
    p.add_argument("--verify", action="store_true", help="run the top layouts on CPU contexts, a few steps each")
    p.add_argument("--plot", help="with --verify: draw predicted beside measured to this PNG")
    p.add_argument("--top", type=int, help=f"layouts --verify runs (default {PLAN_TOP})")
    p.add_argument("--steps", type=int, help=f"timed steps per layout under --verify (default {PLAN_STEPS})")
    return p


def parse(argv):
    """The checked arguments, memory_per_device in bytes; UsageError for anything no plan can use."""
    args = build_parser().parse_args(argv)
    if (args.top is not None or args.steps is not None) and not args.verify:
        raise UsageError("--top and --steps choose what --verify runs: add --verify")
    args.top = PLAN_TOP if args.top is None else args.top          # 0 is refused below, not taken for the default
    args.steps = PLAN_STEPS if args.steps is None else args.steps
    for flag in ("devices", "width", "batch_size", "top", "steps"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag, most in (("devices", PLAN_MAX_DEVICES), ("batch_size", PLAN_MAX_BATCH)):
        if getattr(args, flag) > most:
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: the planner lays out at most {most:,}")
    if args.link not in LINKS:
        raise UsageError(f"--link {args.link}: choose from {', '.join(LINKS)}")
    if args.optimizer not in OPTIMIZERS:
        raise UsageError(f"--optimizer {args.optimizer}: choose from {', '.join(OPTIMIZERS)}")
    if args.batch_size < args.devices:
        raise UsageError(f"--batch-size {args.batch_size} is smaller than the {args.devices} devices")
    if args.plot and not args.verify:
        raise UsageError("--plot draws what --verify measured: add --verify")
    if args.plot:                     # checked now, not after --verify's measurements
        plot = Path(args.plot)
        if plot.is_dir() or not plot.parent.is_dir() or not os.access(plot.parent, os.W_OK):
            raise UsageError(f"--plot {plot}: " + ("is a directory" if plot.is_dir() else
                                                   f"cannot write in {plot.parent}"))
    args.memory_per_device = parse_bytes(args.memory_per_device)
    return model_sizes(args)


def model_sizes(args):
    """`args` with the model's sizes checked as manual_dp.train checks them (a size flag of another
    model refused) and the transformer's defaults filled in; UsageError otherwise."""
    sizes = {k: getattr(args, k) for k in ("model", "width", "layers", "d_model", "heads", "patch")}
    for flag in ("layers", "d_model", "heads"):
        if sizes[flag] is not None and sizes[flag] < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {sizes[flag]}")
    cfg = RunConfig(**sizes)
    check_model(cfg)
    cfg = modes.resolve(cfg)
    for k in sizes:
        setattr(args, k, getattr(cfg, k))
    return args


def network(args):
    """The models.Model the arguments name (MXNet loads here); UsageError for sizes it cannot take."""
    from .models import build
    try:
        return build(args.model, args.width, args.layers, args.d_model, args.heads, args.patch, RunConfig.seed)
    except ValueError as e:
        raise UsageError(f"--model {args.model}: {e}") from None


def main(argv=None):
    """Ctrl-C, SIGTERM or SIGHUP (during --verify's measurements) end the plan with one line and
    exit 130 or 128 + signal."""
    with ends_on_signals("manual_dp.plan"):
        args = parsed_or_exit(parse, argv, "manual_dp.plan")
        configure(args.devices, model=args.model)   # thread settings before MXNet loads
        net = parsed_or_exit(network, args, "manual_dp.plan")
        from .planner.report import run
        print(run(args, machine(), net))


if __name__ == "__main__":
    main()
