"""A tiny, deterministic, random-weight Soprano (mlx-audio's text-to-speech family `soprano`) for
tests, in the layout mlx-audio loads: config.json (`model_type` "soprano"), model.safetensors with
the Qwen3 language model and the Vocos decoder in mlx's layout, and a byte-level BPE tokenizer with
Soprano's markers `[STOP]`, `[TEXT]` and `[START]`.

Soprano rather than another family: it is one folder (no separate codec model to fetch: its decoder
turns the language model's hidden states into audio), it needs no phonemizer (Kokoro needs misaki,
others espeak or spacy), and with a seed its sampling is reproducible.

The language model is small (width 32, one layer); the decoder has the size mlx-audio gives every
Soprano not named 1.1 (8 ConvNeXt layers of 512, 13.7 M weights), stored as float16 (mlx-audio
casts it to float32 at load). So that a random model stops talking, every token embedding carries a
constant in dimension 0, which the final norm keeps, and only `[STOP]`'s output row reads it: each
step stops with a steady chance, a sentence lasts some ten tokens (0.06 s of audio each).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tests.support.whisper_model import byte_alphabet

SPEECH_MODEL_ID = "exo-test/tiny-soprano"
WIDTH, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP = 32, 1, 2, 1, 16, 64
DECODER_DIM, DECODER_MLP, DECODER_LAYERS, N_FFT, INPUT_KERNEL = 512, 1536, 8, 2048, 3
MARKERS = ["[STOP]", "[TEXT]", "[START]"]
CARRIER, STOP_GAIN = 8.0, 0.26  # dimension 0 of every embedding, and how much [STOP]'s logit reads it


def _write_tokenizer(path: Path) -> int:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab={token: n for n, token in enumerate(byte_alphabet())}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(marker, special=True, normalized=False) for marker in MARKERS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[STOP]")  # Soprano stops at its pad token
    tokenizer.save_pretrained(str(path))
    return len(tokenizer)


def make_tiny_soprano(path: Path, seed: int = 11) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = _write_tokenizer(path)
    config = {"model_type": "soprano", "architectures": ["Qwen3ForCausalLM"], "hidden_size": WIDTH,
              "num_hidden_layers": LAYERS, "intermediate_size": MLP, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "vocab_size": vocab_size,
              "max_position_embeddings": 1024, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "sample_rate": 32000, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    rng = np.random.default_rng(seed)
    weights = _language_model(vocab_size, rng) | _decoder(rng)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "mlx"})
    return path


def _normal(rng: np.random.Generator, *shape: int, std: float, dtype: type = np.float32) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * std).astype(dtype)


def _language_model(vocab_size: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    embeddings = _normal(rng, vocab_size, WIDTH, std=1.0)
    embeddings[:, 0] = CARRIER
    head = _normal(rng, vocab_size, WIDTH, std=0.1)
    head[:, 0] = 0.0
    head[MARKERS.index("[STOP]") + 256, 0] = STOP_GAIN  # the markers follow the 256 byte tokens
    prefix = "language_model.layers.0."
    weights = {"language_model.embed_tokens.weight": embeddings, "language_model.lm_head.weight": head,
               "language_model.norm.weight": np.ones(WIDTH, np.float32)}
    shapes = {"self_attn.q_proj": (HEADS * HEAD_DIM, WIDTH), "self_attn.k_proj": (KV_HEADS * HEAD_DIM, WIDTH),
              "self_attn.v_proj": (KV_HEADS * HEAD_DIM, WIDTH), "self_attn.o_proj": (WIDTH, HEADS * HEAD_DIM),
              "mlp.gate_proj": (MLP, WIDTH), "mlp.up_proj": (MLP, WIDTH), "mlp.down_proj": (WIDTH, MLP)}
    weights |= {f"{prefix}{name}.weight": _normal(rng, *shape, std=0.02) for name, shape in shapes.items()}
    for norm, size in (("self_attn.q_norm", HEAD_DIM), ("self_attn.k_norm", HEAD_DIM), ("input_layernorm", WIDTH),
                       ("post_attention_layernorm", WIDTH)):
        weights[f"{prefix}{norm}.weight"] = 1 + _normal(rng, size, std=0.1)
    return weights


def _decoder(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Vocos in mlx's layout (a convolution's weight is out, kernel, in), float16."""
    def normal(*shape: int, std: float) -> np.ndarray:
        return _normal(rng, *shape, std=std, dtype=np.float16)

    def norm(prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}.weight": 1 + normal(DECODER_DIM, std=0.1), f"{prefix}.bias": normal(DECODER_DIM, std=0.1)}

    weights = {"decoder.decoder.embed.weight": normal(DECODER_DIM, INPUT_KERNEL, WIDTH, std=0.05),
               "decoder.decoder.embed.bias": normal(DECODER_DIM, std=0.1), **norm("decoder.decoder.norm"),
               **norm("decoder.decoder.final_layer_norm"),
               "decoder.head.out.weight": normal(N_FFT + 2, DECODER_DIM, std=0.02),
               "decoder.head.out.bias": normal(N_FFT + 2, std=0.1)}
    for n in range(DECODER_LAYERS):
        prefix = f"decoder.decoder.convnext.{n}"
        weights |= {f"{prefix}.dwconv.weight": normal(DECODER_DIM, 3, 1, std=0.3),
                    f"{prefix}.dwconv.bias": normal(DECODER_DIM, std=0.1), **norm(f"{prefix}.norm"),
                    f"{prefix}.pwconv1.weight": normal(DECODER_MLP, DECODER_DIM, std=0.04),
                    f"{prefix}.pwconv1.bias": normal(DECODER_MLP, std=0.1),
                    f"{prefix}.pwconv2.weight": normal(DECODER_DIM, DECODER_MLP, std=0.025),
                    f"{prefix}.pwconv2.bias": normal(DECODER_DIM, std=0.1),
                    f"{prefix}.gamma": np.full(DECODER_DIM, 1 / DECODER_LAYERS, np.float16)}
    return weights
