"""Distributed traces (OpenTelemetry): off unless the standard ``OTEL_*`` environment asks for them.

The node's code opens spans through the OpenTelemetry API (a hard dependency, small and pure
Python); without a configured SDK every span is a no-op. :func:`configure` (called once by
``kvstored``) installs the SDK's tracer provider when ``OTEL_TRACES_EXPORTER`` names an exporter
(``otlp``, ``console``) or an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); the exporter reads the rest of its ``OTEL_*`` variables
itself. The SDK and the OTLP exporter come with ``pip install 'kvstore[tracing]'``.

The trace context travels with the work: in gRPC metadata (``traceparent``) on client calls and on
the Cluster calls between nodes, and in the ``traceparent`` field of the data-channel and peer-transport
frame headers, so one trace shows a Get, the pull it caused on another node and that node's serving
of it. Spans: ``kvstore.<op>`` for each client call (Put, Get, Lookup, ...), ``kvstore.replicate`` and
``kvstore.cluster_lookup`` for Cluster calls, ``kvstore.pull`` (a pull from a peer) and
``kvstore.serve_pull`` (a peer's pull served here), ``kvstore.planner_tick`` on the coordinator.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

__all__ = ["TRACER", "SpanKind", "configure", "context_from", "metadata", "traceparent"]

log = logging.getLogger(__name__)

TRACER = trace.get_tracer("kvstore")
_CARRIED = ("traceparent", "tracestate")


def configure(service_name: str, instance: str, environ: Mapping[str, str] | None = None) -> str:
    """Install the SDK's tracer provider if ``OTEL_*`` asks for traces; returns the exporters set up
    (``""``: traces are off)."""
    env = os.environ if environ is None else environ
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if names == ["none"] or env.get("OTEL_SDK_DISABLED", "").lower() == "true" or (not names and not endpoint):
        return ""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        log.warning("OTEL_* asks for traces but the OpenTelemetry SDK is not installed "
                    "(pip install 'kvstore[tracing]'): traces stay off")
        return ""
    provider = TracerProvider(resource=Resource.create({
        "service.name": env.get("OTEL_SERVICE_NAME", service_name), "service.instance.id": instance}))
    used = []
    for name in names or ["otlp"]:
        if name == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            except ImportError:
                log.warning("OTEL_TRACES_EXPORTER=otlp but the OTLP exporter is not installed "
                            "(pip install 'kvstore[tracing]')")
                continue
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        else:
            log.warning("OTEL_TRACES_EXPORTER: unknown exporter %r ignored (otlp, console)", name)
            continue
        used.append(name)
    if used:
        trace.set_tracer_provider(provider)
        log.info("traces on: %s exporter(s)", ",".join(used))
    return ",".join(used)


def metadata() -> tuple[tuple[str, str], ...]:
    """The current trace context as gRPC metadata (empty when no span is recording)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def traceparent() -> str:
    """The current trace context for a frame header's ``traceparent`` field (``""`` when none)."""
    return dict(metadata()).get("traceparent", "")


def context_from(carried: Iterable[tuple[str, Any]] | str | None) -> Context | None:
    """The caller's trace context from gRPC metadata or a ``traceparent`` string (None: no context)."""
    if not carried:
        return None
    if isinstance(carried, str):
        return propagate.extract({"traceparent": carried})
    carrier = {k: v.decode("latin-1") if isinstance(v, bytes) else v for k, v in carried if k in _CARRIED}
    return propagate.extract(carrier) if carrier else None
