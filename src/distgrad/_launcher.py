"""``distgrad run``: start N local worker processes of one script, as torchrun does on one host.

Each worker gets the environment that ``init_rpc(..., init_method="env://")`` reads --
``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE`` (torchrun's names) -- and a fresh random cluster secret in
``DISTGRAD_SECRET`` unless the user set one, so the workers never take the secret from the
store.

The launcher is one thread and one loop: it reads every worker's stdout and stderr (pipes,
non-blocking) and writes whole lines prefixed with the worker's rank, so lines of different
workers never mix; it watches for exits and for SIGINT/SIGTERM. Each worker runs in its own
process group, so a terminal's Ctrl-C reaches the launcher alone (which forwards it once) and
stopping a worker also stops what it started. On Linux a worker is killed if the launcher
dies (``PR_SET_PDEATHSIG``).

Exit status: 0 when every worker exited 0; otherwise the first failing worker's exit code
(``128 + signal`` when a signal killed it), ``128 + signal`` when the launcher was
interrupted, 2 for bad options.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import importlib.util
import os
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Any

from . import _config

__all__ = ["add_parser", "run"]

#: Seconds the workers get to exit after SIGTERM (or a forwarded signal) before SIGKILL.
DEFAULT_GRACE_PERIOD: float = 5.0
#: A line longer than this is written out in pieces (each piece prefixed, ending in newline).
MAX_LINE: int = 1024 * 1024
#: After the last worker exited, output still in its pipes is read for at most this long.
_DRAIN_S = 2.0
_POLL_S = 0.05
_READ_SIZE = 65536
_PR_SET_PDEATHSIG = 1
_FORWARDED = (signal.SIGINT, signal.SIGTERM)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``run`` on the CLI's subparsers; returns its parser."""
    run_parser: argparse.ArgumentParser = sub.add_parser(
        "run",
        help="launch N local worker processes of a script (like torchrun on one host)",
        description="Start N local worker processes of a script (or module), each with the "
        "environment that init_rpc(init_method='env://') reads, like torchrun on one host.",
    )
    run_parser.add_argument(
        "-n",
        "--nproc-per-node",
        dest="nproc",
        type=int,
        default=1,
        metavar="N",
        help="number of worker processes (default 1)",
    )
    run_parser.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="rendezvous port on 127.0.0.1 (default: a free port)",
    )
    run_parser.add_argument(
        "--grace-period",
        type=float,
        default=DEFAULT_GRACE_PERIOD,
        metavar="S",
        help="seconds workers get to exit after SIGTERM before SIGKILL "
        f"(default {DEFAULT_GRACE_PERIOD:g})",
    )
    run_parser.add_argument(
        "--patch-torch",
        action="store_true",
        help=f"set {_config.ENV_PATCH_TORCH}=1 for the workers: distgrad stands in for "
        "torch.distributed.rpc in them and in every Python process they start, for programs "
        "and libraries that import torch's RPC (docs/libraries.md)",
    )
    run_parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run the target as a module (python -m), not as a script file",
    )
    run_parser.add_argument(
        "target",
        nargs=argparse.REMAINDER,
        metavar="script [args ...]",
        help="the script (or module, with -m) each worker runs, and its arguments",
    )
    return run_parser


def _error(message: str) -> int:
    print(f"distgrad run: error: {message}", file=sys.stderr)
    return 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _module_exists(name: str) -> bool:
    """Whether ``python -m name`` run from here can find the module's top-level package."""
    top = name.split(".", maxsplit=1)[0]
    if not top:
        return False
    sys.path.insert(0, os.getcwd())  # python -m puts the working directory first
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path.pop(0)


