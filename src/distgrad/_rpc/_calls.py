"""What one outgoing call is while it waits: the record the agent keeps (``_Call``) and the
future ``rpc_async`` hands out (``RpcFuture``); and which functions are torch builtins."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.jit._builtins import _find_builtin as _find_builtin_untyped

from ._pool import ThreadPool

if TYPE_CHECKING:
    from .._transport._connection import Connection
    from .._transport._transport import LoopbackConnection
    from .._wire._frames import Frame

__all__ = ["RpcFuture", "is_builtin"]

_find_builtin: Callable[[Any], Any] = _find_builtin_untyped


def is_builtin(func: Any) -> bool:
    """True for torch operators that the reference runs as builtins (e.g. ``torch.add``)."""
    try:
        return _find_builtin(func) is not None
    except Exception:
        return False


class RpcFuture(torch.futures.Future):  # type: ignore[type-arg]
    """The future ``rpc_async`` returns: a ``torch.futures.Future`` whose ``wait()``, on one of
    the agent's worker threads, frees that thread's pool slot while it waits (as ``rpc_sync``
    does), so nested calls that wait on futures cannot exhaust the pool either."""

    _pool: ThreadPool | None = None

    def wait(self) -> Any:
        pool = self._pool
        if pool is None or self.done() or not pool.is_member():
            return super().wait()
        pool.enter_blocking()
        try:
            return super().wait()
        finally:
            pool.exit_blocking()


class _Call:
    """One outgoing request waiting for its response."""

    __slots__ = (
        "cid",
        "conn",
        "error",
        "frame",
        "future",
        "internal",
        "lock",
        "slot",
        "timeout",
    )

    def __init__(
        self,
        cid: int,
        conn: Connection | LoopbackConnection,
        timeout: float,
        internal: bool,
        future: torch.futures.Future[Any] | None,
    ) -> None:
        self.cid = cid
        self.conn = conn
        self.timeout = timeout
        self.internal = internal
        self.future = future
        self.frame: Frame | None = None
        self.error: BaseException | None = None
        self.slot = 0
        self.lock: threading.Lock | None = None
        if future is None:
            self.lock = threading.Lock()
            self.lock.acquire()
