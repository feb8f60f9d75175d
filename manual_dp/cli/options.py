"""The command line's flags, built from manual_dp.config.RunConfig: one flag per field, its default
and help from the field. Parsing needs no MXNet (the thread settings must be chosen first)."""
import argparse
import dataclasses
import typing

from ..checks import check, check_layout, check_model
from ..config import RunConfig, device_request, fields
from ..modes import MODES, resolve
from ..errors import UsageError
from ..mesh import Mesh, mode_of


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


def base_type(t):
    """int for int and Optional[int]; likewise float, str, bool."""
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if args else t


def add_flag(group, f):
    """The argparse argument of RunConfig field `f`: --name, its type, default and help."""
    name, kind = "--" + f.name.replace("_", "-"), base_type(f.type)
    if kind is bool:   # off by default: --name; decided by the mode: --name / --no-name
        action = "store_true" if f.default is False else argparse.BooleanOptionalAction
        group.add_argument(name, action=action, default=f.default, help=f.metadata["help"])
    else:
        choices = {"choices": MODES} if f.name == "mode" else {}     # the table's modes
        group.add_argument(name, type=kind, default=f.default, help=f.metadata["help"],
                           **f.metadata["argparse"], **choices)


def build_parser(prog="python -m manual_dp.train"):
    p = OneLineParser(prog=prog, description="Train a network (LeNet by default) on Fashion-MNIST with hand-written parallelism.",
                      formatter_class=HelpFormatter)
    groups, devices = {}, p.add_mutually_exclusive_group()
    for f in fields():
        group = f.metadata["group"]
        if group == "devices":
            add_flag(devices, f)
            continue
        if group not in groups:
            groups[group] = p if group == "training" else p.add_argument_group(group)
        add_flag(groups[group], f)
    return p


def parse(argv=None):
    """A checked RunConfig from the command line `argv` (default sys.argv[1:]); UsageError if bad."""
    cfg = RunConfig(**vars(build_parser().parse_args(argv)))
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
