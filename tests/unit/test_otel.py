"""distgrad's spans exported through OpenTelemetry's SDK (issue 30 item 3, the optional
``otel`` extra): a nested call across three workers and a backward pass arrive at an SDK
exporter as traces with the ids, parents and kinds distgrad gave them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import distgrad.rpc as rpc
from distgrad._observe import _otel
from distgrad._rpc._core import tracing
from distgrad._testing._world import open_world


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def middle(x: torch.Tensor) -> torch.Tensor:
    return rpc.rpc_sync("worker2", leaf, (x,)) * 2


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    was = tracing.active
    exported = InMemorySpanExporter()
    _otel.install(exported, batch=False)
    try:
        yield exported
    finally:
        _otel.uninstall()
        if not was:
            tracing.disable()


def test_nested_call_exported_as_one_trace(exporter: InMemorySpanExporter) -> None:
    with open_world(3) as world:
        world.run_on(0, rpc.rpc_sync, "worker1", middle, (torch.zeros(1),))
        with pytest.raises(ZeroDivisionError):
            world.run_on(0, rpc.rpc_sync, "worker1", divmod, (1, 0))
    spans = exporter.get_finished_spans()
    mine = [s for s in spans if s.name.endswith(("middle", "leaf"))]
    assert len(mine) == 4
    assert len({s.context.trace_id for s in mine}) == 1
    by_id = {s.context.span_id: s for s in mine}
    root = [s for s in mine if s.parent is None]
    assert len(root) == 1 and root[0].kind is SpanKind.CLIENT
    assert root[0].attributes["distgrad.worker"] == "worker0"
    for span in mine:
        if span.parent is not None:
            assert span.parent.span_id in by_id
    kinds = sorted(s.kind.name for s in mine)
    assert kinds == ["CLIENT", "CLIENT", "SERVER", "SERVER"]
    failed = [s for s in spans if s.name.endswith("divmod") and s.kind is SpanKind.CLIENT]
    assert failed and failed[-1].status.status_code is StatusCode.ERROR


def test_uninstalled_exporter_gets_nothing_more(exporter: InMemorySpanExporter) -> None:
    _otel.uninstall()
    assert tracing.sinks == []
    with open_world(2) as world:
        world.run_on(0, rpc.rpc_sync, "worker1", leaf, (torch.zeros(1),))
    assert exporter.get_finished_spans() == ()
