"""A process of the elastic end-to-end tests (``test_elastic.py``); run as a script.

``python elastic_worker.py member NAME RANK PORT``: join the dynamic group led at
``tcp://127.0.0.1:PORT``, serve until the leader calls :func:`leave_now` (or 60 s pass), then
leave with a graceful ``rpc.shutdown()``.

``python elastic_worker.py leader PORT``: rank 0; runs the scenario (members join, one is killed
and relaunched under its name, one leaves) and prints one JSON line of what it saw.
``leader-dies``, ``death-mid-join`` and ``leave-after-failed-fork`` are other scenarios of
rank 0 (see their functions).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc

_leave = threading.Event()
#: set once this worker's ``init_rpc`` returned: its join is complete (committed to the store)
_joined = threading.Event()
HERE = Path(__file__).resolve()


def leave_now() -> None:
    _leave.set()


def whoami() -> str:
    return rpc.get_worker_info().name


def has_joined() -> bool:
    return _joined.is_set()


def joined(name: str) -> bool:
    """Whether ``name``'s join is complete: a member is in the others' views (and answers
    calls) before its ``init_rpc`` has committed the join to the store and returned."""
    try:
        return bool(rpc.rpc_sync(name, has_joined, timeout=2))
    except Exception:
        return False


def slow(seconds: float) -> int:
    time.sleep(seconds)
    return 1


def options(port: int) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=20, num_worker_threads=4
    )


def member(name: str, rank: int, port: int) -> None:
    rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=options(port))
    _joined.set()
    print(f"{name} joined", flush=True)
    _leave.wait(60)
    rpc.shutdown()


def spawn(name: str, rank: int, port: int, role: str = "member") -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(HERE), role, name, str(rank), str(port)],
        stdout=None if role == "survivor" else subprocess.DEVNULL,
    )


def survivor(name: str, rank: int, port: int) -> None:
    """After the leader dies: calls and autograd between the members still work, and leaving
    without the store returns."""
    rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=options(port))
    _joined.set()
    wait_for(lambda: "w2" in names(), "w2 to join")
    seen: dict[str, Any] = {}

    def leader_gone() -> bool:
        try:
            rpc.rpc_sync("w0", whoami, timeout=2)
            return False
        except Exception as exc:
            seen["leader"] = f"{type(exc).__name__}: {exc}"
            return True

    wait_for(leader_gone, "the leader to die")
    seen["w2"] = rpc.rpc_sync("w2", whoami)
    seen["step"] = step(["w2"])
    rpc.rpc_sync("w2", leave_now)
    wait_for(lambda: "w2" not in names(), "w2 to leave")
    started = time.monotonic()
    rpc.shutdown()
    seen["shutdown_s"] = round(time.monotonic() - started, 2)
    print(json.dumps(seen), flush=True)


def leader_dies(port: int) -> None:
    """Rank 0 starts two members, then dies (os._exit: no goodbye, its store gone)."""
    rpc.init_rpc("w0", rank=0, world_size=None, rpc_backend_options=options(port))
    spawn("w1", 1, port, "survivor")
    time.sleep(0.5)
    spawn("w2", 2, port)
    wait_for(lambda: len(names()) == 3, "the members to join")
    # (dying while w2 still commits its join to this worker's store fails that join: the
    # scenario is the loss of a leader after its members are in)
    wait_for(lambda: joined("w1") and joined("w2"), "the members' joins to complete")
    os._exit(0)


def members_seen() -> list[str]:
    """This worker's view of the group (asked of each member by RPC)."""
    return names()


