"""The distributed backward pass as a state machine under injected faults, on in-memory worlds.

Table-driven: each case runs one forward program on four workers, injects one fault into one
kind of engine message (the first gradient message to a worker, the one-way later ones, START,
the answers, the cleanup), or kills a worker at one step, and asserts the outcome: gradients
equal to single-process torch autograd, or a clear error within the bound -- never a hang --
and afterwards no backward pass and no context left on any live worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad._autograd import _engine
from distgrad._autograd._context import CONTAINER
from distgrad.testing import (
    Fault,
    World,
    open_world,
    worker_thread,
    world_options,
)

WORLD = 4
#: short bounds (a lost message fails a case in a second), loose enough for a loaded machine
OPTIONS = dict(rpc_timeout=0.5, heartbeat_interval=0.1, peer_timeout=2.0)

GRAD = "_grad_message"  # a worker's first gradient message of a pass (answered when done)
LATE = "_late_grad_message"  # later gradient messages (one-way)
START = "_start_message"  # joins a worker that would get no gradient message
ANSWER = "BACKWARD_AUTOGRAD_RESP"  # the answer to a first message
CLEANUP = "CLEANUP_AUTOGRAD_CONTEXT_REQ"


# -- forward programs (run on worker0; the others serve) -------------------------------------------
def scale(x: torch.Tensor, k: float) -> torch.Tensor:
    return x * k


def nested(x: torch.Tensor, hops: list[int]) -> torch.Tensor:
    """x * 2 here, then the same on the next worker of ``hops`` (a nested call)."""
    y = x * 2.0
    if hops:
        y = rpc.rpc_sync(f"worker{hops[0]}", nested, args=(y, hops[1:])) + y
    return y


def chain(w: torch.Tensor) -> torch.Tensor:
    """worker0 -> 1 -> 2 -> 3, each call nested in the previous one."""
    return (rpc.rpc_sync("worker1", nested, args=(w, [2, 3])) ** 2).sum()


def fanout(w: torch.Tensor) -> torch.Tensor:
    """worker0 calls 1, 2 and 3 at once; the results meet in the loss."""
    futures = [rpc.rpc_async(f"worker{k}", scale, args=(w, float(k))) for k in (1, 2, 3)]
    a, b, c = (f.wait() for f in futures)
    return (a * b + c).sum()


def reentrant(w: torch.Tensor) -> torch.Tensor:
    """worker0 -> 1 -> 0 -> 1: a chain that visits workers twice."""
    return rpc.rpc_sync("worker1", nested, args=(w, [0, 1])).pow(2).sum()


def unused(w: torch.Tensor) -> torch.Tensor:
    """A result worker3 computes is not part of the loss (the reference hangs on this)."""
    rpc.rpc_sync("worker3", scale, args=(w, 5.0))
    return rpc.rpc_sync("worker1", scale, args=(w, 3.0)).pow(2).sum()


PROGRAMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "chain": chain,
    "fanout": fanout,
    "reentrant": reentrant,
    "unused": unused,
}
#: the programs whose passes send one-way (later) gradient messages: in the others, each worker
#: sends its gradients for the worker whose first message it answers in that answer
ONE_WAY_SENDERS = {"reentrant"}

#: the workers each program sends a first gradient message (``_grad_message``) to in its
#: backward pass: where a worker can die at its first gradient. (reentrant calls only worker1;
#: in unused, worker3 gets one too -- the final message, with no gradients, of the recv
#: function no source reaches -- and nobody calls worker2.)
GRADIENT_RECEIVERS: dict[str, tuple[int, ...]] = {
    "chain": (1, 2, 3),
    "fanout": (1, 2, 3),
    "reentrant": (1,),
    "unused": (1, 3),
}


def _local(program: Callable[[torch.Tensor], torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    """The program's gradient in one process: every RPC becomes a local call."""
    original_sync, original_async = rpc.rpc_sync, rpc.rpc_async

    def local_sync(
        to: str, func: Callable[..., torch.Tensor], args: tuple[object, ...] = ()
    ) -> torch.Tensor:
        return func(*args)

    def local_async(
        to: str, func: Callable[..., torch.Tensor], args: tuple[object, ...] = ()
    ) -> torch.futures.Future[torch.Tensor]:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(func(*args))
        return future

    leaf = w.detach().clone().requires_grad_()
    rpc.rpc_sync, rpc.rpc_async = local_sync, local_async  # type: ignore[assignment]
    try:
        program(leaf).backward()
    finally:
        rpc.rpc_sync, rpc.rpc_async = original_sync, original_async  # type: ignore[assignment]
    assert leaf.grad is not None
    return leaf.grad


