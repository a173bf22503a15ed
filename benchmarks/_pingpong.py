"""The floor under every RPC on one host: a 16-byte ping-pong between two Python processes over a
Unix socket, with blocking I/O (one ``send`` and one ``recv`` per message each way, two process
wake-ups per round trip, no threads, no pickling). ``rpc_bench.py`` and ``ab_rpc.py`` measure it
in the same invocation as the RPCs they compare with it.

``pin=(a, b)`` runs the two processes pinned to CPUs ``a`` and ``b`` (``taskset``-like): on
different cores each message costs a cross-core wake-up, the floor an RPC between two processes
on two cores cannot go under; unpinned, a quiet scheduler may put both on one core, where a
wake-up is cheap."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

MESSAGE = 16

# The other process: echo every 16-byte message until the socket closes.
_ECHO = """
import os, socket, sys
if len(sys.argv) > 2:
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
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    argv = [sys.executable, "-c", _ECHO, str(theirs.fileno())]
    previous = None
    if pin is not None:
        argv.append(str(pin[1]))
        previous = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {pin[0]})
    child = subprocess.Popen(argv, pass_fds=(theirs.fileno(),))
    theirs.close()
    try:
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
    finally:
        if previous is not None:
            os.sched_setaffinity(0, previous)
        mine.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


if __name__ == "__main__":
    import statistics

    print(f"ping-pong median {statistics.median(pingpong_us()):.2f} µs")
    pair = pin_pair()
    if pair is not None:
        print(f"pinned to CPUs {pair}: median {statistics.median(pingpong_us(pin=pair)):.2f} µs")
