"""Remote references: ``RRef``, ``remote()``, and the messages behind them (SPEC 1.1, 4).

An :class:`RRef` is either the *owner's* handle (it holds an :class:`OwnerValue`) or a *user's*
(ids only). Users become owners' handles and vice versa only through RPC pickling: sending an
RRef in a call's arguments or result forks it (``_rref_fork``: ``_reduce_rref`` on the
sender, ``_rebuild_rref`` on the receiver; ``_layer.register`` installs it), following the
reference's protocol (``_rref_context`` explains the tables). :func:`create_remote` is
``rpc.remote``'s caller side (here: it makes RRefs, and RRef's ``remote()`` proxy calls it).

What runs where: ``remote()`` sends ``_remote_exec`` to the owner, which creates the value and
registers the caller's fork before it replies; ``to_here()`` sends ``_rref_fetch``
(``_rref_owner`` holds the owner's handlers), answered when the value is set. Both ride on
ordinary calls, so distributed autograd records them as the reference does (forced for Python
functions, ``remote`` and ``to_here``). Protocol messages (fork requests, child accepts,
deletes) are internal calls, retried, never recorded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from ..._errors import InjectedFailureError, PeerFailureError, RpcTimeoutError
from ..._wire._pickler import SKIPPED, extracting_tensors
from .._core import RpcAgent, WorkerInfo, current_agent, fresh_copy, is_script, require_agent
from ._remote import create_here, create_there
from ._rref_context import (
    RREF_TIMED_OUT,
    GloballyUniqueId,
    OwnerValue,
    RRefContext,
    context_of,
)
from ._rref_owner import (
    _agent_or_raise,
    _owner_backward,
    _rref_backward_on_owner,
    _rref_fetch,
    _rref_typeof_on_owner,
    _script_rref_fetch,
    _wait_blocking,
)
from ._rref_proxy import RRefProxy

__all__ = ["RRef", "create_remote"]

T = TypeVar("T")


#: ``(owner id, RRef id's created_on, its local_id, fork id's created_on, its local_id, parent
#: id, type)``: torch's fork tuple (``RRef._serialize``)
SerializedRRef = tuple[int, int, int, int, int, int, str]


class _ByHand:
    """``RRef._serialize`` / ``_deserialize`` are the fork protocol's (``_rref_fork``, a module
    above this one, which builds RRefs); ``_layer.register`` installs them here with the RRef's
    reducer."""

    serialize: Callable[[RRef[Any]], SerializedRRef] | None = None
    deserialize: Callable[[SerializedRRef], RRef[Any]] | None = None


BY_HAND = _ByHand()


class RRef(Generic[T]):
    """A reference to a value that lives on one worker, its *owner* (torch's ``RRef``).

    ``RRef(value)`` makes this worker the owner of ``value``; ``rpc.remote(to, fn, args)``
    returns a *user* reference to ``fn(*args)`` run on ``to``. References can be passed to
    other workers in RPC arguments and results (each receiver gets a reference of its own,
    the owner gets back its owner reference); the owner keeps the value while any reference to
    it exists anywhere, following torch's reference-counting protocol. An RRef cannot be
    pickled outside RPC.

    Args:
        value: the object this worker owns from now on (a tensor, a module, anything).
        type_hint: accepted for torch compatibility (TorchScript interfaces); unused.

    Raises:
        RuntimeError: RPC is not initialized ("Current RPC agent is not set! ...").

    Example:
        # Two workers; worker1 owns the values.

        # on worker 0
        import torch
        import distgrad.rpc as rpc

        rpc.init_rpc("worker0", rank=0, world_size=2)
        rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        rref.to_here()  # tensor([2., 2.]), fetched from worker1
        rref.rpc_sync().size()  # torch.Size([2]): value.size() runs on worker1
        mine = rpc.RRef(torch.zeros(3))  # owned here; worker1 can fetch it with to_here()
        rpc.shutdown()

        # on worker 1
        import distgrad.rpc as rpc

        rpc.init_rpc("worker1", rank=1, world_size=2)
        rpc.shutdown()
    """

    __slots__ = (
        "__weakref__",
        "_confirmed",
        "_creation",
        "_ctx",
        "_deleted",
        "_error",
        "_fork_id",
        "_maybe_created",
        "_owner",
        "_owner_incarnation",
        "_profiling_future",
        "_rref_id",
        "_script",
        "_settled",
        "_timed_out",
        "_type_future",
        "_value",
    )

    _ctx: RRefContext
    _rref_id: GloballyUniqueId
    _fork_id: GloballyUniqueId | None
    _owner: WorkerInfo
    _value: OwnerValue | None

    def __init__(self, value: T, type_hint: Any = None) -> None:
        agent = _agent_or_raise()
        ctx = context_of(agent)
        self._init(ctx, ctx.new_id(), None, agent.worker_info)
        self._value = OwnerValue.of(value)
        self._confirmed = True

    def _init(
        self,
        ctx: RRefContext,
        rref_id: GloballyUniqueId,
        fork_id: GloballyUniqueId | None,
        owner: WorkerInfo,
    ) -> None:
        self._ctx = ctx
        self._rref_id = rref_id
        self._fork_id = fork_id
        self._owner = owner
        #: the owner's incarnation when this reference was made (0: not known)
        self._owner_incarnation = ctx.agent.incarnation_of(owner.id)
        self._value = None
        self._confirmed = False
        self._script = False  # created by a builtin or TorchScript function (torch's non-PyObj)
        self._settled: threading.Event | None = None  # users: set once confirmed (or failed)
        self._error: BaseException | None = None
        self._timed_out = False
        self._maybe_created = False  # its creation failed with a lost peer: it may exist there
        self._deleted = False
        self._creation: torch.futures.Future[Any] | None = None
        self._type_future: torch.futures.Future[Any] | None = None
        self._profiling_future: torch.futures.Future[Any] | None = None

    @classmethod
    def _new_owner(cls, ctx: RRefContext, rref_id: GloballyUniqueId, value: OwnerValue) -> RRef[T]:
        rref: RRef[T] = cls.__new__(cls)
        rref._init(ctx, rref_id, None, ctx.agent.worker_info)
        rref._value = value
        rref._confirmed = True
        return rref

    @classmethod
    def _new_user(
        cls,
        ctx: RRefContext,
        rref_id: GloballyUniqueId,
        fork_id: GloballyUniqueId,
        owner: WorkerInfo,
    ) -> RRef[T]:
        rref: RRef[T] = cls.__new__(cls)
        rref._init(ctx, rref_id, fork_id, owner)
        rref._settled = threading.Event()
        return rref

    def __del__(self) -> None:
        try:
            fork_id = self._fork_id
            if fork_id is None or self._deleted or self._ctx.destroyed:
                return
            known = self._owner_incarnation
            if known and self._ctx.agent.incarnation_of(self._owner.id) != known:
                return  # its owner restarted: the new incarnation never knew this fork
            if self._confirmed or self._timed_out or self._maybe_created:
                self._ctx.user_dropped(self._owner.id, self._rref_id, fork_id)
        except Exception:  # interpreter shutdown, half-built object
            pass

    # -- confirmation (users) --------------------------------------------------------------------
    def _settle(self, error: BaseException | None) -> None:
        """The owner confirmed this user (or, with ``error``, the creation failed)."""
        if error is None:
            self._confirmed = True
        elif isinstance(error, (RpcTimeoutError, InjectedFailureError)):  # as torch does
            self._timed_out = True
        else:
            self._error = error
            # the owner may have registered this fork before the connection was lost: it is
            # deleted like a confirmed one (a delete of an unknown fork is a no-op there)
            self._maybe_created = isinstance(error, PeerFailureError)
        settled = self._settled
        if settled is not None:
            settled.set()

    def _check_usable(self) -> None:
        known = self._owner_incarnation
        if known and self._ctx.agent.incarnation_of(self._owner.id) != known:
            owner = self._owner
            raise PeerFailureError(
                f"the owner of {self}, worker {owner.name} (rank {owner.id}), restarted: the "
                f"value lived in its incarnation {known:016x}, which is gone",
                f"worker {owner.name} (rank {owner.id})",
            )
        value = self._value
        if self._timed_out or (value is not None and value.timed_out):
            # (an owner's: its remote() to this worker timed out or failed to send)
            raise RuntimeError(RREF_TIMED_OUT)
        if self._error is not None:  # a copy: the stored one must not collect our frames
            raise fresh_copy(self._error)

    # -- introspection ---------------------------------------------------------------------------
    def is_owner(self) -> bool:
        """Whether this worker owns the value.

        Returns:
            bool: ``True`` for the owner's reference, ``False`` for a user's.
        """
        return self._fork_id is None

    def owner(self) -> WorkerInfo:
        """The worker that owns the value.

        Returns:
            WorkerInfo: the owner's name and id (usable as an RPC destination).
        """
        return self._owner

    def owner_name(self) -> str:
        """The name of the worker that owns the value.

        Returns:
            str: e.g. ``"worker1"``.
        """
        return self._owner.name

    def confirmed_by_owner(self) -> bool:
        """Whether the owner has registered this reference yet.

        A user reference made by ``rpc.remote`` or received from another user is confirmed
        once the owner knows it (the RRef can be used before that; uses wait where needed).

        Returns:
            bool: always ``True`` on the owner.
        """
        return self._confirmed

    def __str__(self) -> str:
        if self._fork_id is None:
            return f"OwnerRRef({self._rref_id!r})"
        return f"UserRRef(RRefId = {self._rref_id!r}, ForkId = {self._fork_id!r})"

    def __repr__(self) -> str:
        return str(self)

    def __reduce__(self) -> Any:
        if extracting_tensors():  # a device-aware future looking for tensors: none here
            return SKIPPED
        raise RuntimeError(
            "Can not pickle rref in python pickler, rref can only be pickled when using RPC"
        )

    def _serialize(self) -> SerializedRRef:
        """Fork this RRef for one receiver, by hand (torch's ``PyRRef._serialize``, what RPC
        pickling does): the 7-tuple ``(owner id, RRef id's created_on, its local_id, fork
        id's created_on, its local_id, this worker's id, type)``, where the type is
        ``"PyObject"`` or ``"Tensor"`` (an owner's tensor, or an RRef made by a builtin or
        TorchScript function).

        As in torch, the fork is registered now -- on the owner, with the owner; on a user, as
        a child this RRef waits for -- so the tuple must reach ``RRef._deserialize`` on
        exactly one worker of the group (the RRef's value is held for it until then).

        Raises:
            RuntimeError: the creation by ``rpc.remote()`` timed out or failed to send ("RRef
                creation via rpc.remote() timed out, ..."), or this user RRef was deleted.
        """
        serialize = BY_HAND.serialize
        if serialize is None:
            raise RuntimeError("RRefs are not plugged into RPC: import distgrad.rpc")
        return serialize(self)

    @staticmethod
    def _deserialize(data: SerializedRRef) -> RRef[Any]:
        """The RRef that :meth:`_serialize` forked, on the worker that receives the tuple
        (torch's ``PyRRef._deserialize``): the owner gets its owner RRef back; a user gets a
        user RRef, which the owner confirms (its parent is told once it is).

        Raises:
            ValueError: ``data`` is not such a 7-tuple.
            RuntimeError: RPC is not initialized.
        """
        deserialize = BY_HAND.deserialize
        if deserialize is None:
            raise RuntimeError("RRefs are not plugged into RPC: import distgrad.rpc")
        return deserialize(data)

    # -- values ----------------------------------------------------------------------------------
    def local_value(self) -> T:
        """The value itself, on the owner (no copy).

        Blocks until the value is set (the call of ``rpc.remote`` that creates it may still
        run); a worker thread waiting here does not hold a pool slot.

        Returns:
            The owned object: the very object the creating function returned.

        Raises:
            RuntimeError: called on a user reference ("... can't call localValue() on user
                WorkerInfo(...). Call it on owner WorkerInfo(...)").
            Exception: the error of the ``rpc.remote`` call that was to create the value.

        Example:
            # On worker1, the owner, in a function worker0 calls with the RRef:
            def add_to(rref, x):
                return rref.local_value() + x


            # on worker 0
            rref = rpc.remote("worker1", torch.ones, args=(2,))
            rpc.rpc_sync("worker1", add_to, args=(rref, 1))  # tensor([2., 2.])
        """
        if self._value is None:
            me = current_agent()
            where = me.worker_info if me is not None else self._ctx.agent.worker_info
            raise RuntimeError(
                f"For UserRRef(rref_id={self._rref_id!r}, fork_id={self._fork_id!r}), can't call "
                f"localValue() on user {where}. Call it on owner {self._owner}"
            )
        return _wait_blocking(self._ctx.agent, self._value)  # type: ignore[no-any-return]

    def to_here(self, timeout: float = -1.0) -> T:
        """A copy of the value, fetched from the owner (on the owner: the value itself).

        Blocks until the value exists and has arrived. Inside a distributed autograd context
        the fetch is recorded, so gradients flow back into the owner's graph.

        Args:
            timeout (float): seconds; ``-1`` (the default) uses the default RPC timeout,
                ``0`` waits without limit.

        Returns:
            The value (for a user: a copy, unpickled here).

        Raises:
            RuntimeError: the reference was deleted ("... Cannot call to_here() on it after
                deletion."), or its creation timed out ("RRef creation via rpc.remote() timed
                out, ...").
            RpcTimeoutError: the fetch took longer than ``timeout``.
            PeerFailureError: the owner died.
            Exception: the error of the ``rpc.remote`` call that was to create the value.

        Example:
            # on worker 0 (worker1 serves)
            rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
            rref.to_here()  # tensor([4., 4.])
        """
        if self._value is not None:
            return _wait_blocking(self._ctx.agent, self._value)  # type: ignore[no-any-return]
        if self._deleted:
            raise RuntimeError(
                f"{self} has been deleted. Cannot call to_here() on it after deletion."
            )
        self._check_usable()
        agent = self._ctx.agent
        fetch = _script_rref_fetch if self._script else _rref_fetch
        return agent.call_sync(self._owner, fetch, (self._rref_id,), {}, timeout)  # type: ignore[no-any-return]

    def _get_future(self) -> torch.futures.Future[Any]:
        """The future of the call that created this RRef (``rpc.remote``)."""
        if self._creation is None:
            future: torch.futures.Future[Any] = torch.futures.Future()
            future.set_result(None)
            return future
        return self._creation

    def _get_profiling_future(self) -> torch.futures.Future[Any]:
        return self._profiling_future if self._profiling_future is not None else self._get_future()

    def _set_profiling_future(self, future: torch.futures.Future[Any]) -> None:
        self._profiling_future = future

    def _get_type(self, timeout: float = -1.0, blocking: bool = True) -> Any:
        """The type of the value (one RPC to the owner the first time, then cached). With
        ``blocking=False``, a future of it."""
        future = self._type_future
        if future is None:
            if self._value is not None:
                future = self._value.as_future(type)
            else:
                self._check_usable()
                future = self._ctx.agent.call_async(
                    self._owner,
                    _rref_typeof_on_owner,
                    (self._rref_id,),
                    {},
                    timeout,
                    internal=True,
                )
            self._type_future = future
        return future.wait() if blocking else future

    # -- proxies ---------------------------------------------------------------------------------
    def _remote_on_owner(self, func: Any, args: tuple[Any, ...], timeout: float) -> RRef[Any]:
        """``rpc.remote`` of the Python function ``func`` on the owner (the ``remote()``
        proxy's call)."""
        return create_remote(require_agent(), self._owner, func, args, {}, timeout, force=True)

    def rpc_sync(self, timeout: float = -1.0) -> RRefProxy:
        """A proxy that calls the value's methods on the owner with ``rpc_sync``.

        ``rref.rpc_sync().method(*args, **kwargs)`` is
        ``rpc.rpc_sync(rref.owner(), <run value.method(*args, **kwargs)>)``: it blocks and
        returns the method's result.

        Args:
            timeout (float): seconds for each call made through the proxy; ``-1`` uses the
                default RPC timeout.

        Returns:
            A proxy whose attributes are the value's methods.

        Example:
            # on worker 0 (worker1 serves)
            rref = rpc.remote("worker1", torch.add, args=(torch.zeros(2, 3), 1))
            rref.rpc_sync().size()  # torch.Size([2, 3])
            rref.rpc_sync().view(3, 2)  # tensor of shape (3, 2), a copy sent back
        """
        return RRefProxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = -1.0) -> RRefProxy:
        """A proxy that calls the value's methods on the owner with ``rpc_async``.

        ``rref.rpc_async().method(*args, **kwargs)`` returns at once a
        ``torch.futures.Future`` of the method's result.

        Args:
            timeout (float): seconds for each call made through the proxy; ``-1`` uses the
                default RPC timeout.

        Returns:
            A proxy whose attributes are the value's methods, each returning a future.

        Example:
            # on worker 0 (worker1 serves)
            rref = rpc.remote("worker1", torch.add, args=(torch.zeros(2, 3), 1))
            rref.rpc_async().size().wait()  # torch.Size([2, 3])
        """
        return RRefProxy(self, "async", timeout)

    def remote(self, timeout: float = -1.0) -> RRefProxy:
        """A proxy that calls the value's methods on the owner with ``rpc.remote``.

        ``rref.remote().method(*args, **kwargs)`` returns at once an ``RRef`` to the method's
        result, which stays on the owner.

        Args:
            timeout (float): seconds for the creation of each result; ``-1`` uses the default
                RPC timeout.

        Returns:
            A proxy whose attributes are the value's methods, each returning an ``RRef``.

        Example:
            # on worker 0 (worker1 serves)
            rref = rpc.remote("worker1", torch.add, args=(torch.zeros(2, 3), 1))
            rref.remote().view(3, 2).to_here()  # the (3, 2) view, made on worker1
        """
        return RRefProxy(self, "remote", timeout)

    # -- autograd --------------------------------------------------------------------------------
    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run backward from the value (a scalar tensor) on its owner.

        With ``dist_autograd_ctx_id`` the pass is a distributed one
        (``dist_autograd.backward(dist_autograd_ctx_id, [value])`` on the owner): gradients
        go to that context on every worker. Without one (owner only) it is a local
        ``torch.autograd.backward`` that fills ``.grad``.

        Args:
            dist_autograd_ctx_id (int): the distributed autograd context; ``-1`` (the default)
                for a local pass, on the owner only.
            retain_graph (bool): keep the graph for another pass (as in ``backward``).

        Raises:
            RuntimeError: a user reference without a context id ("User RRefs require
                'dist_autograd_ctx_id' to be specified"); the value is not a tensor ("RRef
                should contain a tensor for .backward()"); the backward pass failed.

        Example:
            # on worker 0 (worker1 serves)
            import distgrad.autograd as dist_autograd

            with dist_autograd.context() as context_id:
                rref = rpc.remote("worker1", torch.sum, args=(torch.ones(2, requires_grad=True),))
                rref.backward(context_id)
        """
        if self._value is not None:
            _owner_backward(self.local_value(), dist_autograd_ctx_id, retain_graph)
            return
        if dist_autograd_ctx_id == -1:
            raise RuntimeError("User RRefs require 'dist_autograd_ctx_id' to be specified")
        self._check_usable()
        self._ctx.agent.call_sync(
            self._owner,
            _rref_backward_on_owner,
            (self._rref_id, dist_autograd_ctx_id, retain_graph),
            {},
            internal=True,
        )


def create_remote(
    agent: RpcAgent,
    dst: WorkerInfo,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    force: bool,
) -> RRef[Any]:
    """``rpc.remote``: an RRef at once; the value is created on ``dst`` (``_remote`` sends the
    creation call and records its outcome on the RRef)."""
    ctx = context_of(agent)
    rref_id = ctx.new_id()
    if dst.id == ctx.worker_id:  # the owner is here: its handle now, the value from a call
        value = OwnerValue()
        rref: RRef[Any] = RRef._new_owner(ctx, rref_id, value)
        call = (func, args, kwargs)
        rref._creation = create_here(agent, ctx, dst, rref_id, value, call, timeout, force)
    else:
        fork_id = ctx.new_id()
        rref = RRef._new_user(ctx, rref_id, fork_id, dst)
        rref._script = is_script(func)
        call = (func, args, kwargs)
        rref._creation = create_there(agent, ctx, dst, rref, call, timeout, force)
    return rref
