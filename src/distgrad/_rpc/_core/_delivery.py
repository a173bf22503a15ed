"""The message being encoded on this thread: where it goes, and what to tell the objects
pickled into it if it fails.

A layer above may pickle state into a message that only the message's arrival settles: an RRef
forked to another worker is held by its sender until the receiver says the owner knows the
child (``_rrefs``). If the request never arrives, nothing would ever say so, and the sender
would hold -- and a graceful shutdown wait for -- what already failed. So while a request is
encoded, :func:`destination` names its receiver and :func:`on_failure` registers what to run
if it fails: ``callback(maybe_delivered)``, with ``False`` when it is certain the peer never
got it (it was not sent: a broken connection twice, an injected failure, a size limit, an
error while pickling) and ``True`` when it may have (a peer lost after the write, a timeout,
an error reply, the agent stopping). Each callback runs at most once, on whichever thread
learns of the failure: it must be quick and must not block."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["FailureCallbacks", "destination", "on_failure", "run_failure_callbacks"]

_log = logging.getLogger("distgrad.rpc")

FailureCallbacks = list[Callable[[bool], None]]


class _Encoding(threading.local):
    #: the rank the message being encoded goes to (-1: none is being encoded)
    dst: int = -1
    #: what to run if it fails (None: a message that takes no callbacks, e.g. a response)
    callbacks: FailureCallbacks | None = None


encoding = _Encoding()


def destination() -> int:
    """The rank the message being encoded on this thread goes to; -1 if none."""
    return encoding.dst


def on_failure(callback: Callable[[bool], None]) -> bool:
    """Run ``callback(maybe_delivered)`` if the request being encoded on this thread fails;
    False (and nothing registered) if no request is being encoded."""
    callbacks = encoding.callbacks
    if callbacks is None:
        return False
    callbacks.append(callback)
    return True


def run_failure_callbacks(callbacks: FailureCallbacks | None, maybe_delivered: bool) -> None:
    """Run (once: the list is emptied) what the failed request's objects registered."""
    if not callbacks:
        return
    taken = callbacks[:]
    callbacks.clear()
    for callback in taken:
        try:
            callback(maybe_delivered)
        except Exception:
            _log.exception("unhandled error in a failed message's callback")
