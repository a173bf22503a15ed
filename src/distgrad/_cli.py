"""The command line: ``distgrad demo`` (train a model split across local workers) and
``distgrad run`` (start N local workers of a script, as torchrun does)."""

from __future__ import annotations

import argparse
import os

from . import _demo, _launcher

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distgrad", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _demo.add_parser(sub)
    _launcher.add_parser(sub)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.command == "demo":
        return _demo.run(args)
    if args.command == "run":
        return _launcher.run(args)
    return 2
