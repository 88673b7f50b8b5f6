"""A tiny, deterministic, random-weight cross-encoder (a reranker), in the layout sentence-transformers'
CrossEncoder saves: a BertForSequenceClassification with one label (`bert.`-prefixed encoder and
pooler, `classifier.weight` [1, hidden] and `classifier.bias`), the WordPiece tokenizer of
tests/support/embedding_models.py (pairs as [CLS] query [SEP] document [SEP], token types 0 then 1),
and no modules.json. Byte-identical for the same seed, so a FakeHub can serve it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tests.support.embedding_models import BERT_MAX_CONTEXT, _bert_weights, _write_json, save_bert_tokenizer

# A query and documents whose pairs all fit the tiny context (64 positions) with room; the scores of
# the tiny model's random weights differ between them by far more than float32's noise.
QUERY = "what is the capital of France?"
DOCUMENTS = [
    "Paris is the capital of France.",
    "the quick brown fox jumps over the lazy dog",
    "mlx",
    "hello world, embeddings are vectors and similar sentences get nearby vectors",
    "a fast fox leaps over a sleepy dog",
    "numbers 0 1 2 3 4 5 6 7 8 9 and (punctuation) like ; ' \" - ! are here too",
]
# How CrossEncoder's config names its activation: v4 and later, before v4, or not at all (Sigmoid for one label).
ACTIVATION_KEYS = ("sentence_transformers", "sbert_ce_default_activation_function", None)


def make_tiny_cross_encoder(path: Path, *, seed: int = 1, activation: str = "torch.nn.modules.activation.Sigmoid",
                            activation_key: str | None = "sentence_transformers", hidden: int = 32, layers: int = 2,
                            heads: int = 4, intermediate: int = 64, max_position: int = BERT_MAX_CONTEXT) -> Path:
    """Write the cross-encoder into `path` (created if needed) and return it. `activation_key` None
    leaves the activation unnamed; the sizes' defaults are the tests' model, bench/rerank.py asks for
    MiniLM's (384, 6 layers, 12 heads, 1536) as cross-encoder/ms-marco-MiniLM-L6-v2 has."""
    path = Path(path)
    vocab = save_bert_tokenizer(path, max_position)
    encoder = _bert_weights(vocab, hidden, intermediate, layers, max_position, seed)
    rng = np.random.default_rng(seed + 1000)
    weights = {f"bert.{name}": value for name, value in encoder.items()}
    weights["classifier.weight"] = (rng.standard_normal((1, hidden)) * 0.5).astype(np.float32)
    weights["classifier.bias"] = np.array([0.1], dtype=np.float32)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config: dict[str, object] = {
        "architectures": ["BertForSequenceClassification"], "model_type": "bert", "vocab_size": vocab,
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "intermediate_size": intermediate, "hidden_act": "gelu", "max_position_embeddings": max_position,
        "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0, "torch_dtype": "float32",
        "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
    }
    if activation_key == "sentence_transformers":
        config["sentence_transformers"] = {"activation_fn": activation, "version": "4.1.0"}
    elif activation_key is not None:
        config[activation_key] = activation
    _write_json(path / "config.json", config)
    return path
