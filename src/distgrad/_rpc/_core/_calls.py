"""What one outgoing call is while it waits: the record the agent keeps (``_Call``) and the
future ``rpc_async`` hands out (``RpcFuture``); and which functions are torch builtins."""

from __future__ import annotations

import copy
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.jit._builtins import _get_builtin_table

from ._pool import ThreadPool
from ._remote_error import remember_traceback

if TYPE_CHECKING:
    from ..._transport._base import Link
    from ..._wire._frames import Frame

__all__ = [
    "RpcFuture",
    "callback_error_message",
    "check_async_result",
    "failed_future",
    "fresh_copy",
    "is_builtin",
    "set_future_error",
]

#: torch's table of builtin operators by ``id`` (built on first use, then only added to: the
#: same dict is kept, so a reference to it stays current)
_builtins: dict[int, Any] | None = None


def is_builtin(func: Any) -> bool:
    """True for torch operators that the reference runs as builtins (e.g. ``torch.add``): what
    ``torch.jit._builtins._find_builtin`` answers, in one dict lookup."""
    table = _builtins
    if table is None:
        table = _load_builtins()
    return id(func) in table


def _load_builtins() -> dict[int, Any]:
    global _builtins
    table: dict[int, Any] = _get_builtin_table()  # type: ignore[no-untyped-call]
    _builtins = table
    return table


def check_async_result(future: Any) -> Any:
    """What an ``@async_execution`` function returned, if it is a future; the reference's
    error otherwise."""
    if not isinstance(future, (torch.futures.Future, torch._C.Future)):
        kind = type(future)
        raise RuntimeError(
            "Functions decorated with @rpc.async_function must return a "
            f"torch.futures.Future object, but got {kind.__module__}.{kind.__qualname__}"
        )
    return future


def fresh_copy(stored: BaseException) -> BaseException:
    """A new exception equal to ``stored`` (type, args, attributes, cause)."""
    try:
        fresh = copy.copy(stored)
    except Exception:
        return stored
    fresh.__cause__ = stored.__cause__
    fresh.__context__ = stored.__context__
    fresh.__suppress_context__ = stored.__suppress_context__
    return fresh


def _raise_fresh(stored: BaseException) -> None:
    raise fresh_copy(stored)


def set_future_error(future: torch.futures.Future[Any], error: BaseException) -> None:
    """Fail ``future`` with ``error`` (what ``set_exception`` does), but so that every
    ``wait()``/``value()`` raises a fresh copy.

    ``set_exception`` stores the exception object itself and re-raises it on each wait, so its
    traceback collects the frames of every waiter -- and with them whatever those frames hold
    (RRefs, the future itself). A torch Future is opaque to the garbage collector, so such a
    cycle is never collected: an RRef used in a failed call would keep its owner's value alive
    forever. The stored copy keeps no frames, only the traceback's text (which an error reply
    sends on, see ``_remote_error``); ``error`` itself is left as it is."""
    stored = fresh_copy(error)
    if stored is not error and error.__traceback__ is not None:
        remember_traceback(stored, error)
    future._set_unwrap_func(_raise_fresh)  # type: ignore[attr-defined]
    future.set_result(stored)


def failed_future(error: BaseException, pools: tuple[ThreadPool, ...] = ()) -> RpcFuture:
    """An :class:`RpcFuture` that has already failed with ``error`` (``rpc_async`` to a peer
    known dead: torch fails the future rather than raising at the call)."""
    future = RpcFuture()
    future._pools = pools
    set_future_error(future, error)
    return future


class RpcFuture(torch.futures.Future):  # type: ignore[type-arg]
    """The future ``rpc_async`` returns: a ``torch.futures.Future`` whose ``wait()``, on one of
    the agent's threads (a worker thread, or a callback thread running a ``then`` callback),
    frees that thread's pool slot while it waits (as ``rpc_sync`` does). So nested calls that
    wait on futures cannot exhaust the worker pool, and callbacks that wait on other calls
    cannot take every callback thread -- the threads that complete those calls."""

    #: the agent's pools (worker threads, callback threads)
    _pools: tuple[ThreadPool, ...] = ()
    #: the CUDA devices of a device-aware future (``devices=``), which ``then`` passes on
    _device_list: list[torch.device] = []

    def wait(self) -> Any:
        if self._pools and not self.done():
            for pool in self._pools:
                if pool.is_member():
                    pool.enter_blocking()
                    try:
                        return super().wait()
                    finally:
                        pool.exit_blocking()
        return super().wait()

    def then(self, callback: Callable[[Any], Any]) -> torch.futures.Future[Any]:
        """As ``torch.futures.Future.then``, but the chained future is one of these too (its
        ``wait()`` frees the pool slot as well).

        As torch's: what is not callable raises torch's own ``TypeError`` here, and an
        exception raised by ``callback`` fails the chained future with torch's
        ``RuntimeError("Got the following error when running the callback: {type}: {msg}")``
        -- the original exception is its ``__cause__``."""
        if not callable(callback):
            return super().then(callback)  # raises pybind's "then(): incompatible ..." error
        if self._device_list:  # completed on the callback's synced streams, events recorded
            chained = RpcFuture(devices=list[Any](self._device_list))
            chained._device_list = self._device_list
        else:
            chained = RpcFuture()
        chained._pools = self._pools

        def run(done: torch.futures.Future[Any]) -> None:
            try:
                value = callback(done)
            except BaseException as exc:
                error = RuntimeError(callback_error_message(exc))
                error.__cause__ = exc
                set_future_error(chained, error)
            else:
                chained.set_result(value)

        self.add_done_callback(run)
        return chained


def callback_error_message(exc: BaseException) -> str:
    """torch's message for an exception raised by a ``then`` callback: the type and message,
    then the Python frames from where it was raised out to the callback, innermost first."""
    message = f"Got the following error when running the callback: {type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # from the callback inwards
    if frames:
        where = "".join(f"  {f.filename}({f.lineno}): {f.name}\n" for f in reversed(frames))
        message += f"\n\nAt:\n{where}"
    return message


class _Call:
    """One outgoing request waiting for its response."""

    __slots__ = (
        "callback",
        "cid",
        "conn",
        "error",
        "frame",
        "function",
        "future",
        "held",
        "internal",
        "lock",
        "sending",
        "settle",
        "slot",
        "span",
        "started",
        "timeout",
    )

    def __init__(
        self,
        cid: int,
        conn: Link,
        timeout: float,
        future: torch.futures.Future[Any] | None,
        *,
        internal: bool,
        callback: Callable[[Any, BaseException | None], None] | None = None,
    ) -> None:
        self.cid = cid
        self.conn = conn
        self.timeout = timeout
        self.internal = internal
        self.future = future
        self.frame: Frame | None = None
        self.error: BaseException | None = None
        self.slot = 0
        #: its sender holds the connection's read role, to read the answer itself
        self.held = False
        #: what it is counted under (``_statistics.function_label``), and when it was made
        #: (``time.perf_counter()``): the agent's metrics
        self.function = ""
        self.started = 0.0
        #: its caller's span, when calls are traced (``_tracing``)
        self.span: Any = None
        #: its sender is writing the request: a loss of the link meanwhile is the sender's to
        #: judge (the frame may not have left: it is then sent again), not the I/O thread's
        self.sending = True
        #: what the objects pickled into the request want run if it fails (``_delivery``)
        self.settle: list[Callable[[bool], None]] | None = None
        self.lock: threading.Lock | None = None
        #: for internal calls: called with (result, error) where the answer arrives
        self.callback = callback
        if future is None and callback is None:
            self.lock = threading.Lock()
            self.lock.acquire()
