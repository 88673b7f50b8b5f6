"""A scripted tool-using agent session, exo vs mlx_lm.server on the same model, in one run.

Ten steps; in each the user asks, the model calls a tool (the generated tool model always calls
get_weather when the user spoke last), the tool's result (1-4 KB of text) goes back, and the
model answers. So the context grows by some 2.5 KB of tool output a step, as an agent's does.
Both systems get the same conversation (the calls are the same; each answer is the system's own,
and greedy answers are the same text). Runs alternate which system goes first. Reported: wall
time per step (call + answer) as the median over runs, and the whole session's median and range.

    uv run python -m bench.agent_loop [--runs 3] [--steps 10] [--hidden 256] [--layers 4] [--result-bytes 1024 4096]

The generated model's tokenizer makes about 1.4 characters a token (a real BPE one, about 4), and
mlx's CPU backend attends slowly: on a 2-core machine without a GPU, smaller tool results
(--result-bytes 256 1024) keep a session to minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.api_load import start_exo, start_mlx_lm_server
from bench.summary import alternating
from tests.support.tiny_model import Dims
from tests.support.tool_model import CALL_ARGUMENTS, CALL_NAME, TOOL_MODEL_ID, WEATHER_TOOL, make_tool_model

FORECAST = "Paris, hour by hour: clouds {h}% at {h}:00, wind {w} km/h from the west, rain {r} mm, 1{h} C. "


def tool_result(step: int, low: int = 1024, high: int = 4096) -> str:
    """`low`-`high` bytes of a tool's text (1-4 KB by default), different each step."""
    size = low + (step * 977) % (high - low)
    text, h = "", 0
    while len(text) < size:
        text += FORECAST.format(h=h % 24, w=(h * 7 + step) % 40, r=(h + step) % 5)
        h += 1
    return text[:size]


def ask(client: httpx.Client, url: str, model: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "tools": [WEATHER_TOOL], "temperature": 0, "max_tokens": max_tokens}
    response = client.post(f"{url}/v1/chat/completions", json=body)
    response.raise_for_status()
    message: dict[str, Any] = response.json()["choices"][0]["message"]  # the OpenAI API's assistant message
    return message


def session(url: str, model: str, steps: int, salt: int, sizes: tuple[int, int] = (1024, 4096)) -> list[float]:
    """The wall time of each step of one session."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"Session {salt}. You are an agent with tools."}]
    times: list[float] = []
    with httpx.Client(timeout=600) as client:
        for step in range(steps):
            start = time.perf_counter()
            messages.append({"role": "user", "content": f"Step {step}: what is the weather in Paris now?"})
            called = ask(client, url, model, messages, 48)
            calls = called.get("tool_calls") or []
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
                [(CALL_NAME, CALL_ARGUMENTS)], called
            call = {"id": f"call_{step}", "type": "function",
                    "function": {"name": CALL_NAME, "arguments": json.dumps(CALL_ARGUMENTS)}}
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": f"call_{step}", "content": tool_result(step, *sizes)}]
            answer = ask(client, url, model, messages, 32)
            messages.append({"role": "assistant", "content": answer["content"] or ""})
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--result-bytes", type=int, nargs=2, default=[1024, 4096], metavar=("LOW", "HIGH"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dims = Dims(hidden=args.hidden, intermediate=args.hidden * 2, layers=args.layers, heads=8, kv_heads=4)
        model_dir = make_tool_model(root / "model", dims)
        server, server_url = start_mlx_lm_server(model_dir, root / "mlx_lm_server.log")
        (root / "exo").mkdir()
        hub, exo = start_exo(model_dir, root / "exo", model_id=TOOL_MODEL_ID)
        systems = {"exo": (exo.url, TOOL_MODEL_ID), "mlx_lm.server": (server_url, str(model_dir))}
        print(f"Model: generated tool-calling llama, hidden {args.hidden}, {args.layers} layers; both systems on "
              f"this machine. {args.steps} steps a session, tool results of {args.result_bytes[0]}-{args.result_bytes[1]} "
              f"bytes, {args.runs} sessions per system.")
        try:
            for name, (url, model) in systems.items():
                session(url, model, 2, 999)  # warm: kernels, connections
            per_step: dict[str, list[list[float]]] = {name: [[] for _ in range(args.steps)] for name in systems}
            totals: dict[str, list[float]] = {name: [] for name in systems}
            for run, name in alternating(list(systems), args.runs):
                times = session(*systems[name], args.steps, run, tuple(args.result_bytes))
                totals[name].append(sum(times))
                for step, value in enumerate(times):
                    per_step[name][step].append(value)
        finally:
            exo.interrupt()
            hub.stop()
            server.kill()
    print("\n| step | " + " | ".join(f"{n} (median)" for n in systems) + " | exo / mlx_lm.server |")
    print("|---|" + "---|" * (len(systems) + 1))
    for step in range(args.steps):
        medians = [statistics.median(per_step[n][step]) for n in systems]
        print(f"| {step + 1} | " + " | ".join(f"{m * 1000:.0f} ms" for m in medians) + f" | {medians[0] / medians[1]:.2f}x |")
    for name, values in totals.items():
        print(f"\n{name}: session {statistics.median(values):.2f} s (range {min(values):.2f}-{max(values):.2f}, n={len(values)})")
    ratio = statistics.median(totals["exo"]) / statistics.median(totals["mlx_lm.server"])
    print(f"\nSession exo / mlx_lm.server: {ratio:.2f}x (target <= 1.00x: {'met' if ratio <= 1.0 else 'MISSED'})")


if __name__ == "__main__":
    main()
