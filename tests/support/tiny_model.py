"""A tiny, deterministic llama-architecture model directory for tests.

`make_tiny_model(path)` writes everything `mlx_lm.load(path)` needs, fully offline,
in a few milliseconds and ~0.5 MB. The bytes are identical on every run (fixed seed,
sorted JSON), so the directory can also be served by `FakeHub` as a stable repo.

Design notes (why it looks the way it does):

* Tokenizer: byte-level BPE trained on a small built-in English corpus, so any text
  round-trips exactly through encode/decode.
* The ByteLevel decoder is wrapped in a one-element `Sequence`. mlx-lm inspects
  tokenizer.json and, for a bare `{"type": "ByteLevel"}` decoder, picks its
  `BPEStreamingDetokenizer`, which drops a leading space of the first generated
  token (and mangles byte 0x00), so streamed text != tokenizer.decode(tokens).
  With the wrapper it falls back to `NaiveStreamingDetokenizer`, which re-decodes
  through the real tokenizer, so the concatenated stream equals the full decode.
* `tokenizer_class` is set to the generic "PreTrainedTokenizerFast" (transformers 5
  maps it to TokenizersBackend, which uses tokenizer.json as-is). Declaring
  "LlamaTokenizer(Fast)", as real llama repos do, makes transformers 5 either use a
  hardcoded Metaspace pipeline or, for ByteLevel files, fall back with a warning.
* Weights: random normal from a fixed numpy seed, plus a "bias channel": hidden
  dimension 0 is a constant in every embedding and no layer writes to it, so the
  lm_head can give a large negative logit to special tokens and to byte tokens
  that are not printable ASCII. Hence greedy (and sampled) output is ordinary
  printable text and never hits EOS: generation always runs to `max_tokens`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

TINY_MODEL_ID = "exo-test/tiny-llama"

BOS = "<|begin_of_text|>"
EOS = "<|im_end|>"
IM_START = "<|im_start|>"
PAD = "<|endoftext|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, PAD]  # ids 0..3

# ChatML; bos_token is rendered by the template, so chat prompts are encoded
# without adding special tokens again (mlx-lm checks `prompt.startswith(bos)`).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. Hello there! How are you today?
I am fine, thank you. What is the capital of France? The capital of France is Paris.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.
Every morning he went out in his boat; every evening he came home with fish, bread and news.
"Where have you been?" she asked. "Out on the water," he said, "where the wind is free."
Computers add numbers: 1 + 2 = 3, 10 * 4 = 40, and 99 - 9 = 90. (Simple, isn't it?)
You are a helpful assistant. Please answer the question, and keep it short & clear.
Write a story about a robot who learns to paint. Tell me a joke. Summarize this text.
It's 5 o'clock somewhere -- let's go for a walk, see the trees, the river and the hills.
Machines, people, cities, rivers, mountains, stories, questions, answers, and friends.
"""

_VOCAB_SIZE = 384


@dataclasses.dataclass(frozen=True)
class Dims:
    """The model's shape; the default is the tiny test model, bench/ asks for bigger ones."""

    hidden: int = 64
    intermediate: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    sliding_window: int = 0  # > 0: every other layer, from the first, attends to this many tokens only

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

_SEED = 1234


def _build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # Sequence wrapper: see module docstring (keeps mlx-lm on the exact detokenizer).
    tok.decoder = decoders.Sequence([decoders.ByteLevel()])
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama 3: plain encode() prepends BOS; chat prompts already contain it.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def _printable_ids(tok: Tokenizer) -> np.ndarray:
    """Ids of non-special tokens that decode to printable ASCII (spaces allowed)."""
    ok = []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i], skip_special_tokens=False)
        special = tok.id_to_token(i) in SPECIAL_TOKENS
        ok.append(not special and text != "" and text.isascii() and text.isprintable())
    return np.array(ok)


def _weights(vocab: int, allowed: np.ndarray, d: Dims) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(_SEED)

    def normal(*shape: int, std: float) -> np.ndarray:
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    def linear(out_dim: int, in_dim: int, gain: float = 1.0) -> np.ndarray:
        return normal(out_dim, in_dim, std=gain * in_dim**-0.5)

    embed = normal(vocab, d.hidden, std=1.0)
    embed[:, 0] = 2.0  # constant bias channel (see module docstring)
    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": embed}
    for n in range(d.layers):
        p = f"model.layers.{n}."
        # gain 3 on the residual writes: context (not just the last token) then drives
        # the next token, so greedy output varies instead of locking onto one token.
        o_proj = linear(d.hidden, d.heads * d.head_dim, gain=3.0)
        down = linear(d.hidden, d.intermediate, gain=3.0)
        o_proj[0] = 0.0  # layers never write the bias channel
        down[0] = 0.0
        w |= {
            p + "self_attn.q_proj.weight": linear(d.heads * d.head_dim, d.hidden),
            p + "self_attn.k_proj.weight": linear(d.kv_heads * d.head_dim, d.hidden),
            p + "self_attn.v_proj.weight": linear(d.kv_heads * d.head_dim, d.hidden),
            p + "self_attn.o_proj.weight": o_proj,
            p + "mlp.gate_proj.weight": linear(d.intermediate, d.hidden),
            p + "mlp.up_proj.weight": linear(d.intermediate, d.hidden),
            p + "mlp.down_proj.weight": down,
            p + "input_layernorm.weight": np.ones(d.hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(d.hidden, np.float32),
        }
    w["model.norm.weight"] = np.ones(d.hidden, np.float32)
    lm_head = normal(vocab, d.hidden, std=1.0)
    lm_head[:, 0] = np.where(allowed, 0.0, -1000.0)  # per-token bias via channel 0
    w["lm_head.weight"] = lm_head
    return w


def _write_json(path: pathlib.Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _sliding(d: Dims) -> dict[str, Any]:
    if not d.sliding_window:
        return {}
    kinds = ["sliding_attention" if n % 2 == 0 else "full_attention" for n in range(d.layers)]
    return {"sliding_window": d.sliding_window, "layer_types": kinds}


def make_tiny_model(path: pathlib.Path, d: Dims = Dims()) -> pathlib.Path:
    """Write the tiny model + tokenizer into `path` (created if needed) and return it."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer()
    vocab = tok.get_vocab_size()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}

    # tokenizer.json: `to_str` output is deterministic for a deterministic training run.
    (path / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    _write_json(
        path / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 32768,
            "added_tokens_decoder": {
                str(ids[t]): {
                    "content": t,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for t in SPECIAL_TOKENS
            },
        },
    )
    _write_json(
        path / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    )
    _write_json(
        path / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": d.hidden,
            "intermediate_size": d.intermediate,
            "num_hidden_layers": d.layers,
            "num_attention_heads": d.heads,
            "num_key_value_heads": d.kv_heads,
            "head_dim": d.head_dim,
            "vocab_size": vocab,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "bos_token_id": ids[BOS],
            "eos_token_id": ids[EOS],
            "pad_token_id": ids[PAD],
            "torch_dtype": "float32",
            **_sliding(d),
        },
    )
    _write_json(
        path / "generation_config.json",
        {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD], "do_sample": False},
    )
    weights = _weights(vocab, _printable_ids(tok), d)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "mlx"})
    return path
