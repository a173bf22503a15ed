"""The floor under every RPC on one host: a 16-byte ping-pong between two Python processes over a
Unix socket, with blocking I/O (one ``send`` and one ``recv`` per message each way, two process
wake-ups per round trip, no threads, no pickling). ``rpc_bench.py`` and ``ab_rpc.py`` measure it
in the same invocation as the RPCs they compare with it.

``pin=(a, b)`` runs the two processes pinned to CPUs ``a`` and ``b`` (``taskset``-like): on
different cores each message costs a cross-core wake-up, the floor an RPC between two processes
on two cores cannot go under; unpinned, a quiet scheduler may put both on one core, where a
wake-up is cheap.

:func:`minimal_rpc` is the floor of a *Python* RPC: the same two processes, but each message is
a request an RPC library must at least make -- ``(function, args, kwargs)`` pickled behind a
16-byte header, unpickled and called on the other side, its result pickled back -- with no
threads, timeouts, call table, statistics or failure detection. Its CPU per call on each side
is what a pure-Python message path cannot go under on the machine."""

from __future__ import annotations

import json
import os
import pickle
import resource
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MESSAGE = 16

# The other process: echo every 16-byte message until the socket closes.
_ECHO = """
import os, socket, sys
if sys.argv[2] != "-":
    os.sched_setaffinity(0, {int(sys.argv[2])})
sock = socket.socket(fileno=int(sys.argv[1]))
buf = bytearray(16)
view = memoryview(buf)
while True:
    got = 0
    while got < 16:
        n = sock.recv_into(view[got:])
        if n == 0:
            sys.exit(0)
        got += n
    sock.sendall(buf)
"""


# The other process of minimal_rpc: serve every request until the socket closes; then print its
# CPU time and voluntary context switches per request served after the first ``warmup``.
_SERVE = """
import json, os, pickle, resource, socket, struct, sys
if sys.argv[2] != "-":
    os.sched_setaffinity(0, {int(sys.argv[2])})
sys.path.insert(0, sys.argv[3])
header = struct.Struct("<QQ")
warmup = int(sys.argv[4])
sock = socket.socket(fileno=int(sys.argv[1]))
recv_into, sendall, loads, dumps = sock.recv_into, sock.sendall, pickle.loads, pickle.dumps
buf = bytearray(1 << 16)
view = memoryview(buf)
served, start = 0, None
while True:
    got = 0
    while got < 16:
        n = recv_into(view[got:])
        if n == 0:
            end = resource.getrusage(resource.RUSAGE_SELF)
            calls = max(1, served - warmup)
            print(json.dumps({
                "user_us": (end.ru_utime - start.ru_utime) / calls * 1e6,
                "sys_us": (end.ru_stime - start.ru_stime) / calls * 1e6,
                "sleeps": (end.ru_nvcsw - start.ru_nvcsw) / calls,
            }) if start is not None else "{}", flush=True)
            sys.exit(0)
        got += n
    message_id, length = header.unpack_from(buf)
    while got < 16 + length:
        got += recv_into(view[got:])
    func, args, kwargs = loads(view[16:16 + length])
    body = dumps(func(*args, **(kwargs or {})), 5)
    sendall(header.pack(message_id, len(body)) + body)
    served += 1
    if served == warmup:
        start = resource.getrusage(resource.RUSAGE_SELF)
"""

_HEADER = struct.Struct("<QQ")


def noop() -> None:
    """What :func:`minimal_rpc` calls."""


