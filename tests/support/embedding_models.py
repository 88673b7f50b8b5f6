"""Tiny, deterministic, random-weight embedding models, written in the layout real Hub repos have.

Tests compare the vectors exo serves against references computed without exo's code
(tests/support/embedding_reference.py); these models are what both sides run. Each is a few
hundred KB, made offline in well under a second, and byte-identical for the same seed (seeded
numpy weights, deterministic tokenizer training, sorted JSON), so a FakeHub can serve it too.

* `make_tiny_bert`: a BERT encoder (like all-MiniLM / bge): WordPiece tokenizer adding
  `[CLS] ... [SEP]`, weights without a `bert.` prefix, sentence-transformers files for
  Pooling (mean, cls or lasttoken; legacy or the newer config format) then Normalize.
* `make_tiny_qwen3_embedding`: a Qwen3-Embedding-style decoder: weights without the `model.`
  prefix and with no lm_head (as Qwen3-Embedding ships them), a ByteLevel BPE tokenizer whose
  post-processor appends `<|endoftext|>` (the token whose last hidden state is the embedding),
  pad token `<|endoftext|>`, `padding_side` "left" (as the real tokenizer_config says), and
  sentence-transformers files for last-token pooling then Normalize, plus its query prompt.

Weights are normal with std 0.2 and norm gains near 1, so activations stay O(1): outputs are
well-conditioned and float32 implementations agree to ~1e-6.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BERT_MAX_CONTEXT = 64  # max_position_embeddings of the tiny BERT: longer inputs must be truncated
QWEN3_MAX_CONTEXT = 128  # max_position_embeddings of the tiny Qwen3 embedding model

# Varied test inputs: a subword split ("quick ##ly"), an accent (BERT strips it, "c ##a ##f ##e"; ByteLevel
# keeps its two bytes), and a last one several times longer than the others, so batches need padding, that still
# fits both contexts with its special tokens. Tokens with specials: BERT 4, 16, 3, 35; Qwen3 9, 32, 4, 100.
TEXTS = [
    "hello world",
    "What is the capital of France? Paris, café!",
    "mlx",
    "Similar sentences, like 'the quick brown fox quickly jumps over the lazy dog' and 'a fast fox leaps over a sleepy dog', "
    "get nearby vectors.",
]

QWEN3_QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"

# Tokenizer training text: covers TEXTS' words so they tokenize into few pieces, plus other words.
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a fast fox leaps over a sleepy dog",
    "hello world, embeddings are vectors and similar sentences get nearby vectors",
    "embeddings turn text into vectors: what is the capital of France? Paris is.",
    "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: what is mlx?",
    "numbers 0 1 2 3 4 5 6 7 8 9 and (punctuation) like ; ' \" - ! are here too",
] * 10

F32 = npt.NDArray[np.float32]

_BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_POOLING_MODES = ("mean", "cls", "lasttoken")


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _sampler(seed: int) -> tuple[Callable[..., F32], Callable[[int], F32]]:
    """(normal std 0.2 of a shape, norm gain in [0.5, 1.5) of a length), both from one seeded stream."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> F32:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    def gain(n: int) -> F32:
        return rng.uniform(0.5, 1.5, n).astype(np.float32)

    return normal, gain


def _pooling_config(dim: int, pooling: str, pooling_format: str) -> dict[str, object]:
    if pooling not in _POOLING_MODES:
        raise ValueError(f"pooling must be one of {_POOLING_MODES}, not {pooling!r}")
    if pooling_format == "v6":
        return {"embedding_dimension": dim, "pooling_mode": pooling, "include_prompt": True}
    if pooling_format != "legacy":
        raise ValueError(f"pooling_format must be 'legacy' or 'v6', not {pooling_format!r}")
    legacy: dict[str, object] = {
        "word_embedding_dimension": dim,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": pooling == "lasttoken",
        "include_prompt": True,
    }
    return legacy


def _write_sentence_transformers(path: Path, dim: int, pooling: str, pooling_format: str, max_seq: int,
                                 prompts: dict[str, str], normalize: bool = True) -> None:
    """modules.json: Transformer (the repo root), then Pooling, then Normalize (an empty folder, as on the Hub)
    unless `normalize` is False (models whose vectors keep their length)."""
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), *([("2_Normalize", "Normalize")] if normalize else [])]
    modules = [{"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{t}"}
               for i, (p, t) in enumerate(kinds)]
    _write_json(path / "modules.json", modules)
    (path / "1_Pooling").mkdir(exist_ok=True)
    if normalize:
        (path / "2_Normalize").mkdir(exist_ok=True)
    _write_json(path / "1_Pooling" / "config.json", _pooling_config(dim, pooling, pooling_format))
    _write_json(path / "sentence_bert_config.json", {"max_seq_length": max_seq, "do_lower_case": False})
    _write_json(path / "config_sentence_transformers.json",
                {"prompts": prompts, "default_prompt_name": None, "similarity_fn_name": "cosine"})


def _bert_vocab() -> dict[str, int]:
    """Specials, the corpus' characters (alone and as "##" pieces), a few suffixes, then its words.

    Built here rather than by tokenizers' WordPieceTrainer: that one orders the "##" alphabet by
    hash-map iteration, so its vocabulary (and which merges win ties) changes between processes.
    """
    normalizer, pre = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    words = sorted({w for line in _CORPUS for w, _ in pre.pre_tokenize_str(normalizer.normalize_str(line))})
    chars = sorted({c for w in words for c in w})
    tokens = [*_BERT_SPECIALS, *chars, *(f"##{c}" for c in chars), "##s", "##ly", "##ing", *(w for w in words if len(w) > 1)]
    return {t: i for i, t in enumerate(dict.fromkeys(tokens))}


