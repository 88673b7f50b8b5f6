"""An embedding model on one node: one vector per input, pooled as its sentence-transformers files say.

Encoders (BERT, XLM-RoBERTa, ModernBERT) run on mlx-embeddings' models; decoder embedders
(Qwen3-Embedding: a Qwen3 without its head) on mlx-lm's. Only their last hidden states are taken:
pooling and normalization are exo's (exo/core/embedding_files.py reads the recipe), because
mlx-embeddings hardcodes one pooling per architecture and ignores the model's own files.
Inputs are padded on the right, with a mask for encoders; a decoder's causal mask already keeps
each sequence from seeing the padding after it, and its last real token is taken.
A cross-encoder (a reranker, exo/runner/cross_encoder.py) takes the same way: one score per
(query, document) pair, sent as a vector of one float.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.utils import _get_classes, load_model
from transformers import AutoTokenizer

from exo.core.embedding_files import embedding_of
from exo.core.requests import EmbedInputs, GenerationParams
from exo.core.types import EmbeddingSpec, SamplingDefaults
from exo.runner.cross_encoder import load_cross_encoder, relevance
from exo.runner.decoding import GenerationResult, OnOutput, PromptTooLong, RequestRefused
from exo.runner.engine import Engine
from exo.runner.protocol import RankSetup
from exo.settings.services import RunnerSettings

ENCODER_TYPES = frozenset({"bert", "xlm-roberta", "xlm_roberta", "modernbert"})  # mlx-embeddings' encoders
BATCH = 32  # inputs per forward pass: a request of 256 inputs is 8 passes, each padded to its longest input


Tokens = tuple[list[int], list[int]]  # one input's token ids and their token types (1: a reranked document's)


class Embedded(NamedTuple):
    vectors: list[str]  # per input: little-endian float32, base64 (TokenChunk.embedding)
    prompt_tokens: int  # every input's tokens, special tokens included (OpenAI's usage.prompt_tokens)


def embedding_spec_of(model_path: str) -> EmbeddingSpec | None:
    """The model's pooling from its sentence-transformers files; None: not an embedding model."""
    root = Path(model_path)
    return embedding_of(lambda name: (root / name).read_text() if (root / name).is_file() else None)


