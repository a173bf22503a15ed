"""The caller's side of a profiled call (SPEC 3): a ``record_function`` range named by the
call's key around the call (for ``rpc_async``, until its future completes), the request sent
as a call of ``serve`` carrying the function, and the callee's events kept on response."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import profiler as _torch_profiler

from .._rpc._core import KeyScope, WorkerInfo, set_future_error
from .._rpc._core import profiling as _profiling
from ._clock import OFFSETS
from ._keys import RPCExecMode, build_rpc_profiling_key, func_name
from ._records import CallRecord, RemoteProfile, Session, current_session

__all__ = ["ProfiledKeyScope", "call_async", "call_sync", "key_for"]

_local = threading.local()
_record_function: Any = _torch_profiler.record_function  # untyped in torch


def key_for(mode: RPCExecMode, func: Any, me: WorkerInfo, dst: WorkerInfo) -> str:
    return build_rpc_profiling_key(mode, func_name(func), me.name, dst.name)


class _Range:
    """A ``record_function`` range that may end on another thread (torch's Kineto profiler
    records such an end; the legacy one drops it, and the range is then rebuilt from the
    call's record when results are merged)."""

    def __init__(self, name: str) -> None:
        self._rf: Any = _record_function(name)
        self._rf.__enter__()

    def end(self) -> None:
        rf, self._rf = self._rf, None
        if rf is not None:
            rf.__exit__(None, None, None)


class ProfiledKeyScope(KeyScope):
    """``_profiling.key_scope`` while profiling: the range, and the key for the next call."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._future: torch.futures.Future[Any] | None = None
        self._range: _Range | None = None

    def __enter__(self) -> ProfiledKeyScope:
        self._range = _Range(self.key)
        _local.key = self.key
        return self

    def end_on(self, future: torch.futures.Future[Any]) -> None:
        self._future = future

    def __exit__(self, *exc: object) -> None:
        if getattr(_local, "key", None) == self.key:
            _local.key = None  # no call consumed it
        span = self._range
        if span is None:
            return
        if self._future is None or exc[0] is not None:
            span.end()
        else:
            self._future.add_done_callback(lambda _f: span.end())


def _take_key(mode: RPCExecMode, func: Any, me: WorkerInfo, dst: WorkerInfo) -> tuple[str, bool]:
    """The call's key, and whether the call owns its range (not inside a key scope)."""
    scoped: str | None = getattr(_local, "key", None)
    if scoped is not None:
        _local.key = None
        return scoped, False
    return key_for(mode, func, me, dst), True


def _request(session: Session | None) -> tuple[bool, bool]:
    if session is None:
        return (False, False)
    return (session.record_shapes, session.profile_memory)


def _target(func: Any) -> Any:
    if getattr(func, "_wrapped_async_rpc_function", None) is not None:
        return _profiling.serve_async
    return _profiling.serve


def _receive(
    session: Session | None,
    key: str,
    me: WorkerInfo,
    dst: WorkerInfo,
    t0: int,
    t3: int,
    remote: RemoteProfile,
) -> None:
    shift = OFFSETS.observe(dst.id, t0, remote.start_ns, remote.end_ns, t3)
    if session is None:
        return
    call = CallRecord(
        key,
        me.id,
        dst.id,
        me.name,
        dst.name,
        -1,
        t0,
        t3,
        remote.thread,
        remote.start_ns - shift,
        remote.end_ns - shift,
    )
    events = [event.received(key, shift) for event in remote.events]
    session.add(call, events, [record.shifted(shift) for record in remote.calls])


def call_sync(
    send: Callable[..., Any],
    me: WorkerInfo,
    dst: WorkerInfo,
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    force: bool,
    internal: bool,
) -> Any:
    key, owns = _take_key(RPCExecMode.SYNC, func, me, dst)
    session = current_session()
    span = _Range(key) if owns else None
    if session is not None:
        session.begin_call()
    try:
        t0 = time.time_ns()
        result, remote = send(
            dst,
            _target(func),
            (_request(session), func, args, kwargs),
            {},
            timeout,
            force=force,
            internal=internal,
        )
        t3 = time.time_ns()
        _receive(session, key, me, dst, t0, t3, remote)
    finally:
        if span is not None:
            span.end()
        if session is not None:
            session.end_call()
    return result


def call_async(
    send: Callable[..., torch.futures.Future[Any]],
    me: WorkerInfo,
    dst: WorkerInfo,
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    force: bool,
    internal: bool,
) -> torch.futures.Future[Any]:
    key, owns = _take_key(RPCExecMode.ASYNC, func, me, dst)
    session = current_session()
    span = _Range(key) if owns else None
    if session is not None:
        session.begin_call()
    t0 = time.time_ns()
    try:
        inner = send(
            dst,
            _target(func),
            (_request(session), func, args, kwargs),
            {},
            timeout,
            force=force,
            internal=internal,
        )
    except BaseException:
        if span is not None:
            span.end()
        if session is not None:
            session.end_call()
        raise
    outer = type(inner)()  # the agent's future type (its wait() frees a pool slot)
    if hasattr(inner, "_pools"):
        outer._pools = inner._pools  # type: ignore[attr-defined]

    def done(completed: torch.futures.Future[Any]) -> None:
        t3 = time.time_ns()
        try:
            result, remote = completed.value()
            _receive(session, key, me, dst, t0, t3, remote)
        except BaseException as exc:
            if span is not None:
                span.end()
            if session is not None:
                session.end_call()
            set_future_error(outer, exc)
            return
        if span is not None:  # the range ends before the caller's future completes
            span.end()
        if session is not None:
            session.end_call()
        outer.set_result(result)

    inner.add_done_callback(done)
    return outer
