"""LoRA adapters (mlx-lm's format: `adapter_config.json` + `adapters.safetensors`), what State
keeps of each, and the pure checks an added one passes.

An adapter is named by its user and fits one base model card. A request asks for it as
`"<base>:<adapter>"` (as vLLM and LocalAI name them): model ids never hold a ":", so the last
one splits the two. The weights live in the object store exo-adapters under their sha256; the
config, small, lives in State, so a node writes it to disk beside the fetched weights.

The facts State keeps (layers touched, input widths) come from the safetensors header, read
strictly here: a header that lies about its tensors is refused before anything is stored.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

import msgspec

from exo.core.ids import ModelId
from exo.core.types import ModelCard

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
MAX_CONFIG_BYTES = 64 * 1024
MAX_HEADER_BYTES = 16 * 1024 * 1024  # safetensors' own bound is 100 MB; an adapter's header is a few KB
MAX_RANK = 4096
FINE_TUNE_TYPES = ("lora", "dora")  # mlx-lm's "full" saves whole layers: that is a model, added as a card
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_LEAVES = ("lora_a", "lora_b", "m")  # what mlx-lm's load_adapters accepts from a LoRA or DoRA adapter
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Projections whose input is the hidden state in every llama / qwen / mistral-style family: their
# lora_a's first dimension must be the base model's hidden size.
_HIDDEN_INPUTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


class Adapter(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    base_model: ModelId
    digest: str  # sha256 hex of adapters.safetensors: its name in exo-adapters
    size: int  # bytes of adapters.safetensors
    config: str  # adapter_config.json, as given
    fine_tune_type: str = "lora"
    rank: int = 0
    layers: int = 0  # the highest layer index its tensors touch, plus one
    hidden_inputs: list[int] = []  # the input widths of its q/k/v/gate/up projections (the base's hidden size)
    source: str = ""  # "upload", or the Hub repo it came from
    # DELETE /adapters asked while requests used it: it takes no new ones, and the master deletes it
    # once the last ends (exo/master/adapters.py). In State, so a new master finishes it too.
    deleting: bool = False

    @property
    def model_id(self) -> ModelId:
        return adapter_model_id(self.base_model, self.name)

    def problem(self) -> str | None:
        """Why State cannot hold it (None: it can): the reducer checks this before folding one in."""
        if not _NAME.fullmatch(self.name):
            return f"invalid adapter name {self.name!r}: letters, digits, '.', '_' and '-', at most 64"
        if not _DIGEST.fullmatch(self.digest):
            return f"invalid adapter digest {self.digest!r}: 64 lowercase hex digits"
        if self.size <= 0 or len(self.config) > MAX_CONFIG_BYTES:
            return "an adapter's weights must be non-empty and its config at most 64 KB"
        if self.fine_tune_type not in FINE_TUNE_TYPES:
            return f"fine_tune_type must be one of {', '.join(FINE_TUNE_TYPES)}, not {self.fine_tune_type!r}"
        return None


def is_valid_adapter_name(name: str) -> bool:
    return bool(_NAME.fullmatch(name))


def adapter_model_id(base: ModelId, name: str) -> ModelId:
    return ModelId(f"{base}:{name}")


def split_adapter_id(model_id: str) -> tuple[ModelId, str]:
    """("base", "adapter") of "base:adapter"; (model_id, "") of a plain model id."""
    base, colon, name = model_id.rpartition(":")
    return (ModelId(base), name) if colon else (ModelId(model_id), "")


class AdapterFacts(msgspec.Struct, frozen=True, kw_only=True):
    fine_tune_type: str
    rank: int
    layers: int
    hidden_inputs: list[int]


def read_adapter(config_bytes: bytes, weights: bytes, card: ModelCard | None = None) -> AdapterFacts | str:
    """What the adapter's files say, or why they are not an mlx-lm LoRA adapter (or not one for
    `card`'s model: its lora_b widths; lora_a's input widths are kept for `misfit`)."""
    config = _read_config(config_bytes)
    if isinstance(config, str):
        return config
    tensors = _tensors(weights)
    if isinstance(tensors, str):
        return f"adapters.safetensors: {tensors}"
    layers, hidden = 0, set()
    for name, tensor in tensors.items():
        shape = tensor.shape
        if name.rsplit(".", 1)[-1] not in _LEAVES:
            return f"adapters.safetensors: {name!r} is not a LoRA parameter (lora_a, lora_b or m)"
        if (layer := _LAYER.search(name)) is not None:
            layers = max(layers, int(layer.group(1)) + 1)
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        if name.endswith(".lora_a") and module in _HIDDEN_INPUTS and shape:
            hidden.add(shape[0])
        if problem := _shape_problem(name, shape, config["rank"], card):
            return f"adapters.safetensors: {problem}"
    if not tensors:
        return "adapters.safetensors holds no tensors"
    if problem := _non_finite(weights, tensors):
        return f"adapters.safetensors: {problem}"
    return AdapterFacts(fine_tune_type=config["fine_tune_type"], rank=config["rank"], layers=layers,
                        hidden_inputs=sorted(hidden))


def _shape_problem(name: str, shape: list[int], rank: int, card: ModelCard | None) -> str | None:
    """lora_a is (input width, rank) and lora_b (rank, output width), as mlx-lm's LoRALinear holds them."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf not in ("lora_a", "lora_b") or len(shape) != 2:
        return None
    found = shape[1] if leaf == "lora_a" else shape[0]
    if found != rank:
        return f"{name} has rank {found}, its config says {rank}"
    if leaf == "lora_a" or card is None:
        return None
    width = _output_width(name.rsplit(".", 2)[-2], card)
    if width and shape[1] != width:
        return f"{name} is {shape}, but {card.model_id} needs {[rank, width]}: it was trained for another model"
    return None


