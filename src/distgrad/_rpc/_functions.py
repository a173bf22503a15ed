"""``@async_execution``: a function whose result is a ``torch.futures.Future``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

__all__ = ["after_current_task", "async_execution", "on_io_thread"]

F = TypeVar("F", bound=Callable[..., Any])


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a ``torch.futures.Future``; the callee replies when it
    completes, without holding a worker thread meanwhile (torch's decorator, same rules:
    innermost under ``@staticmethod``/``@classmethod``)."""

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
