"""``distgrad.profiler.profile``: torch's profiler, with the other workers' events and a
trace across workers."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from .._rpc._core import current_agent
from ._clock import OFFSETS
from ._torch_hooks import install, session_of, time_base_ns
from ._trace import build_trace, write_trace

__all__ = ["clock_offsets", "export_chrome_trace", "profile"]


def clock_offsets() -> dict[int, tuple[int, int]]:
    """This worker's clock offset estimates: ``{rank: (offset ns, round trip ns)}``, the
    offset being the peer's clock minus this worker's (see docs/profiling.md)."""
    return OFFSETS.snapshot()


def _events_of(prof: Any) -> Any:
    if isinstance(prof, profile):
        return prof.events()
    events = getattr(prof, "events", None)
    if callable(events):  # torch.profiler.profile
        result: Any = events()
        return result
    function_events: Any = prof.function_events
    return function_events


def export_chrome_trace(prof: Any, path: str | Path) -> None:
    """Write one Chrome/Perfetto trace of ``prof`` with a process track per worker.

    ``prof``: a :class:`profile`, or a finished ``torch.profiler.profile``,
    ``torch.autograd.profiler.profile`` or ``torch.autograd.profiler_legacy.profile``.
    """
    torch_prof = prof.torch_profiler if isinstance(prof, profile) else prof
    session = session_of(torch_prof)
    base = time_base_ns(torch_prof)
    if session is None or base is None:
        raise RuntimeError("export_chrome_trace needs a finished profile started by torch")
    events = _events_of(prof)
    remote, calls = session.snapshot()
    agent = current_agent()
    rank = agent.worker_info.id if agent is not None else 0
    names = dict(session.names)
    if agent is not None:
        names.update({info.id: info.name for info in agent.get_worker_infos()})
    trace = build_trace(rank, base, list(events), remote, calls, names, OFFSETS.snapshot())
    write_trace(path, trace)


class profile:
    """torch's profiler for a step that spans workers.

    ``use_kineto=True`` (default) runs ``torch.profiler.profile`` (CPU activity; keyword
    arguments go to it, e.g. ``record_shapes``); ``use_kineto=False`` runs the legacy
    ``torch.autograd.profiler_legacy.profile``. Either way the RPCs made in the block are
    recorded with the remote workers' events (:meth:`events`, :meth:`key_averages`,
    :meth:`table`), and :meth:`export_chrome_trace` writes one trace with a track per
    worker. Example (worker0; the other workers only serve)::

        with distgrad.profiler.profile() as prof:
            with dist_autograd.context() as ctx:
                loss = rpc.rpc_sync("worker1", forward, (x,)).sum()
                dist_autograd.backward(ctx, [loss])
        print(prof.key_averages().table())
        prof.export_chrome_trace("step.json")  # open in https://ui.perfetto.dev
    """

    def __init__(self, *, use_kineto: bool = True, **kwargs: Any) -> None:
        install()  # (before torch's profile starts: its methods carry the remote events)
        self.use_kineto = use_kineto
        self.torch_profiler: Any
        if use_kineto:
            kwargs.setdefault("activities", [torch.profiler.ProfilerActivity.CPU])
            self.torch_profiler = torch.profiler.profile(**kwargs)
        else:
            legacy: Any = torch.autograd.profiler_legacy.profile
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.torch_profiler = legacy(**kwargs)
        self._finished = False

    def __enter__(self) -> profile:
        self.torch_profiler.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.torch_profiler.__exit__(*exc)
        self._finished = True

    def events(self) -> Any:
        """Every event, local and remote (remote ones have ``is_remote=True``)."""
        if not self._finished:
            raise RuntimeError("the profile has not finished")
        if self.use_kineto:
            events: Any = self.torch_profiler.events()
            return events
        function_events: Any = self.torch_profiler.function_events
        return function_events

    def key_averages(self, group_by_input_shape: bool = False) -> Any:
        return self.events().key_averages(group_by_input_shape)

    def table(self, sort_by: str | None = None, row_limit: int = 100) -> str:
        return str(self.events().table(sort_by=sort_by, row_limit=row_limit))

    def export_chrome_trace(self, path: str | Path) -> None:
        """Write one Chrome/Perfetto trace with a process track per worker."""
        export_chrome_trace(self, path)
