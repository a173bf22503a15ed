"""Run a function on N real worker processes joined by distgrad's RPC over 127.0.0.1.

``run_cluster(fn, world_size)`` spawns one process per rank; each calls ``init_rpc`` (TCP
rendezvous on a fresh loopback port), runs ``fn(rank, world_size, **kwargs)``, shuts down
gracefully and reports its return value. The call is bounded by ``timeout``; on expiry, or on
any exit, every child still alive is killed -- no process outlives the call. A worker's
exception fails the test with the worker's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["ClusterError", "free_port", "run_cluster"]


class ClusterError(AssertionError):
    """A worker failed, or the cluster did not finish in time."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(
    q: Any,
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    kwargs: dict[str, Any],
    env: dict[str, str],
    options: dict[str, Any],
    init: bool,
    shutdown: bool,
) -> None:
    os.environ.update(env)
    try:
        import distgrad.rpc as rpc

        if init:
            opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", **options)
            rpc.init_rpc(
                f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts
            )
        result = fn(rank, world_size, **kwargs) if init else fn(rank, world_size, port, **kwargs)
        if init and shutdown:
            rpc.shutdown()
        q.put((rank, True, result))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))


def run_cluster(
    fn: Callable[..., Any],
    world_size: int,
    *,
    timeout: float = 60.0,
    kwargs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    options: dict[str, Any] | None = None,
    init: bool = True,
    shutdown: bool = True,
    may_die: frozenset[int] = frozenset(),
) -> dict[int, Any]:
    """Run ``fn`` on ``world_size`` workers; return ``{rank: result}``.

    ``init=False`` runs ``fn(rank, world_size, port)`` without ``init_rpc`` (the function
    drives RPC itself). Ranks in ``may_die`` may exit without a result (killed on purpose).
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(
                q,
                fn,
                rank,
                world_size,
                port,
                kwargs or {},
                env or {},
                options or {},
                init,
                shutdown,
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        expected = set(range(world_size)) - set(may_die)
        while len(results) + len(failures) < world_size:
            if all(not p.is_alive() for p in procs) and q.empty():
                break
            if expected <= set(results) | set(failures) and q.empty():
                break  # the rest may have died (or been stopped) on purpose
            try:
                rank, ok, value = q.get(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"cluster of {world_size} did not finish within {timeout:.0f}s; "
                        f"results from {sorted(results)}, failures from {sorted(failures)}"
                    ) from None
                continue
            (results if ok else failures)[rank] = value
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        q.close()
    if failures:
        report = "\n".join(f"worker {rank} failed:\n{failures[rank]}" for rank in sorted(failures))
        raise ClusterError(report)
    missing = set(range(world_size)) - set(results) - set(may_die)
    if missing:
        codes = {r: procs[r].exitcode for r in sorted(missing)}
        raise ClusterError(f"workers {sorted(missing)} exited without a result: exit codes {codes}")
    return results
