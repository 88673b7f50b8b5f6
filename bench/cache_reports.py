"""Routing with and without the runners' cache reports (docs/prompt-cache.md, "What each cache
holds"): two instances of a generated model on one exo node, each runner caching only --entries
prompts, and --conversations concurrent conversations (a system prompt of its own each) of
--turns turns: more conversations than the caches hold, so entries are evicted. Once with the
reports (the default), once with EXO_CACHE_REPORTS=0 (routing by State alone, which cannot see an
eviction), alternating, --runs times each. Reported: the share of prompt tokens read from the
cache (hit rate), TTFT median and p90, requests/s.

    uv run python -m bench.cache_reports [--runs 2] [--conversations 8] [--turns 5] [--entries 2]
        [--system-words 150] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.api_load import start_exo
from bench.prompt_cache import QUESTIONS, system_prompt
from tests.support.tiny_model import TINY_MODEL_ID, Dims, make_tiny_model

Turn = tuple[float, int, int]  # TTFT, prompt tokens, cached prompt tokens


async def streamed_turn(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]],
                        max_tokens: int) -> tuple[Turn, str]:
    body = {"model": TINY_MODEL_ID, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, text = time.perf_counter(), None, []
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event: dict[str, Any] = json.loads(line[6:])
            usage = event.get("usage") or usage
            delta = (event.get("choices") or [{}])[0].get("delta", {}).get("content")
            if delta:
                first = first or time.perf_counter() - start
                text.append(delta)
    assert first is not None and usage, "no text or no usage came back"
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return (first, usage["prompt_tokens"], cached), "".join(text)


async def conversations(url: str, count: int, turns: int, system_words: int, max_tokens: int,
                        salt: int) -> tuple[float, list[Turn]]:
    done: list[Turn] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=count + 4)) as client:
        async def one(c: int) -> None:
            history = [{"role": "system", "content": system_prompt(system_words, salt * 1000 + c)}]
            for turn in range(turns):
                history.append({"role": "user", "content": f"Conversation {c}: {QUESTIONS[(c + turn) % len(QUESTIONS)]}"})
                measured, text = await streamed_turn(client, url, history, max_tokens)
                done.append(measured)
                history.append({"role": "assistant", "content": text})

        start = time.perf_counter()
        await asyncio.gather(*(one(c) for c in range(count)))
        return count * turns / (time.perf_counter() - start), done


def run_arm(model_dir: Path, home: Path, reports: bool, args: argparse.Namespace, salt: int) -> tuple[float, list[Turn]]:
    env = {"EXO_CACHE_REPORTS": "1" if reports else "0", "EXO_PROMPT_CACHE_ENTRIES": str(args.entries)}
    hub, exo = start_exo(model_dir, home, extra_env=env)
    try:
        with httpx.Client(base_url=exo.url, timeout=300) as http:
            http.post("/place_instance", json={"model_id": TINY_MODEL_ID, "max_queue": 1000}).raise_for_status()
            deadline = time.monotonic() + 300
            while sum(r["status"] == "ready" for r in http.get("/state").json()["runners"].values()) < 2:
                assert time.monotonic() < deadline, "the two instances did not become ready"
                time.sleep(0.5)
        asyncio.run(conversations(exo.url, 2, 1, 20, 4, 10_000 + salt))  # warm both instances
        return asyncio.run(conversations(exo.url, args.conversations, args.turns, args.system_words,
                                         args.max_tokens, salt))
    finally:
        exo.interrupt()
        hub.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--entries", type=int, default=2)
    parser.add_argument("--system-words", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    arms = {"with reports": True, "State alone (EXO_CACHE_REPORTS=0)": False}
    results: dict[str, list[tuple[float, list[Turn]]]] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dims = Dims(hidden=args.hidden, intermediate=args.hidden * 2, layers=args.layers, heads=8, kv_heads=4)
        model_dir = make_tiny_model(root / "model", dims)
        for run in range(args.runs):
            for name in list(arms) if run % 2 == 0 else list(arms)[::-1]:
                home = root / f"{run}-{arms[name]}"
                home.mkdir()
                results[name].append(run_arm(model_dir, home, arms[name], args, run))
    print(f"\n### Two instances caching {args.entries} prompts each, {args.conversations} concurrent conversations x "
          f"{args.turns} turns, a {args.system_words}-word system prompt of their own, {args.runs} runs each\n")
    print("| routing | prompt tokens from the cache | TTFT median | TTFT p90 | requests/s (median) |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        turns = [t for _, ts in runs for t in ts]
        ttfts = sorted(t for t, _, _ in turns)
        hit = sum(c for _, _, c in turns) / sum(p for _, p, _ in turns)
        print(f"| {name} | {hit:.1%} | {statistics.median(ttfts) * 1000:.0f} ms | "
              f"{ttfts[int(0.9 * (len(ttfts) - 1))] * 1000:.0f} ms | {statistics.median(r for r, _ in runs):.2f} |")


if __name__ == "__main__":
    main()
