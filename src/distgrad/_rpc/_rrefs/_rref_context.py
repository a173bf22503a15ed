"""The RRef bookkeeping of one worker: ids, owner values, forks, and the pending states of the
reference-counting protocol (SPEC 4.1). Pure state; the messages live in ``_rref``, the ids
and the owner values in ``_rref_values``.

Terms, as in the reference:

* An **OwnerRRef** holds the value (:class:`OwnerValue`); exactly one per RRef id, on its
  owner. A **UserRRef** elsewhere holds only ids; each has its own *fork id*.
* The owner keeps ``forks[rref_id]``: the fork ids of every UserRRef that exists anywhere.
  While that set is not empty, ``owners[rref_id]`` keeps the value alive; when the last fork is
  deleted, only local ``RRef`` handles (if any) keep it.
* **Pending users** are UserRRefs the owner has not confirmed yet (created by ``remote()``, or
  received from a user that is not the owner). They are held here, so they cannot be deleted
  before the owner knows them (G1 in the reference's notes).
* **Pending children** are UserRRefs that were sent to another worker: the sender keeps them
  until the receiver says the owner knows the child (G2: a parent outlives its child's
  registration, so the owner never sees the fork set empty too early). A child whose request
  failed is *settled*: dropped if the request certainly never arrived (nothing can exist
  there), kept but no longer waited for by a graceful shutdown if it may have (the receiver
  may still accept it, e.g. a frozen peer that comes back); and a shutdown never waits for a
  child whose receiver or owner is dead, replaced by a new incarnation, or gone from the
  group -- no acceptance can come from those.

Invariants: a fork id is added to ``forks`` before any delete for it can be sent (the owner adds
it while handling the creating call, before replying; a forked child is confirmed only after
the owner acknowledged it); control messages are idempotent (adding a known fork or deleting an
unknown one is a no-op), so they may be retried.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, cast

import torch

from .._core import RpcAgent, current_agent, message_type, on_io_thread
from ._outbox import outbox_of
from ._rref_values import RREF_TIMED_OUT, GloballyUniqueId, OwnerValue, UserHandle

__all__ = [
    "RREF_TIMED_OUT",
    "GloballyUniqueId",
    "OwnerValue",
    "RRefContext",
    "RemoteCreation",
    "context_of",
    "leaks_of",
]

_log = logging.getLogger("distgrad.rpc")

_TOMBSTONES = 65536


class _Collecting(threading.local):
    users: list[UserHandle] | None = None
    #: the value a ``remote()`` request being served on this thread creates (see
    #: :class:`RemoteCreation`); reset by :meth:`RRefContext.start_collecting`
    creating: RemoteCreation | None = None


_collecting = _Collecting()


class RemoteCreation:
    """The ids of the value a ``remote()`` call creates, as its request carries them.

    They come first in the request, and unpickling them notes them on the serving thread, so a
    request that fails before its function runs -- an argument that cannot be unpickled there,
    an RRef argument whose owner never confirms it -- still gives its error to the value (see
    :meth:`RRefContext.fail_creation`). Without that the value stayed unset: a ``to_here()``
    already on its way waited out its timeout (for ever with ``timeout=0``) and then hid the
    real error behind a timeout."""

    __slots__ = ("fork_id", "rref_id")

    def __init__(self, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        self.rref_id = rref_id
        self.fork_id = fork_id

    def __reduce__(self) -> tuple[Any, ...]:
        return (_note_creation, (self.rref_id, self.fork_id))


def _note_creation(rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> RemoteCreation:
    creation = RemoteCreation(rref_id, fork_id)
    if _collecting.users is not None:  # unpickled as part of a request being served
        _collecting.creating = creation
    return creation


class RRefContext:
    """One worker's RRef tables (the reference's ``RRefContext``). Made for an agent on first
    use (:func:`context_of`), destroyed when it stops; every method is thread-safe."""

    def __init__(self, agent: RpcAgent) -> None:
        self.agent = agent
        self.worker_id = agent.worker_info.id
        self._lock = threading.Lock()
        self._owners: dict[GloballyUniqueId, OwnerValue] = {}
        self._forks: dict[GloballyUniqueId, set[GloballyUniqueId]] = {}
        #: forks deleted before they were registered (the most recent ``_TOMBSTONES``)
        self._tombstones: OrderedDict[GloballyUniqueId, None] = OrderedDict()
        self._pending_users: dict[GloballyUniqueId, UserHandle] = {}
        self._pending_children: dict[GloballyUniqueId, UserHandle] = {}
        #: per pending child: its receiver's rank (-1: unknown) and incarnation then
        self._child_receivers: dict[GloballyUniqueId, tuple[int, int]] = {}
        #: pending children whose request failed but may have arrived (not waited for)
        self._failed_children: set[GloballyUniqueId] = set()
        self._confirmed_users: weakref.WeakValueDictionary[GloballyUniqueId, UserHandle] = (
            weakref.WeakValueDictionary()
        )
        # (owner id, rref id, fork id) of UserRRefs whose last handle was dropped. Appended from
        # ``__del__`` (any thread, any time -- so no lock there), sent in batches per owner.
        self._deletes: deque[tuple[int, GloballyUniqueId, GloballyUniqueId]] = deque()
        self._flush_scheduled = False
        self.pending_controls = 0
        self.destroyed = False

    def new_id(self) -> GloballyUniqueId:
        return GloballyUniqueId.new(self.worker_id)

    # -- owner side ------------------------------------------------------------------------------
    def get_or_create_owner(self, rref_id: GloballyUniqueId) -> OwnerValue:
        """The owner value of ``rref_id``, created empty if its creating call has not run yet
        (a fork of it can arrive first)."""
        with self._lock:
            value = self._owners.get(rref_id)
            if value is None:
                value = self._owners[rref_id] = OwnerValue()
            return value

    def keep_owner(self, rref_id: GloballyUniqueId, value: OwnerValue) -> None:
        """Register a locally created OwnerRRef's value (it is about to get its first fork)."""
        with self._lock:
            self._owners.setdefault(rref_id, value)

    def add_fork(self, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        with self._lock:
            if fork_id in self._tombstones:  # deleted before it got here: never registered
                del self._tombstones[fork_id]
                if rref_id not in self._forks:
                    self._owners.pop(rref_id, None)
                return
            self._forks.setdefault(rref_id, set()).add(fork_id)

    def del_forks(self, pairs: list[tuple[GloballyUniqueId, GloballyUniqueId]]) -> None:
        """Users are gone: forget their forks; an RRef with no fork left loses its table
        entry (its value lives on only in local handles). Unknown forks are ignored."""
        with self._lock:
            for rref_id, fork_id in pairs:
                forks = self._forks.get(rref_id)
                if forks is None or fork_id not in forks:
                    # Not registered (yet): the user's creation or fork request may still come,
                    # by another connection (one that was lost after it was written, read after
                    # a freeze), and must then not register it.
                    self._tombstones[fork_id] = None
                    if len(self._tombstones) > _TOMBSTONES:
                        self._tombstones.popitem(last=False)
                    continue
                forks.discard(fork_id)
                if not forks:
                    del self._forks[rref_id]
                    self._owners.pop(rref_id, None)

    # -- user side -------------------------------------------------------------------------------
    def add_pending_user(self, fork_id: GloballyUniqueId, rref: UserHandle) -> None:
        with self._lock:
            self._pending_users[fork_id] = rref

    def confirm_user(self, fork_id: GloballyUniqueId, error: BaseException | None = None) -> None:
        """The owner knows the user (or, with ``error``, never will): stop holding it."""
        with self._lock:
            rref = self._pending_users.pop(fork_id, None)
        if rref is not None:
            rref._settle(error)
            # A creation that timed out may still have reached the owner (its fork registered
            # there): such a user is deleted like a confirmed one, at shutdown too (a delete of
            # a fork the owner never saw is a no-op there).
            if error is None or rref._timed_out or rref._maybe_created:
                self.add_confirmed_user(rref)

    def add_confirmed_user(self, rref: UserHandle) -> None:
        fork_id = rref._fork_id
        assert fork_id is not None
        with self._lock:
            self._confirmed_users[fork_id] = rref

    def add_pending_child(
        self, fork_id: GloballyUniqueId, parent: UserHandle, receiver: int = -1
    ) -> None:
        incarnation = self.agent.incarnation_of(receiver) if receiver >= 0 else 0
        with self._lock:
            self._pending_children[fork_id] = parent
            self._child_receivers[fork_id] = (receiver, incarnation)

    def del_pending_child(self, fork_id: GloballyUniqueId) -> None:
        with self._lock:
            self._pending_children.pop(fork_id, None)
            self._child_receivers.pop(fork_id, None)
            self._failed_children.discard(fork_id)

    def child_failed(self, fork_id: GloballyUniqueId, maybe_delivered: bool) -> None:
        """The request carrying child ``fork_id`` failed (any thread; quick). Never delivered:
        no child exists, the parent is let go. Maybe delivered: the receiver may still accept
        it (then it is let go as usual), but nothing waits for it any more."""
        if not maybe_delivered:
            self.del_pending_child(fork_id)
            return
        with self._lock:
            if fork_id in self._pending_children:
                self._failed_children.add(fork_id)

    def _awaited_children(self) -> int:
        """Pending children an acceptance may still come for: not failed, their receiver and
        their owner neither dead, nor replaced, nor gone from the group."""
        agent = self.agent
        with self._lock:
            pending = [
                (
                    (parent._owner.id, parent._owner_incarnation),
                    self._child_receivers.get(fork_id, (-1, 0)),
                )
                for fork_id, parent in self._pending_children.items()
                if fork_id not in self._failed_children
            ]
        members = {info.id for info in agent.get_worker_infos()}

        def reachable(rank: int, incarnation: int) -> bool:
            if rank < 0:
                return True
            if rank not in members or agent.peer_is_dead(rank):
                return False
            return not incarnation or agent.incarnation_of(rank) == incarnation

        return sum(1 for owner, receiver in pending if reachable(*receiver) and reachable(*owner))

    def user_dropped(
        self, owner: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId
    ) -> None:
        """A UserRRef's last handle is gone (called from ``__del__``: no locks, no I/O here)."""
        self._deletes.append((owner, rref_id, fork_id))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                self.agent.schedule(self.flush_deletes)
            except Exception:  # the agent is stopping: the owner's tables go with it
                self._flush_scheduled = False

    def take_deletes(self) -> dict[int, list[tuple[GloballyUniqueId, GloballyUniqueId]]]:
        """The dropped users not yet reported, by owner."""
        self._flush_scheduled = False
        batches: dict[int, list[tuple[GloballyUniqueId, GloballyUniqueId]]] = {}
        while True:
            try:
                owner, rref_id, fork_id = self._deletes.popleft()
            except IndexError:
                return batches
            batches.setdefault(owner, []).append((rref_id, fork_id))

    def flush_deletes(self) -> list[tuple[int, torch.futures.Future[Any]]]:
        """Tell owners about the dropped users (one message per owner); the owners and the
        futures of their messages."""
        return [
            (owner, self.control(owner, _user_deletes, (pairs,)))
            for owner, pairs in self.take_deletes().items()
        ]

    # -- control messages ------------------------------------------------------------------------
    def control(
        self,
        dst: int,
        handler: Callable[..., Any],
        args: tuple[Any, ...],
        then: Callable[[BaseException | None], None] | None = None,
    ) -> torch.futures.Future[Any]:
        """Send a protocol message (idempotent, so retried); ``then(error)`` runs when it is
        answered or has failed for good."""
        with self._lock:
            self.pending_controls += 1
        future = self.agent.send_with_retries(dst, handler, args)

        def done(result: torch.futures.Future[Any]) -> None:
            error: BaseException | None = None
            try:
                result.wait()
            except BaseException as exc:
                error = exc
                _log.debug("RRef control message %s to %s failed: %s", handler.__name__, dst, exc)
            try:
                if then is not None:
                    then(error)
            finally:
                with self._lock:
                    self.pending_controls -= 1

        future.add_done_callback(done)
        return future

    def accept_child(self, parent: int, fork_id: GloballyUniqueId) -> None:
        """Tell ``parent`` that the owner knows its child ``fork_id``, so it may let go of the
        parent RRef it holds for it. One way (a ``NOTIFY`` handled on the parent's I/O thread):
        nothing waits for an answer, and a user that sends an RRef to its owner in every call
        (an agent's RRef, in the batch RL pattern) would otherwise pay a request, a response
        and four thread wake-ups per call. A reliable notice (``_outbox``): numbered, resent
        until the parent acknowledges it (with its next write), run there once -- a notice that
        is lost, or cannot be sent while the parent is suspected, reaches it when it is back."""
        outbox_of(self.agent).send(parent, _child_accept_notice, (fork_id,))

    def request_fork(self, rref: UserHandle, parent: int) -> None:
        """A UserRRef received from a user (not the owner): ask the owner to register its fork;
        once acknowledged, the user is confirmed and the parent may let go of it."""
        fork_id = rref._fork_id
        assert fork_id is not None
        self.add_pending_user(fork_id, rref)

        def acknowledged(error: BaseException | None) -> None:
            self.confirm_user(fork_id, error)
            if error is None:
                self.accept_child(parent, fork_id)

        self.control(rref._owner.id, _fork_request, (rref._rref_id, fork_id), acknowledged)

    # -- waiting for confirmations of RRefs received in a request --------------------------------
    # Plain calls, not a context manager: the agent brackets every request's unpickling with
    # them, on the per-message path.
    @staticmethod
    def start_collecting() -> list[UserHandle] | None:
        """From now on, collect the unconfirmed UserRRefs unpickled on this thread; returns
        what :meth:`stop_collecting` needs to restore."""
        previous = _collecting.users
        _collecting.users = []
        _collecting.creating = None
        return previous

    @staticmethod
    def stop_collecting(previous: list[UserHandle] | None) -> list[UserHandle]:
        """The UserRRefs collected since :meth:`start_collecting`."""
        users = _collecting.users
        _collecting.users = previous
        return users if users is not None else []

    @staticmethod
    def collect(rref: UserHandle) -> None:
        users = _collecting.users
        if users is not None:
            users.append(rref)

    def fail_creation(self, error: BaseException) -> bool:
        """The request served on this thread failed before its function ran. If it was a
        ``remote()`` creation, ``error`` becomes the value's, as if the function had raised
        it (the caller's fork is registered, so its user is confirmed and later deleted as
        usual), and True is returned: the creation is then answered, not failed. Uses what
        :meth:`start_collecting` began collecting on this thread."""
        creation = _collecting.creating
        _collecting.creating = None
        if creation is None:
            return False
        value = self.get_or_create_owner(creation.rref_id)
        if creation.fork_id != creation.rref_id:
            self.add_fork(creation.rref_id, creation.fork_id)
        value.set_error(error)
        return True

    # -- shutdown --------------------------------------------------------------------------------
    def _wait_for(self, condition: Callable[[], bool], deadline: float) -> bool:
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def delete_all_users(self, timeout: float, *, wait_for_remote_users: bool = True) -> None:
        """Graceful shutdown: let pending users and children settle, tell owners that every
        user here is gone, and (with ``wait_for_remote_users``) wait until the users elsewhere
        of what this worker owns are gone too (the reference's
        ``_delete_all_user_and_unforked_owner_rrefs``). Time-outs are only logged, as in the
        reference."""
        deadline = time.monotonic() + timeout
        if not self._wait_for(
            lambda: not self._pending_users and not self._awaited_children(), deadline
        ):
            _log.warning(
                "shutdown: %d pending UserRRefs and %d pending forks not settled in time",
                len(self._pending_users),
                self._awaited_children(),
            )
        with self._lock:
            users = list(self._confirmed_users.values())
            self._confirmed_users.clear()
        for rref in users:
            if not rref._deleted:
                rref._deleted = True
                assert rref._fork_id is not None
                self._deletes.append((rref._owner.id, rref._rref_id, rref._fork_id))
        transport = self.agent.transport
        for owner, future in self.flush_deletes():
            if transport.is_suspected(owner) or transport.is_dead(owner):
                # Its calls failed already: not waited for (the delete is retried while this
                # agent runs; a dead owner's table is gone anyway).
                continue
            left = deadline - time.monotonic()
            if left <= 0 or not _wait_future(future, left):
                _log.warning("shutdown: an RRef delete was not acknowledged in time")
                break
        if wait_for_remote_users and not self._wait_for(lambda: not self._forks, deadline):
            _log.warning("shutdown: %d owned RRefs still have users", len(self._forks))

    def destroy(self) -> list[tuple[GloballyUniqueId, GloballyUniqueId]]:
        """Forget everything; return the forks that were still registered (leaks)."""
        self.destroyed = True
        with self._lock:
            leaks = [(r, f) for r, forks in self._forks.items() for f in sorted(forks, key=repr)]
            self._owners.clear()
            self._forks.clear()
            pending = list(self._pending_users.values())
            self._pending_users.clear()
            self._pending_children.clear()
            self._child_receivers.clear()
            self._failed_children.clear()
            self._confirmed_users.clear()
        for rref in pending:
            rref._settle(RuntimeError("RPC was shut down before the owner confirmed this RRef"))
        return leaks

    def debug_info(self) -> dict[str, str]:
        """The reference's ``_rref_context_get_debug_info()`` (values are strings)."""
        with self._lock:
            return {
                "num_owner_rrefs": str(len(self._owners)),
                "num_pending_futures": str(self.pending_controls),
                "num_pending_users": str(len(self._pending_users)),
                "num_forks": str(sum(len(f) for f in self._forks.values())),
            }


_create_lock = threading.Lock()
_LEAKS = "rref_leaks"


def context_of(agent: RpcAgent) -> RRefContext:
    """The RRef tables of ``agent`` (kept in its ``layer_state``; made on first use)."""
    ctx = agent.layer_state.get(RRefContext)
    if ctx is None:
        with _create_lock:
            ctx = agent.layer_state.get(RRefContext)
            if ctx is None:
                ctx = agent.layer_state[RRefContext] = RRefContext(agent)
    return cast(RRefContext, ctx)


def stop_context(agent: RpcAgent) -> None:
    """The agent stopped: destroy its tables, keeping the forks still registered (leaks)."""
    agent.layer_state[_LEAKS] = context_of(agent).destroy()


def leaks_of(agent: RpcAgent) -> list[tuple[GloballyUniqueId, GloballyUniqueId]]:
    """The forks still registered when ``agent`` stopped (empty before it stopped)."""
    return cast(
        "list[tuple[GloballyUniqueId, GloballyUniqueId]]", agent.layer_state.get(_LEAKS, [])
    )


def _context() -> RRefContext | None:
    agent = current_agent()
    return context_of(agent) if agent is not None else None


# -- handlers of the protocol messages (run on the receiving worker) ---------------------------
@message_type("RREF_FORK_REQUEST")
def _fork_request(rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
    """On the owner: a user forwarded the RRef; register the new user's fork."""
    ctx = _context()
    if ctx is not None:
        ctx.add_fork(rref_id, fork_id)


@message_type("RREF_CHILD_ACCEPT")
def _child_accept(fork_id: GloballyUniqueId) -> None:
    """On a parent user: the owner knows the child now; stop holding the parent for it."""
    ctx = _context()
    if ctx is not None:
        ctx.del_pending_child(fork_id)


@message_type("RREF_CHILD_ACCEPT")
@on_io_thread
def _child_accept_notice(fork_id: GloballyUniqueId) -> None:
    """:func:`_child_accept` as a one-way notice (quick, never blocks: on the I/O thread)."""
    _child_accept(fork_id)


@message_type("RREF_USER_DELETE")
def _user_deletes(pairs: list[tuple[GloballyUniqueId, GloballyUniqueId]]) -> None:
    """On the owner: these users are gone."""
    ctx = _context()
    if ctx is not None:
        ctx.del_forks(pairs)


def _wait_future(future: torch.futures.Future[Any], timeout: float) -> bool:
    done = threading.Event()
    future.add_done_callback(lambda _f: done.set())
    return done.wait(timeout)
