"""The tiny test model split the way big Hub models are: several safetensors files and a
`model.safetensors.index.json` naming which file holds each tensor.

One file holds the tensors of no layer (embeddings, final norm, head), then one file per
layer, so a pipeline shard of layers [start, end) needs exactly the first file plus those of
its layers (mlx-lm's rule) and a test can tell which files a node fetched.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from tests.support.tiny_model import Dims, make_tiny_model

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def shard_file(n: int, count: int) -> str:
    return f"model-{n:05d}-of-{count:05d}.safetensors"


def make_sharded_model(path: Path, dims: Dims | None = None) -> Path:
    dims = dims or Dims()
    make_tiny_model(path, dims)
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    count = dims.layers + 1
    groups: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in tensors.items():
        match = _LAYER.search(name)
        file = shard_file(1 if match is None else int(match.group(1)) + 2, count)
        groups.setdefault(file, {})[name] = tensor
    weight_map: dict[str, str] = {}
    for file, group in sorted(groups.items()):
        save_file(group, str(path / file), metadata={"format": "mlx"})
        weight_map |= {name: file for name in group}
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
