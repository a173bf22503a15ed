"""The command line: ``distgrad demo`` (train a model split across local workers),
``distgrad run`` (start N local workers of a script, as torchrun does on one host),
``distgrad slurm`` (run one worker as a Slurm task, with torchrun's environment) and
``distgrad top`` (a live view of a running group's members, through their metrics endpoints)."""

from __future__ import annotations

import argparse
import os

from . import _demo, _launcher, _slurm
from ._observe import _top

__all__ = ["main"]

_DESCRIPTION = (
    "distgrad: distributed autograd over RPC for PyTorch. 'distgrad demo' trains a model "
    "split across local worker processes; 'distgrad run' starts N local worker processes of a "
    "script, as torchrun does on one host; 'distgrad slurm' runs one worker of a script as a "
    "Slurm task (srun ... distgrad slurm train.py), across hosts; 'distgrad top' shows a running "
    "group's members live, through their metrics endpoints."
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distgrad", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {
        "demo": _demo.add_parser(sub),
        "run": _launcher.add_parser(sub),
        "slurm": _slurm.add_parser(sub),
        "top": _top.add_parser(sub),
    }
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # report it with the command's own usage, not the top-level one
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.command == "demo":
        return _demo.run(args)
    if args.command == "run":
        return _launcher.run(args)
    if args.command == "slurm":
        return _slurm.run(args)
    if args.command == "top":
        return _top.run(args)
    return 2
