"""Spans, and their context as a W3C `traceparent` string between processes.

Callers never touch opentelemetry: they open a span by name with `span`, `root_span` or
`start_span`, read its `traceparent` to put in a message, and give a received one back as the
parent of the next span. With tracing off (`configure` never called with an endpoint) each
function returns at its first line, with the shared `NO_SPAN` where a span is asked for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Literal, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

Kind = Literal["internal", "server", "producer", "consumer"]
Attributes = Mapping[str, str | int | float | bool]
K = TypeVar("K")

TRACEPARENT = "traceparent"  # the W3C header, in NATS headers as in HTTP ones
_KINDS = {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "producer": SpanKind.PRODUCER,
          "consumer": SpanKind.CONSUMER}
_propagator = TraceContextTextMapPropagator()
_tracer: Tracer | None = None  # set by exo.telemetry.setup.configure: tracing is on


def use_tracer(tracer: Tracer | None) -> None:
    """Turn tracing on with `tracer` (None: off again)."""
    global _tracer
    _tracer = tracer


def enabled() -> bool:
    return _tracer is not None


class OpenSpan:
    """A started span: `traceparent` names it to other processes; `end` it once (or leave it to `with`)."""

    __slots__ = ("_span", "_token", "traceparent")

    def __init__(self, span: Span | None) -> None:
        self._span = span
        self._token: object = None
        self.traceparent = _format(span) if span is not None else ""

    def set(self, key: str, value: str | int | float | bool) -> None:
        if self._span is not None:
            self._span.set_attribute(key, value)

    def end(self, end_ns: int | None = None, error: BaseException | str | None = None) -> None:
        if self._span is None:
            return
        if error is not None:
            if isinstance(error, BaseException):
                self._span.record_exception(error)
            self._span.set_status(Status(StatusCode.ERROR, str(error)))
        self._span.end(end_time=end_ns)

    def __enter__(self) -> OpenSpan:
        """The span is the current one inside the `with`: spans opened there are its children."""
        if self._span is not None:
            self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if self._span is None:
            return
        # A client that left (cancelled) or a generator closed early is not the span's work failing.
        failed = error is not None and not isinstance(error, (GeneratorExit, asyncio.CancelledError))
        self.end(error=error if failed else None)
        otel_context.detach(self._token)  # type: ignore[arg-type]  # the Token attach gave


NO_SPAN = OpenSpan(None)  # what every call gives while tracing is off (or no trace goes on)


def _format(span: Span) -> str:
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT, "")


def _parent_context(traceparent: str) -> otel_context.Context | None:
    """The remote span `traceparent` names; None when it names none (empty, malformed)."""
    if not traceparent:
        return None
    context = _propagator.extract({TRACEPARENT: traceparent})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def _current_context() -> otel_context.Context | None:
    return None if not trace.get_current_span().get_span_context().is_valid else otel_context.get_current()


def start_span(name: str, parent: str | None = None, kind: Kind = "internal", attributes: Attributes | None = None,
               start_ns: int | None = None) -> OpenSpan:
    """A span in the trace `parent` names (None: the current span's); NO_SPAN where there is none:
    only a request's own root span (`root_span`) starts a trace."""
    if _tracer is None:
        return NO_SPAN
    context = _current_context() if parent is None else _parent_context(parent)
    if context is None:
        return NO_SPAN
    return OpenSpan(_tracer.start_span(name, context, _KINDS[kind], attributes, start_time=start_ns))


def span(name: str, parent: str | None = None, kind: Kind = "internal", attributes: Attributes | None = None) -> OpenSpan:
    """`start_span`, for a `with`: current inside it, ended (with the error, if one) after it."""
    return NO_SPAN if _tracer is None else start_span(name, parent, kind, attributes)


def root_span(name: str, kind: Kind = "server", attributes: Attributes | None = None) -> OpenSpan:
    """A request's span: the child of the current span (a client's traceparent: `continued`), else a new trace."""
    if _tracer is None:
        return NO_SPAN
    return OpenSpan(_tracer.start_span(name, _current_context(), _KINDS[kind], attributes))


def continued(traceparent: str) -> AbstractContextManager[object]:
    """Inside it, the remote span `traceparent` names is the current one (no span of our own): what a
    client sends is honoured as the parent of the request's spans."""
    if _tracer is None or (context := _parent_context(traceparent)) is None:
        return nullcontext()
    return _attached(context)


@contextmanager
def _attached(context: otel_context.Context) -> Iterator[None]:
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)


def current_traceparent() -> str:
    """The current span as a traceparent ("" when tracing is off or no span is current)."""
    if _tracer is None:
        return ""
    current = trace.get_current_span()
    return _format(current) if current.get_span_context().is_valid else ""


def traceparent_of(headers: Mapping[str, str] | None) -> str:
    """A message's traceparent header ("" without one)."""
    return headers.get(TRACEPARENT, "") if headers else ""


def with_traceparent(headers: dict[str, str], traceparent: str) -> dict[str, str]:
    """`headers` plus the traceparent header, when there is one to carry."""
    if traceparent:
        headers[TRACEPARENT] = traceparent
    return headers


@contextmanager
def spans(name: str, parents: Mapping[K, str], kind: Kind = "producer") -> Iterator[dict[K, str]]:
    """One span per distinct parent in `parents` around one piece of work done for all of them (a
    batch of events of several requests): inside, each key's child span as a traceparent."""
    if _tracer is None or not parents:
        yield {}
        return
    opened = {parent: start_span(name, parent, kind) for parent in set(parents.values())}
    error: BaseException | None = None
    try:
        yield {key: opened[parent].traceparent for key, parent in parents.items() if opened[parent].traceparent}
    except BaseException as failure:
        error = failure
        raise
    finally:
        for each in opened.values():
            each.end(error=error)
