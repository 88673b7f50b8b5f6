"""Reference embeddings for the tiny models of tests/support/embedding_models.py, computed without exo's code.

exo serves encoders through `mlx_embeddings.load` (the forward pass only, `last_hidden_state`) with its own
pooling, and decoders through mlx-lm's qwen3 with right padding and its own pooling. So the references here
come from implementations exo does not use for the result:

* `numpy_bert_embeddings` / `numpy_qwen3_embeddings`: a pure-numpy float64 forward pass written from the
  architectures' definitions (BERT: post-LayerNorm, exact erf GELU; Qwen3: RMSNorm, q/k norms, RoPE, GQA,
  causal attention, SiLU MLP). Each text is tokenized alone with the model's own tokenizer.json (through the
  `tokenizers` library, special tokens as its post-processor adds them), so there is no padding at all; then
  sentence-transformers' recipe: Pooling (mean over all tokens, specials included / first token / last
  token), then Normalize (L2).
* `mlx_embeddings_reference`: mlx-embeddings' own pooled output (`text_embeds`). Its models hardcode the
  pooling: bert mean-pools, qwen3 takes the last token; both L2-normalize. So it is a reference only for a
  mean-pooled BERT and for Qwen3 (it refuses anything else). It runs one text at a time: its qwen3 model
  gives NaN rows for a left-padded batch (the tiny Qwen3's tokenizer pads left, like the real one).

`agreement()` checks that the two references agree (run this file: `uv run python -m tests.support.embedding_reference`).
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from safetensors.numpy import load_file
from tokenizers import Tokenizer

F64 = npt.NDArray[np.float64]
F32 = npt.NDArray[np.float32]

_erf = np.vectorize(math.erf, otypes=[np.float64])
# mlx-embeddings' hardcoded pooling per model_type (see the module docstring).
_MLX_EMBEDDINGS_POOLING = {"bert": "mean", "qwen3": "lasttoken"}


def _config(path: Path) -> dict[str, Any]:
    return dict(json.loads((Path(path) / "config.json").read_text()))


def _weights(path: Path, prefix: str) -> dict[str, F64]:
    """All tensors as float64, with an optional checkpoint prefix ("bert.", "model.") removed."""
    return {k.removeprefix(prefix): v.astype(np.float64) for k, v in load_file(str(Path(path) / "model.safetensors")).items()}


def _token_ids(path: Path, text: str, limit: int) -> npt.NDArray[np.int64]:
    ids = Tokenizer.from_file(str(Path(path) / "tokenizer.json")).encode(text).ids
    if len(ids) > limit:  # the reference does not truncate: a test relying on truncation must say how
        raise ValueError(f"{len(ids)} tokens > the model's {limit} positions: {text[:40]!r}")
    return np.array(ids, dtype=np.int64)


def _softmax(x: F64) -> F64:
    e = np.exp(x - x.max(-1, keepdims=True))
    return np.asarray(e / e.sum(-1, keepdims=True))


def _layer_norm(x: F64, w: F64, b: F64, eps: float) -> F64:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return np.asarray((x - mean) / np.sqrt(var + eps) * w + b)


def _rms_norm(x: F64, w: F64, eps: float) -> F64:
    return np.asarray(x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w)


def _pool(hidden: F64, pooling: str) -> F64:
    """sentence-transformers' Pooling for one unpadded sequence (L, H): every position is a real token."""
    if pooling == "mean":
        return np.asarray(hidden.mean(0))
    if pooling == "cls":
        return np.asarray(hidden[0])
    if pooling == "lasttoken":
        return np.asarray(hidden[-1])
    raise ValueError(f"unknown pooling {pooling!r}")


def _normalized(rows: list[F64]) -> F32:
    """sentence-transformers' Normalize: L2 per row, then float32 as the served vectors are."""
    v = np.stack(rows)
    return np.asarray(v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12), dtype=np.float32)


def _bert_layer(x: F64, w: dict[str, F64], p: str, heads: int, eps: float) -> F64:
    seq, hidden = x.shape
    hd = hidden // heads

    def lin(v: F64, name: str) -> F64:
        return np.asarray(v @ w[p + name + ".weight"].T + w[p + name + ".bias"])

    q, k, v = (lin(x, f"attention.self.{n}").reshape(seq, heads, hd).transpose(1, 0, 2) for n in ("query", "key", "value"))
    a = (_softmax(q @ k.transpose(0, 2, 1) / math.sqrt(hd)) @ v).transpose(1, 0, 2).reshape(seq, hidden)
    ln1 = p + "attention.output.LayerNorm"
    x = _layer_norm(lin(a, "attention.output.dense") + x, w[ln1 + ".weight"], w[ln1 + ".bias"], eps)
    h = lin(x, "intermediate.dense")
    h = 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0)))  # "gelu" in HF BERT configs is the exact erf form
    return _layer_norm(lin(h, "output.dense") + x, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)


def _bert_hidden(path: Path, ids: npt.NDArray[np.int64]) -> F64:
    """last_hidden_state (L, H) of one unpadded sequence (token type 0, positions 0..L-1)."""
    c, w = _config(path), _weights(path, "bert.")
    eps = float(c.get("layer_norm_eps", 1e-12))
    x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][: len(ids)]
    x = x + w["embeddings.token_type_embeddings.weight"][0]
    x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    for i in range(int(c["num_hidden_layers"])):
        x = _bert_layer(x, w, f"encoder.layer.{i}.", int(c["num_attention_heads"]), eps)
    return x


