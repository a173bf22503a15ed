"""The marathon, short: an elastic group on three network-namespace "hosts" trains with
distributed autograd and RemoteModules for about two minutes while its members are frozen
(SIGSTOP), cut off (their host's link down), SIGKILLed and relaunched, leave and rejoin, and one
dies mid-join holding the membership token. Skips cleanly where namespaces cannot be made.

The group's store runs outside the members (a ``TCPStore`` process on host 0, members with
``TORCHELASTIC_USE_AGENT_STORE=True``), as docs/elastic.md recommends. The trainer (rank 0, on
host 0) is the one process never faulted: it drives the steps and reports (``marathon_worker``).
Asserted: no hang (every step and the whole run bounded), every gradient equal to
single-process torch's, every member live and listing the same group at the end, every error
naming a member faulted at that moment and reaching the program within the bound, and no
graceful leave over a few seconds. ``DISTGRAD_MARATHON_ROUNDS`` sets the rounds of faults
(default 2); ``DISTGRAD_MARATHON_DUMP=path`` writes every process's output, the faults and the
errors to ``path`` (a post-mortem)."""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest

from tests._harness import REPO
from tests._needs import needs
from tests._netns import Hosts, unavailable

ROUNDS = int(os.environ.get("DISTGRAD_MARATHON_ROUNDS", "2"))

pytestmark = [
    pytest.mark.timeout(120 + 90 * ROUNDS),
    needs(unavailable()),
]

WORKER = REPO / "tests" / "e2e" / "marathon_worker.py"
PORT = 29700
#: peer_timeout + heartbeat_interval (the defaults, 4 s + 1 s): the documented bound of an error
#: after its peer went silent (docs/failure-semantics.md), plus 1.5 s of slack for loaded cores
ERROR_BOUND_S = 4.0 + 1.0 + 1.5
#: no step may take longer than a call's timeout (``rpc_timeout``): nothing hangs
STEP_BOUND_S = 20.0
#: a graceful leave takes about its messages' round trips
LEAVE_BOUND_S = 3.0
#: host of each member: two on host 1, two on host 2 (cutting a host off cuts two members);
#: m5, m6 ... are the members that die mid-join (one a round) and are relaunched
HOST_OF = {1: 1, 2: 2, 3: 1, 4: 2, **{5 + n: 1 + n % 2 for n in range(ROUNDS)}}


