"""A LoRA adapter for a test model, in mlx-lm's format (`adapter_config.json` +
`adapters.safetensors`), as `mlx_lm.lora` saves one: random, deterministic, and strong enough
that greedy text with it differs from the base model's."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load_model


def make_adapter(model_dir: Path, out: Path, *, seed: int = 7, rank: int = 4, scale: float = 20.0,
                 num_layers: int = -1, dora: bool = False) -> Path:
    """-1 layers: every layer of the model (mlx-lm takes the last `num_layers`)."""
    model, _ = load_model(Path(model_dir))
    layers = len(model.layers) if num_layers == -1 else num_layers
    parameters = {"rank": rank, "scale": scale, "dropout": 0.0}
    mx.random.seed(seed)
    linear_to_lora_layers(model, layers, parameters, use_dora=dora)
    for _, module in model.named_modules():
        if isinstance(module, LoRALinear):  # mlx-lm starts lora_b at zero: an untrained adapter changes nothing
            module.lora_b = mx.random.normal(module.lora_b.shape) * 0.05
    leaves = ("lora_a", "lora_b", "m")
    weights = {name: value for name, value in tree_flatten(model.parameters()) if name.rsplit(".", 1)[-1] in leaves}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"model": str(model_dir), "fine_tune_type": "dora" if dora else "lora", "num_layers": layers,
              "lora_parameters": parameters}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
