"""``distgrad.rpc.api`` (as ``torch.distributed.rpc.api``): the group helpers, and the private
names of torch's module that libraries and torch's own RPC tests use (``_require_initialized``,
``_all_gather``, ``AllGatherStates``, ``_wait_all`` with ``_thread_local_var``,
``_use_rpc_pickler``; docs/libraries.md lists them)."""

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from .._rpc import _api as _api_impl
from .._rpc._api import (
    get_worker_info,
    init_rpc,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from .._rpc._core import RpcAgent as _RpcAgent
from .._rpc._core import WorkerInfo as _WorkerInfo
from .._rpc._core import current_agent as _current_agent
from .._rpc._group import _collectives
from .._rpc._rrefs._rref import RRef
from .._rpc._rrefs._rref_context import context_of
from .._wire._choice import set_pickler
from .internal import _internal_rpc_pickler, _InternalRPCPickler

__all__ = ["RRef", "get_worker_info", "init_rpc", "remote", "rpc_async", "rpc_sync", "shutdown"]

#: When False, ``shutdown()`` raises if RRef forks are still registered (leak check).
_ignore_rref_leak = True

_wait_all = _api_impl.wait_all
#: torch's thread-local of ``_wait_all``: ``future_list`` collects ``rpc_async``'s futures
_thread_local_var = _api_impl._wait_all_state
#: the pickler in use (torch's name; ``_use_rpc_pickler`` changes it)
_default_pickler: Any = _internal_rpc_pickler


@contextlib.contextmanager
def _use_rpc_pickler(rpc_pickler: Any) -> Iterator[None]:
    """Pickle this process's messages with ``rpc_pickler`` inside the block (torch's private
    helper, which code like verl's TorchRPC backend uses to send lambdas and closures with
    dill): an ``internal._InternalRPCPickler`` subclass that overrides ``_pickler(f)`` /
    ``_unpickler(f)``, or anything the ``pickler=`` option takes (the ``dill`` module).
    Tensors still travel out of band.

    Raises:
        TypeError: the pickler overrides ``serialize`` / ``deserialize`` (distgrad's messages
            are its own format), or has no pickle shape.
        ValueError: it fails a round trip.
    """
    global _default_pickler
    if isinstance(rpc_pickler, _InternalRPCPickler):
        for method in ("serialize", "deserialize"):
            if getattr(type(rpc_pickler), method) is not getattr(_InternalRPCPickler, method):
                raise TypeError(
                    f"{type(rpc_pickler).__name__} overrides {method}(): distgrad pickles its "
                    "messages itself -- override _pickler(f) / _unpickler(f) to choose the "
                    "pickle library (or pass the library, e.g. the dill module)"
                )
    default = rpc_pickler is _internal_rpc_pickler or type(rpc_pickler) is _InternalRPCPickler
    previous = set_pickler(None if default else rpc_pickler)
    before, _default_pickler = _default_pickler, rpc_pickler
    try:
        yield
    finally:
        _default_pickler = before
        set_pickler(previous)


_all_gather = _collectives.all_gather
_barrier = _collectives.barrier
# what the leader of _all_gather calls on each follower (torch's name)
_broadcast_to_followers = _collectives._broadcast_to_followers
_wait_all_workers = _collectives.wait_all_workers
PyRRef = RRef  # torch's C++ base class of RRef; here they are one class
# names torch's module has too (libraries call ``rpc.api._require_initialized``)
_require_initialized = _api_impl._require_initialized
get_rpc_timeout = _api_impl.get_rpc_timeout
WorkerInfo = _WorkerInfo


class AllGatherStates:
    """torch's per-round state of ``_all_gather`` (``gathered_objects``, ``proceed_signal``).

    distgrad's own gather keeps its state elsewhere; this class is here for libraries that
    build their own gather on top of it (GraphLearn-for-PyTorch's role-based ``all_gather``).
    """

    def __init__(self) -> None:
        self.gathered_objects: dict[str, Any] = {}
        self.proceed_signal = threading.Event()


def _is_current_rpc_agent_set() -> bool:
    """True between ``init_rpc`` and ``shutdown``."""
    return _current_agent() is not None


def _get_current_rpc_agent() -> _RpcAgent:
    """This worker's agent (torch's; tools call ``get_worker_info(name_or_id=None)``,
    ``get_worker_infos()``, ``get_debug_info()`` and ``get_metrics()`` on it)."""
    agent = _current_agent()
    if agent is None:
        raise RuntimeError(
            "Current RPC agent is not set! Did you initialize the RPC framework (e.g. by "
            "calling `rpc.init_rpc`)?"
        )
    return agent


def _delete_all_user_and_unforked_owner_rrefs(timeout: float = 60.0) -> None:
    """Tell owners that every UserRRef here is gone and wait for this worker's owned RRefs to
    lose their users (what graceful shutdown does; seconds)."""
    agent = _api_impl._agent()
    context_of(agent).delete_all_users(timeout)
