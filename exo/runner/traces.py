"""A runner's part of a traced request (Generate.traceparent set; exo/telemetry): one span for the
generation, its phases (queue wait, prefill, decode) as child spans, and the span its token chunks
name in their headers (the API's receiving span is that one's child).

The phases' boundaries are stamped where they happen (the model thread starts the request, its
first output) and made into spans once the generation ends: nothing on the model thread but a
clock read, and nothing at all for a request that is not traced.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from exo.core.ids import TaskId
from exo.runner.decoding import Output
from exo.runner.protocol import Generate
from exo.telemetry import tracing


@dataclass
class _Traced:
    generation: tracing.OpenSpan
    received_ns: int
    started_ns: int = 0  # the model thread took the request (prefill begins)
    first_output_ns: int = 0
    publishing: tracing.OpenSpan | None = None  # from its first chunk sent to its last stored


class GenerationTraces:
    def __init__(self) -> None:
        self._open: dict[TaskId, _Traced] = {}

    @contextmanager
    def generation(self, request: Generate) -> Iterator[None]:
        """Around the whole generation: its spans end when it does."""
        generation = tracing.start_span("exo.runner.generate", request.traceparent or "", "consumer",
                                        {"exo.task_id": request.task_id,
                                         "exo.attempt": request.resume.attempt if request.resume else 0})
        if generation is tracing.NO_SPAN:
            yield
            return
        traced = self._open[request.task_id] = _Traced(generation, time.time_ns())
        error: BaseException | None = None
        try:
            yield
        except BaseException as failure:
            error = failure
            raise
        finally:
            del self._open[request.task_id]
            _end(traced, time.time_ns(), error)

    def started(self, task_id: TaskId) -> Callable[[], None] | None:
        """What the model thread calls as it takes the request (None: not traced)."""
        traced = self._open.get(task_id)
        if traced is None:
            return None

        def stamp() -> None:
            traced.started_ns = time.time_ns()
        return stamp

    def watching(self, task_id: TaskId, on_output: Callable[[Output], None]) -> Callable[[Output], None]:
        """`on_output`, stamping the first output of a traced request (prefill ends there)."""
        traced = self._open.get(task_id)
        if traced is None:
            return on_output

        def stamped(out: Output) -> None:
            if not traced.first_output_ns:
                traced.first_output_ns = time.time_ns()
            on_output(out)
        return stamped

    def publishing(self, task_id: TaskId) -> str:
        """The traceparent a chunk of this task carries ("" : not traced); the first opens its span."""
        traced = self._open.get(task_id)
        if traced is None:
            return ""
        if traced.publishing is None:
            traced.publishing = tracing.start_span("exo.tokens.publish", traced.generation.traceparent, "producer")
        return traced.publishing.traceparent


def _end(traced: _Traced, now_ns: int, error: BaseException | None) -> None:
    """The phases as child spans of the generation, then the generation's own end."""
    parent = traced.generation.traceparent
    started = traced.started_ns or now_ns
    phases = [("exo.runner.queue_wait", traced.received_ns, started)]
    if traced.started_ns and traced.first_output_ns:
        phases += [("exo.runner.prefill", started, traced.first_output_ns),
                   ("exo.runner.decode", traced.first_output_ns, now_ns)]
    for name, begin, end in phases:
        tracing.start_span(name, parent, start_ns=begin).end(end)
    if traced.publishing is not None:
        traced.publishing.end(now_ns)
    traced.generation.end(now_ns, error)
