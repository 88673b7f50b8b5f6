"""How much context an instance can hold: the KV cache its ranks must keep room for.

Every token of context keeps a key and a value in every layer: 2 x KV heads x head dim x the
cache's element size, per layer. Placement reserves that for an instance's `max_context` tokens
(one request at the full context, or several sharing it in a batch) on top of the weights, and
refuses a context that does not fit with the numbers. A card that does not give its layers, heads
and sizes reserves nothing (unknown sizes do not constrain, as for the weights).
"""

from __future__ import annotations

import math

from exo.core.types import ModelCard, Sharding

DEFAULT_MAX_CONTEXT = 32768  # what an instance gets when its placement does not say, at most the model's own
MIN_MAX_CONTEXT = 64  # tokens asked for: below this an instance cannot hold a chat template, a question and an answer
MIN_AUTO_CONTEXT = 2048  # below this a context chosen to fit is not worth an instance: refused instead
CONTEXT_STEP = 256  # contexts chosen to fit are rounded down to this
ASSUMED_ELEMENT_BYTES = 2  # float16 / bfloat16 caches, when the card does not say
KV_BITS = (2, 3, 4, 5, 6, 8)  # what mlx quantizes to


def kv_group_size(head_dim: int) -> int:
    """Elements of a head that share one scale and one bias in a quantized cache: mlx-lm's 64 where
    the head dim allows, else 32 (0: it cannot be quantized); each scale and bias is kept in the
    cache's type. An unknown head dim (0) is taken to allow 64."""
    return next((g for g in (64, 32) if head_dim % g == 0), 0)


def head_dim_of(card: ModelCard) -> int:
    return card.head_dim or (card.hidden_size // card.num_attention_heads if card.num_attention_heads else 0)


def kv_bytes_per_token(card: ModelCard, kv_bits: int = 0) -> float:
    """One token's keys and values in every layer of the model (0: the card does not say); a
    quantized cache keeps `kv_bits` per element and a scale and a bias per group."""
    heads = card.num_key_value_heads or card.num_attention_heads
    head_dim = head_dim_of(card)
    element: float = card.kv_dtype_bytes or ASSUMED_ELEMENT_BYTES
    if kv_bits:
        element = kv_bits / 8 + 2 * element / (kv_group_size(head_dim) or 64)
    return 2 * heads * head_dim * element * card.n_layers


def rank_kv_bytes(card: ModelCard, sharding: Sharding, world: int, layers: tuple[int, int], tokens: int,
                  kv_bits: int = 0) -> int:
    """What one rank keeps for `tokens` of context: tensor ranks hold 1/world of every layer's
    heads, pipeline ranks all heads of their block of layers."""
    per_token = kv_bytes_per_token(card, kv_bits)
    if not per_token or not tokens:
        return 0
    share = 1 / world if sharding == "tensor" else (layers[1] - layers[0]) / max(1, card.n_layers)
    return math.ceil(per_token * tokens * share)


def context_cap(card: ModelCard) -> int:
    return card.context_length or DEFAULT_MAX_CONTEXT


def default_context(card: ModelCard) -> int:
    return min(context_cap(card), DEFAULT_MAX_CONTEXT)


def tokens_that_fit(card: ModelCard, sharding: Sharding, world: int, layers: tuple[int, int], room: int,
                    kv_bits: int = 0) -> int:
    """The most tokens of context whose KV cache fits in `room` bytes on this rank."""
    one = rank_kv_bytes(card, sharding, world, layers, CONTEXT_STEP, kv_bits)
    return room // one * CONTEXT_STEP if one else 1 << 62


def least_context(card: ModelCard) -> int:
    """The smallest max_context a placement may ask for (the model's own, if that is smaller)."""
    return min(MIN_MAX_CONTEXT, context_cap(card))
