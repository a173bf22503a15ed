"""``@async_execution``: a function whose result is a ``torch.futures.Future``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

__all__ = ["after_current_task", "async_execution", "on_io_thread"]

F = TypeVar("F", bound=Callable[..., Any])


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a ``torch.futures.Future``: the callee answers the call when
    that future completes, with its value or its error, and holds no worker thread meanwhile
    (torch's ``rpc.functions.async_execution``).

    The function runs on the callee like any RPC target; what it returns must be a
    ``torch.futures.Future`` (it never crosses the wire). It may start nested RPCs and return
    their futures, or futures chained with ``then``, or a future it completes later (e.g. once
    a batch is full). Works with ``rpc_sync``, ``rpc_async``, ``remote`` and the RRef
    proxies. Under ``@staticmethod`` or ``@classmethod`` it must be the inner decorator.

    Args:
        fn (Callable): the function; it returns a ``torch.futures.Future``.

    Returns:
        Callable: ``fn`` wrapped (``functools.wraps``), with ``_wrapped_async_rpc_function``
        set to ``fn``.

    Raises:
        RuntimeError: (on the caller, when the call is answered) the function returned
            something else than a future ("Functions decorated with @rpc.async_function must
            return a torch.futures.Future object, but got ...").

    Example:
        # Defined on every worker (functions travel by reference):
        @rpc.functions.async_execution
        def async_add_chained(to, x, y, z):
            # worker1 answers worker0 only once worker2 answered worker1
            return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)


        # on worker 0 (worker1 and worker2 serve)
        ret = rpc.rpc_sync(
            "worker1", async_add_chained, args=("worker2", torch.ones(2), 1, 1)
        )  # tensor([3., 3.])
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]
    return cast(F, wrapper)


def on_io_thread(fn: F) -> F:
    """Mark an internal notification handler (see ``RpcAgent.notify``) to run on the receiver's
    I/O thread, as soon as its frame is read, instead of on a worker thread. Only for handlers
    that are quick and never block: they hold up every connection while they run."""
    fn._distgrad_on_io_thread = True  # type: ignore[attr-defined]
    return fn


def after_current_task(fn: F) -> F:
    """Mark an internal notification handler that nothing waits for (context cleanup) to run
    after the task a worker thread is running, on that thread, rather than on a thread of its
    own at once (see ``ThreadPool.submit_after_current``): a notification that arrives with a
    request, in the same write, then neither wakes a second thread nor competes with the
    request for the GIL. With no task running, it runs at once."""
    fn._distgrad_after_current = True  # type: ignore[attr-defined]
    return fn
