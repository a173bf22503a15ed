"""``rpc._server_process_global_profile``: a profiler over every request a worker serves.

torch's is a legacy ``profile`` whose ``__enter__`` turns on a thread-local profiler on every
RPC thread that runs server-side requests, and whose ``__exit__`` gathers what they recorded.
Programs use it from a client through an RRef::

    prof = rpc.remote("worker1", rpc._server_process_global_profile)
    prof.rpc_sync().__enter__()
    ...  # calls served by worker1
    prof.rpc_sync().__exit__(None, None, None)
    print(prof.rpc_sync().key_averages())

Here, while one is open, the agent's serving path (``_rpc._core._profiling.serving_wrapper``)
runs each request's function under the legacy profiler of its worker thread (as torch's
callee profiles a profiled call, ``_callee``), and hands the events to every such profiler
open when it ran. Profilers nest (an inner one sees its range, an outer one everything).
What it covers: the functions of requests (Python functions, builtin operators, TorchScript
functions, RRef method calls, ``remote()`` creations, the synchronous part of
``@async_execution`` functions) and requests profiled by their caller; not the continuations
of ``@async_execution`` functions (they run on callback threads after the request returned),
nor distgrad's internal messages (RRef protocol, gradients).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import profiler_legacy, profiler_util

from .._rpc._core import profiling as _profiling

__all__ = ["_server_process_global_profile", "add_records"]

_autograd: Any = torch.autograd  # the profiler's bindings are untyped
_enable_legacy: Callable[[Any], None] = _autograd._enable_profiler_legacy
_disable_legacy: Callable[[], Any] = _autograd._disable_profiler_legacy
_profiler_enabled: Callable[[], bool] = _autograd._profiler_enabled
_parse_legacy_records: Callable[[Any], list[Any]] = profiler_legacy._parse_legacy_records

_lock = threading.Lock()
_open: list[_server_process_global_profile] = []  # the profilers open now, oldest first


class _server_process_global_profile(profiler_legacy.profile):
    """torch's ``rpc._server_process_global_profile``: the API of
    ``torch.autograd.profiler.profile``, over every request this worker serves while it is
    entered (see the module's docstring for what that covers).

    Args:
        enabled (bool): ``False`` makes it a no-op.
        use_cuda (bool): accepted as torch's; events are recorded on the CPU.
        record_shapes (bool): record operators' input shapes.
        profile_memory (bool): record memory use.

    Raises:
        RuntimeError: entered twice ("autograd profiler traces are not reentrant").
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._records: list[list[Any]] = []

    def __enter__(self) -> _server_process_global_profile | None:
        if not self.enabled:
            return None  # as torch's
        if self.entered:
            raise RuntimeError("autograd profiler traces are not reentrant")
        self.entered = True
        with _lock:
            _open.append(self)
            _profiling.serving_wrapper = _profiled
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> bool:
        if not self.enabled:
            return False
        with _lock:
            if self in _open:
                _open.remove(self)
            if not _open:
                _profiling.serving_wrapper = None
            per_request, self._records = self._records, []
        events = []
        for records in per_request:
            parsed = _parse_legacy_records(records)
            parsed.sort(key=lambda event: [event.time_range.start, -event.time_range.end])
            events.append(parsed)
        self.function_events = profiler_util.EventList(  # type: ignore[no-untyped-call]
            list(itertools.chain.from_iterable(events)),
            use_device="cuda" if self.use_cuda else None,
            profile_memory=self.profile_memory,
        )
        self.function_events._build_tree()  # type: ignore[no-untyped-call]
        #: the events per request (torch's: per serving thread)
        self.process_global_function_events = events
        return False

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_records"] = []  # raw records stay on the worker that recorded them
        return state


def add_records(records: Any) -> None:
    """Give the legacy profiler ``records`` of one served request to every open profiler
    (``_callee`` calls this for requests its caller profiled)."""
    with _lock:
        for profile in _open:
            profile._records.append(records)


def _config() -> Any:
    record_shapes = any(p.record_shapes for p in _open)
    profile_memory = any(p.profile_memory for p in _open)
    return _autograd.ProfilerConfig(
        _autograd.ProfilerState.CPU,
        record_shapes,
        profile_memory,
        False,
        False,
        False,
        torch._C._profiler._ExperimentalConfig(),
    )


def _profiled(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` run under this thread's legacy profiler, its events handed to the profilers
    open now (the serving path's ``serving_wrapper`` while any is open)."""
    if func is _profiling.serve or func is _profiling.serve_async:
        return func  # profiled by its caller already: ``_callee`` hands on its records

    def run(*args: Any, **kwargs: Any) -> Any:
        if _profiler_enabled():  # this thread profiles already (a nested call's continuation)
            return func(*args, **kwargs)
        with _lock:
            config = _config() if _open else None
        if config is None:  # closed meanwhile
            return func(*args, **kwargs)
        _enable_legacy(config)
        try:
            return func(*args, **kwargs)
        finally:
            add_records(_disable_legacy())

    return run
