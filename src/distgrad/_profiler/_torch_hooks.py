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

These are torch internals, so each is looked up, not assumed: where ``_ensure_function_events``
is missing (torch before 2.5 builds the event list in ``__exit__``), the Kineto ``__exit__``
merges as the legacy one does; where something else is missing or differs, remote events are
not added to torch's results (one warning) -- RPC itself never depends on this.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from typing import Any

import torch
from torch.autograd import profiler as autograd_profiler
from torch.autograd import profiler_legacy, profiler_util

from .._rpc._core import current_agent
from ._records import Event, Session, pop, push

__all__ = ["install", "session_of", "time_base_ns"]

_util: Any = profiler_util  # untyped in torch
_log = logging.getLogger("distgrad.profiler")
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
        start_ns = getattr(results, "trace_start_ns", None)
        if start_ns is not None:
            return int(start_ns())
        return int(results.trace_start_us()) * 1000  # (torch before 2.4)
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
    options: dict[str, Any] = {
        "use_device": getattr(events, "_use_device", None),
        "profile_memory": getattr(events, "_profile_memory", False),
        "with_flops": getattr(events, "_with_flops", False),
    }
    if hasattr(events, "_use_cuda"):  # torch before 2.4: it defaults to True
        options["use_cuda"] = events._use_cuda
    added = _util.EventList(extra, **options)
    added._populate_cpu_children()  # (no backward stack traces: remote ones have none)
    merged = _util.EventList(
        sorted([*events, *added], key=lambda fe: (fe.time_range.start, -fe.time_range.end)),
        **options,
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


_REQUIRED = (
    (autograd_profiler.profile, "_start_trace"),
    (autograd_profiler.profile, "__exit__"),
    (profiler_legacy.profile, "_start_trace"),
    (profiler_legacy.profile, "__exit__"),
    (profiler_util, "FunctionEvent"),
    (profiler_util, "EventList"),
    (profiler_util.EventList, "_populate_cpu_children"),
)


def missing_internals() -> list[str]:
    """The torch profiler internals that :func:`install` wraps or uses and this torch lacks."""
    return [
        f"{getattr(owner, '__module__', '')}.{owner.__qualname__}.{name}".lstrip(".")
        if isinstance(owner, type)
        else f"{owner.__name__}.{name}"
        for owner, name in _REQUIRED
        if getattr(owner, name, None) is None
    ]


def install() -> None:
    """Wrap torch's profiler methods (idempotent). On a torch that lacks one of them, remote
    events stay out of torch's profiler results, with one warning, and nothing is wrapped."""
    global _installed
    if _installed:
        return
    _installed = True
    missing = missing_internals()
    if missing:
        _log.warning(
            "distgrad: torch %s lacks %s; remote events are not added to torch's profiler "
            "results, and distgrad.profiler.export_chrome_trace is unavailable (RPC itself "
            "is not affected)",
            torch.__version__,
            ", ".join(missing),
        )
        return
    try:
        _install()  # (it assigns nothing until every wrapper is built)
    except Exception as exc:  # a torch whose internals differ: the feature is off, RPC is not
        _log.warning(
            "distgrad: could not wrap torch %s's profiler (%r); remote events are not added "
            "to torch's profiler results, and distgrad.profiler.export_chrome_trace is "
            "unavailable (RPC itself is not affected)",
            torch.__version__,
            exc,
        )


def _install() -> None:
    kineto: Any = autograd_profiler.profile
    legacy: Any = profiler_legacy.profile

    start_kineto = kineto._start_trace
    exit_kineto = kineto.__exit__
    # torch 2.5 and later build the event list lazily here; before, in __exit__
    ensure_kineto: Any = getattr(kineto, "_ensure_function_events", None)
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

    @functools.wraps(exit_kineto)
    def kineto_exit_merging(self: Any, *exc: Any) -> Any:
        try:
            result = exit_kineto(self, *exc)
        finally:
            session = _close(self)
        events = getattr(self, "function_events", None)
        if session is not None and events is not None:
            base = time_base_ns(self)
            if base is not None:
                self.function_events = merge(events, session, base)
        return result

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
    if ensure_kineto is not None:
        kineto.__exit__ = kineto_exit
        kineto._ensure_function_events = functools.wraps(ensure_kineto)(kineto_ensure)
    else:
        kineto.__exit__ = kineto_exit_merging
    legacy._start_trace = legacy_start
    legacy.__exit__ = legacy_exit
