"""The vision-language engine: mlx-vlm as shipped, behind the runner's engine interface.

A model whose config.json has a `vision_config` (Qwen2-VL, LLaVA, Gemma 3, ...) loads here. It
serves one request at a time on one node (mlx-vlm has no sharding and no batch exo can join); what
it shares with the text engine it inherits: the token budget, constraints, logprobs, and Decoding
for stop strings, tool calls and reasoning, so both send the same chunks.

Prompts are mlx-vlm's own: each message with images is formatted by mlx-vlm for the model's type
(where its image tokens go), then the processor's chat template renders the conversation, so a
request gives exactly the tokens `mlx_vlm.generate` gives for the same messages and images.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx_lm.tokenizer_utils
import mlx_vlm
import PIL.Image
from mlx_vlm.prompt_utils import get_chat_template, get_message_json
from mlx_vlm.vision_cache import VisionFeatureCache

from exo.core.chat_template import template_messages
from exo.core.ids import TaskId
from exo.core.requests import GenerationParams
from exo.core.types import SamplingDefaults
from exo.runner.decoding import Decoding, GenerationResult, OnOutput, RequestRefused
from exo.runner.distributed import StepAnnouncement
from exo.runner.engine import Engine, check_logit_bias, logits_processors_of, sampler_of, vocabulary_size
from exo.runner.protocol import RankSetup, Resume
from exo.settings.services import RunnerSettings


class VisionEngine(Engine):
    def __init__(self, settings: RunnerSettings = RunnerSettings()) -> None:
        super().__init__(settings)
        self.batches = False
        self.processor: Any = None
        # Image features kept per runner, for models mlx-vlm can encode apart.
        self._vision_cache = VisionFeatureCache(max_size=settings.vision_cache_images)

    def load(self, model_path: str, shard: RankSetup | None = None, max_context: int = 0, kv_bits: int = 0,
             adapter_path: str = "") -> None:
        if adapter_path:
            raise ValueError("LoRA adapters are served on text models (mlx-lm's), not vision models")
        if shard is not None:
            raise ValueError("mlx-vlm cannot split a model: a vision model runs on one node")
        if kv_bits:
            raise ValueError("a quantized KV cache is not served for vision models")
        self.model, self.processor = mlx_vlm.load(model_path)
        # mlx-lm's wrapper over the same tokenizer: thinking and tool-call markers, parsers, decode.
        self.tokenizer = mlx_lm.tokenizer_utils.load(Path(model_path))
        text_config = getattr(self.model.config, "text_config", None)
        self.context_length = int(getattr(text_config, "max_position_embeddings", 0) or 0)
        if max_context:
            self.context_length = min(self.context_length or max_context, max_context)

    def warm_up(self) -> None:
        prompt = self.prompt_for(GenerationParams(messages=[]), text="warm up")
        for _ in mlx_vlm.stream_generate(self.model, self.processor, prompt, max_tokens=2):
            pass

    def prompt_for(self, params: GenerationParams, text: str | None = None) -> str:
        if params.prompt is not None and text is None:
            return params.prompt
        if text is not None:
            messages: list[dict[str, Any]] = [{"role": "user", "content": text}]
        else:
            messages = self._messages(params)
        switch = {} if params.enable_thinking is None else {"enable_thinking": params.enable_thinking}
        prompt: str = get_chat_template(self.processor, messages, add_generation_prompt=True,
                                        tools=params.tools or None, **switch)
        return prompt

    def _messages(self, params: GenerationParams) -> list[dict[str, Any]]:
        model_type = self.model.config.model_type
        messages = template_messages(params)
        for entry, message in zip(messages, params.messages, strict=True):
            if not message.images:
                continue
            if message.role != "user":  # mlx-vlm puts image tokens in user turns only
                raise RequestRefused(f"images are taken in user messages only, not in a {message.role!r} one")
            formatted = get_message_json(model_type, message.content, "user", num_images=len(message.images))
            entry["content"] = formatted["content"] if isinstance(formatted, dict) else formatted
        return messages

    def generate(
        self,
        params: GenerationParams,
        defaults: SamplingDefaults,
        on_output: OnOutput,
        is_cancelled: Callable[[], bool],
        task_id: TaskId = TaskId(""),
        told: StepAnnouncement | None = None,
        images: Sequence[str] = (),
        resume: Resume | None = None,
    ) -> GenerationResult:
        # Its prompt is mlx-vlm's to build: no earlier tokens can be put after it. A run moved before
        # anything was streamed (it waited for a lost instance's replacement) simply starts.
        if resume is not None and (resume.token_ids or resume.next_index):
            raise RuntimeError("a vision model cannot take over a generation another runner began")
        _readable(images)
        prompt = self.prompt_for(params)
        tokens = self.encode(prompt)  # the text's tokens: images add theirs inside mlx-vlm's processor
        max_tokens = self.max_tokens_for(params, len(tokens))
        decoding = Decoding(self, params, on_output, task_id, tokens)
        check_logit_bias(params.logit_bias, vocabulary_size(self.model))
        processors = [*logits_processors_of(params), *self.constraint_for(params, tokens)]
        result = None
        for response in mlx_vlm.stream_generate(
            self.model, self.processor, prompt, image=list(images) or None, max_tokens=max_tokens,
            sampler=sampler_of(params, defaults, vocabulary_size(self.model)), logits_processors=processors or None,
            vision_cache=self._vision_cache,
        ):
            # mlx-vlm's last record closes the stream: the detokenizer's rest, the token before it again.
            closing = response.finish_reason is not None
            result = decoding.step(response.text, None if closing else response.token, response.logprobs,
                                   response.prompt_tokens, response.generation_tokens, response.finish_reason)
            if result is None and is_cancelled():
                result = decoding.cancelled()
            if result is not None:
                break
        return result or decoding.finish()


def _readable(images: Sequence[str]) -> None:
    """Bytes that are no image are the client's mistake (a 400), found before any work: the
    format is read from the header (verifying a whole 1 MB PNG would cost ~1 ms; a damaged one
    fails in mlx-vlm's loader instead, as an error)."""
    for n, path in enumerate(images):
        try:
            with PIL.Image.open(path):
                pass
        except (OSError, SyntaxError, ValueError) as error:
            raise RequestRefused(f"image {n + 1} of the request is not an image this model can read: {error}") from None