def numpy_bert_embeddings(path: Path, texts: Sequence[str], pooling: str = "mean", normalize: bool = True) -> F32:
    """(len(texts), hidden) float32 vectors: numpy BERT forward, `pooling` ("mean", "cls", "lasttoken"), then L2
    unless `normalize` is False (a model without a Normalize module)."""
    limit = int(_config(path)["max_position_embeddings"])
    rows = [_pool(_bert_hidden(path, _token_ids(path, t, limit)), pooling) for t in texts]
    return _normalized(rows) if normalize else np.stack(rows).astype(np.float32)


def _rope(x: F64, theta: float) -> F64:
    """HF "rotate_half" RoPE on (heads, L, head_dim): pairs dimension i with i + head_dim/2 (mlx traditional=False)."""
    hd, seq = x.shape[-1], x.shape[-2]
    ang = np.arange(seq)[:, None] * (1.0 / theta ** (np.arange(0, hd, 2) / hd))[None]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _qwen3_attention(h: F64, w: dict[str, F64], p: str, c: dict[str, Any]) -> F64:
    seq = h.shape[0]
    nh, nkv, eps = int(c["num_attention_heads"]), int(c["num_key_value_heads"]), float(c["rms_norm_eps"])
    hd = int(c.get("head_dim") or int(c["hidden_size"]) // nh)
    theta = float(c.get("rope_theta", 1e6))

    def heads(name: str, n: int) -> F64:
        return np.asarray((h @ w[p + f"self_attn.{name}_proj.weight"].T).reshape(seq, n, hd).transpose(1, 0, 2))

    q = _rope(_rms_norm(heads("q", nh), w[p + "self_attn.q_norm.weight"], eps), theta)  # q/k norm per head, before RoPE
    k = _rope(_rms_norm(heads("k", nkv), w[p + "self_attn.k_norm.weight"], eps), theta)
    k, v = np.repeat(k, nh // nkv, 0), np.repeat(heads("v", nkv), nh // nkv, 0)  # GQA: each kv head serves nh/nkv query heads
    causal = np.triu(np.full((seq, seq), -np.inf), 1)
    a = (_softmax(q @ k.transpose(0, 2, 1) / math.sqrt(hd) + causal) @ v).transpose(1, 0, 2).reshape(seq, nh * hd)
    return np.asarray(a @ w[p + "self_attn.o_proj.weight"].T)


def _qwen3_hidden(path: Path, ids: npt.NDArray[np.int64]) -> F64:
    """Final-norm hidden states (L, H) of one unpadded sequence (no lm_head)."""
    c, w = _config(path), _weights(path, "model.")
    eps = float(c["rms_norm_eps"])
    x = w["embed_tokens.weight"][ids]
    for i in range(int(c["num_hidden_layers"])):
        p = f"layers.{i}."
        x = x + _qwen3_attention(_rms_norm(x, w[p + "input_layernorm.weight"], eps), w, p, c)
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return _rms_norm(x, w["norm.weight"], eps)


def numpy_qwen3_embeddings(path: Path, texts: Sequence[str]) -> F32:
    """(len(texts), hidden) float32 unit vectors: numpy Qwen3 forward, last token (the appended <|endoftext|>), L2."""
    limit = int(_config(path)["max_position_embeddings"])
    return _normalized([_pool(_qwen3_hidden(path, _token_ids(path, t, limit)), "lasttoken") for t in texts])


def _declared_pooling(path: Path) -> str:
    """The pooling mode in 1_Pooling/config.json, legacy (`pooling_mode_*` booleans) or newer (`pooling_mode`) format."""
    cfg = json.loads((Path(path) / "1_Pooling" / "config.json").read_text())
    if isinstance(cfg.get("pooling_mode"), str):
        return str(cfg["pooling_mode"])
    legacy = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "lasttoken"}
    on = [mode for key, mode in legacy.items() if cfg.get(key)]
    return on[0] if len(on) == 1 else f"unsupported {sorted(k for k, v in cfg.items() if v is True)}"


def mlx_embeddings_reference(path: Path, texts: Sequence[str]) -> F32:
    """mlx-embeddings' own `text_embeds`, one text at a time; only where its hardcoded pooling is the model's."""
    import mlx.core as mx  # late: importing this module needs neither mlx nor mlx-embeddings
    import mlx_embeddings

    kind, declared = str(_config(path)["model_type"]), _declared_pooling(path)
    if _MLX_EMBEDDINGS_POOLING.get(kind) != declared:
        raise ValueError(f"mlx-embeddings pools {kind} as {_MLX_EMBEDDINGS_POOLING.get(kind)}, the model declares {declared}")
    model, tokenizer = mlx_embeddings.load(str(path))
    rows = []
    for text in texts:
        out = mlx_embeddings.generate(model, tokenizer, texts=[text])  # a one-text list: tokenized with specials, no padding
        rows.append(np.array(out.text_embeds.astype(mx.float32))[0])
    return np.stack(rows).astype(np.float32)


def _max_abs(a: F32, b: F32) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


def agreement(texts: Sequence[str] | None = None) -> dict[str, float]:
    """Max abs difference, numpy vs mlx-embeddings, on freshly made tiny models (both should be ~1e-7, well under 1e-5)."""
    from tests.support.embedding_models import TEXTS, make_tiny_bert, make_tiny_qwen3_embedding

    texts = list(texts or TEXTS)
    cases: dict[str, tuple[Callable[[Path], Path], Callable[[Path, Sequence[str]], F32]]] = {
        "bert_mean": (make_tiny_bert, numpy_bert_embeddings),
        "qwen3": (make_tiny_qwen3_embedding, numpy_qwen3_embeddings),
    }
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (make, numpy_ref) in cases.items():
            path = make(Path(tmp) / name)
            result[name] = _max_abs(numpy_ref(path, texts), mlx_embeddings_reference(path, texts))
    return result


if __name__ == "__main__":
    print(agreement())