def worker_env(
    base: dict[str, str], rank: int, world_size: int, port: int, secret: str
) -> dict[str, str]:
    """The environment of worker ``rank`` (torchrun's variables, the secret, unbuffered I/O)."""
    env = dict(base)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(world_size),
        PYTHONUNBUFFERED="1",
    )
    env[_config.ENV_SECRET] = secret
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn``: own process group, and (Linux) SIGKILL when the launcher dies."""
    parent = os.getpid()
    prctl: Any = None
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            prctl = ctypes.CDLL(None, use_errno=True).prctl

    def setup() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:  # the launcher died before prctl took effect
                os._exit(1)

    return setup


@dataclass
class _Stream:
    """One pipe of one worker, and the part of a line read but not yet written."""

    rank: int
    pipe: IO[bytes]
    out: _Output
    pending: bytearray = field(default_factory=bytearray)


class _Output:
    """A destination (the launcher's stdout or stderr) that takes whole prefixed lines."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._broken = False

    def write(self, data: bytes) -> None:
        if self._broken:
            return  # keep draining the workers' pipes, so they never block on a full pipe
        try:
            self._stream.flush()
            buffer = getattr(self._stream, "buffer", None)
            if buffer is not None:
                buffer.write(data)
                buffer.flush()
            else:
                self._stream.write(data.decode(errors="replace"))
                self._stream.flush()
        except (OSError, ValueError):
            self._broken = True

    def line(self, prefix: bytes, line: bytes) -> None:
        self.write(prefix + line + (b"" if line.endswith(b"\n") else b"\n"))


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen[bytes]
    returncode: int | None = None


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


class _Launcher:
    def __init__(self, grace: float, stdout: _Output, stderr: _Output) -> None:
        self.grace = grace
        self.stdout = stdout
        self.stderr = stderr
        self.workers: list[_Worker] = []
        self.selector = selectors.DefaultSelector()
        self.signal: int | None = None
        self.signals_seen = 0
        self.failure: _Worker | None = None
        self.kill_at: float | None = None  # set once stopping: SIGKILL what is left then

    def say(self, message: str) -> None:
        self.stderr.write(f"distgrad run: {message}\n".encode())

    # -- signals ---------------------------------------------------------------------------------
    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.signal = self.signal or signum
        self.signals_seen += 1

    @contextlib.contextmanager
    def signals_handled(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.on_signal) for sig in _FORWARDED}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    # -- processes -------------------------------------------------------------------------------
    def start(self, argv: list[str], envs: list[dict[str, str]]) -> None:
        preexec = _die_with_parent()
        for rank, env in enumerate(envs):
            proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                preexec_fn=preexec,  # noqa: PLW1509 -- the launcher has one thread
            )
            self.workers.append(_Worker(rank, proc))
            for pipe, out in ((proc.stdout, self.stdout), (proc.stderr, self.stderr)):
                assert pipe is not None
                os.set_blocking(pipe.fileno(), False)
                self.selector.register(pipe, selectors.EVENT_READ, _Stream(rank, pipe, out))

    def live(self) -> list[_Worker]:
        return [w for w in self.workers if w.returncode is None]

    def send(self, sig: int, workers: list[_Worker]) -> None:
        """Signal each worker's process group (the worker and what it started)."""
        for worker in workers:
            try:
                os.killpg(worker.proc.pid, sig)
            except ProcessLookupError:
                pass
            except PermissionError:  # the group is gone and its id reused: the worker alone
                with contextlib.suppress(OSError):
                    worker.proc.send_signal(sig)

    def stop(self, sig: int) -> None:
        """Send ``sig`` to every live worker; SIGKILL what is left after the grace period."""
        if self.kill_at is None:
            self.send(sig, self.live())
            self.kill_at = time.monotonic() + self.grace

    def reap(self) -> None:
        for worker in self.live():
            code = worker.proc.poll()
            if code is None:
                continue
            worker.returncode = code
            self.send(signal.SIGKILL, [worker])  # what the worker left running in its group
            if code != 0 and self.failure is None and self.signal is None:
                self.failure = worker
                self.say(f"rank {worker.rank} {_describe(code)}; stopping the other workers")
                self.stop(signal.SIGTERM)

    # -- output ----------------------------------------------------------------------------------
    def pump(self, timeout: float) -> None:
        for key, _events in self.selector.select(timeout):
            stream: _Stream = key.data
            try:
                data = os.read(stream.pipe.fileno(), _READ_SIZE)
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                data = b""
            if not data:
                self.close_stream(stream)
                continue
            self.lines(stream, data)

    def lines(self, stream: _Stream, data: bytes) -> None:
        prefix = f"[{stream.rank}] ".encode()
        pending = stream.pending
        pending += data
        start = 0
        while True:
            end = pending.find(b"\n", start)
            if end < 0:
                break
            stream.out.line(prefix, bytes(pending[start : end + 1]))
            start = end + 1
        del pending[:start]
        while len(pending) >= MAX_LINE:  # bound memory: a huge line goes out in pieces
            stream.out.line(prefix, bytes(pending[:MAX_LINE]))
            del pending[:MAX_LINE]

    def close_stream(self, stream: _Stream) -> None:
        if stream.pending:
            stream.out.line(f"[{stream.rank}] ".encode(), bytes(stream.pending))
            stream.pending.clear()
        self.selector.unregister(stream.pipe)
        stream.pipe.close()

    def close_all_streams(self) -> None:
        for key in list(self.selector.get_map().values()):
            self.close_stream(key.data)
        self.selector.close()

    # -- the loop --------------------------------------------------------------------------------
    def wait(self) -> int:
        handled_signals = 0
        drain_until: float | None = None
        while True:
            self.pump(_POLL_S)
            self.reap()
            if self.signals_seen > handled_signals:
                handled_signals = self.signals_seen
                assert self.signal is not None
                if self.kill_at is None:
                    name = signal.Signals(self.signal).name
                    self.say(f"received {name}; forwarding it to the workers")
                    self.stop(self.signal)
                else:  # a second signal: no more grace
                    self.kill_at = time.monotonic()
            now = time.monotonic()
            live = self.live()
            if live and self.kill_at is not None and now >= self.kill_at:
                self.say(f"killing ranks {[w.rank for w in live]} (grace period over)")
                self.send(signal.SIGKILL, live)
                self.kill_at = float("inf")
            if not live:
                if drain_until is None:
                    drain_until = now + _DRAIN_S
                if not self.selector.get_map() or now >= drain_until:
                    break
        return self.status()

    def status(self) -> int:
        """The first cause wins: a worker's failure (recorded only before any signal), else the
        signal the launcher received."""
        if self.failure is not None:
            assert self.failure.returncode is not None
            return _exit_status(self.failure.returncode)
        if self.signal is not None:
            return 128 + self.signal
        return 0

    def kill_everything(self) -> None:
        """Last resort on the way out: nothing the launcher started may outlive it."""
        for worker in self.workers:
            if worker.returncode is None:
                self.send(signal.SIGKILL, [worker])
                with contextlib.suppress(subprocess.TimeoutExpired):
                    worker.proc.wait(5)