def _bert_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(_bert_vocab(), unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return tok


def _bert_weights(vocab: int, hidden: int, inter: int, layers: int, positions: int, seed: int) -> dict[str, F32]:
    normal, gain = _sampler(seed)
    w = {
        "embeddings.word_embeddings.weight": normal(vocab, hidden),
        "embeddings.position_embeddings.weight": normal(positions, hidden),
        "embeddings.token_type_embeddings.weight": normal(2, hidden),
        "embeddings.LayerNorm.weight": gain(hidden),
        "embeddings.LayerNorm.bias": normal(hidden),
        "pooler.dense.weight": normal(hidden, hidden),
        "pooler.dense.bias": normal(hidden),
    }
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for n in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            w[p + n + ".weight"], w[p + n + ".bias"] = normal(hidden, hidden), normal(hidden)
        w[p + "intermediate.dense.weight"], w[p + "intermediate.dense.bias"] = normal(inter, hidden), normal(inter)
        w[p + "output.dense.weight"], w[p + "output.dense.bias"] = normal(hidden, inter), normal(hidden)
        for n in ("attention.output.LayerNorm", "output.LayerNorm"):
            w[p + n + ".weight"], w[p + n + ".bias"] = gain(hidden), normal(hidden)
    return w


def save_bert_tokenizer(path: Path, max_position: int) -> int:
    """The tiny BERT tokenizer saved into `path` (created if needed); returns its vocabulary size."""
    path.mkdir(parents=True, exist_ok=True)
    tok = _bert_tokenizer()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_max_length=max_position,
    ).save_pretrained(str(path))
    return int(tok.get_vocab_size())


def make_tiny_bert(path: Path, pooling: str = "mean", *, pooling_format: str = "legacy", seed: int = 0, hidden: int = 32,
                   layers: int = 2, heads: int = 4, intermediate: int = 64, max_position: int = BERT_MAX_CONTEXT,
                   normalize: bool = True) -> Path:
    """Write a tiny BERT sentence-transformers repo into `path` (created if needed) and return it.

    `pooling` is "mean", "cls" or "lasttoken"; `pooling_format` "legacy" (`pooling_mode_*_tokens`
    booleans) or "v6" (`{"pooling_mode": ...}`); `normalize` False leaves out the Normalize module. The
    weights depend on `seed` (and the sizes) only, so models that differ in pooling share them. The sizes'
    defaults are the tiny model the tests use (byte-identical whatever else changes here);
    bench/embeddings.py asks for MiniLM's (384, 6 layers, 12 heads, 1536), same tokenizer.
    """
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    path = Path(path)
    vocab = save_bert_tokenizer(path, max_position)
    weights = _bert_weights(vocab, hidden, intermediate, layers, max_position, seed)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    _write_json(path / "config.json", {
        "architectures": ["BertModel"], "model_type": "bert", "vocab_size": vocab, "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "intermediate_size": intermediate, "hidden_act": "gelu",
        "max_position_embeddings": max_position, "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0,
        "torch_dtype": "float32",
    })
    _write_sentence_transformers(path, hidden, pooling, pooling_format, max_position, {}, normalize)
    return path


def _qwen3_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=_QWEN3_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_CORPUS, trainer)
    eot = tok.token_to_id("<|endoftext|>")
    # As Qwen3-Embedding's tokenizer.json: every encoded text ends with <|endoftext|>.
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1", special_tokens=[("<|endoftext|>", eot)]
    )
    return tok


def _qwen3_weights(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int, hd: int, seed: int) -> dict[str, F32]:
    normal, gain = _sampler(seed)
    w = {"embed_tokens.weight": normal(vocab, hidden), "norm.weight": gain(hidden)}  # no "model." prefix, no lm_head
    for i in range(layers):
        p = f"layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": normal(heads * hd, hidden), p + "self_attn.k_proj.weight": normal(kv * hd, hidden),
            p + "self_attn.v_proj.weight": normal(kv * hd, hidden), p + "self_attn.o_proj.weight": normal(hidden, heads * hd),
            p + "self_attn.q_norm.weight": gain(hd), p + "self_attn.k_norm.weight": gain(hd),
            p + "mlp.gate_proj.weight": normal(inter, hidden), p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
            p + "input_layernorm.weight": gain(hidden), p + "post_attention_layernorm.weight": gain(hidden),
        }
    return w


def make_tiny_qwen3_embedding(path: Path, *, seed: int = 0) -> Path:
    """Write a tiny Qwen3-Embedding-style repo into `path` (created if needed) and return it."""
    hidden, inter, layers, heads, kv, hd = 64, 128, 2, 4, 2, 16
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _qwen3_tokenizer()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left",
        model_max_length=QWEN3_MAX_CONTEXT,
    ).save_pretrained(str(path))
    vocab, eot = tok.get_vocab_size(), tok.token_to_id("<|endoftext|>")
    weights = _qwen3_weights(vocab, hidden, inter, layers, heads, kv, hd, seed)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    _write_json(path / "config.json", {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": hd, "max_position_embeddings": QWEN3_MAX_CONTEXT, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "bos_token_id": eot, "eos_token_id": eot,
        "pad_token_id": eot, "torch_dtype": "float32",
    })
    prompts = {"query": QWEN3_QUERY_PROMPT, "document": ""}  # as Qwen3-Embedding's config_sentence_transformers.json
    _write_sentence_transformers(path, hidden, "lasttoken", "legacy", QWEN3_MAX_CONTEXT, prompts)
    return path
