"""Self-checks for the test fixtures in tests/support (tiny model + fake Hub).

mlx-lm and huggingface_hub run in subprocesses: determinism has to hold across
processes, and huggingface_hub reads HF_ENDPOINT / HF_HOME at import time.
"""

import asyncio
import json
import os
import subprocess
import sys
import time

from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

_GENERATE = """
import json, sys
import mlx_lm
model, tok = mlx_lm.load(sys.argv[1])
messages = [{"role": "user", "content": "Hello there"}]
prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
segments, tokens = [], []
for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=20):
    segments.append(r.text)
    tokens.append(r.token)
print(json.dumps({"prompt": prompt, "text": mlx_lm.generate(model, tok, prompt, max_tokens=20),
                  "streamed": "".join(segments), "decoded": tok.decode(tokens), "tokens": tokens}))
"""

_DOWNLOAD = """
import asyncio
import json
import mlx_lm
from huggingface_hub import snapshot_download
from huggingface_hub.errors import RepositoryNotFoundError
first = snapshot_download(%(repo)r)
second = snapshot_download(%(repo)r)
model, tok = mlx_lm.load(first)
try:
    snapshot_download("exo-test/does-not-exist")
    missing = "no error"
except RepositoryNotFoundError:
    missing = "RepositoryNotFoundError"
print(json.dumps({"first": first, "second": second, "missing": missing,
                  "text": mlx_lm.generate(model, tok, "Hello", max_tokens=5)}))
"""


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tiny_model_is_small_fast_and_byte_identical(tmp_path):
    start = time.perf_counter()
    a = make_tiny_model(tmp_path / "a")
    elapsed = time.perf_counter() - start
    b = make_tiny_model(tmp_path / "b")
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert sum((a / f).stat().st_size for f in files) < 2_000_000
    assert elapsed < 2.0
    assert json.loads((a / "config.json").read_text())["model_type"] == "llama"


def test_generation_is_deterministic_across_processes(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    first = _run(_GENERATE, str(model), env=offline)
    second = _run(_GENERATE, str(model), env=offline)
    assert first == second
    assert first["prompt"].endswith("<|im_start|>assistant\n")
    text = first["text"]
    assert text.strip() and text.isascii() and text.isprintable()
    # What the product streams must equal both mlx_lm.generate and a full decode.
    assert first["streamed"] == text == first["decoded"]
    assert len(first["tokens"]) == 20 and len(set(first["tokens"])) > 3


def test_fake_hub_download_then_cache_then_unknown_repo(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    with FakeHub({TINY_MODEL_ID: model}) as hub:
        env = {
            "HF_ENDPOINT": hub.endpoint,
            "HF_HOME": str(tmp_path / "hf"),
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "HF_HUB_OFFLINE": "0",
        }
        result = _run(_DOWNLOAD % {"repo": TINY_MODEL_ID}, env=env)
        assert result["first"] == result["second"]
        assert result["first"].startswith(str(tmp_path / "hf"))
        assert result["missing"] == "RepositoryNotFoundError"
        assert result["text"]
        # Every file came over HTTP exactly once; the second call was served from the cache.
        expected = {f"{TINY_MODEL_ID}/{p.name}": 1 for p in model.iterdir()}
        assert hub.downloads == expected


def test_replay_stops_at_the_sequence_asked_for_while_the_log_goes_on(tmp_path):
    """tests.support.cluster.replay compares a node's State with the log up to that State's sequence;
    events appended meanwhile (heartbeats) must not slip in (the cause of the soak's one
    'State differs from the replay')."""
    from exo.bus.connection import connect
    from exo.bus.event_log import EventLog
    from exo.bus.provision import provision
    from exo.core.events import NodeHeartbeat
    from exo.core.types import NodeInfo
    from tests.support.cluster import NatsServer, replay

    nats = NatsServer(tmp_path / "nats")

    async def append(count: int) -> None:
        nc = await connect([nats.url], name="replay-fixture-test")
        await provision(nc)
        log = EventLog(nc)
        for n in range(count):
            await log.append(NodeHeartbeat(node=NodeInfo(node_id="n", memory_available=n)), f"beat-{n}")
        await nc.close()

    try:
        asyncio.run(append(300))
        state, seen = replay(nats.url, 10)
        assert state.last_seq == 10 and state.nodes["n"].memory_available == 9
        assert [seq for seq, _, _ in seen][-1] == 10
    finally:
        nats.stop()