def run(args: argparse.Namespace) -> int:
    """``distgrad run``: launch ``args.nproc`` workers of the script; return the exit status."""
    if args.nproc < 1:
        return _error(f"-n must be at least 1, got {args.nproc}")
    if args.grace_period < 0:
        return _error(f"--grace-period must not be negative, got {args.grace_period:g}")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        return _error(f"--master-port must be in 1..65535, got {args.master_port}")
    if not args.target:
        return _error("missing the script to run (or the module, with -m)")
    script, script_args = args.target[0], args.target[1:]
    if args.module:
        if not _module_exists(script):
            return _error(f"no module named {script!r}")
        argv = [sys.executable, "-m", script, *script_args]
    else:
        if not os.path.isfile(script):
            return _error(f"script not found: {script}")
        argv = [sys.executable, script, *script_args]
    port = args.master_port if args.master_port is not None else _free_port()
    secret = _config.env_str(_config.ENV_SECRET) or secrets.token_hex(32)
    base = dict(os.environ)
    if getattr(args, "patch_torch", False):
        base[_config.ENV_PATCH_TORCH] = "1"
    envs = [worker_env(base, rank, args.nproc, port, secret) for rank in range(args.nproc)]
    launcher = _Launcher(args.grace_period, _Output(sys.stdout), _Output(sys.stderr))
    with launcher.signals_handled():
        try:
            launcher.start(argv, envs)
            status = launcher.wait()
        finally:
            launcher.kill_everything()
            launcher.close_all_streams()
    return status