def death_mid_join(port: int) -> None:
    """A joiner is SIGKILLed mid-join, holding the membership token (it told w0, and waits
    for w1, which is frozen); a later joiner must still get in, and every view must agree."""
    rpc.init_rpc("w0", rank=0, world_size=None, rpc_backend_options=options(port))
    seen: dict[str, Any] = {}
    procs = [spawn("w1", 1, port)]
    try:
        # (w1 is in the view before its join is committed and the token released: frozen
        # before that, w1 itself would hold the token, and its join be rolled back)
        wait_for(lambda: names() == ["w0", "w1"] and joined("w1"), "w1's join to complete")
        os.kill(procs[0].pid, signal.SIGSTOP)
        procs.append(spawn("w2", 2, port))
        wait_for(lambda: "w2" in names(), "w2 to tell w0 it joins")
        os.kill(procs[1].pid, signal.SIGKILL)  # it holds the token, waiting on frozen w1
        procs[1].wait(10)
        os.kill(procs[0].pid, signal.SIGCONT)
        started = time.monotonic()
        procs.append(spawn("w3", 3, port))
        try:
            wait_for(lambda: "w3" in names(), "w3 to join", timeout=40)
            seen["join_s"] = round(time.monotonic() - started, 2)
        except TimeoutError as exc:
            seen["join_s"] = str(exc)
            print(json.dumps(seen), flush=True)
            return
        wait_for(lambda: "w2" not in names(), "w2 to be dropped", timeout=10)
        seen["views"] = {
            "w0": names(),
            "w1": rpc.rpc_sync("w1", members_seen),
            "w3": rpc.rpc_sync("w3", members_seen),
        }
        seen["step"] = step(["w1", "w3"])
        for name in ("w3", "w1"):
            rpc.rpc_sync(name, leave_now)
        wait_for(lambda: names() == ["w0"], "w1 and w3 to leave")
        seen["exit"] = [procs[0].wait(30), procs[2].wait(30)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        rpc.shutdown()
    print(json.dumps(seen), flush=True)


_forked: list[Any] = []
LEAVE_FILE = "DISTGRAD_TEST_LEAVE_FILE"  # where ``forker`` writes how long its leave took


def rref_sum(rref: Any) -> float:
    """On the owner (as RemoteModule's forward): use the RRef passed to it."""
    return float(rref.local_value().sum())


def forker_make_rref() -> None:
    """On w2: a UserRRef owned by w1."""
    rref = rpc.remote("w1", torch.ones, args=(2,))
    rref.to_here()
    _forked.append(rref)


def forker_call_owner() -> str:
    """On w2: pass the RRef to its owner, w1 (frozen now): the call fails, its fork unsettled."""
    try:
        return str(rpc.rpc_sync("w1", rref_sum, args=(_forked[0],), timeout=0))
    except rpc.PeerFailureError as exc:
        return f"PeerFailureError: {exc}"


def forker(name: str, rank: int, port: int) -> None:
    """A member whose call carrying an RRef fails; it then leaves, timing its leave."""
    rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=options(port))
    _joined.set()
    _leave.wait(90)
    _forked.clear()
    started = time.monotonic()
    rpc.shutdown(timeout=30)
    Path(os.environ[LEAVE_FILE]).write_text(f"{time.monotonic() - started:.2f}")


