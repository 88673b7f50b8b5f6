"""A small OTLP/HTTP trace collector (POST /v1/traces, protobuf) on a thread of its own: every span
exo's processes export, decoded with opentelemetry-proto. For tests/test_tracing.py and
bench/tracing_overhead.py."""

from __future__ import annotations

import asyncio
import gzip
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.support.exo_process import free_port


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any]


@dataclass
class OtlpReceiver:
    """An OTLP/HTTP collector of spans (POST /v1/traces, protobuf), on a thread of its own."""

    port: int = field(default_factory=free_port)
    spans: list[Span] = field(default_factory=list)
    posts: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        started = threading.Event()
        threading.Thread(target=self._serve, args=(started,), daemon=True).start()
        assert started.wait(10), "the receiver did not start"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/traces", self._on_export)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        started.set()
        self._loop.run_forever()

    async def _on_export(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest.FromString(body)
        received = [Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                         {a.key: _value(a.value) for a in s.attributes},
                         {a.key: _value(a.value) for a in batch.resource.attributes})
                    for batch in export.resource_spans for scope in batch.scope_spans for s in scope.spans]
        with self._lock:
            self.posts += 1
            self.spans.extend(received)
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf")

    def of_trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def named(self, name: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


def _value(value: AnyValue) -> Any:
    return getattr(value, value.WhichOneof("value") or "string_value")
