"""Group operations over RPC: ``_all_gather``, ``_barrier``, ``_wait_all_workers``.

As in the reference, the worker with the smallest name leads: followers send their object to
the leader, the leader broadcasts the gathered dict to every follower. Unlike the reference,
a wait notices a dead participant (through the transport's failure detection) instead of
sitting out the whole timeout.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import defaultdict
from typing import Any

from ..._errors import DistgradError, PeerFailureError, RpcTimeoutError
from .._core import RpcAgent, current_agent

__all__ = ["all_gather", "all_gather_survivors", "barrier", "wait_all_workers"]

_log = logging.getLogger("distgrad.rpc")

_POLL = 0.05


class _GatherState:
    __slots__ = ("all_arrived", "gathered", "proceed", "result")

    def __init__(self) -> None:
        self.gathered: dict[str, Any] = {}
        self.all_arrived = threading.Event()
        self.proceed = threading.Event()
        self.result: dict[str, Any] | None = None


_lock = threading.Lock()


class _Groups:
    """One worker's group operations in progress (kept with its agent: the agents of an
    in-memory world share the process)."""

    def __init__(self) -> None:
        self.states: dict[str, _GatherState] = {}
        self.sequences: dict[tuple[str, ...], itertools.count[int]] = defaultdict(itertools.count)


def _groups(agent: RpcAgent) -> _Groups:
    found = agent.layer_state.get(_Groups)
    if found is None:
        with _lock:
            found = agent.layer_state.setdefault(_Groups, _Groups())
    assert isinstance(found, _Groups)
    return found


def _state(agent: RpcAgent, key: str) -> _GatherState:
    states = _groups(agent).states
    with _lock:
        state = states.get(key)
        if state is None:
            state = states[key] = _GatherState()
        return state


def _gather_to_leader(key: str, name: str, obj: Any, names: list[str]) -> None:
    state = _state(_require_agent(), key)
    with _lock:
        state.gathered[name] = obj
        if len(state.gathered) == len(names):
            state.all_arrived.set()


def _broadcast_to_followers(key: str, gathered: dict[str, Any]) -> None:
    state = _state(_require_agent(), key)
    state.result = gathered
    state.proceed.set()


def _require_agent() -> RpcAgent:
    agent = current_agent()
    if agent is None:
        raise RuntimeError(
            "RPC has not been initialized. Call torch.distributed.rpc.init_rpc first."
        )
    return agent


def _wait(
    agent: RpcAgent, event: threading.Event, ranks: list[int], deadline: float | None
) -> bool:
    """Wait for ``event``; raise if one of ``ranks`` dies; False at the deadline."""
    while not event.wait(_POLL):
        for rank in ranks:
            agent.transport.check_alive(rank)
        if deadline is not None and time.monotonic() > deadline:
            return event.is_set()
    return True


def all_gather(
    obj: Any, worker_names: list[str] | None = None, timeout: float = -1.0
) -> dict[str, Any]:
    """Gather ``obj`` from every worker in ``worker_names`` (default: all) on every worker."""
    agent = _require_agent()
    names = (
        sorted(worker_names) if worker_names else sorted(w.name for w in agent.get_worker_infos())
    )
    me = agent.worker_info.name
    leader = names[0]
    groups = _groups(agent)
    with _lock:
        sequence = next(groups.sequences[tuple(names)])
    key = f"{sequence}|{','.join(names)}"
    if timeout < 0:
        timeout = agent.rpc_timeout
    deadline = time.monotonic() + timeout if timeout > 0 else None
    state = _state(agent, key)
    try:
        if me == leader:
            _gather_to_leader(key, me, obj, names)
            followers = [agent.get_worker_info(n) for n in names if n != me]
            for info in followers:  # a connection per follower: its death is noticed
                agent.transport.connection(info.id)
            if not _wait(agent, state.all_arrived, [f.id for f in followers], deadline):
                missing = sorted(set(names) - set(state.gathered))
                raise RpcTimeoutError(
                    f"Followers {missing} timed out in _all_gather after {timeout:.2f} seconds. "
                    f"The first exception is no response from {missing[0]}"
                )
            gathered = dict(state.gathered)
            futures = [
                agent.call_async(
                    info, _broadcast_to_followers, (key, gathered), {}, timeout, internal=True
                )
                for info in followers
            ]
            for info, future in zip(followers, futures, strict=True):
                try:
                    future.wait()
                except PeerFailureError as exc:
                    # The follower arrived (its part is in ``gathered``) and its connection
                    # broke before its answer came: it may have left as soon as it had the
                    # result (its handler lets it go before the answer is written: a follower
                    # that shuts down at once can close first). Nothing the leader returns
                    # depends on it; a follower that died before it had the result fails on
                    # its own side.
                    _log.debug("all_gather %s: no answer from %s: %s", key, info.name, exc)
            return gathered
        leader_info = agent.get_worker_info(leader)
        agent.call_sync(
            leader_info, _gather_to_leader, (key, me, obj, names), {}, timeout, internal=True
        )
        # Every other member is watched, not only the leader: one found dead means the leader
        # may be gathering without it (under another key) -- this worker's view of who
        # survives was stale, and all_gather_survivors must gather again without it.
        others = [agent.get_worker_info(n).id for n in names if n != me]
        if not _wait(agent, state.proceed, others, deadline):
            raise RpcTimeoutError(
                f"timed out in _all_gather after {timeout:.2f} seconds waiting for {leader}"
            )
        assert state.result is not None
        return state.result
    finally:
        with _lock:
            groups.states.pop(key, None)


def barrier(worker_names: list[str] | None = None) -> None:
    """Wait until every worker in ``worker_names`` (default: all) reached this barrier."""
    all_gather(None, worker_names)


def wait_all_workers(timeout: float = 0) -> None:
    """Block until every worker called this; 0 = no timeout."""
    all_gather(None, timeout=timeout)


def _survivors(agent: RpcAgent) -> list[str]:
    """The names of the workers not known dead; each peer is connected to first, so that one
    that died (its connections broke: only suspected so far) is found dead by its refusal."""
    names = []
    for info in agent.get_worker_infos():
        if info.id != agent.worker_info.id:
            try:
                agent.transport.connection(info.id)
            except DistgradError:
                pass
        if not agent.transport.is_dead(info.id):
            names.append(info.name)
    return sorted(names)


def _dead_reason(agent: RpcAgent, name: str) -> str:
    try:
        agent.transport.check_alive(agent.get_worker_info(name).id)
    except DistgradError as exc:
        return str(exc)
    return f"{name} is dead"


def all_gather_survivors(obj: Any, timeout: float = 0) -> dict[str, Any]:
    """:func:`all_gather` among the workers not known dead (graceful shutdown): a member of a
    static group that died does not make its survivors' shutdown fail -- they leave without it,
    with a warning naming it. One found dead during the gather is left out the same way, and
    the gather is made again; any other failure is raised. ``timeout``: 0 = none."""
    agent = _require_agent()
    deadline = time.monotonic() + timeout if timeout > 0 else None
    everyone = sorted(w.name for w in agent.get_worker_infos())
    while True:
        names = _survivors(agent)
        if names != everyone:
            gone = sorted(set(everyone) - set(names))
            _log.warning(
                "graceful shutdown goes on without %s, found dead: %s",
                ", ".join(gone),
                "; ".join(_dead_reason(agent, n) for n in gone),
            )
            everyone = names
        left = 0.0
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RpcTimeoutError(f"shutdown timed out after {timeout:g}s waiting for {names}")
        try:
            return all_gather(obj, names, timeout=left)
        except PeerFailureError:
            if _survivors(agent) == names:
                raise
