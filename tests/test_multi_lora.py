"""Many LoRA adapters on one loaded base (exo/runner/multi_lora.py): one batch whose rows use three
different adapters (different ranks and targets) and the bare base gives, row by row, mlx-lm's
greedy tokens and logits with that adapter alone loaded (`mlx_lm.load(model, adapter_path=...)`),
on a float32 and a 4-bit base, with either strategy; adapters added and removed without reloading
the base; the converted model's memory is the base's plus the adapters'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from exo.runner.multi_lora import MultiLoRA, MultiLoRALinear, read_config
from tests.support.adapters import make_adapter
from tests.support.qwen_model import make_4bit
from tests.support.tiny_model import make_tiny_model

STEPS = 16
TEXTS = ["The quick brown fox jumps over", "Once upon a time, in a small village",
         "What is the capital of France?", "Write a story about a robot who"]
ROWS = ["every", None, "last", "qv"]  # row i's adapter; None: the bare base


def _keyed(source: Path, out: Path, keys: list[str]) -> Path:
    """`source`'s adapter cut down to the linears `keys` names, its config saying so (lora_parameters.keys)."""
    config = json.loads((source / "adapter_config.json").read_text())
    config["lora_parameters"]["keys"] = keys
    weights = mx.load(str(source / "adapters.safetensors"))
    kept = {name: w for name, w in weights.items() if any(f".{key}." in name for key in keys)}
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), kept)
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("multi_lora")
    model = make_tiny_model(root / "tiny")
    return {"model": model, "model-4bit": make_4bit(model, root / "tiny-4bit"),
            "every": make_adapter(model, root / "every", seed=7, rank=4),  # every linear of both blocks
            "last": make_adapter(model, root / "last", seed=11, rank=8, num_layers=1),  # the last block only
            "qv": _keyed(make_adapter(model, root / "qv-all", seed=13, rank=2), root / "qv",
                         ["self_attn.q_proj", "self_attn.v_proj"]),
            "late": make_adapter(model, root / "late", seed=17, rank=4, scale=10.0)}


@pytest.fixture(scope="module")
def prompts(files) -> list[list[int]]:
    _, tokenizer = mlx_lm.load(str(files["model"]))
    encoded = [tokenizer.encode(text) for text in TEXTS]
    shortest = min(len(tokens) for tokens in encoded)
    return [tokens[:shortest] for tokens in encoded]  # one length: a batch without padding


