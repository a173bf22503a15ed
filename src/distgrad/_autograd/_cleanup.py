"""Context cleanup across workers: leaving ``with context()`` releases the context everywhere
it went (SPEC 2.2: transitive, best effort, retried)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from .._rpc._core import after_current_task, bind_thread, current_agent
from .._rpc._core import profiling as _profiling
from ._context import _ID_BITS, CONTAINER, DistAutogradContext
from ._pass import BackwardError

if TYPE_CHECKING:
    from .._rpc._core import RpcAgent

__all__ = ["after_release", "release_orphans"]

_log = logging.getLogger("distgrad.autograd")

_CLEANUP_ATTEMPTS = 5  # as the RPC layer's retries (an injected fault may fail the first ones)


@after_current_task
def _cleanup_message(context_id: int, *notified: int) -> None:
    """Release ``context_id`` here; ``notified``: the workers already told. (Flat integer
    arguments: the message then takes the plain-pickle path.) A context this worker created
    is left alone: only its creator's ``with context()`` block releases it, as in torch (a
    survivor releasing what a dead peer orphaned may reach the creator through others)."""
    if CONTAINER.created_here(context_id):
        return
    ctx = CONTAINER.release_context_if_present(context_id)
    if ctx is not None:
        after_release(ctx, frozenset(notified))


def after_release(ctx: DistAutogradContext, notified: frozenset[int] = frozenset()) -> None:
    """Fail a pass in progress, and tell every known worker to release the context too.

    Cleanup spreads transitively (a worker forwards it to its own known workers); each message
    carries the workers already told, so a context two workers share costs one message, not
    one each way."""
    with ctx.lock:
        running = ctx.pass_state
        if running is not None:
            running.fail_released(
                BackwardError(f"Could not find autograd context with id: {ctx.context_id}")
            )
    agent = current_agent()
    if agent is None:
        return
    me = CONTAINER.worker_id
    targets = sorted(w for w in ctx.known_worker_ids if w != me and w not in notified)
    told = notified | set(targets) | {me}
    for worker in targets:
        _send_cleanup(agent, worker, ctx.context_id, told, _CLEANUP_ATTEMPTS, running is None)


def _send_cleanup(
    agent: Any, worker: int, context_id: int, told: frozenset[int], attempts: int, later: bool
) -> None:
    """Best effort, retried, one-way: releasing a context needs no answer (an answer would
    cost the peer a response and this worker a wake-up per context, on the next step's time).

    It never blocks the caller (leaving ``with dist_autograd.context()``, often right after a
    call failed because ``worker`` is frozen or cut off: a re-dial there would wait out a
    handshake timeout before the program saw the error). With a connection open, it is written
    now -- with ``later`` (no backward pass was running: nobody there is working on the
    context), with this worker's next message to that peer or the next heartbeat tick, so the
    end of a step costs no write and the peer no wake-up. Without one, or if that write finds
    the connection broken, the agent's dialing thread for ``worker`` connects and sends it,
    ``attempts`` times while connections break; a dead peer or a stopped agent ends it
    (``RpcAgent.post``). Under torch's profiler it is a request, so that it shows in the trace
    like the other internal messages."""
    if _profiling.wants(_cleanup_message):
        _send_cleanup_profiled(agent, worker, context_id, told, attempts)
        return
    agent.post(worker, _cleanup_message, (context_id, *told), later=later, attempts=attempts)


def _send_cleanup_profiled(
    agent: Any, worker: int, context_id: int, told: frozenset[int], attempts: int
) -> None:
    future = agent.send_with_retries(worker, _cleanup_message, (context_id, *told), attempts)

    def done(result: torch.futures.Future[Any]) -> None:
        try:
            result.wait()
        except Exception as exc:
            _log.debug("context %s: cleanup on worker %s failed: %s", context_id, worker, exc)

    future.add_done_callback(done)


def release_orphans(dead: int) -> None:
    """Release the contexts that worker ``dead`` (proved dead) was this worker's only way to be
    told about: those it created, and those whose creator this worker never messaged (the
    context came through other workers, so the creator's cleanup reaches it only through them,
    maybe only through the dead one). The release spreads to their known workers as a normal
    cleanup does, so contexts further downstream of the dead worker are released too.

    A peer that is only *suspected* may come back and clean up itself; but a killed one is
    never called again by anyone, so the proof (a refused connect) would never come and its
    orphans would stay for the agent's life. When there are orphans, a probe connects to the
    suspected peer once, on a thread of its own (it may wait up to the peer timeout): refused,
    the peer is dead and its orphans are released; otherwise they stay until it cleans up."""
    agent = current_agent()
    if agent is None:
        return
    if not agent.peer_is_dead(dead):
        if _orphans_of(dead):
            threading.Thread(
                target=_probe, args=(agent, dead), name="distgrad-probe", daemon=True
            ).start()
        return
    for ctx in _orphans_of(dead):
        released = CONTAINER.release_context_if_present(ctx.context_id)
        if released is not None:
            after_release(released, frozenset({dead}))


def _orphans_of(dead: int) -> list[DistAutogradContext]:
    """The contexts only ``dead`` links this worker to (see :func:`release_orphans`)."""
    me = CONTAINER.worker_id
    orphans = []
    for ctx in CONTAINER.contexts():
        creator = ctx.context_id >> _ID_BITS
        if creator == me:
            continue  # the user's own context: released when the user leaves it
        known = ctx._known_worker_ids()
        if dead not in known and creator != dead:
            continue
        if creator != dead and creator in known:
            continue  # the creator tells this worker directly
        orphans.append(ctx)
    return orphans


def _probe(agent: RpcAgent, suspected: int) -> None:
    """Connect to a suspected peer once (as a call would); if that proves it dead, release
    the contexts it orphaned."""
    if agent.isolated:  # (an agent of an in-memory world: its state is bound to its threads)
        bind_thread(agent)
    try:
        agent.transport.connection(suspected)
    except Exception as exc:  # refused (proof), or not reachable now (no proof)
        _log.debug("probe of worker %s: %s", suspected, exc)
    if agent.peer_is_dead(suspected) and not agent.state.stopped:
        release_orphans(suspected)
