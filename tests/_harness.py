"""Run a function on N real worker processes joined by distgrad's RPC over 127.0.0.1.

``run_workers(fn, world_size)`` spawns one process per rank (``multiprocessing`` "spawn"
context). Each child sets its environment (a fresh cluster secret in ``DISTGRAD_SECRET`` per
run, unless told otherwise), calls ``distgrad.rpc.init_rpc(f"worker{rank}", ...)`` with a
``tcp://127.0.0.1:<free port>`` rendezvous, runs ``fn(rank, world_size, **kwargs)``, calls
``rpc.shutdown()`` and sends its return value back over a pipe. A worker's exception comes back
as its formatted traceback and fails the run with it.

Every run is bounded: past ``timeout`` every child is killed and the run fails naming the ranks
that had not finished. Whatever happens, no child outlives the call (killed and reaped in a
``finally``). Ranks listed in ``may_die`` may end without a result (killed on purpose, or stopped
with SIGSTOP: once every other rank has reported, they are killed rather than waited for).

``fn`` must be a module-level function of an importable module (the children import it by
name); its return value must be picklable.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import secrets
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

__all__ = ["Died", "WorkerFailure", "child_pids", "free_port", "run_workers", "stop_process"]

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"
#: A failed rank still tries a graceful shutdown for this long (so idle peers finish cleanly).
FAILURE_SHUTDOWN_S = 5.0
#: After the first failure, the other ranks get this long to report before they are killed.
FAILURE_GRACE_S = FAILURE_SHUTDOWN_S + 3.0
#: A rank that reported must have exited within this long (shutdown leaves nothing running).
EXIT_GRACE_S = 10.0


class WorkerFailure(AssertionError):
    """A worker failed, died unexpectedly, or the run did not finish in time."""


@dataclass(frozen=True)
class Died:
    """The outcome of a rank in ``may_die`` that ended without reporting a result."""

    exitcode: int | None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_pids() -> list[tuple[int, str]]:
    """``(pid, cmdline)`` of every live or zombie child of this process, except
    multiprocessing's resource tracker and fork server (which live as long as the test
    process)."""
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me and "resource_tracker" not in cmdline and "forkserver" not in cmdline:
            found.append((int(entry), cmdline))
    return found


def stop_process(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped. ``kill`` returns before
    that: the thread that takes the signal stops the others, and one that is running (or just
    woke with data, as a worker waiting in ``recv`` does) can serve a request meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:  # (a thread that ended)
                continue
        if all(state in ("T", "t") for state in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} not stopped after {timeout} s: {states}")
        time.sleep(0.001)


def _send(conn: Connection, message: tuple[str, Any]) -> None:
    try:
        data = pickle.dumps(message)
    except Exception:
        data = pickle.dumps(
            ("error", f"the worker's result is not picklable:\n{traceback.format_exc()}")
        )
    conn.send_bytes(data)


def _child(
    conn: Connection,
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    init: bool,
    shutdown: bool,
    options: dict[str, Any],
    kwargs: dict[str, Any],
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks on a timeout
    for path in (str(SRC), str(REPO)):
        if path not in sys.path:
            sys.path.insert(0, path)
    initialized = False
    try:
        if init:
            import distgrad.rpc as rpc

            opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", **options)
            rpc.init_rpc(
                f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts
            )
            initialized = True
        result = fn(rank, world_size, **kwargs)
        if initialized and shutdown:
            initialized = False
            rpc.shutdown()
        message: tuple[str, Any] = ("ok", result)
    except BaseException:
        message = ("error", traceback.format_exc())
    _send(conn, message)
    conn.close()
    if initialized:  # failed: leave the group, gracefully if the others are idle and willing
        try:
            rpc.shutdown(timeout=FAILURE_SHUTDOWN_S)
        except BaseException:
            pass
    sys.stdout.flush()
    sys.stderr.flush()


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *,
    timeout: float = 60.0,
    kwargs: Mapping[str, Any] | None = None,
    rank_kwargs: Mapping[int, Mapping[str, Any]] | None = None,
    options: Mapping[str, Any] | None = None,
    rank_options: Mapping[int, Mapping[str, Any]] | None = None,
    secret: str | None = "",
    env: Mapping[str, str] | None = None,
    rank_env: Mapping[int, Mapping[str, str]] | None = None,
    init: bool = True,
    shutdown: bool = True,
    may_die: frozenset[int] | set[int] = frozenset(),
    start_method: str = "spawn",
) -> dict[int, Any]:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` workers; return
    ``{rank: result}`` (a :class:`Died` for a ``may_die`` rank that ended without one).

    ``options``: keyword arguments of ``TensorPipeRpcBackendOptions`` (built in the child, so
    they need only be picklable); ``rank_options``, ``rank_kwargs`` and ``rank_env`` add to
    ``options``, ``kwargs`` and ``env`` for one rank. ``secret``: the cluster secret put in
    ``DISTGRAD_SECRET``; ``""`` (default) makes a fresh one for this run, ``None`` leaves the
    variable unset.
    ``init=False`` ("skip init"): the child neither initializes nor shuts down RPC, and ``fn``
    gets ``port=`` (a free port for its own ``tcp://`` rendezvous) among its kwargs.
    ``shutdown=False``: ``fn`` shuts down RPC itself.

    On a timeout, every rank still running dumps its threads' stacks to stderr (shown with the
    test's captured output) before it is killed.

    ``start_method="forkserver"`` starts the workers from one fork server per test process,
    which has imported torch and distgrad once: a worker then starts in a fraction of a second
    instead of seconds (for tests that start many groups).
    """
    __tracebackhide__ = True
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "distgrad.rpc", "distgrad.autograd"])
    port = free_port()
    path = [str(SRC), str(REPO), os.environ.get("PYTHONPATH", "")]
    base_env = {"PYTHONPATH": os.pathsep.join(p for p in path if p)}
    if secret == "":
        base_env["DISTGRAD_SECRET"] = secrets.token_hex(16)
    elif secret is not None:
        base_env["DISTGRAD_SECRET"] = secret
    base_env.update(env or {})
    procs: dict[int, Any] = {}
    pipes: dict[int, Connection] = {}
    try:
        for rank in range(world_size):
            child_kwargs = dict(kwargs or {})
            child_kwargs.update((rank_kwargs or {}).get(rank, {}))
            if not init:
                child_kwargs.setdefault("port", port)
            child_options = dict(options or {})
            child_options.update((rank_options or {}).get(rank, {}))
            child_env = dict(base_env)
            child_env.update((rank_env or {}).get(rank, {}))
            receiver, sender = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child,
                args=(
                    sender,
                    fn,
                    rank,
                    world_size,
                    port,
                    init,
                    shutdown,
                    child_options,
                    child_kwargs,
                    child_env,
                ),
                name=f"distgrad-test-worker{rank}",
                daemon=True,
            )
            proc.start()
            sender.close()
            procs[rank], pipes[rank] = proc, receiver
        return _collect(procs, pipes, world_size, timeout, frozenset(may_die))
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()  # SIGKILL also ends a SIGSTOPped process
        for proc in procs.values():
            proc.join(10)
        for pipe in pipes.values():
            pipe.close()