def leave_after_failed_fork(port: int) -> None:
    """w2's call passing an RRef to its owner w1 fails (w1 frozen), w1 is killed and
    relaunched under its name, then w2 leaves: its leave must not wait for the fork that
    failed (before: the whole 30 s timeout, "pending forks not settled in time")."""
    rpc.init_rpc("w0", rank=0, world_size=None, rpc_backend_options=options(port))
    events: list[str] = []
    rpc.add_membership_listener(lambda e: events.append(str(e)))
    seen: dict[str, Any] = {}
    leave_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"distgrad-leave-{os.getpid()}"
    os.environ[LEAVE_FILE] = str(leave_file)
    procs = [spawn("w1", 1, port)]
    try:
        wait_for(lambda: names() == ["w0", "w1"], "w1 to join")
        procs.append(spawn("w2", 2, port, "forker"))
        # (complete, token released, before w1 freezes: see death_mid_join)
        wait_for(lambda: names() == ["w0", "w1", "w2"] and joined("w2"), "w2's join to complete")
        rpc.rpc_sync("w2", forker_make_rref)
        os.kill(procs[0].pid, signal.SIGSTOP)
        seen["call"] = rpc.rpc_sync("w2", forker_call_owner, timeout=60)
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(10)
        procs.append(spawn("w1", 1, port))  # relaunched under the same name
        wait_for(lambda: "w1 (rank 1) restarted" in " ".join(events), "w1 to rejoin", 60)
        rpc.rpc_sync("w2", leave_now)
        wait_for(lambda: "w2" not in names(), "w2 to leave", 60)
        procs[1].wait(30)
        seen["leave_s"] = float(leave_file.read_text())
        rpc.rpc_sync("w1", leave_now)
        wait_for(lambda: names() == ["w0"], "w1 to leave", 60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        leave_file.unlink(missing_ok=True)
        rpc.shutdown()
    print(json.dumps(seen), flush=True)


def wait_for(condition: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def names() -> list[str]:
    return [w.name for w in rpc.members()]


def step(members: list[str]) -> bool:
    """A distributed autograd step through ``members``; True if it equals local autograd."""
    w = torch.randn(3, requires_grad=True)
    with dist_autograd.context() as context_id:
        x = w
        for i, dst in enumerate(members):
            x = rpc.rpc_sync(dst, torch.mul, args=(x, float(i + 2)))
        dist_autograd.backward(context_id, [(x * x).sum()])
        grad = dist_autograd.get_gradients(context_id)[w]
    local = w.detach().clone().requires_grad_()
    y = local
    for i in range(len(members)):
        y = y * float(i + 2)
    (y * y).sum().backward()
    assert local.grad is not None
    return bool(torch.allclose(grad, local.grad))


def leader(port: int) -> None:
    rpc.init_rpc("w0", rank=0, world_size=None, rpc_backend_options=options(port))
    events: list[str] = []
    rpc.add_membership_listener(lambda e: events.append(str(e)))
    seen: dict[str, Any] = {}
    procs = [spawn("w1", 1, port)]
    try:
        # (complete, before w1 is killed: see death_mid_join)
        wait_for(lambda: names() == ["w0", "w1"] and joined("w1"), "w1's join to complete")
        seen["w1"] = rpc.rpc_sync("w1", whoami)
        seen["step_2"] = step(["w1"])
        rref = rpc.remote("w1", torch.ones, args=(2,))
        seen["rref_before"] = rref.to_here().tolist()
        pending = rpc.rpc_async("w1", slow, args=(30.0,))
        time.sleep(0.3)
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(10)
        procs.append(spawn("w1", 1, port))  # relaunched under the same name
        wait_for(lambda: "w1 (rank 1) restarted" in events, "w1 to rejoin")
        try:
            pending.wait()
            seen["pending"] = "no error"
        except Exception as exc:
            seen["pending"] = f"{type(exc).__name__}: {exc}"
        try:
            rref.to_here()
            seen["rref_after"] = "no error"
        except Exception as exc:
            seen["rref_after"] = f"{type(exc).__name__}: {exc}"
        del rref
        seen["w1_again"] = rpc.rpc_sync("w1", whoami)
        procs.append(spawn("w2", 2, port))
        wait_for(lambda: "w2" in names(), "w2 to join")
        seen["step_3"] = step(["w1", "w2"])
        info = rpc.get_worker_info("w2")
        rpc.rpc_sync("w2", leave_now)
        wait_for(lambda: "w2" not in names(), "w2 to leave")
        try:
            rpc.rpc_sync(info, whoami)
            seen["after_leave"] = "no error"
        except Exception as exc:
            seen["after_leave"] = f"{type(exc).__name__}: {exc}"
        seen["step_after_leave"] = step(["w1"])
        rpc.rpc_sync("w1", leave_now)
        wait_for(lambda: names() == ["w0"], "w1 to leave")
        seen["events"] = events
        for proc in procs[1:]:
            seen.setdefault("exit", []).append(proc.wait(30))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        rpc.shutdown()
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "member":
        member(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "survivor":
        survivor(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "leader-dies":
        leader_dies(int(sys.argv[2]))
    elif sys.argv[1] == "death-mid-join":
        death_mid_join(int(sys.argv[2]))
    elif sys.argv[1] == "forker":
        forker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "leave-after-failed-fork":
        leave_after_failed_fork(int(sys.argv[2]))
    else:
        leader(int(sys.argv[2]))
