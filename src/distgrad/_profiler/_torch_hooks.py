"""Remote events in torch's own profilers' results.

torch offers no public way to add events to a profile, so distgrad wraps five methods of
torch's profiler classes -- once, when profiling can first be used: an RPC agent starts, or a
``distgrad.profiler.profile`` is made (importing distgrad patches nothing in torch):

* starting a profile (``torch.autograd.profiler.profile._start_trace``, which
  ``torch.profiler.profile`` also uses, and ``profiler_legacy.profile._start_trace``) opens a
  :class:`Session` on the starting thread, attached to the profile object;
* stopping it (their ``__exit__``) closes the session: responses arriving later are dropped;
* building the event list (``_ensure_function_events`` for Kineto, ``__exit__`` for the
  legacy profiler) appends the session's remote events as ``FunctionEvent``\\ s with
  ``node_id`` = the worker that ran them and ``is_remote=True``, and gives local events
  ``node_id`` = this worker's rank, as the reference does.

Everything else (the Kineto trace ``torch.profiler.profile.export_chrome_trace`` writes, for
one) is torch's alone: remote events are not in it. ``distgrad.profiler.export_chrome_trace``
writes the trace across workers.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from typing import Any

from torch.autograd import profiler as autograd_profiler
from torch.autograd import profiler_legacy, profiler_util

from .._rpc._core._agent import current_agent
from ._records import Event, Session, pop, push

__all__ = ["install", "session_of", "time_base_ns"]

_util: Any = profiler_util  # untyped in torch
_SESSION = "_distgrad_session"
_BASE = "_distgrad_base_ns"
_installed = False


def session_of(prof: Any) -> Session | None:
    """The session of a torch profile object (or of the one ``torch.profiler`` wraps)."""
    inner = getattr(prof, "profiler", None)
    if inner is not None and hasattr(inner, _SESSION):
        prof = inner
    session: Session | None = getattr(prof, _SESSION, None)
    return session


def time_base_ns(prof: Any) -> int | None:
    """The wall-clock time (ns) that ``FunctionEvent`` times of ``prof`` count from."""
    inner = getattr(prof, "profiler", None)
    if inner is not None and hasattr(inner, _SESSION):
        prof = inner
    results = getattr(prof, "kineto_results", None)
    if results is not None:
        return int(results.trace_start_ns())
    base: int | None = getattr(prof, _BASE, None)
    return base


def _function_event(event: Event, base_ns: int, index: int) -> Any:
    return _util.FunctionEvent(
        id=index,
        name=event.name,
        thread=event.thread,
        fwd_thread=event.thread,
        start_us=(event.start_ns - base_ns) / 1000,
        end_us=(event.end_ns - base_ns) / 1000,
        input_shapes=event.input_shapes,
        stack=[],
        scope=event.scope,
        cpu_memory_usage=event.cpu_memory_usage,
        is_remote=True,
        sequence_nr=event.sequence_nr,
        node_id=event.node,
        trace_name=event.name,
    )


def merge(events: Any, session: Session, base_ns: int) -> Any:
    """``events`` with the session's remote events added (and calls whose range the local
    profiler lost rebuilt from their records)."""
    agent = current_agent()
    rank = agent.worker_info.id if agent is not None else -1
    remote, calls = session.snapshot()
    if rank >= 0:
        for fe in events:
            if not fe.is_remote:
                fe.node_id = rank
    present = Counter(fe.name for fe in events if not fe.is_remote)
    lost: list[Event] = []
    for call in calls:
        if call.src != rank:
            continue
        if present[call.key] > 0:
            present[call.key] -= 1
        else:
            lost.append(Event(call.key, call.key, rank, 0, call.start_ns, call.end_ns))
    if not remote and not lost:
        return events
    next_id = max((fe.id for fe in events), default=0) + 1
    extra = [_function_event(e, base_ns, next_id + i) for i, e in enumerate(remote + lost)]
    for fe, event in zip(extra[len(remote) :], lost, strict=True):
        fe.is_remote = event.node != rank
    use_device = getattr(events, "_use_device", None)
    profile_memory = getattr(events, "_profile_memory", False)
    with_flops = getattr(events, "_with_flops", False)
    added = _util.EventList(
        extra, use_device=use_device, profile_memory=profile_memory, with_flops=with_flops
    )
    added._populate_cpu_children()  # (no backward stack traces: remote ones have none)
    merged = _util.EventList(
        sorted([*events, *added], key=lambda fe: (fe.time_range.start, -fe.time_range.end)),
        use_device=use_device,
        profile_memory=profile_memory,
        with_flops=with_flops,
    )
    merged._tree_built = True
    merged._cpu_children_populated = True
    return merged


def _open(prof: Any) -> None:
    session = Session(bool(prof.record_shapes), bool(prof.profile_memory))
    setattr(prof, _SESSION, session)
    push(session)


def _close(prof: Any) -> Session | None:
    session: Session | None = getattr(prof, _SESSION, None)
    if session is not None:
        session.close()
        pop(session)
    return session


def install() -> None:
    """Wrap torch's profiler methods (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    kineto: Any = autograd_profiler.profile
    legacy: Any = profiler_legacy.profile

    start_kineto = kineto._start_trace
    exit_kineto = kineto.__exit__
    ensure_kineto = kineto._ensure_function_events
    start_legacy = legacy._start_trace
    exit_legacy = legacy.__exit__

    @functools.wraps(start_kineto)
    def kineto_start(self: Any) -> Any:
        _open(self)
        return start_kineto(self)

    @functools.wraps(exit_kineto)
    def kineto_exit(self: Any, *exc: Any) -> Any:
        try:
            return exit_kineto(self, *exc)
        finally:
            _close(self)

    @functools.wraps(ensure_kineto)
    def kineto_ensure(self: Any) -> Any:
        fresh = self._function_events is None
        result = ensure_kineto(self)
        session = getattr(self, _SESSION, None)
        if fresh and session is not None and self._function_events is not None:
            base = time_base_ns(self)
            if base is not None:
                self._function_events = merge(self._function_events, session, base)
        return result

    @functools.wraps(start_legacy)
    def legacy_start(self: Any) -> Any:
        _open(self)
        setattr(self, _BASE, time.time_ns())  # the legacy profiler's zero is taken just after
        return start_legacy(self)

    @functools.wraps(exit_legacy)
    def legacy_exit(self: Any, *exc: Any) -> Any:
        try:
            result = exit_legacy(self, *exc)
        finally:
            session = _close(self)
        if session is not None and self.function_events is not None:
            self.function_events = merge(self.function_events, session, getattr(self, _BASE))
        return result

    kineto._start_trace = kineto_start
    kineto.__exit__ = kineto_exit
    kineto._ensure_function_events = kineto_ensure
    legacy._start_trace = legacy_start
    legacy.__exit__ = legacy_exit
