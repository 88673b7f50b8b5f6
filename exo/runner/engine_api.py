"""What the runner needs of an engine: the interface its process loop (__main__.py), its batch
(batch.py) and a follower rank (follower.py) use, and nothing else.

exo/runner/engine.py (mlx-lm) is the first implementation; a second one (a vision-language
engine on mlx-vlm) implements the same members and the runner, the batch and lockstep serve it
unchanged. mypy checks that `Engine` satisfies this Protocol where the runner builds one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from exo.core.types import GenerationParams, SamplingDefaults, TokenLogprob
    from exo.runner.distributed import Announcement, Lockstep
    from exo.runner.engine import GenerationResult, OnOutput
    from exo.runner.prompt_cache import PromptCache
    from exo.runner.protocol import RankSetup


class TextEngine(Protocol):
    model: Any  # the loaded model (this rank's part of it on a multi-node instance)
    tokenizer: Any  # mlx-lm's TokenizerWrapper: chat template, detokenizer, markers, parsers
    lockstep: Lockstep | None  # set on a rank of a multi-node instance
    prompt_cache: PromptCache
    pulse: float  # when the model thread last made progress (time.monotonic())
    kv_bits: int  # > 0: a quantized KV cache, served on the single path only

    # Lifecycle.
    def load(self, model_path: str, shard: RankSetup | None = None, max_context: int = 0, kv_bits: int = 0) -> None: ...
    def warm_up(self) -> None: ...
    def release_followers(self) -> None: ...
    def beat(self) -> None: ...

    # The single path: one request alone, start to end (on a follower rank, as rank 0 announced it).
    def generate(self, params: GenerationParams, defaults: SamplingDefaults, on_output: OnOutput,
                 is_cancelled: Callable[[], bool], task_id: str = "", told: Announcement | None = None,
                 ) -> GenerationResult: ...

    # Batch hooks: a request's prompt tokens, its token budget, its constraint, its logprobs.
    def prompt_for(self, params: GenerationParams, text: str | None = None) -> str: ...
    def encode(self, prompt: str) -> list[int]: ...
    def max_tokens_for(self, params: GenerationParams, prompt_tokens: int) -> int: ...
    def constraint_for(self, params: GenerationParams, prompt: list[int]) -> list[Callable[..., Any]]: ...
    def logprob(self, token: int, logprobs: Any, top: int) -> TokenLogprob: ...
