"""OpenTelemetry tracing along a request's path (docs/tracing.md): the SDK, the apiserver,
placement, the edge (in-process or a daemon across the network) and the backend's steps,
exported over OTLP/HTTP to whatever collector the standard variables name.

Off by default: with no ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
(or with ``DSEC_TRACING=0``) nothing is set up and every helper here is a no-op costing one
attribute read. On, each process names itself (``dsec-apiserver``, ``dsec-edge``,
``dsec-sdk``...), batches its spans and flushes them at exit; W3C ``traceparent`` carries a
trace from the SDK into the apiserver and from the apiserver into an edge daemon.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

try:  # the SDK installs without OpenTelemetry; tracing is then simply off
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
except ImportError:  # pragma: no cover - exercised by a bare `pip install dsec`
    trace = None  # type: ignore[assignment]

_lock = threading.Lock()
_on = False


def wanted() -> bool:
    """Whether the environment asks for tracing."""
    flag = os.environ.get("DSEC_TRACING", "")
    if flag == "0" or trace is None:
        return False
    return flag == "1" or bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                               or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def forwarded_env() -> dict[str, str]:
    """This environment's tracing variables, for the daemons a cluster starts on other nodes
    (dsec.control.cluster): the collector, headers, sampler... but not ``OTEL_SERVICE_NAME``, so
    that each daemon still names itself."""
    return {k: v for k, v in os.environ.items()
            if (k.startswith("OTEL_") and k != "OTEL_SERVICE_NAME") or k == "DSEC_TRACING"}


def setup(service: str) -> bool:
    """Turn tracing on for this process as ``service`` if the environment asks (once; the
    first caller names the process). True when on."""
    global _on
    with _lock:
        if _on or not wanted():
            return _on
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:  # the SDK side without the exporter: `pip install "dsec[server]"`
            return False
        name = os.environ.get("OTEL_SERVICE_NAME", service)
        provider = TracerProvider(resource=Resource.create({"service.name": name}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        atexit.register(provider.shutdown)
        _on = True
        return True


def on() -> bool:
    return _on


_OFF: contextlib.nullcontext[None] = contextlib.nullcontext()  # reusable: what span() is when off


def span(name: str, kind: str = "internal", **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A span around the block (None inside when tracing is off: a shared no-op, ~0.3 us). An
    exception marks it failed and is recorded; attributes whose value is None are left out."""
    if not _on:
        return _OFF
    k = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT}.get(kind, SpanKind.INTERNAL)
    return trace.get_tracer("dsec").start_as_current_span(
        name, kind=k, attributes={f"dsec.{a}" if "." not in a else a: v for a, v in attributes.items()
                                  if v is not None})


def annotate(**attributes: Any) -> None:
    """Attributes on the current span (what is known only partway: the edge placement chose)."""
    if _on:
        s = trace.get_current_span()
        for a, v in attributes.items():
            if v is not None:
                s.set_attribute(f"dsec.{a}" if "." not in a else a, v)


def failed(s: Any, description: str) -> None:
    if s is not None:
        s.set_status(Status(StatusCode.ERROR, description))


def inject(headers: MutableMapping[str, str]) -> None:
    """The current trace's ``traceparent`` into outgoing headers."""
    if _on:
        propagate.inject(headers)


@contextlib.contextmanager
def extracted(headers: Mapping[str, str]) -> Iterator[None]:
    """The block runs in the trace the incoming headers carry (a child of the caller's span)."""
    if not _on or "traceparent" not in headers:
        yield
        return
    token = otel_context.attach(propagate.extract(dict(headers)))
    try:
        yield
    finally:
        otel_context.detach(token)
