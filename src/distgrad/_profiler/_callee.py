"""The callee's side of a profiled call: run the function under a profiler of its own and
answer ``(result, RemoteProfile)``.

The profiler is torch's *legacy* one, enabled for the serving thread only
(``_enable_profiler_legacy``): it is thread-local, so any number of requests can be profiled
at once in one process, next to a Kineto profiler the process runs itself (Kineto allows one
session per process). It records what torch records -- operators, ``record_function``
blocks -- on the serving thread. Calls the function makes are profiled too (the thread's
profiler is on), and their callees' events come back nested under their keys.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.autograd import profiler_legacy

from .._rpc._core import check_async_result, current_agent, is_builtin, set_future_error
from . import _server
from ._records import CallRecord, Event, RemoteProfile, Session, pop, push

__all__ = ["SETTLE_GRACE_S", "serve", "serve_async"]

#: how long a profiled callee waits for the answers to calls it made before it answers
SETTLE_GRACE_S = 0.2

_autograd: Any = torch.autograd  # the profiler's bindings are untyped
_enable_legacy: Callable[[Any], None] = _autograd._enable_profiler_legacy
_disable_legacy: Callable[[], Any] = _autograd._disable_profiler_legacy
_profiler_enabled: Callable[[], bool] = _autograd._profiler_enabled
_parse_legacy_records: Callable[[Any], list[Any]] = profiler_legacy._parse_legacy_records


def _rank() -> int:
    agent = current_agent()
    return agent.worker_info.id if agent is not None else -1


def _events(records: Any, rank: int, skip: set[str]) -> tuple[list[Event], int]:
    """Legacy profiler records -> events on this worker's wall clock, and the thread id."""
    start = None
    for thread_records in records:
        for record in thread_records:
            if record.name() == "__start_profile":
                start = record
                break
        if start is not None:
            break
    if start is None:
        return [], -1
    base_us: float = start.start_us()
    events = []
    for fe in _parse_legacy_records(records):
        if fe.name in skip:
            continue
        events.append(
            Event(
                name=fe.name,
                op=fe.name,
                node=rank,
                thread=int(fe.thread),
                start_ns=int((base_us + fe.time_range.start) * 1000),
                end_ns=int((base_us + fe.time_range.end) * 1000),
                input_shapes=list(fe.input_shapes or []),
                cpu_memory_usage=int(fe.cpu_memory_usage),
                sequence_nr=int(fe.sequence_nr),
                scope=int(fe.scope),
            )
        )
    return events, int(start.thread_id())


class _Serving:
    """One profiled request being served."""

    def __init__(self, request: Any) -> None:
        record_shapes, profile_memory = request
        self.rank = _rank()
        self.session = Session(bool(record_shapes), bool(profile_memory))
        self.records: Any = []
        self.stopped = False
        self.start_ns = time.time_ns()
        # a thread already profiling (a continuation under a propagated profiler state) keeps
        # its profiler; the request then ships only what its own calls brought back
        self.enabled = not _profiler_enabled()
        if self.enabled:
            config = _autograd.ProfilerConfig(
                _autograd.ProfilerState.CPU,
                bool(record_shapes),
                bool(profile_memory),
                False,
                False,
                False,
                torch._C._profiler._ExperimentalConfig(),
            )
            _enable_legacy(config)
        push(self.session)

    def stop_local(self) -> None:
        """End profiling on the serving thread (results of its calls may still come in)."""
        if self.stopped:
            return
        self.stopped = True
        pop(self.session)
        if self.enabled:
            self.records = _disable_legacy()
            _server.add_records(self.records)  # for rpc._server_process_global_profile

    def settle(self, then: Callable[[], None]) -> None:
        """Run ``then`` once the calls made for this request have answered (bounded)."""
        self.stop_local()
        self.session.when_settled(then, SETTLE_GRACE_S)

    def finish(self) -> RemoteProfile:
        self.stop_local()
        self.session.close()
        remote_events, calls = self.session.snapshot()
        mine = [c for c in calls if c.src == self.rank and c.thread == -1]
        local, thread = _events(self.records, self.rank, {c.key for c in mine})
        resolved: list[CallRecord] = []
        for call in calls:
            if call.src == self.rank and call.thread == -1:
                # the call's own range, from its record: an rpc_async range that ended on
                # another thread is not in the legacy profiler's records
                local.append(
                    Event(call.key, call.key, self.rank, thread, call.start_ns, call.end_ns)
                )
                resolved.append(replace(call, thread=thread))
            else:
                resolved.append(call)
        return RemoteProfile(
            self.rank, thread, self.start_ns, time.time_ns(), local + remote_events, resolved
        )


def _mark_builtin_error(func: Any, exc: BaseException) -> None:
    if is_builtin(func):  # the agent sends builtin operators' errors verbatim
        try:
            exc.verbatim_over_rpc = True  # type: ignore[attr-defined]
        except AttributeError:
            pass


def serve(request: Any, func: Any, args: Any, kwargs: Any) -> Any:
    serving = _Serving(request)
    try:
        result = func(*args, **(kwargs or {}))
    except BaseException as exc:
        serving.finish()
        _mark_builtin_error(func, exc)
        raise
    settled = threading.Event()
    serving.settle(settled.set)
    settled.wait()
    return result, serving.finish()


def serve_async(request: Any, func: Any, args: Any, kwargs: Any) -> torch.futures.Future[Any]:
    serving = _Serving(request)
    try:
        future = check_async_result(func(*args, **(kwargs or {})))
    except BaseException:
        serving.finish()
        raise
    serving.stop_local()
    answer: torch.futures.Future[Any] = torch.futures.Future()

    def done(completed: torch.futures.Future[Any]) -> None:
        try:
            value = completed.value()
        except BaseException as exc:
            serving.finish()
            set_future_error(answer, exc)
            return
        serving.settle(lambda: answer.set_result((value, serving.finish())))

    future.add_done_callback(done)
    return answer
