"""A run described by a file: `--config FILE.toml` read into RunConfig's fields, and a run's resolved
settings written back as such a file (beside its --log-json, into its --checkpoint-dir), which
`--config` reads to the same settings.

The sections are RunConfig's groups (config.GROUPS: the groups of --help), the keys its field names
(underscores, or dashes as in the flags); each value is checked as its flag's would be, and a bad
file ends in one line (UsageError). No MXNet here: the file is read before MXNet loads.
"""
import difflib
import sys
import typing
from pathlib import Path

from ..config import EXCLUSIVE, GATHERED, GROUPS, fields
from ..errors import UsageError
from ..modes import MODES

CHECKPOINT_CONFIG = "config.toml"       # --checkpoint-dir DIR: DIR/config.toml
LOG_CONFIG = ".config.toml"             # --log-json PATH: PATH.config.toml
KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
HEADER = ("# The resolved settings of a run of python -m manual_dp.train. `python -m manual_dp.train\n"
          "# --config THIS_FILE` runs with them again; flags given beside it override them.")


def base_type(t):
    """int for int and Optional[int]; likewise float, str, bool."""
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if args else t


def read(path):
    """{field: value} that the TOML file at `path` sets, each value as its flag would give it;
    UsageError (one line, naming the file) for a file that cannot be read or says anything else."""
    document, values = load(path), {}
    for section, table in document.items():
        for key, value in section_items(path, section, table):
            name = field_name(path, section, key)
            if name in values:
                raise UsageError(f"--config {path}: [{section}] {key} sets {name} a second time")
            values[name] = checked(path, section, key, value)
    given = [name for name in EXCLUSIVE if name in values]
    if len(given) > 1:
        raise UsageError(f"--config {path}: [{group_of()[given[0]]}] sets {' and '.join(given)}: give one of them")
    return values


def load(path):
    """The TOML document at `path`; UsageError if it cannot be read or is not TOML."""
    try:
        import tomllib            # Python 3.11's; the rest of the command line runs on 3.8 to 3.10 too
    except ImportError:
        raise UsageError(f"--config needs Python 3.11 or newer (its tomllib), not {sys.version.split()[0]}") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise UsageError(f"--config {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError:
        raise UsageError(f"--config {path}: not a TOML file (not UTF-8 text)") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config {path}: not valid TOML: {e}") from None


def section_items(path, section, table):
    """The (key, value) pairs of `section`; UsageError for a section that is not one of GROUPS or a
    key outside every section."""
    groups, name = group_of(), section.replace("-", "_")
    if not isinstance(table, dict):
        near = difflib.get_close_matches(name, groups, n=1)
        hint = (f"put it under [{groups[name]}]" if name in groups else
                f"unknown key (did you mean {near[0]}, in [{groups[near[0]]}]?)" if near else "unknown key")
        raise UsageError(f"--config {path}: {section} is outside every section: {hint}")
    if section not in GROUPS:
        near = difflib.get_close_matches(section, GROUPS, n=1)
        hint = (f"did you mean [{near[0]}]?" if near else f"{section} is a key of [{groups[section]}]"
                if section in groups else f"the sections are {', '.join(f'[{g}]' for g in GROUPS)}")
        raise UsageError(f"--config {path}: unknown section [{section}]: {hint}")
    return table.items()


def field_name(path, section, key):
    """The RunConfig field that `key` of [section] names; UsageError for an unknown key (with the
    nearest) or a key of another section (naming it)."""
    name, groups = key.replace("-", "_"), group_of()
    if name not in groups:
        near = difflib.get_close_matches(name, groups, n=1)
        hint = (f": did you mean {near[0]}" + ("" if groups[near[0]] == section else f" (in [{groups[near[0]]}])")
                + "?") if near else ""
        raise UsageError(f"--config {path}: unknown key {key} in [{section}]{hint}")
    if groups[name] != section:
        raise UsageError(f"--config {path}: {key} belongs in [{groups[name]}], not [{section}]")
    return name


def checked(path, section, key, value):
    """`value` as the flag of `key` would give it (an int where a float is asked: that float);
    UsageError if it is of another kind or not one of the flag's choices."""
    f = field_of(key.replace("-", "_"))
    kind, where = base_type(f.type), f"--config {path}: [{section}] {key}"
    fits = isinstance(value, bool) if kind is bool else not isinstance(value, bool) and (
        isinstance(value, kind) or (kind is float and isinstance(value, int)))
    if not fits:
        raise UsageError(f"{where} must be {KINDS[kind]}, not {kind_of(value)} ({short(value)})")
    value = kind(value)
    choices = MODES if f.name == "mode" else f.metadata["argparse"].get("choices")
    if choices is not None and value not in choices:
        raise UsageError(f"{where}: invalid choice {value!r} (choose from {', '.join(map(repr, choices))})")
    return value


def kind_of(value):
    """What kind of TOML value `value` is, in words."""
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
                       (list, "an array"), (dict, "a table")):
        if isinstance(value, kind):
            return name
    return "a date or time"