@dataclass
class Proc:
    """A worker process and the lines it printed (read by a thread)."""

    popen: subprocess.Popen[str]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    seen: list[str] = field(default_factory=list)

    def start_reading(self) -> None:
        def read() -> None:
            assert self.popen.stdout is not None
            for line in self.popen.stdout:
                self.lines.put(line.rstrip("\n"))

        threading.Thread(target=read, daemon=True).start()

    def wait_line(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {prefix!r} line in {timeout:g}s; saw {self.seen[-20:]}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def drain(self) -> list[str]:
        """Every line printed so far (those not waited for included)."""
        while True:
            try:
                self.seen.append(self.lines.get_nowait())
            except queue.Empty:
                return self.seen

    def send(self, line: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def signal(self, sig: int) -> None:
        os.killpg(self.popen.pid, sig)


@dataclass
class Fault:
    kind: str
    members: list[str]
    start: float
    end: float = 0.0


class Marathon:
    def __init__(self, hosts: Hosts) -> None:
        self.hosts = hosts
        self.store = f"{hosts.address(0)}:{PORT}"
        self.env = {
            k: v for k, v in os.environ.items() if not k.startswith(("DISTGRAD_", "MASTER_"))
        }
        self.env.update(
            PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]),
            DISTGRAD_SECRET=secrets.token_hex(32),
            TORCHELASTIC_USE_AGENT_STORE="True",
            OMP_NUM_THREADS="1",
        )
        self.members: dict[int, Proc] = {}
        #: every process started (relaunches under "m3#2" ...), for a post-mortem
        self.everyone: dict[str, Proc] = {}
        self.faults: list[Fault] = []
        self.leave_s: list[float] = []
        self.join_after_death_s: list[float] = []
        self.trainer = self.start(0, ["trainer", self.store])
        self.everyone["trainer"] = self.trainer

    def start(self, host: int, args: list[str]) -> Proc:
        proc = Proc(
            self.hosts.popen(host, [sys.executable, str(WORKER), *args], self.env, stdin=True)
        )
        proc.start_reading()
        return proc

    def launch(self, rank: int, wait: bool = True) -> Proc:
        proc = self.start(HOST_OF[rank], ["member", str(rank), self.store])
        self.members[rank] = proc
        n = sum(1 for name in self.everyone if name.split("#")[0] == f"m{rank}")
        self.everyone[f"m{rank}#{n + 1}"] = proc
        if wait:
            proc.wait_line("JOINED", 60)
        return proc

    def settle(self, seconds: float) -> None:
        time.sleep(seconds)

    def fault(self, kind: str, ranks: list[int]) -> Fault:
        record = Fault(kind, [f"m{r}" for r in ranks], time.time())
        self.faults.append(record)
        return record

    # -- the faults ------------------------------------------------------------------------------
    def freeze(self, rank: int, seconds: float) -> None:
        record = self.fault("freeze", [rank])
        self.members[rank].signal(signal.SIGSTOP)
        time.sleep(seconds)
        self.members[rank].signal(signal.SIGCONT)
        record.end = time.time()

    def cut(self, host: int, seconds: float) -> None:
        record = self.fault(
            "cut", [r for r, h in HOST_OF.items() if h == host and r in self.members]
        )
        self.hosts.partition(host)
        time.sleep(seconds)
        self.hosts.heal(host)
        record.end = time.time()

    def kill_and_relaunch(self, rank: int) -> None:
        record = self.fault("kill", [rank])
        self.members[rank].signal(signal.SIGKILL)
        self.members[rank].popen.wait(10)
        self.launch(rank)
        record.end = time.time()

    def leave_and_rejoin(self, rank: int) -> None:
        record = self.fault("leave", [rank])
        proc = self.members[rank]
        proc.send("leave")
        self.leave_s.append(float(proc.wait_line("LEFT", 30).split()[1]))
        assert proc.popen.wait(30) == 0
        self.launch(rank)
        record.end = time.time()

    def death_mid_join(self, rank: int, frozen: int) -> None:
        """``rank`` joins while ``frozen`` is stopped; it is SIGKILLed once it has told the
        trainer (so it holds the token, waiting on the frozen member); then relaunched."""
        record = self.fault("death-mid-join", [rank, frozen])
        self.members[frozen].signal(signal.SIGSTOP)
        doomed = self.launch(rank, wait=False)
        deadline = time.monotonic() + 60
        while f"m{rank} (rank {rank}) joined" not in self.trainer.wait_line(
            "EVENT", max(0.1, deadline - time.monotonic())
        ):
            pass
        doomed.signal(signal.SIGKILL)
        doomed.popen.wait(10)
        time.sleep(1.0)
        self.members[frozen].signal(signal.SIGCONT)
        started = time.monotonic()
        self.launch(rank)
        self.join_after_death_s.append(round(time.monotonic() - started, 2))
        record.end = time.time()

    def finish(self) -> tuple[dict[str, object], list[dict[str, object]]]:
        """Stop training (the trainer checks views and steps once more on each member); every
        member leaves, then the trainer."""
        self.trainer.send("stop")
        result: dict[str, object] = json.loads(self.trainer.wait_line("RESULT", 60)[7:])
        for proc in self.members.values():  # all at once: they take the token in turn
            proc.send("leave")
        for rank, proc in sorted(self.members.items()):
            self.leave_s.append(float(proc.wait_line("LEFT", 30).split()[1]))
            assert proc.popen.wait(30) == 0, rank
        self.trainer.send("leave")
        self.leave_s.append(float(self.trainer.wait_line("LEFT", 30).split()[1]))
        errors = [json.loads(x[6:]) for x in self.trainer.seen if x.startswith("ERROR ")]
        return result, errors


