"""Reference relevance scores of a cross-encoder, computed without exo's code (or mlx).

What sentence-transformers' `CrossEncoder.predict` computes, written from transformers'
BertForSequenceClassification in float64 numpy: embeddings (word + position + token type, then
LayerNorm), the encoder layers (tests/support/embedding_reference.py's BERT layer), the pooler
(dense and tanh on the [CLS] state), the classifier's one logit, then CrossEncoder's default
activation: the one the config names (`sentence_transformers.activation_fn`, or before v4
`sbert_ce_default_activation_function`), else Sigmoid for one label. Each pair is tokenized alone
with the model's tokenizer.json through the `tokenizers` library ([CLS] query [SEP] document [SEP],
token types 0 then 1 as its post-processor says), so there is no padding.

sentence-transformers itself is not the reference: it needs torch, whose x86_64 wheels pull
gigabytes of CUDA libraries into the environment for one test.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from tests.support.embedding_reference import _bert_layer, _config, _layer_norm, _weights

F64 = npt.NDArray[np.float64]


def _pair(path: Path, query: str, document: str) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    encoded = Tokenizer.from_file(str(Path(path) / "tokenizer.json")).encode(query, document)
    return np.array(encoded.ids, dtype=np.int64), np.array(encoded.type_ids, dtype=np.int64)


def _logit(path: Path, ids: npt.NDArray[np.int64], types: npt.NDArray[np.int64]) -> float:
    c, w = _config(path), _weights(path, "bert.")
    if len(ids) > int(c["max_position_embeddings"]):
        raise ValueError(f"{len(ids)} tokens > the model's {c['max_position_embeddings']} positions")
    eps = float(c.get("layer_norm_eps", 1e-12))
    x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][: len(ids)]
         + w["embeddings.token_type_embeddings.weight"][types])
    x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    for i in range(int(c["num_hidden_layers"])):
        x = _bert_layer(x, w, f"encoder.layer.{i}.", int(c["num_attention_heads"]), eps)
    pooled = np.tanh(x[0] @ w["pooler.dense.weight"].T + w["pooler.dense.bias"])
    return float((pooled @ w["classifier.weight"].T + w["classifier.bias"])[0])


def _activation(path: Path) -> str:
    c = _config(path)
    named = (c.get("sentence_transformers") or {}).get("activation_fn") or c.get("sbert_ce_default_activation_function")
    return str(named).rsplit(".", 1)[-1] if named else "Sigmoid"


def numpy_cross_encoder_scores(path: Path, query: str, documents: Sequence[str]) -> F64:
    """One score per document, as CrossEncoder.predict([(query, d) for d in documents]) gives them."""
    logits = np.array([_logit(path, *_pair(path, query, d)) for d in documents])
    activation = _activation(path)
    if activation == "Sigmoid":
        return np.asarray(1.0 / (1.0 + np.exp(-logits)))
    if activation == "Identity":
        return logits
    raise ValueError(f"no reference for activation {activation!r}")


def pair_tokens(path: Path, query: str, documents: Sequence[str]) -> int:
    """The pairs' tokens, special tokens included: what a rerank's usage counts."""
    return sum(len(_pair(path, query, d)[0]) for d in documents)
