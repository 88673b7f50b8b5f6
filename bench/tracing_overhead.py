"""Request latency with tracing off and on, side by side in one run (exo/telemetry, issue #46).

Two `exo` nodes (separate processes, each with its embedded NATS and the tiny test model from a
fake Hub): "off" with no endpoint, "on" exporting every span over OTLP/HTTP to a receiver in this
process (tests/support/otlp_receiver.py) with the SDK's default batching. Each run sends
`--requests` streamed chats one after another to each node, alternating which goes first; the
latency of a request is from sending it to its `[DONE]`, its TTFT to the first text. Printed per
node: runs, samples, medians with ranges over the runs' medians; and the spans received per traced
request. Also the off path's own cost, measured in this process: each traced call site calls
`tracing.span` / `traceparent_of` once per request or per chunk, and with tracing off that is a
check of one global.

    uv run python -m bench.tracing_overhead [--runs 6] [--requests 20] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import timeit
from pathlib import Path

import httpx

from bench.api_load import start_exo
from bench.summary import alternating, print_medians
from exo.telemetry import tracing
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

SYSTEMS = ["off", "on"]


def streamed_chat(http: httpx.Client, max_tokens: int) -> tuple[float, float]:
    """(latency, TTFT) in ms of one streamed chat."""
    body = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "tell me about the sea"}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started, first = time.perf_counter(), 0.0
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not first and line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                first = time.perf_counter()
    done = time.perf_counter()
    return (done - started) * 1000, ((first or done) - started) * 1000


def off_path_ns() -> float:
    """ns per call site with tracing off: a span opened and closed around nothing, a header read."""
    assert not tracing.enabled()
    headers = {"Nats-Msg-Id": "x"}

    def call_site() -> None:
        with tracing.span("exo.events.deliver", tracing.traceparent_of(headers), "consumer"):
            pass
    return min(timeit.repeat(call_site, number=100_000, repeat=5)) / 100_000 * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    receiver = OtlpReceiver()
    results: dict[str, list[dict[str, float]]] = {system: [] for system in SYSTEMS}
    samples = {system: 0 for system in SYSTEMS}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_tiny_model(root / "model")
        (root / "off").mkdir()
        (root / "on").mkdir()
        alone = {"EXO_DISCOVERY": "0"}  # two clusters of one node: else they find each other and form one
        nodes = {"off": start_exo(model_dir, root / "off", extra_env=alone),
                 "on": start_exo(model_dir, root / "on", extra_env={**alone, "EXO_OTLP_ENDPOINT": receiver.url})}
        clients = {system: httpx.Client(base_url=exo.url, timeout=300) for system, (_, exo) in nodes.items()}
        try:
            for system in SYSTEMS:  # the model loaded and compiled before anything is timed
                for _ in range(3):
                    streamed_chat(clients[system], args.max_tokens)
            time.sleep(6)  # the warm-up's spans exported (every 5 s by default) before counting
            spans_before = len(receiver.spans)
            for _, system in alternating(SYSTEMS, args.runs):
                timed = [streamed_chat(clients[system], args.max_tokens) for _ in range(args.requests)]
                samples[system] += len(timed)
                results[system].append({"latency": statistics.median(t[0] for t in timed),
                                        "ttft": statistics.median(t[1] for t in timed)})
            time.sleep(6)  # the SDK exports every 5 s by default: the last requests' spans in
            spans = receiver.spans[spans_before:]
        finally:
            for client in clients.values():
                client.close()
            for hub, exo in nodes.values():
                exo.interrupt()
                hub.stop()
            receiver.stop()
    print(f"tiny model, streamed chats of {args.max_tokens} tokens, one at a time; {args.runs} runs per node, "
          f"alternating; {args.requests} requests a run; medians over the runs' medians [range], ms")
    print_medians([("tracing", 8), ("latency ms", 18), ("TTFT ms", 18)], results, ["latency", "ttft"])
    traced = sum(1 for span in spans if span.name == "exo.api.generation")
    print(f"samples: off {samples['off']}, on {samples['on']}; spans received: {len(spans)} "
          f"({len(spans) / max(1, traced):.1f} per traced request, {traced} requests traced)")
    off, on = (statistics.median(run["latency"] for run in results[s]) for s in SYSTEMS)
    print(f"on vs off: {on - off:+.1f} ms per request ({(on / off - 1) * 100:+.1f}%)")
    print(f"off path: {off_path_ns():.0f} ns per call site (a span around nothing plus a header read)")


if __name__ == "__main__":
    main()