# -- the cases -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    fault: Fault
    outcome: str  # "grads": correct gradients; "error": a clear error from backward
    match: str = ""  # what the error says


def _kill_later(world_ref: list[World], rank: int) -> Callable[[], None]:
    """A fault hook that kills worker ``rank`` (on a thread of its own: the hook runs on a
    sending thread, maybe one of that worker's)."""

    def fire() -> None:
        threading.Thread(target=world_ref[0].kill, args=(rank,), daemon=True).start()

    return fire


TIMEOUT = "RPC ran for more than"
CASES: dict[str, Case] = {
    "first-grad-dropped": Case(Fault("drop", function=GRAD, nth=1), "error", TIMEOUT),
    "first-grad-delayed": Case(Fault("delay", function=GRAD, seconds=0.05), "grads"),
    "first-grad-reordered": Case(Fault("reorder", function=GRAD, nth=1, hold=0.05), "grads"),
    "late-grad-dropped": Case(  # one-way: to the caller of backward, its driver's bound
        # fails it, naming the peer; to another worker, the first message's timeout
        Fault("drop", function=LATE, nth=1),
        "error",
        "will now be marked with an error",
    ),
    "late-grad-delayed": Case(Fault("delay", function=LATE, seconds=0.05), "grads"),
    "late-grad-reordered": Case(Fault("reorder", function=LATE, nth=1, hold=0.05), "grads"),
    "answer-dropped": Case(Fault("drop", type=ANSWER, nth=1), "error", TIMEOUT),
    "answer-delayed": Case(Fault("delay", type=ANSWER, seconds=0.02), "grads"),  # every answer
    "grad-send-fails": Case(Fault("fail", function=GRAD, nth=1), "error", "failed intentionally"),
}


@pytest.fixture
def world_ref() -> Iterator[list[World]]:
    yield []


def _leftovers(world: World, before: set[int]) -> list[str]:
    """Passes and contexts still held by live workers, and calls still waiting (passes in
    ``before`` belong to earlier worlds)."""
    found = []
    for rank in world.alive():
        agent = world.agents[rank]
        if agent._calls:
            found.append(f"worker{rank}: calls {sorted(agent._calls)}")
        contexts = world.run_on(rank, CONTAINER.num_contexts)
        if contexts:
            found.append(f"worker{rank}: {contexts} contexts")
    with _engine._PASSES_LOCK:
        live = {p.worker_id for p in _engine._ALL_PASSES if id(p) not in before}
    found += [f"worker{w}: a backward pass" for w in sorted(live) if w in world.alive()]
    return found


def _run_case(
    program_name: str,
    case: Case,
    world_ref: list[World],
    kill: int | None,
    *,
    baseline: bool = False,
) -> None:
    program = PROGRAMS[program_name]
    torch.manual_seed(0)
    w0 = torch.randn(3)
    expected = _local(program, w0)
    fault = case.fault
    if kill is not None:
        fault = Fault(
            fault.action,
            function=fault.function,
            dst=kill,
            nth=1,
            on_fire=_kill_later(world_ref, kill),
        )

    def body(rank: int) -> torch.Tensor | BaseException | None:
        if rank != 0:
            return None
        w = w0.clone().requires_grad_()
        with dist_autograd.context() as context_id:
            loss = program(w)
            started = time.monotonic()
            try:
                dist_autograd.backward(context_id, [loss])
            except RuntimeError as exc:
                assert time.monotonic() - started < 5.0, "the error came after the bound"
                return exc
            return dist_autograd.get_gradients(context_id)[w]

    with _engine._PASSES_LOCK:
        before = {id(p) for p in _engine._ALL_PASSES}
    with open_world(WORLD, options=world_options(**OPTIONS), faults=[fault], timeout=4) as world:
        world_ref.append(world)
        outcome = world.run(body)[0]
        fired = world.faults.fired() if world.faults is not None else []
        if baseline:
            assert not fired, fired
        else:  # (a table case whose fault never fires would test nothing)
            assert fired, f"{program_name} sent no message the fault chooses: {fault}"
        if case.outcome == "grads":
            assert isinstance(outcome, torch.Tensor), f"backward failed: {outcome!r}"
            torch.testing.assert_close(outcome, expected)
        else:
            assert isinstance(outcome, RuntimeError), f"backward did not fail: {outcome!r}"
            assert case.match in str(outcome), str(outcome)
        deadline = time.monotonic() + 5.0
        left = _leftovers(world, before)
        while left and time.monotonic() < deadline:
            time.sleep(0.02)
            left = _leftovers(world, before)
        assert not left, left


