"""What exo adds to mlx-vlm for a request with an image: time to first token and decode speed,
side by side in one run, and what a second request with the same image costs.

(a) mlx-vlm's stream_generate in this process, the image read from a file; (b) the same model,
prompt and image through `exo`'s OpenAI API (a separate process with its embedded NATS, the model
from a local imitation of the Hub), streamed, the image sent as a base64 data: URL as clients do.
Greedy, same max tokens; runs alternate. The first request through exo with a new image pays for
its upload to the object store and the worker's fetch; later ones with the same image send its
bytes again (clients do) but nothing is stored or fetched: the bench reads the object store's
byte count and the worker's fetch log lines around them to show it.

    uv run python -m bench.vision [--requests 20] [--max-tokens 32] [--image-kb 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import httpx
import mlx_vlm
from mlx_vlm.prompt_utils import apply_chat_template

from bench.overhead import Run, decode_rate, timed_chat_stream
from exo.bus.connection import connect
from exo.bus.subjects import IMAGES_STREAM
from tests.support.exo_process import ExoProcess
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import Dims
from tests.support.vision_model import VISION_MODEL_ID, make_vision_model, png

ASK = "Describe this picture in a few words."


def direct_run(model: Any, processor: Any, prompt: str, image: str, max_tokens: int) -> Run:
    """`model`, `processor`: what mlx_vlm.load returns (its model is an mlx module, which mypy does not follow)."""
    start = time.perf_counter()
    stamps = [time.perf_counter() for _ in mlx_vlm.stream_generate(model, processor, prompt, image=[image],
                                                                   max_tokens=max_tokens, temperature=0.0)]
    return stamps[0] - start, decode_rate(stamps[:-1]), len(stamps) - 1  # the last record repeats the last token


def chat_body(data_url: str, max_tokens: int) -> bytes:
    """The request, serialised once: encoding 1.3 MB of JSON is the client's work (~8 ms with the
    standard library), the same whichever server answers, so it is left out of the timings."""
    content = [{"type": "text", "text": ASK}, {"type": "image_url", "image_url": {"url": data_url}}]
    return json.dumps({"model": VISION_MODEL_ID, "messages": [{"role": "user", "content": content}], "temperature": 0,
                       "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}).encode()


def start_cluster(model_dir: Path, root: Path) -> tuple[FakeHub, ExoProcess]:
    hub = FakeHub({VISION_MODEL_ID: model_dir})
    endpoint = hub.start()
    env = {"HF_ENDPOINT": endpoint, "HF_HOME": str(root / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "EXO_LOG_LEVEL": "INFO"}
    exo = ExoProcess(root / "data", env).start()
    with httpx.Client(base_url=exo.url, timeout=300) as http:
        http.post("/models/add", json={"model_id": VISION_MODEL_ID}).raise_for_status()
        http.post("/place_instance", json={"model_id": VISION_MODEL_ID}).raise_for_status()
    return hub, exo


async def stored_bytes(exo: ExoProcess) -> int:
    nc = await connect([exo.nats_url()], name="bench-vision")
    try:
        return (await nc.jetstream().stream_info(IMAGES_STREAM)).state.bytes
    finally:
        await nc.close()


def image_of(kb: int, seed: int) -> bytes:
    side = int((kb * 1000 / 3) ** 0.5)  # noise PNGs barely compress: ~3 bytes a pixel
    return png(seed, size=side)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-kb", type=int, default=1000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    dims = Dims(hidden=args.hidden, intermediate=args.hidden * 3, layers=args.layers, heads=8, kv_heads=4)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_vision_model(root / "model", dims)
        hub, exo = start_cluster(model_dir, root)
        try:
            rows = measure(args, model_dir, root, exo)
        finally:
            exo.interrupt()
            hub.stop()
    report(args, dims, *rows)


def measure(args: argparse.Namespace, model_dir: Path, root: Path,
            exo: ExoProcess) -> tuple[int, Run, list[Run], list[Run], tuple[int, int]]:
    """(image bytes, the first request with it through exo, direct runs, runs through exo, (bytes stored,
    worker fetches) during the runs)."""
    model, processor = mlx_vlm.load(str(model_dir))
    # The chat template applied: a string (a list of messages only with return_messages=True).
    prompt = cast(str, apply_chat_template(processor, model.config, ASK, num_images=1))
    with httpx.Client(base_url=exo.url, timeout=300) as http:
        for seed in range(3):  # warm both paths with other images: kernels, connections, the runner
            warm = image_of(args.image_kb, 100 + seed)
            (root / "warm.png").write_bytes(warm)
            direct_run(model, processor, prompt, str(root / "warm.png"), args.max_tokens)
            timed_chat_stream(http, chat_body("data:image/png;base64," + base64.b64encode(warm).decode(), args.max_tokens))
        image = image_of(args.image_kb, 1)
        path, body = root / "image.png", chat_body("data:image/png;base64," + base64.b64encode(image).decode(),
                                                   args.max_tokens)
        path.write_bytes(image)
        first = timed_chat_stream(http, body)  # a new image: uploaded, then fetched by the worker
        before, fetches = asyncio.run(stored_bytes(exo)), exo.output().count("fetched and verified")
        direct: list[Run] = []
        cluster: list[Run] = []
        for _ in range(args.requests):
            direct.append(direct_run(model, processor, prompt, str(path), args.max_tokens))
            cluster.append(timed_chat_stream(http, body))
        transfers = (asyncio.run(stored_bytes(exo)) - before, exo.output().count("fetched and verified") - fetches)
    return len(image), first, direct, cluster, transfers


def report(args: argparse.Namespace, dims: Dims, image_bytes: int, first: Run, direct: list[Run], cluster: list[Run],
           transfers: tuple[int, int]) -> None:
    def stats(rows: list[Run], column: int, scale: float = 1.0) -> tuple[float, float, float]:
        values = [r[column] * scale for r in rows]
        return statistics.median(values), min(values), max(values)

    (t_d, t_d_lo, t_d_hi), (t_c, t_c_lo, t_c_hi) = stats(direct, 0, 1000), stats(cluster, 0, 1000)
    (r_d, r_d_lo, r_d_hi), (r_c, r_c_lo, r_c_hi) = stats(direct, 1), stats(cluster, 1)
    print(f"model: qwen2_vl, language hidden={dims.hidden} layers={dims.layers}; image {image_bytes} bytes (PNG); "
          f"{args.requests} requests per system, alternating, {args.max_tokens} tokens each, greedy")
    print(f"{'':30}{'mlx-vlm direct':>22}{'through exo':>22}{'exo - direct':>14}{'ratio':>8}")
    print(f"{'time to first token p50 (ms)':30}{t_d:>9.1f} [{t_d_lo:.1f}-{t_d_hi:.1f}]{t_c:>9.1f} [{t_c_lo:.1f}-{t_c_hi:.1f}]"
          f"{t_c - t_d:>14.1f}{t_c / t_d:>8.3f}")
    print(f"{'decode tokens/s p50':30}{r_d:>9.1f} [{r_d_lo:.0f}-{r_d_hi:.0f}]{r_c:>9.1f} [{r_c_lo:.0f}-{r_c_hi:.0f}]"
          f"{r_c - r_d:>14.1f}{r_c / r_d:>8.3f}")
    print(f"first request with a new image through exo: time to first token {first[0] * 1000:.1f} ms "
          f"(upload to the object store and the worker's fetch on its path)")
    print(f"during the {args.requests} repeated requests: {transfers[0]} bytes stored in the object store, "
          f"{transfers[1]} worker fetches")
    print(f"completion tokens: direct {sorted({r[2] for r in direct})}, exo {sorted({r[2] for r in cluster})}")


if __name__ == "__main__":
    main()