def _output_width(module: str, card: ModelCard) -> int:
    """The output width of a projection of the card's model, 0 where the card does not say."""
    head_dim = card.head_dim or (card.hidden_size // card.num_attention_heads if card.num_attention_heads else 0)
    widths = {"q_proj": card.num_attention_heads * head_dim, "k_proj": card.num_key_value_heads * head_dim,
              "v_proj": card.num_key_value_heads * head_dim, "o_proj": card.hidden_size, "down_proj": card.hidden_size}
    return widths.get(module, 0)


# Where each float format keeps its exponent (little-endian, as safetensors stores it): its width
# in bytes, and the exponent's bits in the top byte and in the byte below it. All set: NaN or infinity.
_EXPONENT_BITS = {"F16": (2, 0x7C, 0x00), "BF16": (2, 0x7F, 0x80), "F32": (4, 0x7F, 0x80), "F64": (8, 0x7F, 0xF0)}


def _bytes_with_bits(mask: int) -> bytes:
    """A translation table: 1 for each byte value that has every bit of `mask` set, else 0."""
    return bytes(1 if value & mask == mask else 0 for value in range(256))


_BITS_SET = {mask: _bytes_with_bits(mask) for _, top, below in _EXPONENT_BITS.values() for mask in (top, below)}


def _non_finite(weights: bytes, tensors: dict[str, _Tensor]) -> str | None:
    """The first tensor holding NaN or infinity: such an adapter makes every logit NaN. Byte slices,
    translations and one big-integer AND keep it at C speed without numpy (this is the pure core)."""
    for name, tensor in tensors.items():
        if tensor.dtype not in _EXPONENT_BITS:
            continue
        width, top, below = _EXPONENT_BITS[tensor.dtype]
        raw = weights[tensor.start:tensor.end]
        top_set = raw[width - 1::width].translate(_BITS_SET[top])
        below_set = raw[width - 2::width].translate(_BITS_SET[below])  # mask 0: every byte qualifies
        if int.from_bytes(top_set, "little") & int.from_bytes(below_set, "little"):
            return f"{name} holds NaN or infinite values: every logit of the model would be NaN"
    return None


def _read_config(data: bytes) -> dict[str, Any] | str:
    if len(data) > MAX_CONFIG_BYTES:
        return f"adapter_config.json is {len(data)} bytes; at most {MAX_CONFIG_BYTES}"
    try:
        config = json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        return f"adapter_config.json is not JSON: {error}"
    if not isinstance(config, dict):
        return "adapter_config.json must hold a JSON object"
    kind = config.get("fine_tune_type", "lora")
    if kind not in FINE_TUNE_TYPES:
        return (f"adapter_config.json: fine_tune_type {kind!r} is not served; one of {', '.join(FINE_TUNE_TYPES)} "
                "(a full fine-tune is a model: add it with /models/add)")
    layers = config.get("num_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or not (layers == -1 or 1 <= layers <= 10_000):
        return f"adapter_config.json: num_layers must be a positive integer (or -1: all), not {layers!r}"
    lora = config.get("lora_parameters")
    if not isinstance(lora, dict):
        return "adapter_config.json: lora_parameters must be an object (rank, scale, ...)"
    rank, scale = lora.get("rank"), lora.get("scale")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_RANK:
        return f"adapter_config.json: lora_parameters.rank must be between 1 and {MAX_RANK}, not {rank!r}"
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not -1e6 < scale < 1e6:
        return f"adapter_config.json: lora_parameters.scale must be a number, not {scale!r}"
    keys = lora.get("keys")
    if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        return "adapter_config.json: lora_parameters.keys must be a list of module names"
    return {"fine_tune_type": kind, "rank": rank, "num_layers": layers}


class _Tensor(NamedTuple):
    dtype: str
    shape: list[int]
    start: int  # where its bytes are in the file
    end: int


def safetensors_header(data: bytes) -> dict[str, tuple[str, list[int]]] | str:
    """Each tensor's (dtype, shape), checked against the bytes that follow the header."""
    tensors = _tensors(data)
    return tensors if isinstance(tensors, str) else {name: (t.dtype, t.shape) for name, t in tensors.items()}


def _tensors(data: bytes) -> dict[str, _Tensor] | str:
    if len(data) < 8:
        return "too short for a safetensors file"
    length = int.from_bytes(data[:8], "little")  # the header's size, a little-endian u64
    if length > min(MAX_HEADER_BYTES, len(data) - 8):
        return f"its header claims {length} bytes; the file has {len(data) - 8} after the length"
    try:
        header = json.loads(data[8:8 + length])
    except (ValueError, UnicodeDecodeError) as error:
        return f"its header is not JSON: {error}"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    body, tensors = len(data) - 8 - length, {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        problem = _tensor_problem(spec, body)
        if problem:
            return f"tensor {name!r}: {problem}"
        start, end = (8 + length + offset for offset in spec["data_offsets"])
        tensors[name] = _Tensor(spec["dtype"], list(spec["shape"]), start, end)
    return tensors


def _tensor_problem(spec: object, body: int) -> str | None:
    if not isinstance(spec, dict):
        return "not an object"
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if dtype not in _DTYPE_BYTES:
        return f"unknown dtype {dtype!r}"
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        return f"bad shape {shape!r}"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= body):
        return f"data_offsets {offsets!r} are outside the file's {body} bytes of data"
    count = 1
    for dimension in shape:
        count *= dimension
    if count * _DTYPE_BYTES[dtype] != offsets[1] - offsets[0]:
        return f"{dtype} {shape} needs {count * _DTYPE_BYTES[dtype]} bytes, its offsets give {offsets[1] - offsets[0]}"
    return None


def misfit(adapter: Adapter, card: ModelCard) -> str | None:
    """Why the adapter cannot be applied to the card's model (None: as far as the card says, it can)."""
    if card.embedding is not None or card.supports_images:
        return f"{card.model_id} is an embedding or vision model: adapters are served on text models"
    if card.n_layers and adapter.layers > card.n_layers:
        return (f"the adapter changes layer {adapter.layers - 1}, but {card.model_id} has {card.n_layers} layers: "
                "it was trained for another model")
    wrong = [width for width in adapter.hidden_inputs if card.hidden_size and width != card.hidden_size]
    if wrong:
        return (f"the adapter's projections take inputs {wrong[0]} wide, but {card.model_id}'s hidden size is "
                f"{card.hidden_size}: it was trained for another model")
    return None
