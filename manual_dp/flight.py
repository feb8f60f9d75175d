"""`python -m manual_dp.flight DIR`: where the ranks of a job part, from their flight records.

Every process of a multi-process job keeps its last collectives in a ring buffer and writes it to
DIR/flight-RANK.json when the job fails (or always, with --flight-record DIR; see
manual_dp/multiprocess/flight.py). This command reads every rank's record, prints each rank's last
completed and last started collective, lines the ranks up by sequence number (every rank enters the
same collectives in the same order) and names the first one where they part: a rank that never
entered it (late, or its code took another path: it skipped it), or ranks that entered another
operation, key, step or size there. Exit status 0: they agree to the end; 1: they part; 2: bad
input (no such directory, no record, a corrupt or truncated one, a rank's record missing).
"""
import argparse
import math
import sys
from pathlib import Path

from .cli.output import ends_on_signals
from .jsonfile import read_json
from .multiprocess.flight import FORMAT

MAX_BYTES = 16 << 20                  # a record holds a few hundred entries: about 100 kB
MAX_RANKS = 1 << 16                   # a job's processes at most
FIELDS = {"seq": int, "op": str, "key": str, "step": int, "site": str, "state": str}
NUMBERS = {"dumped_at": "the record's", "start": "an entry's"}   # optional times, finite numbers where present


class FlightError(Exception):
    """Bad input: the one line says which directory or file, and what is wrong with it."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise FlightError(message)


def read_record(path):
    """One rank's record, checked: FlightError if it is not one (a link to something that is no
    regular file, such as /dev/zero, included: at most MAX_BYTES are read)."""
    try:
        record = read_json(path, MAX_BYTES)
    except (OSError, ValueError) as e:
        raise FlightError(f"{path}: not a readable flight record ({type(e).__name__}: {str(e)[:80]}); "
                          f"a process killed while writing leaves none, never half of one") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise FlightError(f"{path}: not a flight record (no \"format\": \"{FORMAT}\")")
    for name in ("rank", "size"):
        if not isinstance(record.get(name), int) or isinstance(record[name], bool) or record[name] < 0:
            raise FlightError(f"{path}: its {name} is not a number")
    if not record["rank"] < record["size"] <= MAX_RANKS:
        raise FlightError(f"{path}: rank {record['rank']} of {record['size']} is not a rank of a job of at most "
                          f"{MAX_RANKS} processes")
    problem = fields_problem(record)
    if problem:
        raise FlightError(f"{path}: {problem}")
    return record


def fields_problem(record):
    """What is malformed in the record's entries and the fields the lines print, or None."""
    entries = record.get("entries")
    if not isinstance(entries, list) or not all(isinstance(e, dict) and all(
            isinstance(e.get(k), t) for k, t in FIELDS.items()) for e in entries):
        return f"its entries are malformed (each needs {', '.join(FIELDS)})"
    if not all(e.get("bytes") is None or (isinstance(e["bytes"], int) and e["bytes"] >= 0) for e in entries):
        return "an entry's bytes is not a whole number"
    for name, whose in NUMBERS.items():
        values = [record.get(name)] if name == "dumped_at" else [e.get(name) for e in entries]
        if not all(v is None or (isinstance(v, (int, float)) and math.isfinite(v)) for v in values):
            return f"{whose} {name} is not a number"
    if not all(v is None or isinstance(v, (str, int)) for v in (record.get("job"), record.get("reason"))):
        return "its job or reason is neither a name nor a number"
    return None


