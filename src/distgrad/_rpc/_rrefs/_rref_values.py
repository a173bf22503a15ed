"""The values of the RRef protocol: the ids of RRefs and forks (:class:`GloballyUniqueId`), and
an owner's value, set once by the creating call and waited for by ``to_here()``
(:class:`OwnerValue`); and :class:`UserHandle`, what the tables (``_rref_context``'s) use of a
user's ``RRef``."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .._core import WorkerInfo, set_future_error

__all__ = ["RREF_TIMED_OUT", "GloballyUniqueId", "OwnerValue", "UserHandle"]


RREF_TIMED_OUT = (
    "RRef creation via rpc.remote() timed out, and it is possible that the RRef on the owner "
    "node does not exist."
)

# One counter per process for RRef ids and fork ids alike (ids never repeat, not even after a
# re-init); the reference numbers them the same way.
_local_ids = itertools.count()


class GloballyUniqueId:
    """``(created_on, local_id)``: the worker that made the id and its per-process counter."""

    __slots__ = ("created_on", "local_id")

    def __init__(self, created_on: int, local_id: int) -> None:
        self.created_on = created_on
        self.local_id = local_id

    @classmethod
    def new(cls, worker_id: int) -> GloballyUniqueId:
        return cls(worker_id, next(_local_ids))

    def __repr__(self) -> str:
        return f"GloballyUniqueId(created_on={self.created_on}, local_id={self.local_id})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GloballyUniqueId):
            return NotImplemented
        return self.created_on == other.created_on and self.local_id == other.local_id

    def __hash__(self) -> int:
        return hash((self.created_on, self.local_id))

    def __reduce__(self) -> tuple[Any, ...]:
        return (GloballyUniqueId, (self.created_on, self.local_id))


class OwnerValue:
    """The value of an OwnerRRef: set once, to a value or an error; waited for or called back.

    The object is stored as it is (no conversion), so ``local_value()`` returns the very object
    the creating function returned -- parameters keep their identity, which the distributed
    optimizer relies on."""

    __slots__ = ("_callbacks", "_done", "_error", "_lock", "_value", "timed_out")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[OwnerValue], None]] = []
        self.timed_out = False

    @classmethod
    def of(cls, value: Any) -> OwnerValue:
        holder = cls()
        holder.set_value(value)
        return holder

    def done(self) -> bool:
        return self._done.is_set()

    def set_value(self, value: Any) -> None:
        self._complete(value, None)

    def set_error(self, error: BaseException) -> None:
        self._complete(None, error)

    def _complete(self, value: Any, error: BaseException | None) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._value, self._error = value, error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def add_callback(self, callback: Callable[[OwnerValue], None]) -> None:
        """Call ``callback(self)`` once the value is set (at once if it is)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def wait(self, timeout: float | None = None) -> Any:
        """The value (blocking until set), or raise the error it holds."""
        if self.timed_out and not self._done.is_set():
            raise RuntimeError(RREF_TIMED_OUT)
        if not self._done.wait(timeout):
            raise TimeoutError("the RRef's value was not set in time")
        if self._error is not None:
            raise self._error
        return self._value

    def result(self) -> Any:
        """Like :meth:`wait` once done (never blocks)."""
        if self._error is not None:
            raise self._error
        return self._value

    def as_future(self, transform: Callable[[Any], Any] | None = None) -> torch.futures.Future[Any]:
        """A ``torch.futures.Future`` of the value (or of ``transform(value)``)."""
        future: torch.futures.Future[Any] = torch.futures.Future()

        def complete(holder: OwnerValue) -> None:
            try:
                value = holder.result()
                future.set_result(transform(value) if transform is not None else value)
            except BaseException as exc:
                set_future_error(future, exc)

        self.add_callback(complete)
        return future


class UserHandle(Protocol):
    """What the RRef tables use of a UserRRef (``_rref.RRef`` is one): its ids and owner, its
    deletion and confirmation state. The tables sit below the ``RRef`` class (it uses them), so
    they know it only through this."""

    _rref_id: GloballyUniqueId
    _fork_id: GloballyUniqueId | None
    _owner: WorkerInfo
    _owner_incarnation: int
    _timed_out: bool
    _maybe_created: bool
    _deleted: bool

    def _settle(self, error: BaseException | None) -> None:
        """The owner confirmed it (``error`` None) or never will (why)."""
