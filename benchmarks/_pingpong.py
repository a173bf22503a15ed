"""The floor under every RPC on one host: a 16-byte ping-pong between two Python processes over a
Unix socket, with blocking I/O (one ``send`` and one ``recv`` per message each way, two process
wake-ups per round trip, no threads, no pickling). ``rpc_bench.py`` and ``ab_rpc.py`` measure it
in the same invocation as the RPCs they compare with it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

MESSAGE = 16

# The other process: echo every 16-byte message until the socket closes.
_ECHO = """
import socket, sys
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


def pingpong_us(iters: int = 20000, warmup: int = 2000) -> list[float]:
    """Round-trip times (µs), one per message, of 16 bytes to a child Python process and back."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = subprocess.Popen(
        [sys.executable, "-c", _ECHO, str(theirs.fileno())], pass_fds=(theirs.fileno(),)
    )
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
        mine.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


if __name__ == "__main__":
    import statistics

    print(f"ping-pong median {statistics.median(pingpong_us()):.2f} µs")
