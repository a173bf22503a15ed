"""Traces across workers (issue 30), off unless asked for (``DISTGRAD_TRACE=1`` or
:func:`enable`): a call's span on the caller and its span on the callee, linked through a W3C
``traceparent`` (``00-<trace id>-<span id>-01``) carried in the request as a fourth element of
its payload; what the callee calls while serving it is a child of the callee's span. Finished
spans are kept, bounded (``KEEP``), for the metrics endpoint's ``/traces`` (and any exporter:
their fields are OpenTelemetry's). Distributed autograd makes a backward pass one trace by
deriving its ids from the pass id (``pass_trace``): every worker it reaches records its part
under the same trace, no id travelling in the gradient messages.

Off, the cost on the call path is one read of :data:`active`."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ... import _config

__all__ = [
    "KEEP",
    "Span",
    "active",
    "disable",
    "enable",
    "finished",
    "new_span_id",
    "pass_trace",
    "sinks",
    "traceparent",
]

_log = logging.getLogger("distgrad.observe")

#: finished spans kept (the oldest dropped first)
KEEP = 20000

#: whether calls are traced now (read on every call)
active: bool = _config.env_flag(_config.ENV_TRACE, False)

_spans: collections.deque[Span] = collections.deque(maxlen=KEEP)
_local = threading.local()
#: called with each span as it ends (an exporter's hand-off: quick, must not raise)
sinks: list[Callable[[Span], None]] = []


@dataclass(slots=True)
class Span:
    """One span: OpenTelemetry's fields (ids in hex, times in ns since the epoch)."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    kind: str  # "client", "server", "internal"
    worker: str
    start_ns: int
    end_ns: int = 0
    status: str = "ok"
    attributes: dict[str, Any] = field(default_factory=dict)

    def end(self, status: str = "ok") -> None:
        self.end_ns = time.time_ns()
        self.status = status
        _spans.append(self)
        for sink in sinks:
            try:
                sink(self)
            except Exception:  # (an exporter's trouble never fails a call)
                _log.debug("a span sink failed", exc_info=True)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "parent_id": self.parent_id,
            "kind": self.kind,
            "worker": self.worker,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "status": self.status,
            "attributes": dict(self.attributes),
        }


def enable() -> None:
    global active
    active = True


def disable() -> None:
    global active
    active = False


def _id(nbytes: int) -> str:
    return os.urandom(nbytes).hex()


def new_span_id() -> str:
    return _id(8)


def traceparent(span: Span) -> str:
    return f"00-{span.trace_id}-{span.span_id}-01"


def parse(header: object) -> tuple[str, str] | None:
    """(trace id, parent span id) of a ``traceparent``, or None for anything else."""
    if not isinstance(header, str) or len(header) != 55:
        return None
    parts = header.split("-")
    if len(parts) != 4:
        return None
    version, trace_id, span_id, _flags = parts
    if version != "00" or len(trace_id) != 32 or len(span_id) != 16:
        return None
    return trace_id, span_id


def current() -> Span | None:
    """The span the calling thread is in (serving a traced request, or a pass's part)."""
    return getattr(_local, "span", None)


def set_current(span: Span | None) -> Span | None:
    previous = getattr(_local, "span", None)
    _local.span = span
    return previous


def client(worker: str, peer: str, function: str) -> Span:
    """The caller's span of a call (a child of the thread's span, or a new trace's root)."""
    parent = current()
    return Span(
        name=function,
        trace_id=parent.trace_id if parent is not None else _id(16),
        span_id=_id(8),
        parent_id=parent.span_id if parent is not None else None,
        kind="client",
        worker=worker,
        start_ns=time.time_ns(),
        attributes={"rpc.peer": peer},
    )


def server(header: object, worker: str, peer: str, function: str) -> Span | None:
    """The callee's span of a request that came with ``header`` (None if it is not one)."""
    ids = parse(header)
    if ids is None:
        return None
    return Span(
        name=function,
        trace_id=ids[0],
        span_id=_id(8),
        parent_id=ids[1],
        kind="server",
        worker=worker,
        start_ns=time.time_ns(),
        attributes={"rpc.peer": peer},
    )


def pass_trace(pass_id: tuple[int, int]) -> tuple[str, str]:
    """The trace id and root span id of the backward pass ``pass_id`` (driver, counter):
    every worker derives the same, so the pass is one trace without ids in its messages."""
    driver, counter = pass_id
    mask = 2**64 - 1
    return f"{driver & mask:016x}{counter & mask:016x}", f"{(counter + 1) & mask:016x}"


def finished(worker: str | None = None) -> list[Span]:
    """The finished spans kept (those of ``worker`` only, if given), oldest first."""
    spans = list(_spans)
    return spans if worker is None else [s for s in spans if s.worker == worker]
