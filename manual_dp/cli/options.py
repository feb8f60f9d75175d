"""The command line's flags, built from manual_dp.config.RunConfig: one flag per field, its default,
help and group of --help from the field; `--config FILE.toml` gives their values from a file
(manual_dp/cli/config_file.py), the flags given beside it overriding it. Parsing needs no MXNet (the
thread settings must be chosen first)."""
import argparse
import dataclasses

from ..checks import check, check_layout, check_model
from ..config import EXCLUSIVE, GROUPS, MODEL_RUN_DEFAULTS, RunConfig, device_request, fields
from ..modes import MODES, mode_of, resolve
from ..errors import UsageError
from ..mesh import Mesh
from .config_file import base_type, read as read_config

USAGE = "%(prog)s [-h] [--config FILE.toml] [FLAG ...]"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default only where it has one worth showing."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """Reports bad input as a UsageError (one line, exit 2) instead of printing usage."""

    def error(self, message):
        raise UsageError(message)


def positive(text):
    """An int >= 1 (argparse type)."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def add_flag(group, f, defaults=True):
    """The argparse argument of RunConfig field `f` in `group`: --name, its type, default (none
    unless `defaults`: the flag is then in the namespace only if given) and help."""
    name, kind = "--" + f.name.replace("_", "-"), base_type(f.type)
    default = f.default if defaults else argparse.SUPPRESS
    if kind is bool:   # off by default: --name; decided by the mode: --name / --no-name
        action = "store_true" if f.default is False else argparse.BooleanOptionalAction
        group.add_argument(name, action=action, default=default, help=f.metadata["help"])
    else:
        choices = {"choices": MODES} if f.name == "mode" else {}     # the table's modes
        group.add_argument(name, type=kind, default=default, help=f.metadata["help"],
                           **f.metadata["argparse"], **choices)


def build_parser(prog="python -m manual_dp.train", defaults=True):
    """The parser of the command line: --config, then every RunConfig field's flag in its group
    of config.GROUPS, in their order, --gpus and --cpus (EXCLUSIVE) one at most; without
    `defaults`, a namespace holds only the flags given."""
    p = OneLineParser(prog=prog, usage=USAGE, formatter_class=HelpFormatter,
                      description="Train a network (LeNet by default) on Fashion-MNIST with hand-written parallelism.")
    p.add_argument("--config", metavar="FILE.toml", default=None if defaults else argparse.SUPPRESS,
                   help="the run's settings from this TOML file: a section per group below ([model], "
                        "[parallelism]...), a key per flag (layers = 2); flags given beside it override it")
    groups = {name: p.add_argument_group(name, about) for name, about in GROUPS.items()}
    for name in {f.metadata["group"] for f in fields() if f.name in EXCLUSIVE}:
        groups[name, "exclusive"] = groups[name].add_mutually_exclusive_group()
    for f in fields():
        add_flag(groups[f.metadata["group"], "exclusive"] if f.name in EXCLUSIVE else groups[f.metadata["group"]],
                 f, defaults)
    return p


def settings(argv=None):
    """{field: value} of the command line `argv` (default sys.argv[1:]): the flags given, over the
    values of the --config file it names (a device flag given replaces the file's), over the
    model's own training defaults (config.MODEL_RUN_DEFAULTS), over the defaults; UsageError if bad."""
    args = vars(build_parser().parse_args(argv))     # --help ends here; so do bad flags
    path = args.pop("config")
    given = vars(build_parser(defaults=False).parse_args(argv))
    given.pop("config", None)
    from_file = read_config(path) if path is not None else {}
    if given.keys() & set(EXCLUSIVE):
        from_file = {k: v for k, v in from_file.items() if k not in EXCLUSIVE}
    model = {**args, **from_file, **given}["model"]
    return {**args, **MODEL_RUN_DEFAULTS.get(model, {}), **from_file, **given}


def parse(argv=None):
    """A checked, resolved RunConfig from the command line `argv` (default sys.argv[1:]) and the
    --config file it names; UsageError if bad."""
    cfg = RunConfig(**settings(argv))
    check(cfg)
    if cfg.mesh is None:
        return resolve(cfg)
    cfg = with_mesh(cfg)
    check_model(cfg)                     # again, in the mode the mesh chose
    return resolve(cfg)


def trainer_config(model_flags, batch, n, flags):
    """The checked RunConfig of `python -m manual_dp.train --model transformer MODEL_FLAGS --cpus n
    --batch-size batch FLAGS` (the benchmarks' layouts); UsageError (one line) where the trainer
    would refuse it, layout included."""
    cfg = parse(["--model", "transformer", "--cpus", str(n), "--batch-size", str(batch)] + model_flags + flags)
    check_model(cfg)
    check_layout(cfg, n)
    return cfg


def with_mesh(cfg):
    """`cfg` with --mesh turned into the mode and degree that lay it out (manual_dp.mesh.mode_of)."""
    if cfg.mesh is None:
        return cfg
    try:
        mode, settings = mode_of(Mesh.parse(cfg.mesh, device_request(cfg)[1]), cfg.mode)
    except ValueError as e:
        raise UsageError(str(e)) from None
    for name, value in settings.items():
        if getattr(cfg, name) not in (None, value):
            raise UsageError(f"--{name.replace('_', '-')} {getattr(cfg, name)} and --mesh {cfg.mesh} disagree")
    return dataclasses.replace(cfg, mode=mode, **settings)
