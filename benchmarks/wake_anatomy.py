"""Where the wake-ups of a same-host call come from, counted per thread (issue 28, sixth session).

Two measurements, no TensorPipe (``call_cost.py`` counts per process; this one explains):

* ``pingpong``: a 52-byte request / 20-byte answer ping-pong between two Python processes over
  Unix socket pairs, the answering side working ``--work`` µs (busy) before it answers, the
  asking side waiting either in a blocking ``recv`` or in ``poll(POLLIN)`` then ``recv``.
  Prints the asking process's voluntary context switches (sleeps), CPU and wall per round
  trip. With work before the answer, a blocking ``recv`` sleeps twice per round trip: when the
  peer reads the request, the kernel frees its buffer and wakes every sleeper on the socket to
  say there is room to write (``unix_write_space``); the reader finds no data and sleeps
  again. ``poll`` waits only for the events it asks for; ``split`` (requests on one socket
  pair, answers on another) gives the kernel no sleeper to wake.
* ``threads``: a real 2-process distgrad group (``_common.run_group``) making ``--calls``
  ``rpc_sync`` no-ops; per thread of each process (named from the process's own
  ``threading.enumerate()``), its sleeps per call, and each process's user and system CPU per
  call (``os.times()``).

Usage::

    python benchmarks/wake_anatomy.py pingpong [--work 40] [--rounds 10000]
    python benchmarks/wake_anatomy.py threads [--calls 10000]
"""

from __future__ import annotations

import argparse
import os
import resource
import select
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import noop, run_group


# -- pingpong -------------------------------------------------------------------------------------
def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _receive(sock: socket.socket, poller: Any, mode: str) -> bytes:
    if mode == "poll":
        poller.poll()
        return sock.recv(256, socket.MSG_DONTWAIT)
    return sock.recv(256)


def pingpong(mode: str, work_us: float, rounds: int) -> dict[str, float]:
    """One run; the asking process's figures per round trip. ``mode``: ``recv`` or ``poll``
    (how the asking side waits), or ``split``: a blocking ``recv``, but each side writes on
    one socket pair and reads on another (no one sleeps on a socket it writes to)."""
    asking, answering = socket.socketpair()
    asked, answered = asking, answering  # (the answers' pair)
    if mode == "split":
        asked, answered = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the answering process: read, work, answer
        for _ in range(rounds + 1000):
            if not answering.recv(256):
                break
            _spin(work_us * 1e-6)
            answered.send(b"a" * 20)
        os._exit(0)
    poller = select.poll()
    poller.register(asked, select.POLLIN)
    try:
        for _ in range(1000):  # warm
            asking.send(b"q" * 52)
            _receive(asked, poller, mode)
        before = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        for _ in range(rounds):
            asking.send(b"q" * 52)
            _receive(asked, poller, mode)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        for sock in {asking, answering, asked, answered}:
            sock.close()
        os.waitpid(pid, 0)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {
        "wall_us": wall / rounds * 1e6,
        "cpu_us": cpu / rounds * 1e6,
        "sleeps": (after.ru_nvcsw - before.ru_nvcsw) / rounds,
    }


# -- threads --------------------------------------------------------------------------------------
def _sleeps(pid: int) -> dict[int, int]:
    """Voluntary context switches of each thread of ``pid``, by thread id."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        out[int(tid)] = int(line.split()[1])
        except OSError:
            continue
    return out


def thread_names() -> dict[int, str]:
    """This process's Python threads by native id (run in the callee through RPC)."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def process_state() -> tuple[int, float, float]:
    times = os.times()
    return os.getpid(), times.user, times.system


def threads_caller(rpc: Any, dst: str, cfg: dict[str, Any]) -> dict[str, Any]:
    n = cfg["calls"]
    for _ in range(2000):
        rpc.rpc_sync(dst, noop)
    peer, *_ = rpc.rpc_sync(dst, process_state)
    me = os.getpid()
    before = (_sleeps(me), _sleeps(peer))
    mine = os.times()
    theirs = rpc.rpc_sync(dst, process_state)
    for _ in range(n):
        rpc.rpc_sync(dst, noop)
    theirs_after = rpc.rpc_sync(dst, process_state)
    mine_after = os.times()
    after = (_sleeps(me), _sleeps(peer))
    names = (thread_names(), rpc.rpc_sync(dst, thread_names))
    result: dict[str, Any] = {
        "caller_cpu_us": {
            "user": (mine_after.user - mine.user) / n * 1e6,
            "system": (mine_after.system - mine.system) / n * 1e6,
        },
        "callee_cpu_us": {
            "user": (theirs_after[1] - theirs[1]) / n * 1e6,
            "system": (theirs_after[2] - theirs[2]) / n * 1e6,
        },
    }
    for side, index in (("caller", 0), ("callee", 1)):
        per_thread = {}
        for tid, count in after[index].items():
            delta = count - before[index].get(tid, 0)
            if delta:
                name = names[index].get(tid, f"thread {tid} (not Python)")
                per_thread[name] = delta / n
        result[f"{side}_sleeps_per_call"] = per_thread
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("pingpong", "threads"))
    parser.add_argument("--work", type=float, default=40.0, help="µs of work before an answer")
    parser.add_argument("--rounds", type=int, default=10000)
    parser.add_argument("--calls", type=int, default=10000)
    args = parser.parse_args(argv)
    if args.part == "pingpong":
        for work in sorted({0.0, args.work}):
            for mode in ("recv", "poll", "split", "split", "poll", "recv"):
                got = pingpong(mode, work, args.rounds)
                print(
                    f"work {work:4.0f} µs, {mode:5}: {got['wall_us']:6.1f} µs per round "
                    f"trip, {got['cpu_us']:5.1f} µs CPU, {got['sleeps']:.3f} sleeps"
                )
        return 0
    result = run_group("distgrad", threads_caller, {"calls": args.calls})
    if not result.ok:
        print(result.log_tail, file=sys.stderr)
        return 1
    for key, value in result.value.items():
        shown = {k: round(v, 3) for k, v in value.items()}
        print(f"{key}: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
