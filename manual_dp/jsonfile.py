"""A JSON document read from a path that may hold anything (a --trace, a flight record): a regular
file (not /dev/zero, a FIFO or a directory, through a symlink or not), at most `max_bytes` of it
read, nested no deeper than the parser goes. ValueError in a few words otherwise (OSError as the
system gives it)."""
import json
import stat
from pathlib import Path


def read_json(path, max_bytes):
    """The parsed document at `path`."""
    path = Path(path)
    if not stat.S_ISREG(path.stat().st_mode):
        raise ValueError("not a regular file")
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"more than {max_bytes:,} bytes")
    try:
        return json.loads(data.decode())
    except RecursionError:
        raise ValueError("nested deeper than the JSON parser goes") from None