def read_dumps(directory):
    """({rank: record}, notes) of the newest job's flight-RANK.json files in `directory` (a job
    restarted on fewer ranks leaves the earlier job's records of the other ranks: noted, ignored);
    FlightError if none is there, one is not a record, or one of the job's ranks left none."""
    d = Path(directory)
    if not d.is_dir():
        raise FlightError(f"{d}: {'not a directory' if d.exists() else 'no such directory'}")
    files = sorted(d.glob("flight-*.json"))
    if not files:
        raise FlightError(f"{d} holds no flight record (flight-RANK.json): the job wrote none there")
    found = {}
    for path in files:
        record = read_record(path)
        if path.name != f"flight-{record['rank']}.json":
            raise FlightError(f"{path}: holds rank {record['rank']}'s record")
        found[record["rank"]] = record
    newest = max(found.values(), key=lambda r: r.get("dumped_at") or 0)
    job = (newest.get("job"), newest["size"])
    records = {r: rec for r, rec in found.items() if (rec.get("job"), rec["size"]) == job}
    notes = [f"flight-{r}.json ignored: an earlier job's ({rec.get('job')}, {rec['size']} ranks)"
             for r, rec in sorted(found.items()) if r not in records]
    missing = [r for r in range(newest["size"]) if r not in records]
    if missing or max(records) >= newest["size"]:
        names = ", ".join(f"flight-{r}.json" for r in missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise FlightError(f"{d}: {len(missing)} of job {job[0]}'s {job[1]} ranks left no record ({names}); a rank "
                          f"on another machine wrote it there: copy it here" if missing else
                          f"{d}: rank {max(records)} is beyond the job's {job[1]} ranks")
    return records, notes


def signature(entry):
    """What every rank's entry of one sequence number must share."""
    return entry["op"], entry["key"], entry["step"], entry.get("bytes")


def describe(entry):
    size = f", {entry['bytes']:,} bytes" if entry.get("bytes") is not None else ""
    return f"#{entry['seq']} {entry['op']} {entry['key']}".rstrip() + f" (step {entry['step']}{size}) from {entry['site']}"


def rank_line(rank, record):
    """A rank's last started and last completed collective, and the first it started but never
    saw completed (the engine had not delivered its result when the record was written)."""
    entries = record["entries"]
    if not entries:
        return f"rank {rank} ({record.get('reason', '?')}): no collective recorded"
    done = [e["seq"] for e in entries if e["state"] == "completed"]
    line = (f"rank {rank} ({record.get('reason', '?')}): last started {describe(entries[-1])}; last completed "
            + (f"#{done[-1]}" if done else "none"))
    open_ = next((e for e in entries if e["state"] != "completed"), None)
    if open_ is not None:
        ago = (record.get("dumped_at") or 0) - (open_.get("start") or 0)
        line += f"; not completed: {describe(open_)}, started {ago:.1f} s before the record was written"
    return line


def verdict(seq, entries, ranks):
    """The line naming how the ranks part at `seq` ({rank: {seq: entry}}) and who is late."""
    missing = [r for r in ranks if seq not in entries[r]]
    present = [r for r in ranks if r not in missing]
    if missing:
        lasts = "; ".join(f"rank {r}'s last is " + (f"#{max(entries[r])}" if entries[r] else "none") for r in missing)
        return (f"the ranks part at collective #{seq}: {names(missing)} never entered it ({lasts}), which "
                f"{names(present)} entered: {describe(entries[present[0]][seq])}; late: {names(missing)}")
    at = {r: entries[r][seq] for r in ranks}
    skipped = [r for r in ranks if any(signature(at[o]) != signature(at[r]) and seq + 1 in entries[o] and
                                       signature(entries[o][seq + 1]) == signature(at[r]) for o in ranks)]
    what = "; ".join(f"{names(rs)} entered {describe(at[rs[0]])}" for rs in groups(at).values())
    if skipped and len(skipped) < len(ranks):
        other = next(r for r in ranks if r not in skipped)
        return (f"the ranks part at collective #{seq}: {what}; {names(skipped)} never entered rank {other}'s "
                f"#{seq} (its #{seq} is rank {other}'s #{seq + 1}: skipped, or its code took another path); "
                f"late: {names(skipped)}")
    odd = sorted(groups(at).values(), key=len)
    late = f"late: {names(odd[0])}" if len(odd[0]) < len(odd[1]) else "which rank is late the records cannot tell"
    return f"the ranks part at collective #{seq}: {what}; {late}"


def groups(at):
    """{signature: [ranks]} of the entries `at` ({rank: entry})."""
    found = {}
    for r, e in sorted(at.items()):
        found.setdefault(signature(e), []).append(r)
    return found


def names(ranks):
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def compare(records):
    """(status, lines): a line per rank, then where they part (1) or that they agree (0)."""
    ranks = sorted(records)
    lines = [rank_line(r, records[r]) for r in ranks]
    entries = {r: {e["seq"]: e for e in records[r]["entries"]} for r in ranks}
    starts = [min(entries[r]) for r in ranks if entries[r]]
    first, last = max(starts, default=1), max((max(entries[r]) for r in ranks if entries[r]), default=0)
    for seq in sorted(s for s in set().union(*entries.values()) if s >= first):   # numbers no rank holds: skipped
        if any(seq not in entries[r] for r in ranks) or len(groups({r: entries[r][seq] for r in ranks})) > 1:
            return 1, lines + [verdict(seq, entries, ranks)]
    older = f" (older ones left the ring buffer before #{first})" if first > 1 else ""
    return 0, lines + [f"the ranks agree: {len(ranks)} rank(s) entered the same collectives #{first} to #{last}{older}"]


def main(argv=None):
    parser = Parser(prog="python -m manual_dp.flight", description=__doc__.split("\n")[0])
    parser.add_argument("dir", help="the directory of the flight records (--flight-record DIR, or the one "
                                    "a failed job's error line names)")
    try:
        with ends_on_signals("manual_dp.flight"):
            records, notes = read_dumps(parser.parse_args(argv).dir)
            status, lines = compare(records)
    except FlightError as e:
        sys.stderr.write(f"manual_dp.flight: error: {e}\n")
        sys.exit(2)
    print("\n".join(notes + lines))
    sys.exit(status)


if __name__ == "__main__":
    main()
