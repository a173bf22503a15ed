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
from collections import OrderedDict, defaultdict
from typing import Any

from ..._errors import DistgradError, PeerFailureError, RpcTimeoutError
from .._core import RpcAgent, WorkerInfo, current_agent

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
        #: the results of the last shutdown rounds this worker led, by key: a follower whose
        #: link broke sends its part again, and is answered with the result if the round is over
        self.done: OrderedDict[str, dict[str, Any]] = OrderedDict()


#: how many finished rounds a leader remembers (a follower asks again only moments later)
_DONE_KEPT = 16
#: how many times one round is tried again after a link to a live member broke
_RETRIES = 5


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


def _gather_to_leader(key: str, name: str, obj: Any, names: list[str]) -> dict[str, Any] | None:
    """A follower's part, on the leader. Sent again (its link broke) for a round that is over:
    the result, which the follower takes as the broadcast; otherwise None."""
    agent = _require_agent()
    groups = _groups(agent)
    with _lock:
        done = groups.done.get(key)
        if done is not None:
            return done
    state = _state(agent, key)
    with _lock:
        state.gathered[name] = obj
        if len(state.gathered) == len(names):
            state.all_arrived.set()
    return None


def _broadcast_to_followers(key: str, gathered: dict[str, Any]) -> None:
    """The result, on a follower. One sent again for a round the follower has left (it had the
    result from its own part's answer) finds no state: nothing to do."""
    states = _groups(_require_agent()).states
    with _lock:
        state = states.get(key)
    if state is None:
        return
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
    """Wait for ``event``; raise if one of ``ranks`` dies (or a reconnect to it failed a
    moment ago); False at the deadline. A member that is only suspected (its link was lost
    without proof: stopped, cut off, or this process stalled) is waited for, as a member that
    is slow to arrive is."""
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
    if timeout < 0:
        timeout = agent.rpc_timeout
    key = _new_key(agent, names)
    try:
        return _gather_round(agent, key, names, obj, timeout)
    finally:
        _forget(agent, key)


def _new_key(agent: RpcAgent, names: list[str]) -> str:
    """The key of the next round among ``names`` (every member counts its rounds per group)."""
    groups = _groups(agent)
    with _lock:
        sequence = next(groups.sequences[tuple(names)])
    return f"{sequence}|{','.join(names)}"


def _forget(agent: RpcAgent, key: str) -> None:
    with _lock:
        _groups(agent).states.pop(key, None)


def _gather_round(
    agent: RpcAgent,
    key: str,
    names: list[str],
    obj: Any,
    timeout: float,
    remember: bool = False,
) -> dict[str, Any]:
    """One round of the gather, under ``key``. It may be run again under the same key after a
    link to a live member broke (``all_gather_survivors``): the state is kept (the caller
    forgets it), a part sent twice counts once, and with ``remember`` a leader keeps the
    result of the rounds it finished, for a part sent again (the shutdown's objects are small;
    a user's ``_all_gather`` is not run again, and holds nothing after it returns)."""
    me = agent.worker_info.name
    leader = names[0]
    deadline = time.monotonic() + timeout if timeout > 0 else None
    state = _state(agent, key)
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
        if remember:
            groups = _groups(agent)
            with _lock:
                groups.done[key] = gathered
                while len(groups.done) > _DONE_KEPT:
                    groups.done.popitem(last=False)
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
                _broadcast_again(agent, info, key, gathered, timeout, exc)
        return gathered
    leader_info = agent.get_worker_info(leader)
    result = agent.call_sync(
        leader_info, _gather_to_leader, (key, me, obj, names), {}, timeout, internal=True
    )
    if isinstance(result, dict):  # a part sent again: the round was over
        return result
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


def _broadcast_again(
    agent: RpcAgent,
    info: WorkerInfo,
    key: str,
    gathered: dict[str, Any],
    timeout: float,
    exc: PeerFailureError,
) -> None:
    """The follower arrived (its part is in ``gathered``) and its link broke before its answer
    to the result came. It may have left as soon as it had the result (its handler lets it go
    before the answer is written: a follower that shuts down at once can close first): then it
    cannot be reached, and nothing the leader returns depends on it. One that can be reached
    may not have the result (it would wait for it for ever): it is sent again, a few times at
    most (a follower that has it already ignores it)."""
    for _ in range(_RETRIES):
        if not _reachable(agent, info.id):
            break
        _log.info("all_gather %s: the result is sent again to %s: %s", key, info.name, exc)
        try:
            agent.call_sync(
                info, _broadcast_to_followers, (key, gathered), {}, timeout, internal=True
            )
            return
        except PeerFailureError as again:
            exc = again
    _log.debug("all_gather %s: no answer from %s: %s", key, info.name, exc)


def _reachable(agent: RpcAgent, rank: int) -> bool:
    """True if ``rank`` is not known dead and a connection to it is open or can be opened
    now (it answers the handshake: it is there, whatever broke the last link)."""
    if agent.transport.is_dead(rank):
        return False
    try:
        agent.transport.connection(rank)
    except DistgradError:
        return False
    return not agent.transport.is_dead(rank)


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
    the gather is made again. A link to a member that broke without proof of its death (a
    stall of this process or of the member, a lost connection) does not end the shutdown while
    every member can still be reached: the round is run again under the same key (a few times
    at most). Any other failure is raised. ``timeout``: 0 = none."""
    agent = _require_agent()
    deadline = time.monotonic() + timeout if timeout > 0 else None
    everyone = sorted(w.name for w in agent.get_worker_infos())
    keys: list[str] = []
    key = ""
    names: list[str] = []
    tries = 0
    try:
        while True:
            if names and deadline is not None and time.monotonic() >= deadline:
                # (before _survivors: its connects to a stopped member wait a handshake out)
                raise RpcTimeoutError(f"shutdown timed out after {timeout:g}s waiting for {names}")
            found = _survivors(agent)
            if found != everyone:
                gone = sorted(set(everyone) - set(found))
                _log.warning(
                    "graceful shutdown goes on without %s, found dead: %s",
                    ", ".join(gone),
                    "; ".join(_dead_reason(agent, n) for n in gone),
                )
                everyone = found
            if found != names:  # a new group: a new round
                names = found
                key = _new_key(agent, names)
                keys.append(key)
                tries = 0
            left = 0.0
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RpcTimeoutError(
                        f"shutdown timed out after {timeout:g}s waiting for {names}"
                    )
            try:
                return _gather_round(agent, key, names, obj, left, remember=True)
            except PeerFailureError as exc:
                if deadline is not None and time.monotonic() >= deadline:
                    raise RpcTimeoutError(
                        f"shutdown timed out after {timeout:g}s waiting for {names} ({exc})"
                    ) from exc
                if _survivors(agent) != names:
                    continue  # one of them is dead: gathered again without it
                me = agent.worker_info.name
                unreachable = [
                    n
                    for n in names
                    if n != me and not _reachable(agent, agent.get_worker_info(n).id)
                ]
                if unreachable or tries == _RETRIES:
                    raise
                tries += 1
                _log.info("graceful shutdown: a link broke (%s); the gather is made again", exc)
    finally:
        for each in keys:
            _forget(agent, each)
