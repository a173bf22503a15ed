"""``shutdown()``: the graceful end of a group (or a member's leaving a dynamic one), and the
agent stopped at interpreter exit when the program did not shut down."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time

from ... import _config
from ..._errors import RpcTimeoutError
from .._core import RpcAgent, current_agent, require_agent, set_current_agent, shutting_down
from .._rrefs._rref_context import context_of, leaks_of
from . import _collectives, _dynamic

__all__ = ["shutdown"]


_exit_hook_registered = False


def _register_exit_hook() -> None:
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_stop_at_exit)
        _exit_hook_registered = True


def _stop_at_exit() -> None:
    """Stop an agent that the program left running (it ended, or raised, without
    ``shutdown()``), while the interpreter is still whole: the agent's I/O thread must not
    outlive it. An event of its loop firing during finalization (a heartbeat timer, a peer's
    frame) would call into an interpreter that is gone, and the process would die of SIGSEGV
    instead of exiting with the program's status. Not graceful: the peers see this worker
    leave as they would see it die. (atexit runs after the non-daemon threads have ended.)"""
    agent = current_agent()
    if agent is None or agent.pid != os.getpid():  # shut down already, or a forked child
        return
    try:
        shutdown(graceful=False)
    except Exception as exc:  # exiting anyway (e.g. an RRef leak reported): say so, go on
        logging.getLogger("distgrad.rpc").warning("stopping RPC at exit: %r", exc)


def shutdown(graceful: bool = True, timeout: float = _config.DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Stop this worker's agent (torch's ``shutdown``).

    With ``graceful`` (the default) every worker first waits for all workers to reach
    shutdown, then for every RPC in flight anywhere in the group (including follow-up calls
    they cause) to finish, and for the users of RRefs this worker owns to be deleted. A
    worker that only serves calls typically calls ``shutdown()`` right after ``init_rpc``:
    it serves until every worker has reached shutdown. Whatever happens, the agent is stopped
    before this returns or raises, and ``init_rpc`` may be called again.

    Args:
        graceful (bool): wait for the group and for calls in flight (``True``), or stop at
            once (``False``: calls still waiting fail with ``RpcShutdownError``).
        timeout (float): seconds the graceful wait may take in all; ``0`` (the default)
            waits as long as it takes. A dead peer is left out of the wait (a warning names
            it): the survivors' graceful shutdown returns.

    Raises:
        RuntimeError: RPC is not initialized; with ``rpc.api._ignore_rref_leak = False``,
            "Leaking RRef ..." when forks of RRefs owned here were still registered.
        RpcTimeoutError: the graceful wait passed ``timeout`` (the agent is stopped anyway).
        PeerFailureError: a peer was lost during the graceful wait without being proved
            dead, and a fresh connection to it failed (suspected: it may come back). A link
            that broke while every peer still answers is connected again.

    Example:
        # The worker that does the work and the worker that serves it.

        # on worker 0
        rpc.init_rpc("worker0", rank=0, world_size=2)
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        rpc.shutdown()  # returns once worker1 reached shutdown and nothing is in flight

        # on worker 1
        rpc.init_rpc("worker1", rank=1, world_size=2)
        rpc.shutdown()  # serves worker0 meanwhile
    """
    agent = require_agent()
    if agent.dynamic:
        _leave(agent, graceful, timeout)
        return
    try:
        if graceful:
            deadline = time.monotonic() + timeout if timeout > 0 else None

            def remaining() -> float:
                if deadline is None:
                    return 0
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RpcTimeoutError(
                        f"shutdown timed out after {timeout:g}s waiting for other workers"
                    )
                return left

            _collectives.all_gather_survivors(None, remaining())
            shutting_down(agent)
            context_of(agent).delete_all_users(_rref_drain_timeout(agent, deadline))
            while True:
                agent.wait_until_idle(deadline)
                counts = _collectives.all_gather_survivors(agent.active_calls(), remaining())
                if sum(counts.values()) == 0:
                    break
    finally:
        _stop_then_clear(agent, graceful)
    _check_rref_leaks(agent)


def _leave(agent: RpcAgent, graceful: bool, timeout: float) -> None:
    """``shutdown()`` of a member of a dynamic group: it leaves; the others go on. Graceful:
    its own calls finish, its RRef users are deleted, every member is told it leaves."""
    try:
        if graceful:
            deadline = time.monotonic() + timeout if timeout > 0 else None
            agent.wait_until_idle(deadline)
            shutting_down(agent)
            # Users elsewhere of what this member owns are not waited for: they cannot let go
            # before they learn it leaves; from then on they fail, naming it as departed.
            context_of(agent).delete_all_users(
                _rref_drain_timeout(agent, deadline), wait_for_remote_users=False
            )
            budget = (
                max(deadline - time.monotonic(), 0.1) if deadline is not None else agent.rpc_timeout
            )
            store = agent.keepalive[0] if agent.keepalive else None
            _dynamic.leave_group(agent, store, budget)
    finally:
        _stop_then_clear(agent, graceful)
    _check_rref_leaks(agent)


def _stop_then_clear(agent: RpcAgent, graceful: bool) -> None:
    """Stop the agent, then clear the process's agent: its workers may still be serving a
    peer's last message (a gather that arrives after this worker's gather ended) and must
    find their agent, not "RPC has not been initialized"."""
    try:
        agent.stop(graceful=graceful)
    finally:
        set_current_agent(None)


_DEAD_PEER_RREF_DRAIN_S = 1.0


def _rref_drain_timeout(agent: RpcAgent, deadline: float | None) -> float:
    """How long shutdown waits for RRef users to be deleted: what is left of its timeout, or
    (with none) the default RPC timeout (60 s if that is infinite too); at most a moment when a
    peer is dead (the users it held are never deleted: they are leaks, not work to wait for)."""
    if agent.statistics().dead_peers:
        left = _DEAD_PEER_RREF_DRAIN_S if deadline is None else deadline - time.monotonic()
        return max(0.0, min(_DEAD_PEER_RREF_DRAIN_S, left))
    if deadline is not None:
        return max(0.0, deadline - time.monotonic())
    return agent.rpc_timeout if agent.rpc_timeout > 0 else _config.DEFAULT_RPC_TIMEOUT_SEC


def _check_rref_leaks(agent: RpcAgent) -> None:
    # ``rpc.api._ignore_rref_leak`` (default True), as in the reference: users set it on the
    # public module, so it is read from there.
    public = sys.modules.get("distgrad.rpc.api")
    leaks = leaks_of(agent)
    if getattr(public, "_ignore_rref_leak", True) or not leaks:
        return
    rref_id, fork_id = leaks[0]
    raise RuntimeError(
        f"Leaking RRef {rref_id} with fork Id {fork_id}\n"
        f"({len(leaks)} forks were still registered at shutdown)"
    )
