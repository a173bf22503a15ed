"""What every example does to run as a plain script: start its workers locally.

``spawn_workers(worker, world_size, args)`` spawns one process per rank running
``worker(rank, world_size, init_method, args)``, joined by a ``tcp://127.0.0.1:<free port>``
rendezvous and a fresh cluster secret (``DISTGRAD_SECRET``, unless already set), and returns 0
only if every worker succeeded. A failed worker gets the others killed (they would wait for it
forever); ``args.timeout`` bounds the whole run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

__all__ = ["spawn_workers"]


def spawn_workers(worker: Callable[..., Any], world_size: int, args: argparse.Namespace) -> int:
    """Start ``world_size`` local worker processes; return 0 if all of them succeed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("DISTGRAD_SECRET", secrets.token_hex(32))  # inherited by the workers
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=worker, args=(rank, world_size, f"tcp://127.0.0.1:{port}", args))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + args.timeout
    try:  # wait for all; stop early if one fails (the others would wait for it forever)
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            wait([p.sentinel for p in procs if p.is_alive()], timeout=0.5)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    if any(p.exitcode != 0 for p in procs):
        print(f"failed: exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
        return 1
    return 0
