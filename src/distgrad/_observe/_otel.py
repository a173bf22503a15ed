"""distgrad's spans into OpenTelemetry (issue 30, optional: the ``otel`` extra,
``opentelemetry-sdk``): :func:`to_readable` makes an SDK ``ReadableSpan`` of a span (same trace
and span ids, parent, kind, times, status, attributes), :func:`install` hands every span to an
SDK span exporter as it ends -- an OTLP exporter, a console one, a test's in-memory one --
through a batch processor, so a collector shows a call on its caller and callee, and a
backward pass across its workers, as one trace."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._rpc._core import tracing

__all__ = ["install", "to_readable", "uninstall"]

_installed: list[tuple[Callable[[tracing.Span], None], Any]] = []


def _sdk() -> Any:
    try:
        from opentelemetry import trace
        from opentelemetry.sdk import trace as sdk_trace
    except ImportError as exc:  # pragma: no cover (the extra is installed where it is used)
        raise ImportError(
            "exporting distgrad's spans needs opentelemetry-sdk: pip install 'distgrad[otel]'"
        ) from exc
    return trace, sdk_trace


def to_readable(span: tracing.Span, resource: Any = None) -> Any:
    """An OpenTelemetry SDK ``ReadableSpan`` of ``span``."""
    trace, sdk_trace = _sdk()
    flags = trace.TraceFlags(trace.TraceFlags.SAMPLED)
    context = trace.SpanContext(
        int(span.trace_id, 16), int(span.span_id, 16), is_remote=False, trace_flags=flags
    )
    parent = None
    if span.parent_id is not None:
        parent = trace.SpanContext(
            int(span.trace_id, 16), int(span.parent_id, 16), is_remote=True, trace_flags=flags
        )
    kind = {
        "client": trace.SpanKind.CLIENT,
        "server": trace.SpanKind.SERVER,
    }.get(span.kind, trace.SpanKind.INTERNAL)
    status = (
        trace.Status(trace.StatusCode.UNSET)
        if span.status == "ok"
        else trace.Status(trace.StatusCode.ERROR, span.status)
    )
    attributes = {"distgrad.worker": span.worker, **span.attributes}
    kwargs: dict[str, Any] = {}
    if resource is not None:
        kwargs["resource"] = resource
    return sdk_trace.ReadableSpan(
        name=span.name,
        context=context,
        parent=parent,
        attributes=attributes,
        kind=kind,
        status=status,
        start_time=span.start_ns,
        end_time=span.end_ns,
        **kwargs,
    )


def install(exporter: Any, *, batch: bool = True) -> None:
    """Hand every span that ends from now on to ``exporter`` (an SDK ``SpanExporter``),
    through a ``BatchSpanProcessor`` (``batch=False``: ``SimpleSpanProcessor``, one export per
    span). Turns tracing on (``tracing.enable()``)."""
    _trace, _sdk_trace = _sdk()
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)

    def sink(span: tracing.Span) -> None:
        processor.on_end(to_readable(span))

    tracing.sinks.append(sink)
    _installed.append((sink, processor))
    tracing.enable()


def uninstall() -> None:
    """Stop handing spans over; flush and shut the processors down."""
    while _installed:
        sink, processor = _installed.pop()
        if sink in tracing.sinks:
            tracing.sinks.remove(sink)
        processor.force_flush()
        processor.shutdown()
