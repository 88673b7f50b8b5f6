"""What the runner needs of an engine: the interface its process loop (process.py), its batch
(batch.py) and a follower rank (follower.py) use, and nothing else.

Two implementations: exo/runner/engine.py (mlx-lm: text models, batches, lockstep ranks) and
exo/runner/vision_engine.py (mlx-vlm: vision-language models, one request at a time on one node;
`batches` says which paths an engine serves). mypy checks both satisfy this Protocol where the
runner builds them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from exo.core.ids import TaskId

if TYPE_CHECKING:
    from exo.core.requests import GenerationParams, TokenLogprob
    from exo.core.types import SamplingDefaults
    from exo.runner.decoding import GenerationResult, OnOutput
    from exo.runner.distributed import Lockstep, StepAnnouncement
    from exo.runner.prompt_cache import PromptCache
    from exo.runner.protocol import RankSetup, Resume


class ModelEngine(Protocol):
    model: Any  # the loaded model (this rank's part of it on a multi-node instance)
    tokenizer: Any  # mlx-lm's TokenizerWrapper: chat template, detokenizer, markers, parsers
    lockstep: Lockstep | None  # set on a rank of a multi-node instance
    prompt_cache: PromptCache
    pulse: float  # when the model thread last made progress (time.monotonic())
    kv_bits: int  # > 0: a quantized KV cache, served on the single path only
    batches: bool  # False: every request takes the single path (generate), one at a time
    draft_model: Any  # speculative decoding's draft model (load_draft), or None

    # Lifecycle.
    def load(self, model_path: str, shard: RankSetup | None = None, max_context: int = 0, kv_bits: int = 0,
             adapter_path: str = "") -> None: ...
    def warm_up(self) -> None: ...
    def load_draft(self, draft_path: str, num_draft_tokens: int) -> None: ...
    def release_followers(self) -> None: ...
    def beat(self) -> None: ...

    # The single path: one request alone, start to end (on a follower rank, as rank 0 announced it).
    def generate(self, params: GenerationParams, defaults: SamplingDefaults, on_output: OnOutput,
                 is_cancelled: Callable[[], bool], task_id: TaskId = TaskId(""), told: StepAnnouncement | None = None,
                 images: Sequence[str] = (),  # files of the request's images, in the order its messages give them
                 resume: Resume | None = None,  # continue a generation another runner began (a migration)
                 ) -> GenerationResult: ...

    # Batch hooks: a request's prompt tokens, its token budget, its constraint, its logprobs.
    def prompt_for(self, params: GenerationParams, text: str | None = None) -> str: ...
    def encode(self, prompt: str) -> list[int]: ...
    def max_tokens_for(self, params: GenerationParams, prompt_tokens: int) -> int: ...
    def constraint_for(self, params: GenerationParams, prompt: list[int]) -> list[Callable[..., Any]]: ...
    def logprob(self, token: int, logprobs: Any, top: int) -> TokenLogprob: ...