def greedy(model: Any, prompts: list[list[int]], steps: int = STEPS) -> tuple[list[list[int]], mx.array]:
    """Greedy tokens per row and the logits they came from, (steps, rows, vocabulary)."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompts), cache=cache)[:, -1, :]
    tokens, seen = [], []
    for _ in range(steps):
        seen.append(logits)
        token = mx.argmax(logits, axis=-1)
        tokens.append(token.tolist())
        logits = model(token[:, None], cache=cache)[:, -1, :]
    return [list(row) for row in zip(*tokens, strict=True)], mx.stack(seen)


_REFERENCES: dict[tuple[str, str | None, tuple[int, ...]], tuple[list[int], mx.array]] = {}


def reference(files: dict[str, Path], base: str, adapter: str | None, prompt: list[int]) -> tuple[list[int], mx.array]:
    """mlx-lm with that adapter alone loaded (or none), one row."""
    key = (base, adapter, tuple(prompt))
    if key not in _REFERENCES:
        model, _ = mlx_lm.load(str(files[base]), adapter_path=None if adapter is None else str(files[adapter]))
        tokens, logits = greedy(model, [prompt])
        _REFERENCES[key] = (tokens[0], logits[:, 0])
    return _REFERENCES[key]


def assert_rows_match(files: dict[str, Path], base: str, model: Any, rows: list[str | None],
                      prompts: list[list[int]]) -> None:
    tokens, logits = greedy(model, prompts)
    for i, (adapter, prompt) in enumerate(zip(rows, prompts, strict=True)):
        want_tokens, want_logits = reference(files, base, adapter, prompt)
        assert tokens[i] == want_tokens, f"row {i} ({adapter}): {tokens[i]} != mlx-lm's {want_tokens}"
        # Bit for bit on this CPU backend: the same sums in the same order as mlx-lm's LoRALinear
        gap = mx.abs(logits[:, i] - want_logits).max().item()
        assert mx.array_equal(logits[:, i], want_logits), f"row {i} ({adapter}): logits off by up to {gap}"


def multi(files: dict[str, Path], base: str, strategy: str, adapters: list[str]) -> MultiLoRA:
    model, _ = mlx_lm.load(str(files[base]))
    lora = MultiLoRA(model, strategy)  # type: ignore[arg-type]
    for name in adapters:
        lora.add_folder(name, files[name])
    return lora


def parameter_bytes(model: Any) -> int:
    return sum(value.nbytes for _, value in tree_flatten(model.parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("base", ["model", "model-4bit"])
@pytest.mark.parametrize("strategy", ["gather", "grouped"])
def test_each_row_of_one_batch_is_mlx_lm_with_its_adapter_alone(files, prompts, base, strategy):
    lora = multi(files, base, strategy, ["every", "last", "qv"])
    lora.select(ROWS)
    assert_rows_match(files, base, lora.model, ROWS, prompts)
    bare, _ = mlx_lm.load(str(files[base]))
    _, with_adapters = greedy(lora.model, prompts, steps=1)
    _, without = greedy(bare, prompts, steps=1)
    assert mx.array_equal(with_adapters[:, 1], without[:, 1])  # the bare row: the base's, bit for bit
    texts = {adapter: reference(files, base, adapter, prompts[0])[0] for adapter in ("every", "last", "qv", None)}
    assert len({tuple(t) for t in texts.values()}) == 4, "every adapter must change the greedy text, or this proves nothing"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["gather", "grouped"])
def test_adapters_come_and_go_without_reloading_the_base(files, prompts, strategy):
    lora = multi(files, "model", strategy, ["every", "last"])
    base_linear = lora.model.layers[0].self_attn.q_proj.linear
    lora.add_folder("late", files["late"])
    lora.select(["late", "every", None, "last"])
    assert_rows_match(files, "model", lora.model, ["late", "every", None, "last"], prompts)
    lora.select(["every", None, "late", "every"])
    lora.remove("last")
    assert_rows_match(files, "model", lora.model, ["every", None, "late", "every"], prompts)
    assert lora.model.layers[0].self_attn.q_proj.linear is base_linear  # the same base weights throughout
    assert lora.names == ("every", "late")


@pytest.mark.slow
def test_one_adapter_for_every_row_and_no_selection_at_all(files, prompts):
    lora = multi(files, "model", "grouped", ["every", "qv"])
    lora.select(["qv"] * 4)
    assert_rows_match(files, "model", lora.model, ["qv"] * 4, prompts)
    lora.select([])  # nothing selected: a warm-up's or any plain call's rows are the base's
    assert_rows_match(files, "model", lora.model, [None] * 4, prompts)


def _tensor_bytes(folder: Path) -> dict[str, tuple[int, int]]:
    """Per target linear of the adapter's file: (its rank, the bytes of one rank's lora_a and lora_b columns)."""
    weights = mx.load(str(folder / "adapters.safetensors"))
    found = {}
    for name, a in weights.items():
        if name.endswith(".lora_a"):
            path = name.removesuffix(".lora_a")
            b = weights[f"{path}.lora_b"]
            found[path] = (a.shape[1], (a.shape[0] + b.shape[1]) * a.dtype.size)
    return found


@pytest.mark.slow
def test_memory_is_the_base_once_plus_the_adapters(files):
    """Adapter bytes as their files hold them, plus the zeros that pad a rank to the largest on the
    same linear (here "every", rank 4, beside "last", rank 8, in the last block)."""
    base, _ = mlx_lm.load(str(files["model"]))
    base_bytes = parameter_bytes(base)
    lora = multi(files, "model", "grouped", ["every", "last", "qv"])
    held = {name: _tensor_bytes(files[name]) for name in ("every", "last", "qv")}
    adapter_bytes = sum(rank * width for targets in held.values() for rank, width in targets.values())
    padding = 0
    for path in {p for targets in held.values() for p in targets}:
        on_it = [targets[path] for targets in held.values() if path in targets]
        largest = max(rank for rank, _ in on_it)
        padding += sum((largest - rank) * width for rank, width in on_it)
    assert padding > 0
    assert parameter_bytes(lora.model) == base_bytes + adapter_bytes + padding
    lora.remove("last")
    lora.remove("qv")  # "every" alone again: no padding left
    assert parameter_bytes(lora.model) == base_bytes + sum(r * w for r, w in held["every"].values())
    lora.remove("every")
    assert parameter_bytes(lora.model) == base_bytes
    assert not [m for _, m in lora.model.named_modules() if isinstance(m, MultiLoRALinear)]


@pytest.mark.slow
def test_what_cannot_be_served_is_refused_and_changes_nothing(files, tmp_path):
    lora = multi(files, "model", "grouped", ["every"])
    before = parameter_bytes(lora.model)
    config = json.loads((files["last"] / "adapter_config.json").read_text())
    weights = dict(mx.load(str(files["last"] / "adapters.safetensors")))
    name = "model.layers.1.self_attn.q_proj.lora_a"
    with pytest.raises(ValueError, match=r"q_proj.lora_a has shape \(64, 3\), the model and its rank need \(64, 8\)"):
        lora.add("bad", config, weights | {name: weights[name][:, :3]})
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.lora_a is not an adapter parameter"):
        lora.add("bad", config, weights | {"model.layers.0.self_attn.q_proj.lora_a": weights[name]})
    with pytest.raises(ValueError, match="'dora': only LoRA"):
        lora.add("bad", config | {"fine_tune_type": "dora"}, weights)
    with pytest.raises(ValueError, match="'every' is resident already"):
        lora.add_folder("every", files["every"])
    assert parameter_bytes(lora.model) == before and lora.names == ("every",)
    with pytest.raises(ValueError, match=r"rows\[1\]: adapter 'nope' is not resident"):
        lora.select([None, "nope"])
    lora.select(["every", None])
    with pytest.raises(ValueError, match="the batch has 1 rows but adapters were selected for 2"):
        lora.model(mx.array([[1, 2, 3]]))
    with pytest.raises(ValueError, match="'every' is selected for a row"):
        lora.remove("every")


@pytest.mark.parametrize(("config", "reason"), [
    ({"fine_tune_type": "full", "num_layers": 2}, "'full': only LoRA"),
    ({"num_layers": 2}, "needs num_layers and lora_parameters"),
    ({"num_layers": 2, "lora_parameters": {"rank": 0, "scale": 1.0}}, "rank must be a positive integer"),
    ({"num_layers": 2, "lora_parameters": {"rank": 4, "alpha": 8}}, "scale must be a number, not None"),
    ({"num_layers": 2, "lora_parameters": {"rank": 4, "scale": 1.0, "keys": "q_proj"}}, "keys must be a list"),
])
def test_configs_that_are_not_lora_are_refused_with_the_reason(config, reason):
    with pytest.raises(ValueError, match=reason):
        read_config(config)
