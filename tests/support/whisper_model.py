"""A tiny, deterministic, random-weight Whisper for tests, in the layout of a Hugging Face Whisper
repository (openai/whisper-*): an HF config.json (`model_type` "whisper"), `model.*` weights in
model.safetensors, a byte-level BPE tokenizer and the feature extractor's preprocessor_config.json.

Whisper's decoding reads its special tokens by id range (timestamps from `<|0.00|>` on, language
tokens after `<|startoftranscript|>`), so the vocabulary has a real multilingual Whisper's ids:
50257 regular tokens (the 256 byte tokens, then made-up words), `<|endoftext|>` 50257, the start
token 50258, 99 languages, the task tokens, and 1501 timestamps up to `<|30.00|>` (51865 in all).
The model is small (width 32, one layer each side, 32 text positions), so a 30-second window
decodes in well under a second; weights are seeded numpy normals, byte-identical per seed.
Also `tone_wav`: a WAV made in the test (16 kHz mono int16), no recording needed.
"""

from __future__ import annotations

import io
import json
import wave
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

WHISPER_MODEL_ID = "exo-test/tiny-whisper"
_LANGUAGES = ["en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr", "pl", "ca", "nl", "ar", "sv", "it", "id",
              "hi", "fi", "vi", "he", "uk", "el", "ms", "cs", "ro", "da", "hu", "ta", "no", "th", "ur", "hr", "bg", "lt",
              "la", "mi", "ml", "cy", "sk", "te", "fa", "lv", "bn", "sr", "az", "sl", "kn", "et", "mk", "br", "eu", "is",
              "hy", "ne", "mn", "bs", "kk", "sq", "sw", "gl", "mr", "pa", "si", "km", "sn", "yo", "so", "af", "oc", "ka",
              "be", "tg", "sd", "gu", "am", "yi", "lo", "uz", "fo", "ht", "ps", "tk", "nn", "mt", "sa", "lb", "my", "bo",
              "tl", "mg", "as", "tt", "haw", "ln", "ha", "ba", "jw", "su"]
REGULAR_TOKENS = 50257
WIDTH, HEADS, MELS, TEXT_CONTEXT, AUDIO_CONTEXT = 32, 2, 80, 16, 1500


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table: the characters byte-level BPE writes each byte as."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return [chr(code) for _, code in sorted(zip(printable, codes, strict=True))]


def _specials() -> list[str]:
    return (["<|endoftext|>", "<|startoftranscript|>", *[f"<|{code}|>" for code in _LANGUAGES], "<|translate|>",
             "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
            + [f"<|{n * 0.02:.2f}|>" for n in range(1501)])


def _vocabulary() -> dict[str, int]:
    """The byte tokens, then " a", " b", ... " aa", ...: words the random model's tokens decode to."""
    tokens = byte_alphabet()
    letters = "abcdefghijklmnopqrstuvwxyz"
    n = 0
    while len(tokens) < REGULAR_TOKENS:
        word, rest = "", n
        while True:
            word, rest = letters[rest % 26] + word, rest // 26 - 1
            if rest < 0:
                break
        tokens.append("Ġ" + word)
        n += 1
    return {token: index for index, token in enumerate(tokens)}


def _write_tokenizer(path: Path) -> int:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import WhisperFeatureExtractor, WhisperTokenizer

    backend = Tokenizer(models.BPE(vocab=_vocabulary(), merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in _specials()])
    tokenizer = WhisperTokenizer(tokenizer_object=backend, unk_token="<|endoftext|>", bos_token="<|endoftext|>",
                                     eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.save_pretrained(str(path))
    WhisperFeatureExtractor(feature_size=MELS).save_pretrained(str(path))
    return len(tokenizer)


def make_tiny_whisper(path: Path, seed: int = 7) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = _write_tokenizer(path)
    assert vocab_size == 51865, vocab_size  # a multilingual Whisper's: decoding finds its tokens by these ids
    config = {"model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"], "d_model": WIDTH,
              "encoder_layers": 1, "decoder_layers": 1, "num_hidden_layers": 1, "encoder_attention_heads": HEADS,
              "decoder_attention_heads": HEADS, "encoder_ffn_dim": 4 * WIDTH, "decoder_ffn_dim": 4 * WIDTH,
              "num_mel_bins": MELS, "max_source_positions": AUDIO_CONTEXT, "max_target_positions": TEXT_CONTEXT,
              "vocab_size": vocab_size, "decoder_start_token_id": 50258, "eos_token_id": 50257, "pad_token_id": 50257,
              "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(_weights(vocab_size, np.random.default_rng(seed)), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


def _weights(vocab_size: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    def normal(*shape: int, std: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    weights = {"model.encoder.conv1.weight": normal(WIDTH, MELS, 3), "model.encoder.conv1.bias": normal(WIDTH),
               "model.encoder.conv2.weight": normal(WIDTH, WIDTH, 3), "model.encoder.conv2.bias": normal(WIDTH),
               "model.decoder.embed_tokens.weight": normal(vocab_size, WIDTH, std=2.0),
               "model.decoder.embed_positions.weight": normal(TEXT_CONTEXT, WIDTH, std=1.0)}
    for side in ("encoder", "decoder"):
        prefix = f"model.{side}.layers.0."
        attentions = ["self_attn", "encoder_attn"] if side == "decoder" else ["self_attn"]
        for attention in attentions:
            for projection in ("q_proj", "k_proj", "v_proj", "out_proj"):
                weights[f"{prefix}{attention}.{projection}.weight"] = normal(WIDTH, WIDTH)
                if projection != "k_proj":  # Whisper's keys have no bias
                    weights[f"{prefix}{attention}.{projection}.bias"] = normal(WIDTH)
        weights |= {f"{prefix}fc1.weight": normal(4 * WIDTH, WIDTH), f"{prefix}fc1.bias": normal(4 * WIDTH),
                    f"{prefix}fc2.weight": normal(WIDTH, 4 * WIDTH), f"{prefix}fc2.bias": normal(WIDTH)}
        for norm in ("self_attn_layer_norm", "final_layer_norm", *(["encoder_attn_layer_norm"] if side == "decoder" else [])):
            weights |= {f"{prefix}{norm}.weight": 1 + normal(WIDTH, std=0.1), f"{prefix}{norm}.bias": normal(WIDTH)}
        weights |= {f"model.{side}.layer_norm.weight": 1 + normal(WIDTH, std=0.1), f"model.{side}.layer_norm.bias": normal(WIDTH)}
    return weights


def tone_wav(seconds: float, rate: int = 16000, pitch_hz: float = 440.0) -> bytes:
    """A WAV file's bytes: a tone that rises in pitch over `seconds`, 16-bit mono at `rate`."""
    t = np.arange(int(seconds * rate)) / rate
    samples = 0.5 * np.sin(2 * np.pi * pitch_hz * t * (1 + t / max(seconds, 1e-9)))
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes((samples * 32767).astype("<i2").tobytes())
    return out.getvalue()