def short(value):
    """`value` as TOML writes it, cut to 40 characters, on one line."""
    text = toml_value(value) if isinstance(value, (bool, int, float, str)) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def group_of():
    """{field: its group}: the section it belongs in."""
    return {f.name: f.metadata["group"] for f in fields()}


def field_of(name):
    """RunConfig's field `name`."""
    return next(f for f in fields() if f.name == name)


def unused(cfg):
    """The fields resolve() fills in that the checks refuse, given beside `cfg`'s other settings,
    and that resolve() fills in again: --allreduce and --fuse-grads beside --deterministic (its own
    fixed order), --allreduce beside a --compress that gathers, --outer-momentum without
    --outer-optimizer nesterov."""
    return (({"allreduce", "fuse_grads"} if cfg.deterministic else set())
            | ({"allreduce"} if cfg.compress.partition(":")[0] in GATHERED else set())
            | ({"outer_momentum"} if cfg.outer_optimizer != "nesterov" else set()))


def dumps(cfg):
    """The TOML text of the resolved `cfg`: every field that is not None (TOML has no null) and
    not unused(cfg), under its group's section, which read() and resolve() turn back into `cfg`."""
    lines, skip = [HEADER], unused(cfg)
    for group in GROUPS:
        rows = [f"{f.name} = {toml_value(getattr(cfg, f.name))}" for f in fields()
                if f.metadata["group"] == group and getattr(cfg, f.name) is not None and f.name not in skip]
        lines += ["", f"[{group}]", *rows] if rows else []
    return "\n".join(lines) + "\n"


def toml_value(value):
    """`value` (bool, int, float or str) as a TOML value, in ASCII."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)               # 0.05, 1e-05, 1e+16, inf, -inf, nan: TOML's own spellings too
    return '"' + "".join(escaped(c) for c in value) + '"'


def escaped(c):
    """The character `c` inside a TOML basic string; ValueError for a lone surrogate, which no
    TOML (UTF-8) file can hold."""
    if c in '"\\':
        return "\\" + c
    if " " <= c <= "~":
        return c
    if 0xD800 <= ord(c) <= 0xDFFF:
        raise ValueError(f"{c!r} (an undecodable byte) cannot be written in TOML")
    return f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}"


def paths(cfg):
    """[(flag, path)] of the files `cfg`'s resolved settings are written to: PATH.config.toml
    beside --log-json PATH, DIR/config.toml in --checkpoint-dir DIR."""
    return ([("--log-json", Path(str(cfg.log_json) + LOG_CONFIG))] if cfg.log_json else []) + (
        [("--checkpoint-dir", Path(cfg.checkpoint_dir) / CHECKPOINT_CONFIG)] if cfg.checkpoint_dir else [])
