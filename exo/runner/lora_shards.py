"""LoRA terms on a rank of a tensor-parallel instance: an adapter's `lora_a` / `lora_b` sliced the
way the linear they wrap is sliced (mlx's AllToShardedLinear / ShardedToAllLinear and their
quantized kinds, as mlx-lm's `model.shard` makes them), so the base stays shared and each rank
holds only its slice of every adapter.

- all-to-sharded (llama's q, k, v, gate, up): a rank has the whole input and a slice of the
  outputs, so lora_a stays whole and lora_b keeps the same slice of output columns.
- sharded-to-all (o, down): a rank has a slice of the input and the outputs are summed over the
  ranks, so lora_a keeps the same slice of input rows and lora_b stays whole. A rank's low-rank
  term is then a partial sum too: it is added to the base's partial product before the one
  all_sum the linear makes anyway, and the ranks' terms add up to mlx-lm's, with no collective more.

Slices are N equal parts in rank order, as mlx shards a linear given no segments (mlx-lm's llama,
qwen2/3, mistral and most others). An architecture that shards a fused projection in segments
(qwen3_5's, say) would need the same segments here: its per-row adapters are not supported.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)

TO_SHARDED = (AllToShardedLinear, QuantizedAllToShardedLinear)
TO_ALL = (ShardedToAllLinear, QuantizedShardedToAllLinear)
SHARDED_LINEARS = (*TO_SHARDED, *TO_ALL)
_QUANTIZED = (nn.QuantizedLinear, QuantizedAllToShardedLinear, QuantizedShardedToAllLinear)


def full_dims(linear: nn.Module) -> tuple[int, int]:
    """(input, output) widths of the whole linear: an adapter's shapes are the unsharded model's."""
    output_dims, input_dims = linear.weight.shape
    if isinstance(linear, _QUANTIZED):
        input_dims = input_dims * 32 // linear.bits
    if isinstance(linear, TO_SHARDED):
        output_dims *= linear.group.size()
    elif isinstance(linear, TO_ALL):
        input_dims *= linear.group.size()
    return int(input_dims), int(output_dims)


def shard_pair(linear: nn.Module, lora_a: mx.array, lora_b: mx.array) -> tuple[mx.array, mx.array]:
    """This rank's slices of an adapter's (lora_a (in, r), lora_b (r, out)) for `linear`."""
    if isinstance(linear, TO_SHARDED):
        return lora_a, _slice(lora_b, 1, linear.group)
    if isinstance(linear, TO_ALL):
        return _slice(lora_a, 0, linear.group), lora_b
    return lora_a, lora_b


def _slice(weights: mx.array, axis: int, group: Any) -> mx.array:
    return mx.contiguous(mx.split(weights, group.size(), axis=axis)[group.rank()])


def sums_over_ranks(linear: nn.Module) -> bool:
    return isinstance(linear, TO_ALL)


def partial_product(linear: nn.Module, x: mx.array) -> mx.array:
    """A sharded-to-all linear's output on this rank before the sum over ranks and the bias (its own math)."""
    if isinstance(linear, QuantizedShardedToAllLinear):
        return mx.quantized_matmul(x, linear["weight"], scales=linear["scales"], biases=linear.get("biases"),
                                   transpose=True, group_size=linear.group_size, bits=linear.bits, mode=linear.mode)
    product: mx.array = x @ linear["weight"].T
    return product


def summed(linear: nn.Module, partial: mx.array) -> mx.array:
    """The rest of a sharded-to-all linear: the sum over ranks, then its bias."""
    y = mx.distributed.all_sum(partial, group=linear.group)
    return y + linear["bias"] if "bias" in linear else y