def minimal_rpc(
    iters: int = 20000, warmup: int = 2000, pin: tuple[int, int] | None = None
) -> tuple[list[float], dict[str, float]]:
    """Round-trip times (µs) of a no-op call (:func:`noop`) made the least way a Python RPC
    can, to a child process over a Unix socket; and each side's CPU (``caller_user_us``,
    ``caller_sys_us``, ``callee_user_us``, ``callee_sys_us``) and voluntary context switches
    (``caller_sleeps``, ``callee_sleeps``) per call. ``pin`` as for :func:`pingpong_us`."""
    func = noop
    if __name__ == "__main__":  # (by the module's name, which the child imports)
        import _pingpong

        func = _pingpong.noop
    here = str(Path(__file__).resolve().parent)
    with _child(_SERVE, [here, str(warmup)], pin) as (mine, output):
        buf = bytearray(1 << 16)
        view = memoryview(buf)
        clock = time.perf_counter_ns
        recv_into, sendall, loads, dumps = mine.recv_into, mine.sendall, pickle.loads, pickle.dumps
        samples: list[float] = []
        start = resource.getrusage(resource.RUSAGE_THREAD)
        for i in range(warmup + iters):
            if i == warmup:
                start = resource.getrusage(resource.RUSAGE_THREAD)
            t0 = clock()
            body = dumps((func, (), None), 5)
            sendall(_HEADER.pack(i, len(body)) + body)
            got = 0
            while got < 16 or got < 16 + _HEADER.unpack_from(buf)[1]:
                n = recv_into(view[got:])
                if n == 0:
                    raise RuntimeError("the serving process exited")
                got += n
            loads(view[16:got])
            if i >= warmup:
                samples.append((clock() - t0) / 1e3)
        end = resource.getrusage(resource.RUSAGE_THREAD)
    cpu = {
        "caller_user_us": (end.ru_utime - start.ru_utime) / iters * 1e6,
        "caller_sys_us": (end.ru_stime - start.ru_stime) / iters * 1e6,
        "caller_sleeps": (end.ru_nvcsw - start.ru_nvcsw) / iters,
    }
    out = output[0].strip()
    served = json.loads(out.splitlines()[-1]) if out else {}
    cpu.update({f"callee_{key}": value for key, value in served.items()})
    return samples, cpu


@contextmanager
def _child(
    script: str, args: list[str], pin: tuple[int, int] | None
) -> Iterator[tuple[socket.socket, list[str]]]:
    """Run ``script`` in a child Python process with one end of a Unix socket pair (its fd,
    then the CPU to pin to or ``-``, then ``args``); yield the other end, and a list that holds
    the child's standard output once the block is left (the socket closed, the child waited
    for at most 10 s, then killed). With ``pin``, this thread runs on CPU ``pin[0]`` meanwhile."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    where = "-" if pin is None else str(pin[1])
    argv = [sys.executable, "-c", script, str(theirs.fileno()), where, *args]
    previous = None
    if pin is not None:
        previous = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {pin[0]})
    child = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdout=subprocess.PIPE, text=True)
    theirs.close()
    output: list[str] = []
    try:
        yield mine, output
    finally:
        if previous is not None:
            os.sched_setaffinity(0, previous)
        mine.close()
        try:
            out, _ = child.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            out, _ = child.communicate()
        output.append(out or "")


def pin_pair() -> tuple[int, int] | None:
    """Two different CPUs this process may run on (None if it has only one)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else None


def pingpong_us(
    iters: int = 20000, warmup: int = 2000, pin: tuple[int, int] | None = None
) -> list[float]:
    """Round-trip times (µs), one per message, of 16 bytes to a child Python process and back;
    with ``pin``, this thread on CPU ``pin[0]`` and the child on ``pin[1]`` meanwhile."""
    with _child(_ECHO, [], pin) as (mine, _output):
        message = b"x" * MESSAGE
        buf = bytearray(MESSAGE)
        view = memoryview(buf)
        clock = time.perf_counter_ns
        samples: list[float] = []
        for i in range(warmup + iters):
            t0 = clock()
            mine.sendall(message)
            got = 0
            while got < MESSAGE:
                n = mine.recv_into(view[got:])
                if n == 0:
                    raise RuntimeError("the echo process exited")
                got += n
            if i >= warmup:
                samples.append((clock() - t0) / 1e3)
        return samples


if __name__ == "__main__":
    import statistics

    def show(label: str, found: tuple[list[float], dict[str, float]]) -> None:
        times, cpu = found
        print(
            f"{label}: median {statistics.median(times):.2f} µs; CPU per call caller "
            f"{cpu['caller_user_us']:.1f} + {cpu['caller_sys_us']:.1f} µs (user + sys), "
            f"{cpu['caller_sleeps']:.2f} sleeps; callee {cpu.get('callee_user_us', 0):.1f} + "
            f"{cpu.get('callee_sys_us', 0):.1f} µs, {cpu.get('callee_sleeps', 0):.2f} sleeps"
        )

    print(f"ping-pong median {statistics.median(pingpong_us()):.2f} µs")
    pair = pin_pair()
    if pair is not None:
        print(f"pinned to CPUs {pair}: median {statistics.median(pingpong_us(pin=pair)):.2f} µs")
    show("minimal Python RPC", minimal_rpc())
    if pair is not None:
        show(f"minimal Python RPC pinned to CPUs {pair}", minimal_rpc(pin=pair))