def _collect(
    procs: dict[int, Any],
    pipes: dict[int, Connection],
    world_size: int,
    timeout: float,
    may_die: frozenset[int],
) -> dict[int, Any]:
    __tracebackhide__ = True
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    reported: set[int] = set()
    started = time.monotonic()
    deadline = started + timeout
    waiting = dict(pipes)

    def receive(rank: int) -> None:
        pipe = waiting.pop(rank)
        try:
            status, value = pickle.loads(pipe.recv_bytes())
        except (EOFError, OSError):
            procs[rank].join(1)
            code = procs[rank].exitcode
            if rank in may_die:
                results[rank] = Died(code)
            else:
                failures[rank] = f"exited without a result (exit code {code})"
            return
        reported.add(rank)
        if status == "ok":
            results[rank] = value
        else:
            failures[rank] = value

    while waiting:
        needed = [r for r in waiting if r not in may_die]
        if not needed:
            break  # only ranks that may die are left: they are killed, not waited for
        left = deadline - time.monotonic()
        if left <= 0:
            late = [r for r in sorted(waiting) if r not in may_die]
            why = (
                f"did not finish within {FAILURE_GRACE_S:g}s of another worker's failure"
                if failures
                else f"did not finish within the harness timeout of {timeout:g}s"
            )
            failures.update({r: why for r in late})
            _dump_stacks([procs[r] for r in late])
            break
        objects: list[Any] = list(waiting.values())
        objects += [procs[r].sentinel for r in waiting]
        ready = set(wait(objects, timeout=left))
        for rank in list(waiting):
            if waiting[rank] in ready or procs[rank].sentinel in ready:
                receive(rank)
        if failures:
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    for rank in [r for r in waiting if r in may_die]:  # still running (e.g. stopped)
        if procs[rank].is_alive():
            procs[rank].kill()
        procs[rank].join(5)
        if waiting[rank].poll():
            receive(rank)
        else:
            waiting.pop(rank)
            results[rank] = Died(procs[rank].exitcode)
    # a rank that reported success must also exit: shutdown leaves no thread running
    exit_deadline = time.monotonic() + EXIT_GRACE_S
    for rank in sorted(reported):
        proc = procs[rank]
        proc.join(max(0.0, exit_deadline - time.monotonic()))
        if rank in failures:
            continue
        if proc.is_alive():
            failures[rank] = f"reported its result but did not exit within {EXIT_GRACE_S:g}s"
            # Its threads' stacks, on stderr (shown with the test's output), if a thread holds
            # it; a process already past the interpreter's teardown of faulthandler dies of the
            # signal instead ("killed by SIGUSR1"): it was exiting, slowly (a loaded host).
            _dump_stacks([proc])
        elif proc.exitcode != 0:
            failures[rank] = f"reported its result but exited with code {proc.exitcode}"
    if failures:
        elapsed = time.monotonic() - started
        report = "\n\n".join(
            f"---- worker{rank} ({_describe(procs[rank].exitcode)}) ----\n{failures[rank]}"
            for rank in sorted(failures)
        )
        raise WorkerFailure(
            f"{len(failures)} of {world_size} workers failed after {elapsed:.1f}s:\n{report}"
        )
    return results


def _dump_stacks(procs: list[Any]) -> None:
    """Ask each process to print its threads' stacks (faulthandler, SIGUSR1)."""
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            try:
                os.kill(proc.pid, signal.SIGUSR1)
            except OSError:
                pass
    time.sleep(1.0)


def _describe(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running, killed"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