class EmbeddingEngine(Engine):
    def __init__(self, settings: RunnerSettings = RunnerSettings()) -> None:
        super().__init__(settings)
        self.batches = False
        self.spec = EmbeddingSpec()
        self.encoder = False
        self._pad_id = 0
        self._vocab_size = 0

    def load(self, model_path: str, shard: RankSetup | None = None, max_context: int = 0, kv_bits: int = 0,
             adapter_path: str = "") -> None:
        if adapter_path:
            raise ValueError("LoRA adapters are served on text models, not embedding models")
        if shard is not None:
            raise ValueError("an embedding model runs on one node: place it with min_nodes 1")
        if kv_bits:
            raise ValueError("an embedding model keeps no KV cache to quantize")
        spec = embedding_spec_of(model_path)
        if spec is None:
            raise ValueError(f"{model_path} is not an embedding model (no Pooling module in modules.json)")
        config = json.loads((Path(model_path) / "config.json").read_text())
        self.spec, self.encoder = spec, config.get("model_type") in ENCODER_TYPES
        if spec.rerank is not None:
            self.model = load_cross_encoder(model_path)
        elif self.encoder:
            import mlx_embeddings  # imports mlx-vlm and transformers' processors: only where it serves

            self.model, _ = mlx_embeddings.load(model_path)
        else:
            self.model, _ = load_model(Path(model_path), get_model_classes=_headless)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._pad_id = self.tokenizer.pad_token_id or 0
        self._vocab_size = int(config.get("vocab_size", 0))
        self.context_length = int(config.get("max_position_embeddings", 0) or 0)
        if max_context:
            self.context_length = min(self.context_length or max_context, max_context)

    def warm_up(self) -> None:
        self.embed(EmbedInputs(texts=["warm up"], query="warm up" if self.spec.rerank else None))

    def generate(self, params: GenerationParams, defaults: SamplingDefaults, on_output: OnOutput, *args: Any,
                 **kwargs: Any) -> GenerationResult:
        raise RequestRefused("this model embeds and does not generate text: use POST /v1/embeddings")

    def embed(self, inputs: EmbedInputs) -> Embedded:
        answer = self.embed_together([inputs])[0]
        if isinstance(answer, RequestRefused):
            raise answer
        return answer

    def embed_together(self, requests: Sequence[EmbedInputs]) -> list[Embedded | RequestRefused]:
        """Several requests' inputs in shared forward passes (each request refused alone if it must be)."""
        answers: list[Embedded | RequestRefused] = []
        accepted: list[tuple[int, list[Tokens]]] = []  # the request's place, its token sequences
        for inputs in requests:
            try:
                sequences = self._sequences(inputs)
                self._check(sequences, reranking=inputs.query is not None)
            except RequestRefused as refused:
                answers.append(refused)
                continue
            accepted.append((len(answers), sequences))
            answers.append(Embedded([], sum(len(ids) for ids, _ in sequences)))
        flat = [s for _, sequences in accepted for s in sequences]
        pooled = [row for start in range(0, len(flat), BATCH) for row in self._pooled(flat[start:start + BATCH])]
        for place, sequences in accepted:
            mine, pooled = np.stack(pooled[:len(sequences)]), pooled[len(sequences):]
            dimensions = requests[place].dimensions
            if dimensions and dimensions > mine.shape[1]:
                answers[place] = RequestRefused(f"dimensions must be at most {mine.shape[1]} for this model, got {dimensions}")
                continue
            if dimensions:  # Matryoshka: the leading dimensions, normalized again (as OpenAI and Ollama answer)
                mine = mine[:, :dimensions]
                mine = mine / np.maximum(np.linalg.norm(mine, axis=1, keepdims=True), 1e-12)
            vectors = [base64.b64encode(row.astype("<f4").tobytes()).decode() for row in mine]
            answers[place] = Embedded(vectors, sum(len(ids) for ids, _ in sequences))
        return answers

    def _sequences(self, inputs: EmbedInputs) -> list[Tokens]:
        """Each input's token ids and token types: a text or token ids alone, or (a reranker) a
        [CLS] query [SEP] document [SEP] pair, its document's tokens of type 1."""
        if (inputs.query is not None) != (self.spec.rerank is not None):
            raise RequestRefused("this model is a reranker: use POST /v1/rerank" if self.spec.rerank
                                 else "this model embeds and does not rerank: use a cross-encoder for POST /v1/rerank")
        if inputs.query is None:
            alone = [list(self.tokenizer(t)["input_ids"]) for t in inputs.texts] + [list(t) for t in inputs.token_ids]
            return [(ids, [0] * len(ids)) for ids in alone]
        if inputs.token_ids:
            raise RequestRefused("a reranker scores documents as text, not token ids")
        query_tokens = len(self.tokenizer(inputs.query)["input_ids"])
        if self.context_length and query_tokens + 2 > self.context_length:  # a document: a token and its [SEP]
            raise PromptTooLong(f"the query is {query_tokens} tokens with its special tokens: with any document it is "
                                f"over the model's context of {self.context_length}")
        # Token types asked for: a tokenizer saved without BERT's class (PreTrainedTokenizerFast) omits them.
        pairs = [self.tokenizer(inputs.query, text, return_token_type_ids=True) for text in inputs.texts]
        return [(list(pair["input_ids"]), list(pair["token_type_ids"])) for pair in pairs]

    def _check(self, sequences: Sequence[Tokens], reranking: bool = False) -> None:
        what = "documents[{n}] with the query" if reranking else "input {n}"
        if not sequences:
            raise RequestRefused("nothing to embed: send at least one input")
        for n, (tokens, _) in enumerate(sequences):
            if not tokens:
                raise RequestRefused(f"input {n} has no tokens: send text, or at least one token id")
            if self.context_length and len(tokens) > self.context_length:
                raise PromptTooLong(f"{what.format(n=n)} is {len(tokens)} tokens, over the model's context of "
                                    f"{self.context_length}")
            if self._vocab_size and not all(0 <= t < self._vocab_size for t in tokens):
                raise RequestRefused(f"input {n} has token ids outside the model's vocabulary (0 to {self._vocab_size - 1})")

    def _pooled(self, sequences: Sequence[Tokens]) -> np.ndarray:
        width = max(len(ids) for ids, _ in sequences)
        ids = mx.array([s + [self._pad_id] * (width - len(s)) for s, _ in sequences])
        mask = mx.array([[1] * len(s) + [0] * (width - len(s)) for s, _ in sequences], dtype=mx.float32)
        if self.spec.rerank is not None:  # one score per pair, as a vector of one float
            types = mx.array([t + [0] * (width - len(t)) for _, t in sequences])
            vectors = relevance(self.model, ids, types, mask, self.spec.rerank)[:, None]
        else:
            vectors = self._vectors(ids, mask)
        mx.eval(vectors)
        self.beat()
        return np.array(vectors)

    def _vectors(self, ids: mx.array, mask: mx.array) -> mx.array:
        hidden = (self.model(ids, attention_mask=mask).last_hidden_state if self.encoder
                  else self.model.model(ids)).astype(mx.float32)
        vectors = pool(hidden, mask, self.spec.pooling)
        return _normalized(vectors) if self.spec.normalize else vectors


def pool(hidden: mx.array, mask: mx.array, pooling: str) -> mx.array:
    """One vector per row of right-padded `hidden` (batch, tokens, dims), as sentence-transformers pools."""
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "lasttoken":
        last = mask.sum(axis=1).astype(mx.int32) - 1
        return hidden[mx.arange(hidden.shape[0]), last]
    weights = mask[..., None]
    return (hidden * weights).sum(axis=1) / mx.maximum(weights.sum(axis=1), 1e-9)


def _normalized(vectors: mx.array) -> mx.array:
    return vectors / mx.maximum(mx.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)


def _headless(config: dict[str, Any]) -> tuple[type[nn.Module], type[Any]]:
    """mlx-lm's classes for the model, without its head, taking weights with or without the `model.`
    prefix: Qwen3-Embedding ships its layers unprefixed and no lm_head."""
    model_class, args_class = _get_classes(config)

    class Headless(model_class):  # type: ignore[misc,valid-type]  # a class mlx-lm picks at run time
        def __init__(self, args: Any) -> None:
            super().__init__(args)
            if "lm_head" in self:
                del self["lm_head"]

        def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
            weights = {k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v for k, v in weights.items()}
            base = super().sanitize(weights) if hasattr(super(), "sanitize") else weights
            return {k: v for k, v in base.items() if not k.startswith("lm_head.")}

    return Headless, args_class

