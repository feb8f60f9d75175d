"""`python -m manual_dp.yardstick [--runs N] [--kinds K,...] [--compare A B] -- TRAIN FLAGS`: how far
rounding alone moves a run, so that a gap between two runs can be told from a bug.

Two layouts add the same numbers in other orders; a process boundary, bf16's rounding or a split
layer each change the last bits, and training amplifies them (ReLU and max-pool take other branches,
and every later step inherits the difference). The yardstick trains the run the flags describe once
as given and N times nudged by as little as floats allow (manual_dp/perturb.py: every initial weight
one ulp up or down, every input value, the rows of every batch reshuffled), and prints, per epoch,
the relative deviation of each nudged run's training loss from the run as given, and its root mean
square s per kind of nudge.

A gap g between two runs of one setting is judged against the largest s: two runs that each stand
off the exact result by rounding of size s stand apart by about sqrt(2) s, so |g| <= 3 sqrt(2) s is
"within rounding" (a normal spread's 3 sigma), and beyond it "outside": look for a bug (python -m
manual_dp.diverge, on --digests files, names where the runs part). --compare A B judges the
training losses of two --log-json files, epoch by epoch. Exit status 0: within (or nothing
compared); 1: outside in some epoch; 2: bad input.
"""
import contextlib
import dataclasses
import io
import json
import math
import sys

from .cli.options import OneLineParser, parse
from .cli.output import ends_on_signals, fail
from .errors import CheckpointError, DataError, DivergedError, OutputError, UsageError
from .jsonfile import read_json

USAGE = "python -m manual_dp.yardstick [--runs N] [--kinds weights,inputs,order] [--compare A B] -- TRAIN FLAGS"
SIGMAS = 3                      # a gap past this many standard deviations of a gap is outside rounding
MAX_LOG_BYTES = 64 << 20


def spreads(cfg, runs, kinds, train):
    """({kind: [per-epoch rms relative deviation]}, the run as given's per-epoch training losses):
    `train(cfg)` returns a run's history."""
    base = [r["train_loss"] for r in train(cfg)]
    out = {}
    for kind in kinds:
        deviations = []
        for seed in range(1, runs + 1):
            losses = [r["train_loss"] for r in train(dataclasses.replace(cfg, perturb=f"{kind}:{seed}"))]
            deviations.append([(a - b) / abs(b) for a, b in zip(losses, base)])
        out[kind] = [math.sqrt(sum(d[e] ** 2 for d in deviations) / runs) for e in range(len(base))]
    return out, base


def bound(rms):
    """The largest gap, relative, that rounding of rms size `rms` explains."""
    return SIGMAS * math.sqrt(2) * rms


def log_losses(path):
    """{epoch: train_loss} of a --log-json file; DataError in one line if it is none."""
    try:
        text = open(path, "rb").read(MAX_LOG_BYTES + 1)
        if len(text) > MAX_LOG_BYTES:
            raise ValueError(f"more than {MAX_LOG_BYTES:,} bytes")
        records = [json.loads(line) for line in text.decode().splitlines() if line.strip()]
        losses = {int(r["epoch"]): float(r["train_loss"]) for r in records}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise UsageError(f"--compare {path}: not a --log-json file ({getattr(e, 'strerror', None) or e})") from None
    if not losses or not all(math.isfinite(v) and v > 0 for v in losses.values()):
        raise UsageError(f"--compare {path}: holds no epoch with a finite, positive training loss")
    return losses


def verdicts(a, b, widest):
    """Lines judging log A's losses against B's, epoch by epoch, against `widest` (per-epoch rms);
    and whether every epoch was within."""
    lines, within = [], True
    for epoch in sorted(set(a) & set(b) & set(range(1, len(widest) + 1))):
        gap, limit = (a[epoch] - b[epoch]) / b[epoch], bound(widest[epoch - 1])
        ok = abs(gap) <= limit
        within &= ok
        lines.append(f"epoch {epoch}: A {a[epoch]:.4f}, B {b[epoch]:.4f}: gap {gap:+.3%}, "
                     f"{'within' if ok else 'OUTSIDE'} rounding's {limit:.3%}"
                     + ("" if ok or not limit else f" ({abs(gap) / limit:.1f}x it)"))
    if not lines:
        raise UsageError("--compare: the two logs and the yardstick's run have no epoch in common")
    return lines, within


def train_quietly(cfg):
    """The history of `python -m manual_dp.train` with `cfg`, its printing swallowed."""
    from .cli.run import run
    with contextlib.redirect_stdout(io.StringIO()):
        return run(cfg)


def main(argv=None):
    with ends_on_signals("manual_dp.yardstick"):
        argv = sys.argv[1:] if argv is None else list(argv)
        cut = argv.index("--") if "--" in argv else len(argv)
        try:
            if cut == len(argv) and not {"-h", "--help"} & set(argv):
                raise UsageError(f"give the run to measure after --: {USAGE}")
            sys.exit(measure(argv[:cut], argv[cut + 1:]))
        except UsageError as e:
            sys.exit(fail(e, 2, prog="manual_dp.yardstick"))
        except (DataError, CheckpointError, OutputError) as e:
            sys.exit(fail(e, 1, prog="manual_dp.yardstick"))
        except DivergedError as e:
            sys.exit(fail(f"a run diverged ({e}): the yardstick measures runs that train", 3, prog="manual_dp.yardstick"))


def measure(own, flags):
    p = OneLineParser(prog="python -m manual_dp.yardstick", usage=USAGE, description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3, help="nudged runs of each kind (default 3)")
    p.add_argument("--kinds", default="weights,order", help="the nudges (manual_dp/perturb.py), default weights,order")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two --log-json files whose gap to judge")
    args = p.parse_args(own)
    kinds = args.kinds.split(",")
    if not 1 <= args.runs <= 100 or not kinds or any(k not in ("weights", "inputs", "order") for k in kinds):
        raise UsageError(f"--runs must be 1 to 100 and --kinds weights, inputs and/or order, got {args.runs} and {args.kinds!r}")
    cfg = parse(flags)
    if cfg.perturb or cfg.checkpoint_dir or cfg.resume:
        raise UsageError("the yardstick's training flags take no --perturb, --checkpoint-dir or --resume: it runs them itself")
    logs = [log_losses(path) for path in args.compare] if args.compare else None
    from .fast.runtime import configure
    from .config import device_request
    kind, n = device_request(cfg)
    configure(n if kind == "cpu" else 0, per_op=1 if cfg.deterministic else None, model=cfg.model)
    from .cli.run import run_or_exit        # noqa: F401 -- MXNet loads here, with the settings above
    by_kind, base = spreads(cfg, args.runs, kinds, train_quietly)
    print(f"yardstick: {args.runs} run(s) nudged by each of {', '.join(kinds)}, against the run as given")
    for e, loss in enumerate(base):
        print(f"epoch {e + 1}: train loss {loss:.4f}; rms deviation " +
              ", ".join(f"{by_kind[k][e]:.3%} ({k})" for k in kinds) +
              f"; a gap within {bound(max(by_kind[k][e] for k in kinds)):.3%} is rounding")
    if not logs:
        return 0
    widest = [max(by_kind[k][e] for k in kinds) for e in range(len(base))]
    lines, within = verdicts(*logs, widest)
    print("\n".join(lines))
    return 0 if within else 1


if __name__ == "__main__":
    main()
