"""Multi-turn chats: time to first token per turn, exo (prompt cache) vs mlx_lm.server, in one run;
then two instances of a model serving concurrent conversations, cache-aware routing vs least busy.

Part 1: one eight-turn conversation (a long system prompt, then turn after turn, each turn
adding the model's reply and a new question), streamed and greedy, sent to exo and to
mlx_lm.server on the same generated model. The systems alternate every turn (which goes first
alternates too); each run uses a fresh system prompt, so no run reuses another's cache. Reported:
TTFT per turn (median over runs), and the median of turns 2-8 with its range and sample count.

Part 2: an exo node with two instances of the model; --conversations concurrent conversations of
--turns turns each. Once with cache-aware routing (the default), once with EXO_CACHE_ROUTING=0
(every request to the least busy instance), alternating, --runs times each.

    uv run python -m bench.prompt_cache [--runs 3] [--system-words 250 1200] [--max-tokens 24]
        [--conversations 8] [--turns 8] [--routing-system-words 150] [--own-context] [--skip-ttft] [--skip-routing]

On the generated model's tokenizer a system prompt of 250 words is ~780 tokens (the whole
eight-turn conversation ~1,100), 1,200 words ~3,600 (~4,000).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.api_load import start_exo, start_mlx_lm_server
from tests.support.tiny_model import TINY_MODEL_ID, Dims, make_tiny_model

WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "the", "old", "fisherman", "mends",
    "his", "nets", "by", "the", "sea", "and", "tells", "stories", "of", "rivers", "mountains", "cities", "and", "friends",
]
QUESTIONS = ["Tell me about the sea.", "And the river?", "What about the hills?", "Tell me a joke.",
             "Summarize this text.", "What is the capital of France?", "Write a story about a robot.", "Thank you."]


def system_prompt(words: int, salt: int) -> str:
    # The salt makes each run's prompt its own.
    return f"Run {salt}. You are a helpful assistant. " + " ".join(WORDS[(i * 7 + salt) % len(WORDS)] for i in range(words))


async def streamed(client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, str]],
                   max_tokens: int) -> tuple[float, str]:
    """(time to first content, the whole text) of one streamed greedy chat completion."""
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True}
    start, first, text = time.perf_counter(), None, []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta", {}).get("content")
                if delta:
                    first = first or time.perf_counter() - start
                    text.append(delta)
    assert first is not None, "no text came back"
    return first, "".join(text)


async def conversation_ttfts(systems: dict[str, tuple[str, str]], system: str, max_tokens: int) -> dict[str, list[float]]:
    """One eight-turn conversation on every system, turn by turn, alternating which goes first."""
    histories = {name: [{"role": "system", "content": system}] for name in systems}
    ttfts: dict[str, list[float]] = {name: [] for name in systems}
    async with httpx.AsyncClient(timeout=600) as client:
        for turn, question in enumerate(QUESTIONS):
            order = list(systems) if turn % 2 == 0 else list(systems)[::-1]
            for name in order:
                url, model = systems[name]
                histories[name].append({"role": "user", "content": question})
                ttft, text = await streamed(client, url, model, histories[name], max_tokens)
                ttfts[name].append(ttft)
                histories[name].append({"role": "assistant", "content": text})
    return ttfts


def summary(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1000:.0f} ms ({min(samples) * 1000:.0f}-{max(samples) * 1000:.0f}, n={len(samples)})"


def part_one(model_dir: Path, root: Path, args: argparse.Namespace) -> None:
    server, server_url = start_mlx_lm_server(model_dir, root / "mlx_lm_server.log")
    (root / "exo").mkdir()
    hub, exo = start_exo(model_dir, root / "exo")
    systems = {"exo": (exo.url, TINY_MODEL_ID), "mlx_lm.server": (server_url, str(model_dir))}
    try:
        asyncio.run(conversation_ttfts(systems, system_prompt(50, 999), 4))  # warm both: kernels, connections
        for words in args.system_words:
            per_turn: dict[str, list[list[float]]] = {name: [[] for _ in QUESTIONS] for name in systems}
            for run in range(args.runs):
                ttfts = asyncio.run(conversation_ttfts(systems, system_prompt(words, run * 31 + words), args.max_tokens))
                for name, values in ttfts.items():
                    for turn, value in enumerate(values):
                        per_turn[name][turn].append(value)
            print(f"\n### System prompt of {words} words, {len(QUESTIONS)} turns, {args.runs} runs, "
                  f"{args.max_tokens} tokens a reply\n")
            print("| turn | " + " | ".join(f"{n} TTFT (median)" for n in systems) + " | exo / mlx_lm.server |")
            print("|---|" + "---|" * (len(systems) + 1))
            for turn in range(len(QUESTIONS)):
                medians = [statistics.median(per_turn[n][turn]) for n in systems]
                times = " | ".join(f"{m * 1000:.0f} ms" for m in medians)
                print(f"| {turn + 1} | {times} | {medians[0] / medians[1]:.2f}x |")
            later = {n: [v for values in per_turn[n][1:] for v in values] for n in systems}
            ratio = statistics.median(later["exo"]) / statistics.median(later["mlx_lm.server"])
            print(f"\nTurns 2-8: exo {summary(later['exo'])}, mlx_lm.server {summary(later['mlx_lm.server'])}: "
                  f"exo/mlx_lm.server = {ratio:.2f}x (target <= 1.00x: {'met' if ratio <= 1.0 else 'MISSED'})")
    finally:
        exo.interrupt()
        hub.stop()
        server.kill()


async def conversations_load(url: str, conversations: int, turns: int, system_words: int, max_tokens: int,
                             salt: int, own_context: bool = False) -> tuple[float, list[float]]:
    """`conversations` concurrent conversations of `turns` turns: (requests/s, TTFTs). `own_context`:
    each conversation has a system prompt (a document) of its own, else all share one."""
    ttfts: list[float] = []
    async with httpx.AsyncClient(timeout=600,
                                 limits=httpx.Limits(max_connections=conversations + 4)) as client:
        async def one(c: int) -> None:
            history = [{"role": "system", "content": system_prompt(system_words, salt * 1000 + c * own_context)}]
            for turn in range(turns):
                history.append({"role": "user", "content": f"Conversation {c}: {QUESTIONS[(c + turn) % len(QUESTIONS)]}"})
                ttft, text = await streamed(client, url, TINY_MODEL_ID, history, max_tokens)
                ttfts.append(ttft)
                history.append({"role": "assistant", "content": text})

        start = time.perf_counter()
        await asyncio.gather(*(one(c) for c in range(conversations)))
        wall = time.perf_counter() - start
    return conversations * turns / wall, ttfts


def part_two(model_dir: Path, root: Path, args: argparse.Namespace) -> None:
    results: dict[str, list[tuple[float, list[float]]]] = {"cache-aware": [], "least busy": []}
    for run in range(args.runs):
        for name in (list(results) if run % 2 == 0 else list(results)[::-1]):
            env = {"EXO_CACHE_ROUTING": "1" if name == "cache-aware" else "0"}
            home = root / f"routing-{run}-{name.replace(' ', '-')}"
            home.mkdir()
            hub, exo = start_exo(model_dir, home, extra_env=env)
            try:
                with httpx.Client(base_url=exo.url, timeout=300) as http:
                    http.post("/place_instance", json={"model_id": TINY_MODEL_ID, "max_queue": 1000}).raise_for_status()
                asyncio.run(conversations_load(exo.url, 2, 1, 50, 4, 999))  # warm both instances
                results[name].append(asyncio.run(conversations_load(
                    exo.url, args.conversations, args.turns, args.routing_system_words, args.max_tokens, run,
                    args.own_context)))
            finally:
                exo.interrupt()
                hub.stop()
    print(f"\n### Two instances, {args.conversations} concurrent conversations x {args.turns} turns, "
          f"{args.routing_system_words}-word system prompt{' of its own each' if args.own_context else ' shared'}, "
          f"{args.runs} runs each\n")
    print("| routing | requests/s (median, range) | TTFT median | TTFT p90 |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        rps = [r for r, _ in runs]
        ttfts = sorted(t for _, ts in runs for t in ts)
        print(f"| {name} | {statistics.median(rps):.2f} ({min(rps):.2f}-{max(rps):.2f}) | "
              f"{statistics.median(ttfts) * 1000:.0f} ms | {ttfts[int(0.9 * (len(ttfts) - 1))] * 1000:.0f} ms |")
    gain = statistics.median(r for r, _ in results["cache-aware"]) / statistics.median(r for r, _ in results["least busy"])
    print(f"\nThroughput cache-aware / least busy: {gain:.2f}x (target >= 1.5x: {'met' if gain >= 1.5 else 'MISSED'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--system-words", type=int, nargs="+", default=[250, 1200])
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--routing-system-words", type=int, default=150)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--skip-routing", action="store_true")
    parser.add_argument("--own-context", action="store_true", help="part 2: a system prompt of its own per conversation")
    parser.add_argument("--skip-ttft", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dims = Dims(hidden=args.hidden, intermediate=args.hidden * 2, layers=args.layers, heads=8, kv_heads=4)
        model_dir = make_tiny_model(root / "model", dims)
        print(f"Model: generated llama, hidden {args.hidden}, {args.layers} layers; both systems on this machine.")
        if not args.skip_ttft:
            part_one(model_dir, root, args)
        if not args.skip_routing:
            part_two(model_dir, root, args)


if __name__ == "__main__":
    main()
