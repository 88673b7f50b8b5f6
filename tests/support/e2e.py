"""What the API end-to-end modules share: an exo process on a fake Hub serving the tiny test
models, and what mlx-lm itself generates, to compare with exactly."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.sample_utils import make_sampler

from tests.support.exo_process import ExoProcess
from tests.support.fake_hub import FakeHub


def start_exo(root: Path, hub: FakeHub, env: dict[str, str] | None = None) -> ExoProcess:
    assert hub.endpoint is not None, "start the hub first"
    base = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(root / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    return ExoProcess(root / "data", base | (env or {})).start()


@contextmanager
def exo_serving(root: Path, models: dict[str, Path], env: dict[str, str] | None = None) -> Iterator[ExoProcess]:
    """An exo process whose (fake) Hub serves `models`, stopped with Ctrl-C at the end."""
    with FakeHub(models) as hub:
        exo = start_exo(root, hub, env)
        try:
            yield exo
        finally:
            exo.interrupt()


def nats_url_of(node: ExoProcess) -> str:
    return node.nats_url()


def place(http: httpx.Client, model_id: str, **extra: object) -> str:
    """Add the model's card from the (fake) Hub and place an instance; returns its id once ready."""
    if model_id not in [m["id"] for m in http.get("/v1/models").json()["data"]]:
        added = http.post("/models/add", json={"model_id": model_id})
        assert added.status_code == 200, added.text
    placed = http.post("/place_instance", json={"model_id": model_id, **extra})
    assert placed.status_code == 200, placed.text
    instance_id: str = placed.json()["instance_id"]
    return instance_id


class Reference:
    """mlx-lm on the same model directory: the text the cluster must reproduce exactly."""

    def __init__(self, model_dir: Path, adapter_dir: Path | None = None) -> None:
        self.model_dir = model_dir
        self.model, self.tokenizer = mlx_lm.load(str(model_dir), adapter_path=str(adapter_dir) if adapter_dir else None)
        # greedy texts already generated, by (prompt, max_tokens): a module asks for the same long
        # one in several tests (a 1,000-token chat is ~3 s of CPU), and greedy decoding gives the
        # same text every time
        self._greedy: dict[tuple[str, int], str] = {}

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        prompt: str = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return prompt  # tokenize=False: the template's text

    def generate(self, prompt: str, max_tokens: int, **kwargs: Any) -> str:
        if kwargs:  # a sampler, logits processors, ...: generated each time
            text: str = mlx_lm.generate(self.model, self.tokenizer, prompt, max_tokens=max_tokens, **kwargs)
            return text
        if (prompt, max_tokens) not in self._greedy:
            self._greedy[prompt, max_tokens] = mlx_lm.generate(self.model, self.tokenizer, prompt, max_tokens=max_tokens)
        return self._greedy[prompt, max_tokens]

    def chat(self, messages: list[dict[str, Any]], max_tokens: int, tools: list[dict[str, Any]] | None = None,
             **kwargs: Any) -> str:
        return self.generate(self.chat_prompt(messages, tools), max_tokens, **kwargs)

    def sampled_chat(self, messages: list[dict[str, Any]], max_tokens: int, seed: int, temperature: float, top_p: float = 0.0,
                     top_k: int = 0) -> str:
        """mlx-lm's seeded sampling: the global seed, then its sampler (as mlx_lm.generate users do)."""
        mx.random.seed(seed)
        sampler = make_sampler(temp=temperature, top_p=top_p, top_k=top_k)
        return self.generate(self.chat_prompt(messages), max_tokens, sampler=sampler)

    def prompt_tokens(self, prompt: str) -> int:
        return len(self.tokenizer.encode(prompt, add_special_tokens=not prompt.startswith(self.tokenizer.bos_token or "\0")))

    def steps(self, prompt: str, max_tokens: int, **kwargs: Any) -> list[Any]:
        """mlx-lm's GenerationResponse per token."""
        return list(mlx_lm.stream_generate(self.model, self.tokenizer, prompt, max_tokens=max_tokens, **kwargs))


def one_model_node(model_id: str, make: Callable[[Path], Path]) -> tuple[Any, Any]:
    """The module fixtures `model_dir` (the model `make` writes) and `node` (an exo process whose
    fake Hub serves it as `model_id`), for a module that tests one generated model:
    `model_dir, node = one_model_node(TINY_MODEL_ID, make_tiny_model)`."""

    @pytest.fixture(scope="module")
    def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return make(tmp_path_factory.mktemp("model") / "model")

    @pytest.fixture(scope="module")
    def node(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ExoProcess]:
        with exo_serving(tmp_path_factory.mktemp("node"), {model_id: model_dir}) as exo:
            yield exo

    return model_dir, node
