"""OpenTelemetry bootstrap shared by every kvroute process.

Tracing is off unless the standard OTel variables ask for it:
  OTEL_TRACES_EXPORTER=otlp     (OTLP/gRPC to OTEL_EXPORTER_OTLP_ENDPOINT, default localhost:4317)
  OTEL_TRACES_EXPORTER=console  (spans printed to stderr, handy locally)
  OTEL_SERVICE_NAME overrides the per-process default service name.
With no exporter configured no provider is installed and `tracing_active()` is False: the router's
request path then opens no span at all (a no-op span still costs ~40 us to open and close, and
trace-context injection ~3 us, measured: docs/benchmarks/2026-12-03-router-overhead.md).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from opentelemetry import trace

_active = False  # a provider was installed through install_tracer_provider (setup_tracing)


def tracing_active() -> bool:
    """Whether spans go anywhere (checked per request: a plain flag, not the provider lookup)."""
    return _active


_NO_SPAN = contextlib.nullcontext(trace.INVALID_SPAN)  # stateless: shared by every request


def span(tracer: trace.Tracer, name: str, **kwargs: Any) -> contextlib.AbstractContextManager[trace.Span]:
    """`tracer.start_as_current_span(name, **kwargs)` while tracing is active, else a shared no-op
    context whose span ignores attributes (what the request path uses)."""
    return tracer.start_as_current_span(name, **kwargs) if _active else _NO_SPAN


def install_tracer_provider(provider: trace.TracerProvider) -> None:
    """Make `provider` the global one and turn the request path's spans on."""
    global _active
    trace.set_tracer_provider(provider)
    _active = True


def setup_tracing(default_service_name: str) -> bool:
    """Install a tracer provider if OTEL_TRACES_EXPORTER names one. Returns True if installed."""
    exporter_names = [e.strip() for e in os.environ.get("OTEL_TRACES_EXPORTER", "none").split(",") if e.strip()]
    exporter_names = [e for e in exporter_names if e != "none"]
    if not exporter_names:
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    service_name = os.environ.get("OTEL_SERVICE_NAME", default_service_name)
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    for name in exporter_names:
        if name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            raise ValueError(f"unsupported OTEL_TRACES_EXPORTER value {name!r} (use otlp, console or none)")
    install_tracer_provider(provider)
    return True


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()
