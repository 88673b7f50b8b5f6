"""A cross-encoder (a reranker) on one node: mlx-embeddings' BERT encodes each [CLS] query [SEP]
document [SEP] pair (token types 0, then 1) and pools its [CLS] state (dense, tanh: BERT's pooler);
exo's head turns that into one relevance score: the classifier's single logit, then the activation
the model's files name (exo/core/embedding_files.py), as sentence-transformers' CrossEncoder.predict.

Checkpoints saved from BertForSequenceClassification prefix the encoder's weights with `bert.`;
mlx-embeddings' BERT has none, and no classifier: both are added here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from exo.core.types import ScoreActivation


def load_cross_encoder(model_path: str) -> nn.Module:
    from mlx_embeddings.utils import load_model  # imports mlx-vlm and transformers' processors: only where it serves

    model: nn.Module = load_model(Path(model_path), get_model_classes=_with_classifier)
    return model


def relevance(model: nn.Module, ids: mx.array, token_types: mx.array, mask: mx.array,
              activation: ScoreActivation) -> mx.array:
    """One score per row of right-padded pairs: the classifier on the pooled [CLS] state, then the activation."""
    pooled = model(ids, token_type_ids=token_types, attention_mask=mask).pooler_output.astype(mx.float32)
    logits = model.classifier(pooled)[:, 0]
    return mx.sigmoid(logits) if activation == "sigmoid" else logits


def _with_classifier(config: dict[str, Any]) -> tuple[type[nn.Module], type[Any], Any, Any]:
    """mlx-embeddings' classes for the encoder, with a one-label classifier and without the `bert.` prefix."""
    from mlx_embeddings.utils import _get_classes

    model_class, args_class, text_config, vision_config = _get_classes(config)

    class CrossEncoder(model_class):  # type: ignore[misc,valid-type]  # a class mlx-embeddings picks at run time
        def __init__(self, args: Any) -> None:
            super().__init__(args)
            self.classifier = nn.Linear(args.hidden_size, 1)

        def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
            unprefixed = {k.removeprefix("bert."): v for k, v in weights.items()}
            return super().sanitize(unprefixed) if hasattr(super(), "sanitize") else unprefixed

    return CrossEncoder, args_class, text_config, vision_config
