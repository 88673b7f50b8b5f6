"""A tiny, deterministic vision-language model for tests: mlx-vlm's Qwen2-VL architecture (a
ViT with 2x2 patch merging, a qwen2 language model with multimodal RoPE), written fully offline.

Qwen2-VL is the shape most users run for vision on Apple silicon (Qwen2/2.5-VL), and mlx-vlm
processes its images itself (numpy; no torch, no Hub). The tokenizer is the tiny llama's byte-level
BPE plus Qwen's vision tokens; images are resized to 56x56 pixels, so each is 4 `<|image_pad|>`
tokens in the prompt. Weights are random from mlx's seeded initialiser, with the tiny llama's
"bias channel" (see tiny_model.py): hidden channel 0 is a constant that no layer (nor the image
merger) writes, so the lm_head keeps special and non-printable tokens out of greedy answers.
The image merger has a large gain, so different images give different greedy answers.
"""

from __future__ import annotations

import hashlib
import io
import json
import pathlib
from typing import Any, cast

import numpy as np

from tests.support.tiny_model import Dims, make_tiny_model

VISION_MODEL_ID = "exo-test/tiny-qwen2-vl"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SIDE = 56  # pixels: a 4x4 grid of 14-pixel patches, merged 2x2 into 4 tokens
_SEED = 4321

# ChatML over content parts, as Qwen2-VL's template renders them.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_vision_model(path: pathlib.Path, d: Dims = Dims()) -> pathlib.Path:
    """Write the tiny Qwen2-VL (weights, config, tokenizer, image processor) into `path`; `d`: the
    language model's shape (bench/ asks for bigger ones)."""
    path = pathlib.Path(path)
    make_tiny_model(path, d)
    half = d.head_dim // 2  # multimodal RoPE splits each head's rotary pairs: time, height, width
    ids = _add_vision_tokens(path)
    text = json.loads((path / "config.json").read_text())
    for key in ("head_dim", "architectures", "model_type"):
        text.pop(key)
    _write_json(path / "config.json", text | {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "vocab_size": max(ids.values()) + 1,
        "rope_scaling": {"type": "mrope", "mrope_section": [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]},
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_config": {"model_type": "qwen2_vl", "depth": 1, "embed_dim": 32, "hidden_size": text["hidden_size"],
                          "num_heads": 2, "mlp_ratio": 2, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "in_channels": 3},
    })
    _write_json(path / "preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": SIDE * SIDE, "max_pixels": SIDE * SIDE,
        "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
    })
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    _write_weights(path)
    return path


def _add_vision_tokens(path: pathlib.Path) -> dict[str, int]:
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    config = json.loads((path / "tokenizer_config.json").read_text())
    ids = {}
    for token in VISION_TOKENS:
        ids[token] = max(int(i) for i in tokenizer["model"]["vocab"].values()) + 1
        tokenizer["model"]["vocab"][token] = ids[token]
        entry = {"content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        tokenizer["added_tokens"].append({"id": ids[token], **entry})
        config["added_tokens_decoder"][str(ids[token])] = entry
    (path / "tokenizer.json").write_text(json.dumps(tokenizer, indent=2, sort_keys=True), encoding="utf-8")
    config["chat_template"] = CHAT_TEMPLATE
    _write_json(path / "tokenizer_config.json", config)
    return ids


def _write_weights(path: pathlib.Path) -> None:
    """mlx-vlm's own model, initialised from a fixed seed, then the bias channel kept constant."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, load_config, update_module_configs
    from safetensors.numpy import load_file, save_file

    llama = load_file(str(path / "model.safetensors"))
    config = load_config(path)
    module, _ = get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, module, config, ["text", "vision"])
    mx.random.seed(_SEED)
    model = module.Model(model_config)
    weights = {name: np.array(value) for name, value in tree_flatten(model.parameters())}
    for name, value in llama.items():  # the language model is the tiny llama (qwen2 adds q/k/v biases: zero)
        weights[f"language_model.{name}"][: value.shape[0]] = value
    for name, value in weights.items():
        if name.startswith("language_model") and name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            value[:] = 0.0
    vocab = llama["lm_head.weight"].shape[0]
    weights["language_model.model.embed_tokens.weight"][vocab:, 0] = 2.0
    weights["language_model.lm_head.weight"][vocab:, 0] = -1000.0  # vision tokens are never sampled
    merger_out, merger_bias = weights["vision_tower.merger.mlp.2.weight"], weights["vision_tower.merger.mlp.2.bias"]
    merger_out *= 8.0  # images move the answer
    merger_out[0], merger_bias[0] = 0.0, 2.0
    (path / "model.safetensors").unlink()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "mlx"})


def png(seed: int, size: int = 64) -> bytes:
    """A deterministic noise image, PNG-encoded."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _write_json(path: pathlib.Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


class VisionReference:
    """mlx-vlm on the same model directory: the text the cluster must reproduce exactly."""

    def __init__(self, model_dir: pathlib.Path, image_dir: pathlib.Path) -> None:
        import mlx_vlm

        # (model, processor): load's declared processor type is not the one generate's annotation asks for
        loaded: tuple[Any, Any] = mlx_vlm.load(str(model_dir))
        self.model, self.processor = loaded
        self._image_dir = image_dir

    def chat(self, text: str, images: list[bytes], max_tokens: int, seed: int | None = None,
             temperature: float = 0.0) -> tuple[str, int]:
        """(mlx-vlm's answer to one user message with these images, its prompt tokens): greedy, or
        sampled after `mx.random.seed(seed)` with mlx-lm's sampler, as mlx-lm users seed."""
        import mlx.core as mx
        import mlx_vlm
        from mlx_lm.sample_utils import make_sampler
        from mlx_vlm.prompt_utils import apply_chat_template

        paths = []
        for image in images:
            path = self._image_dir / f"{hashlib.sha256(image).hexdigest()}.png"
            path.write_bytes(image)
            paths.append(str(path))
        # text in, text out (its declared type also covers messages in, messages out)
        prompt = cast(str, apply_chat_template(self.processor, self.model.config, text, num_images=len(images)))
        if seed is not None:
            mx.random.seed(seed)
        result = mlx_vlm.generate(self.model, self.processor, prompt, image=paths or None, max_tokens=max_tokens,
                                  sampler=make_sampler(temp=temperature))
        return result.text, result.prompt_tokens
