"""`python -m manual_dp.plan`: every layout of N devices (data, ZeRO 1/2/3, tensor, pipelines on each
schedule, and their products with data parallelism), with predicted memory per device and step
time, those that fit marked, one recommended; --verify runs the top ones on CPU contexts.

    python -m manual_dp.plan --devices 4 --memory-per-device 300MiB --width 16 [--link nvlink] [--verify]

The models behind the numbers: manual_dp/planner/predict.py (docstring); docs/design.md "The planner".
"""
import argparse
import re
import sys

from .errors import UsageError
from .fast.runtime import configure, machine

UNITS = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9,
         "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}
LINKS = ("pcie", "nvlink", "eth25", "eth100")


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_bytes(text):
    """Bytes of "300MiB", "1.5G", "4096": K, M, G (and KB, MB, GB) powers of 1000, KiB, MiB, GiB of 1024."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in UNITS:
        raise UsageError(f"--memory-per-device {text!r}: give bytes, e.g. 300MiB, 2G or 1048576")
    value = float(match.group(1)) * UNITS[match.group(2).upper()]
    if value < 1:
        raise UsageError(f"--memory-per-device must be at least 1 byte, got {text!r}")
    return int(value)


def build_parser():
    p = Parser(prog="python -m manual_dp.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, required=True, help="devices to lay LeNet out on")
    p.add_argument("--memory-per-device", required=True, help="bytes each device has, e.g. 300MiB, 2G")
    p.add_argument("--width", type=int, default=1, help="LeNet's width multiplier (default 1)")
    p.add_argument("--batch-size", type=int, default=256, help="global batch (default 256)")
    p.add_argument("--optimizer", default="momentum", help="sgd, momentum or adam (default momentum)")
    p.add_argument("--link", default="pcie", help=f"{', '.join(LINKS)} (default pcie): the link of "
                                                  "manual_dp.costmodel.LINKS the devices share")
    p.add_argument("--verify", action="store_true", help="run the top layouts on CPU contexts, a few steps each")
    p.add_argument("--plot", help="with --verify: draw predicted beside measured to this PNG")
    p.add_argument("--top", type=int, default=3, help="layouts --verify runs (default 3)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per layout under --verify (default 3)")
    return p


def parse(argv):
    """The checked arguments, memory_per_device in bytes; UsageError for anything no plan can use."""
    args = build_parser().parse_args(argv)
    for flag in ("devices", "width", "batch_size", "top", "steps"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.link not in LINKS:
        raise UsageError(f"--link {args.link}: choose from {', '.join(LINKS)}")
    if args.optimizer not in ("sgd", "momentum", "adam"):
        raise UsageError(f"--optimizer {args.optimizer}: choose from sgd, momentum, adam")
    if args.batch_size < args.devices:
        raise UsageError(f"--batch-size {args.batch_size} is smaller than the {args.devices} devices")
    if args.plot and not args.verify:
        raise UsageError("--plot draws what --verify measured: add --verify")
    args.memory_per_device = parse_bytes(args.memory_per_device)
    return args


def main(argv=None):
    try:
        args = parse(argv)
    except UsageError as e:
        print(f"manual_dp.plan: error: {e}", file=sys.stderr)
        sys.exit(2)
    configure(args.devices)                     # thread settings before MXNet loads
    from .planner.report import run
    print(run(args, machine()))


if __name__ == "__main__":
    main()
