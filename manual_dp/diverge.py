"""`python -m manual_dp.diverge A B`: where two runs part, from their `--digests` files (from two
`--ledger` files: the first update, MoE block and token routed differently, manual_dp/ledger.py).

Walks the updates both files hold, in order, and each update's tensors in the order a step computes
them (gradients from the last layer back, then parameters and optimiser state), and names the first
tensor whose digest differs: the update, the tensor, and how large the difference is (its sum and
norm in both runs). Exit status 0: identical wherever both files have updates; 1: they part; 2: bad
input (a missing or malformed file, no update in common, runs of different tensors).

With --replay (manual_dp.replay), both runs are rebuilt in this process from the files' header
lines and that update is run again in each layout from one state: the answer names the first
layer whose output, or the gradient of whose output, differs, with the same exit codes (2 also
for files without a header, runs of different models or data, an update too far to retrain).
"""
import sys

from .cli.options import OneLineParser
from .cli.output import ends_on_signals
from .digests import DigestError, compare, read, settings_apart
from .errors import UsageError
from .ledger import LedgerError, compare as compare_ledgers, is_ledger

USAGE = "python -m manual_dp.diverge A B [--replay] [--update T]"


def main(argv=None):
    """The exit status of the docstring's; Ctrl-C, SIGTERM or SIGHUP end it with one line and 130
    or 128 + signal, a replay's worker process killed."""
    with ends_on_signals("manual_dp.diverge"):
        compare_files(argv)


def compare_files(argv):
    parser = OneLineParser(prog="python -m manual_dp.diverge", usage=USAGE, description=__doc__.split("\n")[0])
    parser.add_argument("a", help="the first run's --digests file")
    parser.add_argument("b", help="the second run's --digests file")
    parser.add_argument("--replay", action="store_true",
                        help="rerun the update where the runs part in both layouts, from A's state before it, "
                             "and name the first layer whose output or output gradient differs")
    parser.add_argument("--update", type=int, help="--replay this update (default: the first that differs, "
                                                   "else 1)")
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        sys.stderr.write(f"manual_dp.diverge: error: {e} (usage: {USAGE})\n")
        sys.exit(2)
    if args.replay or args.update is not None:
        sys.exit(replay_status(args))
    if is_ledger(args.a) or is_ledger(args.b):
        sys.exit(ledger_status(args))
    try:
        notes, heads, runs = {}, [], []
        for label, path in (("A", args.a), ("B", args.b)):
            torn = []
            head, lines = read(path, torn)
            heads.append(head)
            runs.append(lines)
            if torn:
                notes[label] = f"{label} ({path}): its last line is torn (a run killed mid-write): ignored"
        status, message = compare(*runs)
    except DigestError as e:
        sys.stderr.write(f"manual_dp.diverge: error: {e}\n")
        sys.exit(2)
    for note in notes.values():
        print(note)
    apart = settings_apart(*heads) if status else []
    print((f"the runs differ in {', '.join(apart)}; " if apart else "") + message)
    sys.exit(status)


def ledger_status(args):
    """The exit status of comparing two --ledger files (manual_dp.ledger), after its line."""
    try:
        status, message = compare_ledgers(args.a, args.b)
    except LedgerError as e:
        sys.stderr.write(f"manual_dp.diverge: error: {e}\n")
        return 2
    print(message)
    return status


def replay_status(args):
    """--replay's exit status, after its lines (manual_dp.replay; MXNet loads only in its workers)."""
    from .replay import ReplayError, replay_runs as run_replay
    try:
        if args.update is not None and args.update < 1:
            raise ReplayError(f"--update {args.update}: updates count from 1")
        status, message = run_replay(args.a, args.b, args.update, say=lambda line: print(line, flush=True))
    except (DigestError, ReplayError) as e:
        sys.stderr.write(f"manual_dp.diverge: error: {e}\n")
        return 2
    print(message)
    return status


if __name__ == "__main__":
    main()
