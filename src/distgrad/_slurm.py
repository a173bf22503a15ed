"""``distgrad slurm``: run one worker of a script as a Slurm task, with torchrun's environment.

``srun`` starts one process per task on every node of the allocation and tells each who it is
(``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
``SLURM_JOB_NODELIST``, ...). distgrad programs, like torch's, read torchrun's names (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; ``init_rpc``'s ``env://``). This command
translates, then replaces itself with ``python script args`` (or ``python -m module``)::

    srun --nodes 2 --ntasks-per-node 4 distgrad slurm train.py --epochs 3

The rendezvous host is the first node of the allocation (``SLURM_JOB_NODELIST``, expanded here:
no ``scontrol`` needed); its port is ``--master-port``, else ``MASTER_PORT`` when set, else one
derived from the job id, so that two jobs sharing a node do not collide. Variables already set
are kept. It starts nothing itself and supervises nothing: srun does that (use
``--kill-on-bad-exit``). ``distgrad run`` stays the one-host launcher.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["add_parser", "expand_hostlist", "run", "torchrun_environment"]

_BASE_PORT = 20000
_PORT_SPAN = 20000


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list, expanded: ``"gpu[01-03,07],login1"`` -> ``["gpu01",
    "gpu02", "gpu03", "gpu07", "login1"]`` (zero padding kept; several bracket groups in one
    name multiply out)."""
    hosts: list[str] = []
    for item in _split_top_level(text):
        hosts.extend(_expand_one(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in text.strip():
        if char == "," and depth == 0:
            if current:
                items.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0:
            raise ValueError(f"unbalanced brackets in Slurm host list {text!r}")
        current += char
    if depth != 0:
        raise ValueError(f"unbalanced brackets in Slurm host list {text!r}")
    if current:
        items.append(current)
    return items


def _expand_one(item: str) -> list[str]:
    found = re.search(r"\[([^\]]*)\]", item)
    if found is None:
        return [item]
    head, tail = item[: found.start()], item[found.end() :]
    out = []
    for part in found.group(1).split(","):
        if "-" in part:
            low, high = part.split("-", 1)
            width = len(low)
            if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
                raise ValueError(f"bad range {part!r} in Slurm host list entry {item!r}")
            numbers = [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
        else:
            numbers = [part]
        for number in numbers:
            out.extend(_expand_one(head + number + tail))
    return out


def _tasks_per_node(value: str, node: int) -> int | None:
    """``SLURM_TASKS_PER_NODE`` (``"4(x2),3"``) for node index ``node``."""
    index = 0
    for entry in value.split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", entry.strip())
        if found is None:
            return None
        count, repeat = int(found.group(1)), int(found.group(2) or 1)
        if node < index + repeat:
            return count
        index += repeat
    return None


def torchrun_environment(
    slurm: Mapping[str, str], master_port: int | None = None
) -> dict[str, str]:
    """torchrun's variables for the Slurm task described by ``slurm`` (an environment)."""
    missing = [name for name in ("SLURM_PROCID", "SLURM_NTASKS") if not slurm.get(name)]
    nodelist = slurm.get("SLURM_JOB_NODELIST") or slurm.get("SLURM_NODELIST")
    if not nodelist:
        missing.append("SLURM_JOB_NODELIST")
    if missing:
        raise RuntimeError(
            f"not inside a Slurm task: {', '.join(missing)} not set (run it under srun)"
        )
    assert nodelist is not None
    hosts = expand_hostlist(nodelist)
    if not hosts:
        raise RuntimeError(f"SLURM_JOB_NODELIST names no host: {nodelist!r}")
    if master_port is None:
        job = slurm.get("SLURM_JOB_ID", "0")
        master_port = _BASE_PORT + int(job) % _PORT_SPAN if job.isdigit() else 29500
    node = int(slurm.get("SLURM_NODEID", "0"))
    env = {
        "RANK": slurm["SLURM_PROCID"],
        "WORLD_SIZE": slurm["SLURM_NTASKS"],
        "LOCAL_RANK": slurm.get("SLURM_LOCALID", "0"),
        "GROUP_RANK": str(node),
        "MASTER_ADDR": hosts[0],
        "MASTER_PORT": str(master_port),
    }
    local = _tasks_per_node(slurm.get("SLURM_TASKS_PER_NODE", ""), node)
    if local is not None:
        env["LOCAL_WORLD_SIZE"] = str(local)
    return env


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        "slurm",
        help="run one worker of a script as a Slurm task (srun ... distgrad slurm train.py)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="rendezvous port on the first node (default: $MASTER_PORT, else derived from "
        "$SLURM_JOB_ID)",
    )
    parser.add_argument("-m", "--module", action="store_true", help="run the target as a module")
    parser.add_argument("script", help="the script (or module) every task runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return parser


def run(args: argparse.Namespace) -> int:
    port = args.master_port
    if port is None and os.environ.get("MASTER_PORT"):
        port = int(os.environ["MASTER_PORT"])
    try:
        env = torchrun_environment(os.environ, port)
    except (RuntimeError, ValueError) as exc:
        print(f"distgrad slurm: {exc}", file=sys.stderr)
        return 2
    for name, value in env.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    argv = [sys.executable, *(["-m"] if args.module else []), args.script, *args.args]
    sys.stdout.flush()
    os.execv(sys.executable, argv)
    return 0  # not reached
