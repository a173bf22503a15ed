"""What profiling across workers records: events, calls, what a callee sends back, and the
session that collects them for one profiler.

Times are integer nanoseconds of the wall clock (``time.time_ns()``; torch's profilers use
the same clock) *of the worker that holds the record*. A record crossing to another worker is
shifted by the estimated clock offset between the two (see ``_clock``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ._keys import remote_name

__all__ = ["CallRecord", "Event", "RemoteProfile", "Session", "active_sessions", "current_session"]


@dataclass(frozen=True)
class Event:
    """One range recorded on some worker (``node``) for a profiled call."""

    name: str  #: as the worker holding it calls it (``key#remote_op: aten::add``)
    op: str  #: as the worker that ran it called it (``aten::add``)
    node: int
    thread: int
    start_ns: int
    end_ns: int
    input_shapes: list[Any] = field(default_factory=list)
    cpu_memory_usage: int = 0
    sequence_nr: int = -1
    scope: int = 0

    def received(self, key: str, shift_ns: int) -> Event:
        """This event as the caller of ``key`` sees it: renamed, on the caller's clock."""
        return replace(
            self,
            name=remote_name(key, self.name),
            start_ns=self.start_ns - shift_ns,
            end_ns=self.end_ns - shift_ns,
        )


@dataclass(frozen=True)
class CallRecord:
    """One profiled call: the caller's range (send to response) and the callee's handling of
    it, both on the clock of the worker holding the record."""

    key: str
    src: int
    dst: int
    src_name: str
    dst_name: str
    thread: int  #: the caller's thread (-1: not known yet)
    start_ns: int
    end_ns: int
    serve_thread: int
    serve_start_ns: int
    serve_end_ns: int

    def shifted(self, shift_ns: int) -> CallRecord:
        return replace(
            self,
            start_ns=self.start_ns - shift_ns,
            end_ns=self.end_ns - shift_ns,
            serve_start_ns=self.serve_start_ns - shift_ns,
            serve_end_ns=self.serve_end_ns - shift_ns,
        )


@dataclass
class RemoteProfile:
    """What a callee sends back with the result of a profiled request (its clock)."""

    rank: int
    thread: int
    start_ns: int
    end_ns: int
    events: list[Event]
    calls: list[CallRecord]


class Session:
    """The remote side of one profiling window: every event that other workers recorded for
    calls made under it, and every call (local and nested), on this worker's clock."""

    def __init__(self, record_shapes: bool = False, profile_memory: bool = False) -> None:
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.lock = threading.Lock()
        self.events: list[Event] = []
        self.calls: list[CallRecord] = []
        self.names: dict[int, str] = {}
        self.open = True
        self.pending = 0  # calls made under this session still waiting for their response
        self._settled: list[Callable[[], None]] = []

    def begin_call(self) -> None:
        with self.lock:
            self.pending += 1

    def end_call(self) -> None:
        with self.lock:
            self.pending -= 1
            ready = self._settled if self.pending == 0 else []
            if ready:
                self._settled = []
        for callback in ready:
            callback()

    def when_settled(self, callback: Callable[[], None], grace: float) -> None:
        """Run ``callback`` (once) when no call made under the session is pending, or after
        ``grace`` seconds: a callee answers once the calls it made have answered, so their
        events come back with its own, but never waits long (a call it made may depend on
        its answer)."""
        done = threading.Event()

        def once() -> None:
            if not done.is_set():
                done.set()
                callback()

        timer = threading.Timer(grace, once)
        timer.daemon = True
        with self.lock:
            waiting = self.pending > 0
            if waiting:
                self._settled += [timer.cancel, once]
        if not waiting:
            once()
            return
        timer.start()  # (cancelled before it starts: it never runs)

    def add(self, call: CallRecord, events: list[Event], nested: list[CallRecord]) -> None:
        with self.lock:
            if not self.open:  # the response came after the profiler stopped: not recorded
                return
            self.calls.append(call)
            self.calls.extend(nested)
            self.events.extend(events)
            self.names.setdefault(call.src, call.src_name)
            self.names.setdefault(call.dst, call.dst_name)
            for record in nested:
                self.names.setdefault(record.src, record.src_name)
                self.names.setdefault(record.dst, record.dst_name)

    def close(self) -> None:
        with self.lock:
            self.open = False

    def snapshot(self) -> tuple[list[Event], list[CallRecord]]:
        with self.lock:
            return list(self.events), list(self.calls)


# -- which session a call belongs to ---------------------------------------------------------
_local = threading.local()
_active: list[Session] = []
_active_lock = threading.Lock()


def push(session: Session) -> None:
    """Make ``session`` current on this thread (and known process-wide while open)."""
    stack: list[Session] | None = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(session)
    with _active_lock:
        _active.append(session)


def pop(session: Session) -> None:
    stack: list[Session] | None = getattr(_local, "stack", None)
    if stack and session in stack:
        stack.remove(session)
    with _active_lock:
        if session in _active:
            _active.remove(session)


def current_session() -> Session | None:
    """This thread's innermost session; on a thread that has none (torch's profiler state
    was propagated to it, e.g. by a future callback), the most recent open one."""
    stack: list[Session] | None = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    with _active_lock:
        return _active[-1] if _active else None


def active_sessions() -> list[Session]:
    with _active_lock:
        return list(_active)
