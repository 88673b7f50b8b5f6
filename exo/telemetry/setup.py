"""Turning tracing on in a process: where its spans go (OTLP over HTTP) and what they say it is.

The entry points (exo/main.py, exo/runner/__main__.py) call `configure` once; nothing else here
runs while tracing is off. OpenTelemetry's own variables keep their meaning: OTEL_SERVICE_NAME and
OTEL_RESOURCE_ATTRIBUTES name the process, OTEL_BSP_* pace the export, OTEL_EXPORTER_OTLP_HEADERS
and _TIMEOUT reach the exporter (the SDK reads them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from exo.telemetry import tracing

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)

SERVICE_NAME = "exo"
_provider: TracerProvider | None = None
_endpoint = ""  # where this process's spans go; its runners send theirs there too


def traces_endpoint(exo_endpoint: str, environ: Mapping[str, str]) -> str:
    """The URL spans are POSTed to; "" (tracing off) unless EXO_OTLP_ENDPOINT or OpenTelemetry's
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (the whole URL) or OTEL_EXPORTER_OTLP_ENDPOINT (a base URL,
    `/v1/traces` appended) is set. OTEL_SDK_DISABLED=true and OTEL_TRACES_EXPORTER=none turn it off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or \
            environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return ""
    if exo_endpoint.strip():
        return _signal_url(exo_endpoint)
    if whole := environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        return whole
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    return _signal_url(base) if base else ""


def _signal_url(base: str) -> str:
    return base.strip().rstrip("/") + "/v1/traces"


def configure(endpoint: str, process: str, node: str = "") -> None:
    """Send this process's spans to `endpoint` ("" : tracing stays off). `process`: "node" or "runner"."""
    global _provider, _endpoint
    if not endpoint or _provider is not None:
        return
    # Imported only now: a process that does not trace never loads the SDK and its exporter.
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    _endpoint = endpoint
    ours = Resource({"service.name": SERVICE_NAME, "exo.process": process, "process.pid": os.getpid(),
                     **({"service.instance.id": node} if node else {})})
    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win over ours, as the OpenTelemetry conventions say.
    _provider = TracerProvider(resource=ours.merge(OTELResourceDetector().detect()))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(_provider)
    tracing.use_tracer(_provider.get_tracer("exo"))
    log.info("tracing: spans go to %s (OTLP/HTTP)", endpoint)


def configured_endpoint() -> str:
    """Where `configure` sends this process's spans ("" : tracing is off)."""
    return _endpoint


def shutdown() -> None:
    """Export what is still buffered and stop (also done at exit, unless the process leaves by os._exit)."""
    global _provider, _endpoint
    if _provider is not None:
        tracing.use_tracer(None)
        _provider.shutdown()
        _provider, _endpoint = None, ""