def run_marathon(hosts: Hosts) -> tuple[Marathon, dict[str, object], list[dict[str, object]]]:
    """Start the store, the trainer and members m1-m4; ``ROUNDS`` rounds of one fault of each
    kind, a few seconds apart; finish."""
    store = Proc(
        hosts.popen(
            0,
            [sys.executable, str(WORKER), "store", str(PORT)],
            {**os.environ, "PYTHONPATH": str(REPO / "src")},
            stdin=True,
        )
    )
    store.start_reading()
    store.wait_line("READY", 60)
    m = Marathon(hosts)
    m.trainer.wait_line("JOINED", 60)
    for rank in (1, 2, 3, 4):
        m.launch(rank)
    m.settle(3)
    for n in range(ROUNDS):  # frozen and cut off past peer_timeout (4 s), so that calls fail
        m.freeze(1, 5.0 + n)
        m.settle(2)
        m.cut(2, 5.0 + n)
        m.settle(2)
        m.kill_and_relaunch(3)
        m.settle(2)
        m.leave_and_rejoin(4)
        m.settle(2)
        m.death_mid_join(5 + n, frozen=2)
        m.settle(2)
    result, errors = m.finish()
    return m, result, errors


def _fault_of(error: dict[str, object], faults: list[Fault]) -> tuple[Fault, float] | None:
    """The fault on the error's member that the failed step ran into (the step started before
    the fault's effect was over, the error came after the fault began), and the error's delay:
    from the fault's start, or from the step's if it started later."""
    started = float(str(error["t"]))
    reached = started + float(str(error["reached_s"]))
    for fault in faults:
        if (
            error["member"] in fault.members
            and started <= fault.end + ERROR_BOUND_S
            and reached >= fault.start - 0.5
        ):
            return fault, reached - max(started, fault.start)
    return None


def _names(error: dict[str, object]) -> bool:
    """The error names its member: by name, or by rank (``Error on Node 4: ...``, the chain
    of a backward pass that failed on that member)."""
    name = str(error["member"])
    rank = name[1:]
    return any(f in str(error["error"]) for f in (name, f"Node {rank}:", f"rank {rank})"))


def test_marathon_short() -> None:
    """An elastic group rides through every kind of fault: no hang, exact gradients, every
    member live with the same view at the end, errors naming the faulted member within the
    bound, graceful leaves in a few seconds, joins going on after a death mid-join."""
    started = time.monotonic()
    with Hosts(3) as hosts:
        m, result, errors = run_marathon(hosts)
    took = time.monotonic() - started
    expected = ["trainer", *(f"m{r}" for r in range(1, 5 + ROUNDS))]
    delays = sorted(round(found[1], 2) for e in errors if (found := _fault_of(e, m.faults)))
    figures = {
        "seconds": round(took, 1),
        "checks": result["checks"],
        "wrong": result["wrong"],
        "errors": len(errors),
        "error_delay_s": delays,
        "error_raised_s_max": max((float(str(e["error_s"])) for e in errors), default=0.0),
        "slowest_step_s": result["slowest_step_s"],
        "leave_s": m.leave_s,
        "join_after_death_mid_join_s": m.join_after_death_s,
        "faults": [(f.kind, f.members, round(f.end - f.start, 1)) for f in m.faults],
    }
    print("MARATHON " + json.dumps(figures))
    dump = os.environ.get("DISTGRAD_MARATHON_DUMP")
    if dump:  # everything the processes printed, the faults and errors, for a post-mortem
        with open(dump, "w") as f:
            json.dump(
                {
                    "faults": [vars(x) for x in m.faults],
                    "errors": errors,
                    "lines": {name: p.drain() for name, p in m.everyone.items()},
                },
                f,
                indent=1,
            )
    assert result["wrong"] == 0, figures
    assert int(str(result["checks"])) >= 100, figures
    assert result["views"] == {name: expected for name in expected}, result
    assert result["final"] == {name: True for name in expected[1:]}, result
    for error in errors:
        found = _fault_of(error, m.faults)
        assert found is not None, f"an error outside any fault on its member: {error}"
        assert _names(error), error
        assert found[1] <= ERROR_BOUND_S, (error, found, figures)
    assert float(str(result["slowest_step_s"])) <= STEP_BOUND_S, figures
    assert max(m.leave_s) <= LEAVE_BOUND_S, figures
    assert all(s < 20.0 for s in m.join_after_death_s), figures