def _message_cases() -> list[object]:
    params = []
    for case_name in sorted(CASES):
        for program_name in sorted(PROGRAMS):
            if CASES[case_name].fault.function == LATE and program_name not in ONE_WAY_SENDERS:
                continue
            params.append(pytest.param(case_name, program_name, id=f"{case_name}-{program_name}"))
    return params


def _death_cases() -> list[object]:
    params = []
    for program_name in sorted(PROGRAMS):
        for rank in GRADIENT_RECEIVERS[program_name]:
            params.append(pytest.param(rank, program_name, id=f"{rank}-{program_name}"))
    return params


@pytest.mark.parametrize(("case_name", "program_name"), _message_cases())
def test_backward_under_a_message_fault(
    program_name: str, case_name: str, world_ref: list[World]
) -> None:
    """One fault on one kind of engine message: correct gradients or a clear error within the
    bound, and nothing left behind."""
    _run_case(program_name, CASES[case_name], world_ref, None)


@pytest.mark.parametrize(("rank", "program_name"), _death_cases())
def test_backward_when_a_worker_dies_at_its_first_gradient(
    program_name: str, rank: int, world_ref: list[World]
) -> None:
    """A worker killed as its first gradient message is sent (each worker the program sends
    one to): backward fails naming it, within the bound, and the live workers keep nothing of
    the pass."""
    _run_case(
        program_name, Case(Fault("drop", function=GRAD), "error", f"worker{rank}"), world_ref, rank
    )


def test_no_fault_gives_torchs_gradients_for_every_program(world_ref: list[World]) -> None:
    """The baseline of the table: without faults, every program's gradients are torch's."""
    for name in PROGRAMS:
        never = Fault("delay", function="no-such-function")
        _run_case(name, Case(never, "grads"), world_ref, None, baseline=True)


def test_concurrent_passes_on_one_context_end_without_a_hang(world_ref: list[World]) -> None:
    """Two threads run backward on one context at once: the later pass supersedes the
    earlier, which fails with a clear error (or both finish); neither hangs, and nothing is
    left behind."""
    torch.manual_seed(0)
    w0 = torch.randn(3)

    def body(rank: int) -> list[str]:
        if rank != 0:
            return []
        w = w0.clone().requires_grad_()
        outcomes: list[str] = []
        with dist_autograd.context() as context_id:
            loss = chain(w)

            def run() -> None:
                try:
                    dist_autograd.backward(context_id, [loss], retain_graph=True)
                    outcomes.append("ok")
                except RuntimeError as exc:
                    outcomes.append(str(exc))

            threads = [worker_thread(run) for _ in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(5.0)
            assert not any(thread.is_alive() for thread in threads), "a backward call hung"
            dist_autograd.backward(context_id, [loss], retain_graph=True)  # still usable
        return outcomes

    with _engine._PASSES_LOCK:
        before = {id(p) for p in _engine._ALL_PASSES}
    with open_world(WORLD, options=world_options(**OPTIONS), timeout=10) as world:
        world_ref.append(world)
        outcomes = world.run(body)[0]
        assert len(outcomes) == 2
        assert all(o == "ok" or "superseded by a new backward pass" in o for o in outcomes), (
            outcomes
        )
        deadline = time.monotonic() + 5.0
        while _leftovers(world, before) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _leftovers(world, before)
