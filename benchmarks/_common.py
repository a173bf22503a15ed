"""Shared helpers for distgrad's benchmarks.

What lives here:

* :func:`run_group` -- spawn an RPC group of 2 processes (``worker0`` = caller, ``worker1`` =
  callee; ``world_size`` for more: ``worker1`` ... serve)
  for one implementation (``"torch"`` = ``torch.distributed.rpc`` over TensorPipe, or
  ``"distgrad"`` = ``distgrad.rpc``), run a measurement function in the caller and hand its
  (picklable) return value back. Every process is joined with a timeout and killed if it does
  not exit, so a benchmark never hangs; each child's stdout/stderr goes to a log file whose
  tail is reported only when the group fails (this keeps torch's C++ warnings off the console).
* RPC targets (:func:`noop`, :func:`echo`) importable by both workers.
* Statistics (:func:`median`, :func:`percentile`), size parsing / formatting, environment
  info, a plain-text table printer and JSON output.

Nothing here imports torch at module level: spawned children re-import the benchmark's main
module, and they set up their environment before torch is loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import multiprocessing as mp
import os
import platform
import queue
import re
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "IMPLEMENTATIONS",
    "GroupResult",
    "echo",
    "environment_info",
    "format_size",
    "free_port",
    "median",
    "noop",
    "parse_size",
    "percentile",
    "print_table",
    "quiet_env",
    "run_group",
    "run_in_tree",
    "snapshot_package",
    "write_json",
]

#: Implementation names understood by :func:`import_rpc` / :func:`run_group`.
IMPLEMENTATIONS: tuple[str, ...] = ("torch", "distgrad")

CALLER = "worker0"
CALLEE = "worker1"

#: Caller(rpc_module, callee_name, config) -> picklable result. Must be a module-level function.
Caller = Callable[[ModuleType, str, Any], Any]


# --------------------------------------------------------------------------------------------
# RPC targets (module-level so both workers can import them by name)
# --------------------------------------------------------------------------------------------


def noop() -> None:
    """Does nothing: measures the RPC machinery alone."""
    return None


def echo(x: Any) -> Any:
    """Returns its argument unchanged (tensor echo)."""
    return x


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------


def quiet_env() -> dict[str, str]:
    """Environment variables that silence torch's and TensorPipe's chatter in children."""
    return {
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "GLOG_minloglevel": "2",
        "PYTHONWARNINGS": "ignore",
        # Keep TensorPipe's TCP fallback on the loopback interface (only 127.0.0.1 is used).
        "TP_SOCKET_IFNAME": "lo",
    }


def import_rpc(impl: str) -> ModuleType:
    """The RPC module of an implementation."""
    if impl == "torch":
        import torch.distributed.rpc as torch_rpc

        return torch_rpc
    if impl == "distgrad":
        import distgrad.rpc as distgrad_rpc

        return distgrad_rpc
    raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLEMENTATIONS}")


def ensure_distgrad_importable() -> None:
    """Add ``<repo>/src`` to ``sys.path`` when distgrad is not importable (children inherit)."""
    import importlib.util

    if importlib.util.find_spec("distgrad") is None:
        src = Path(__file__).resolve().parent.parent / "src"
        sys.path.insert(0, str(src))


def snapshot_package(name: str = "distgrad") -> Path:
    """Copy the importable package ``name`` to a temporary folder put first on ``sys.path``.

    Spawned workers inherit ``sys.path``, so every group of one run imports the same code even
    while the source tree is being edited. Call before the package is imported; returns the
    temporary folder (remove it when done).
    """
    import importlib.util
    import shutil

    if name in sys.modules:
        raise RuntimeError(f"snapshot_package({name!r}) must run before {name} is imported")
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"package {name!r} not found")
    source = Path(next(iter(spec.submodule_search_locations)))
    root = Path(tempfile.mkdtemp(prefix=f"bench-{name}-snapshot-"))
    shutil.copytree(source, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (root / "SOURCE").write_text(f"{source}\n{git_state(source)}\n")
    sys.path.insert(0, str(root))
    return root


def environment_info() -> dict[str, Any]:
    """Versions and machine facts worth printing at the top of every benchmark."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch

        import distgrad

        uses_uvloop: bool | str
        try:
            from distgrad._transport._io import IoThread

            io = IoThread()
            uses_uvloop = io.uses_uvloop
            io.loop.close()
        except Exception as exc:  # the private API may move; report instead of failing
            uses_uvloop = f"unknown ({type(exc).__name__}: {exc})"
        tensorpipe = bool(getattr(torch.distributed.rpc, "is_available", lambda: False)())
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count() or 0
    return {
        "python": platform.python_version(),
        "python_impl": platform.python_implementation(),
        "torch": str(torch.__version__),
        "torch_rpc_available": tensorpipe,
        "distgrad": str(getattr(distgrad, "__version__", "?")),
        "distgrad_uvloop": uses_uvloop,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "distgrad_env": {k: v for k, v in os.environ.items() if k.startswith("DISTGRAD_")},
        "distgrad_path": str(Path(distgrad.__file__).resolve().parent),
        "git": _distgrad_git(Path(distgrad.__file__).resolve().parent),
        "loadavg": load_average(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def git_state(path: Path) -> str:
    """``<short commit>`` of the checkout holding ``path``, ``+dirty`` if it has local changes
    under ``path`` (the code actually benchmarked); ``"unknown"`` outside git."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", ".")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def _distgrad_git(path: Path) -> str:
    snapshot_note = path.parent / "SOURCE"  # written by snapshot_package
    if snapshot_note.is_file():
        source, state = snapshot_note.read_text().splitlines()[:2]
        return f"{state}, snapshot of {source}"
    return git_state(path)


def load_average() -> str:
    """1/5/15-minute load averages (a hint of how busy the machine was)."""
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def _patched_environ(env: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------------------------
# Spawning a 2-process group
# --------------------------------------------------------------------------------------------


@dataclass
class GroupResult:
    """Outcome of one :func:`run_group` call."""

    impl: str
    ok: bool
    value: Any = None
    error: str | None = None
    phase: str | None = None  # where it failed: "start", "init", "run", "timeout", ...
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    log_tail: str = ""


def _redirect_output(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _put(q: Any, *msg: Any) -> None:
    try:
        q.put(msg)
    except Exception:
        pass


def _flush_and_exit(q: Any, code: int) -> None:
    with contextlib.suppress(Exception):
        q.close()
        q.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def enter_netns(name: str) -> None:
    """Move this (single-threaded) process into the network namespace ``ip netns`` named."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def tls_options(cert: str, key: str) -> dict[str, ssl.SSLContext]:
    """distgrad's mutual-TLS options from one certificate both sides present and trust."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    server.verify_mode = ssl.CERT_REQUIRED
    server.load_verify_locations(cert)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_cert_chain(cert, key)
    client.load_verify_locations(cert)
    return {"server_ssl_context": server, "client_ssl_context": client}


@dataclass(frozen=True)
class Placement:
    """Where a group's processes run: the network namespace of each rank (None, or a rank past
    the tuple: this one), the rendezvous host, and (distgrad only) TLS certificate and key
    paths."""

    netns: tuple[str | None, ...] = (None, None)
    master: str = "127.0.0.1"
    tls: tuple[str, str] | None = None
    #: torch only: TensorPipe's channels and transports. Between namespaces of one machine
    #: TensorPipe would pick its same-machine channels (CMA, shm); across real hosts it cannot.
    torch_channels: tuple[str, ...] | None = None
    torch_transports: tuple[str, ...] | None = None
    #: each rank's ``device_maps`` option (``((rank, {to: {src: dst}}), ...)``), both backends
    device_maps: tuple[tuple[int, dict[str, dict[str, str]]], ...] = ()


def _worker_main(
    impl: str,
    rank: int,
    port: int,
    caller: Caller,
    config: Any,
    q: Any,
    done: Any,
    log_path: str,
    run_timeout: float,
    world_size: int = 2,
    placement: Placement = Placement(),
) -> None:
    """Body of each spawned process (rank 0 = caller, the others serve)."""
    netns = placement.netns[rank] if rank < len(placement.netns) else None
    if netns is not None:
        enter_netns(netns)
    _redirect_output(log_path)
    warnings.filterwarnings("ignore")
    if os.environ.get("DISTGRAD_BENCH_LOG"):  # e.g. DEBUG: the workers' logs, in their log files
        logging.basicConfig(level=os.environ["DISTGRAD_BENCH_LOG"].upper())
    phase = "import"
    try:
        rpc = import_rpc(impl)
        phase = "init"
        extra: dict[str, Any] = {}
        if impl == "distgrad" and placement.tls is not None:
            extra = tls_options(*placement.tls)
        if impl == "torch" and placement.torch_channels is not None:
            extra["_channels"] = list(placement.torch_channels)
        if impl == "torch" and placement.torch_transports is not None:
            extra["_transports"] = list(placement.torch_transports)
        maps = dict(placement.device_maps).get(rank)
        if maps:
            extra["device_maps"] = maps
        options = rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://{placement.master}:{port}", rpc_timeout=120.0, **extra
        )
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
        _put(q, "ready", rank)
        phase = "run"
        if rank == 0:
            try:
                value = caller(rpc, CALLEE, config)
            finally:
                done.set()
            _put(q, "result", rank, value)
        elif not done.wait(run_timeout):
            raise TimeoutError(f"callee: caller did not finish within {run_timeout:.0f}s")
        phase = "shutdown"
        rpc.shutdown()
        _put(q, "exit", rank)
    except BaseException as exc:
        traceback.print_exc()
        _put(q, "error", rank, phase, f"{type(exc).__name__}: {exc}", traceback.format_exc())
        done.set()
        _flush_and_exit(q, 1)
    _flush_and_exit(q, 0)


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-limit:]


def run_group(
    impl: str,
    caller: Caller,
    config: Any,
    timeout: float = 300.0,
    shutdown_grace: float = 30.0,
    env: dict[str, str] | None = None,
    world_size: int = 2,
    placement: Placement | None = None,
) -> GroupResult:
    """Run ``caller(rpc, "worker1", config)`` in rank 0 of a fresh 2-process group (of
    ``world_size`` processes: ``worker1`` ... ``worker{world_size - 1}`` serve).

    ``impl`` picks the RPC implementation. Both processes are started with the ``spawn``
    method and rendezvous at ``tcp://127.0.0.1:<fresh free port>``. ``timeout`` bounds start,
    init and the measurement; ``shutdown_grace`` bounds ``rpc.shutdown()`` and process exit.
    Never hangs: processes still alive at the end are terminated, then killed.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    done = ctx.Event()
    port = free_port()
    start = time.monotonic()
    result = GroupResult(impl=impl, ok=False)
    log_dir = Path(tempfile.mkdtemp(prefix=f"bench-{impl}-"))
    logs = [log_dir / f"rank{rank}.log" for rank in range(world_size)]
    procs = [
        ctx.Process(
            target=_worker_main,
            args=(
                impl,
                rank,
                port,
                caller,
                config,
                q,
                done,
                str(logs[rank]),
                timeout,
                world_size,
                placement or Placement(),
            ),
            name=f"bench-{impl}-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        with _patched_environ({**quiet_env(), **(env or {})}):
            for p in procs:
                p.start()
    except Exception as exc:
        result.error, result.phase = f"could not start workers: {exc}", "start"
        _reap(procs, result, grace=0)
        return result

    deadline = start + timeout
    exited: set[int] = set()
    got_value = False
    while True:
        now = time.monotonic()
        if now >= deadline:
            if got_value:
                result.notes.append(f"shutdown did not finish within {shutdown_grace:.0f}s")
            else:
                result.error, result.phase = f"no result within {timeout:.0f}s", "timeout"
            break
        try:
            msg = q.get(timeout=min(0.25, deadline - now))
        except queue.Empty:
            dead = [
                r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in exited
            ]
            if dead:
                # Give the queue a moment: an error message may still be in flight.
                with contextlib.suppress(queue.Empty):
                    msg = q.get(timeout=1.0)
                    if msg[0] == "error":
                        _record_error(result, msg)
                        break
                r = dead[0]
                result.error = f"rank {r} died with exit code {procs[r].exitcode}"
                result.phase = result.phase or "crash"
                break
            if got_value and all(p.exitcode == 0 for p in procs):
                break  # both exited cleanly; their "exit" messages may have been lost
            continue
        kind = msg[0]
        if kind == "result":
            result.value, got_value = msg[2], True
            deadline = min(deadline, time.monotonic() + shutdown_grace)
        elif kind == "exit":
            exited.add(msg[1])
            if got_value and len(exited) == world_size:
                break
        elif kind == "error":
            _record_error(result, msg)
            break
    result.ok = got_value and result.error is None
    _reap(procs, result, grace=10.0 if result.ok else 3.0)
    result.wall_s = time.monotonic() - start
    if not result.ok:
        result.log_tail = "\n".join(
            f"--- rank {r} log ({logs[r]}) ---\n{_tail(logs[r])}" for r in range(world_size)
        )
    else:
        for path in logs:
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            log_dir.rmdir()
    with contextlib.suppress(Exception):
        q.close()
        q.cancel_join_thread()
    return result


def _record_error(result: GroupResult, msg: tuple[Any, ...]) -> None:
    _, rank, phase, summary, _tb = msg
    result.error = f"rank {rank} failed during {phase}: {summary}"
    result.phase = phase


def _reap(procs: Sequence[Any], result: GroupResult, grace: float) -> None:
    """Join every started process within ``grace`` seconds; terminate, then kill, the rest."""
    deadline = time.monotonic() + grace
    for p in procs:
        if p.pid is None:
            continue
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.pid is None or not p.is_alive():
            continue
        p.terminate()
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
        result.notes.append(f"{p.name} did not exit in time; killed")


# --------------------------------------------------------------------------------------------
# Statistics and formatting
# --------------------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    """Median (NaN for an empty sequence)."""
    return percentile(values, 50.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation (NaN for an empty sequence)."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"64KiB"``, ``"1M"``, ``"4096"`` -> bytes (K/M/G are binary multiples)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"bad size {text!r} (examples: 1KiB, 64K, 16MiB, 4096)")
    number, unit = float(m.group(1)), m.group(2).upper()
    value = int(number * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[unit])
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


def format_size(nbytes: int) -> str:
    """Bytes -> ``"64 KiB"`` style (exact binary units when possible)."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def print_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None
) -> None:
    """Print a plain-text table; ``align`` is one char per column, ``l`` or ``r``."""
    align = align or "l" + "r" * (len(headers) - 1)
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def fmt(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if a == "l" else c.rjust(w)
            for c, w, a in zip(cells, widths, align, strict=True)
        ]
        return "  ".join(parts).rstrip()

    print(fmt(headers))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(fmt(row))


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Write ``data`` as indented JSON (NaN/inf become null), creating parent folders."""

    def clean(obj: Any) -> Any:
        if isinstance(obj, float) and not math.isfinite(obj):
            return None
        if isinstance(obj, dict):
            return {str(k): clean(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [clean(v) for v in obj]
        return obj

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(clean(data), indent=2) + "\n")


def run_in_tree(script: str, tree: str, args: list[str], timeout: float) -> dict[str, float]:
    """Run ``script`` with ``args`` in a fresh interpreter whose distgrad is the one under
    ``tree`` (a ``src/`` folder), and return the JSON object its last output line holds (the
    A/B benchmarks compare two trees this way)."""
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
    done = subprocess.run(
        [sys.executable, script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"run of {tree} failed:\n{done.stderr[-2000:]}")
    value: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return value
