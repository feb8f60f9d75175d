"""`python -m manual_dp.bench.precision`: fp32, bf16 and fp16 side by side in one run.

Each precision trains --model with the fast sync step on `--cpus` CPU contexts from the same
parameters (manual_dp.precision: float32 master weights, products in the precision, gradients
all-reduced on 16-bit copies): bf16 natively where this CPU has AVX-512 BF16 and emulated (rounded
float32 products) always, fp16 emulated. They take turns for --rounds rounds of --steps steps on one
random batch after a warm-up round; the median images/s of each is divided by fp32's, and the bytes
each step hands the all-reduce (per context) are counted, not estimated. Prints one line per
precision and writes DIR/precision.json with the machine and commit.
"""
import json
from pathlib import Path

import numpy as np

from ..cli.output import ends_on_signals, parsed_or_exit
from ..fast.runtime import configure, machine
from .modes import network, parse_bench, take_turns


class Counted:
    """An all-reduce that counts the bytes of the arrays it is handed."""

    def __init__(self, allreduce_fn):
        self.allreduce_fn, self.bytes = allreduce_fn, 0

    def __call__(self, arrays):
        self.bytes += sum(a.size * np.dtype(a.dtype).itemsize for a in arrays)
        return self.allreduce_fn(arrays)


def variants(native):
    """[(name, precision, native)] to time: bf16 natively only where the CPU has it."""
    out = [("fp32", "fp32", False)]
    out += [("bf16 native", "bf16", True)] if native else []
    return out + [("bf16 emulated", "bf16", False), ("fp16 emulated", "fp16", False)]


def build(net, ctx, name, precision, native, loss_scale=2.0 ** 16):
    """(the fast sync step of `net` in `precision` on ctx, its byte-counting all-reduce)."""
    from ..config import FAST_STEP
    from ..fast.collectives import make_allreduce
    from ..models.precise import Precise
    from ..precision import Policy
    from ..strategies.data.data_parallel import DataParallel
    from ..strategies.wrappers.loss_scaled import LossScaled
    policy = Policy(precision, native, loss_scale=loss_scale)
    counted = Counted(make_allreduce(FAST_STEP["allreduce"]))
    model = net if precision == "fp32" else Precise(net, policy)
    step = DataParallel(net.init_params(0), ctx, "momentum", policy.reducer(counted, FAST_STEP["allreduce"]),
                        model=model, conv_pad=1)
    step = LossScaled(step, policy.scaler) if policy.scaler else step
    return step.clip(None), counted


def parse(argv):
    """The checked arguments; UsageError (one line) for values no run can use."""
    return parse_bench(argv, "python -m manual_dp.bench.precision", __doc__, "precision.json", cpus=2, least=1)


@ends_on_signals("python -m manual_dp.bench.precision")   # Ctrl-C, SIGTERM, SIGHUP: one line
def main(argv=None):
    args = parsed_or_exit(parse, argv, "python -m manual_dp.bench.precision")
    configure(args.cpus)                               # thread settings before MXNet loads
    import mxnet as mx
    from .command import commit
    from ..precision import native_bf16
    where = dict(machine(), commit=commit())
    net = parsed_or_exit(network, args, "python -m manual_dp.bench.precision")
    ctx = [mx.cpu(i) for i in range(args.cpus)]
    native = native_bf16()
    built = {name: build(net, ctx, name, p, n) for name, p, n in variants(native)}
    rates = take_turns({name: step for name, (step, _) in built.items()}, args.batch, args.steps, args.rounds)
    updates = (args.rounds + 1) * args.steps
    moved = {name: counted.bytes / updates / len(ctx) for name, (_, counted) in built.items()}
    print(f"{where['cpu']} ({where['vector']}{', AVX-512 BF16' if native else ', no native bf16'}), "
          f"{where['cores']} cores, commit {where['commit']}; {args.cpus} CPU contexts, {net.name} {net.config}, "
          f"batch {args.batch}, median of {args.rounds} rounds")
    for name, rate in rates.items():
        print(f"  {name:14} {rate:8.0f} img/s  {rate / rates['fp32']:5.2f}x fp32  "
              f"{moved[name] / 1024:8.1f} KiB all-reduced per context and step ({moved[name] / moved['fp32']:.2f}x fp32)"
              if moved["fp32"] else f"  {name:14} {rate:8.0f} img/s  {rate / rates['fp32']:5.2f}x fp32")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "precision.json").write_text(json.dumps(dict(
        where, native_bf16=native, model=net.describe(), cpus=args.cpus, batch=args.batch, images_per_sec=rates,
        allreduce_bytes_per_context_step=moved), indent=1))


if __name__ == "__main__":
    main()
