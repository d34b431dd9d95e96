"""What kvtier holds of a vLLM model's KV cache, and the sentence that refuses the rest.

vLLM describes a model's KV cache in its ``KVCacheConfig``: groups of layers that share
a block table, each with one spec (full attention, MLA, sliding window, Mamba state,
...), and hands each worker one tensor per layer with blocks on dim 0. kvtier caches a
model whose KV cache is one group of full attention or MLA, stored as plain elements
(unquantized, or fp8 with per-tensor scales, which live in the layers and not in the
blocks). Every other model is refused when the connector is built, in both roles and
before any request, with one sentence that names the model feature and what to change
(``UnsupportedKVCache``): never a shape error later, never KV read back in a layout that
did not write it.

Kernel blocks. An attention kernel that takes smaller blocks than vLLM's ``--block-size``
(FlashInfer's or FlashMLA's, vLLM's CPU MLA backend's 16 tokens) sees each vLLM block as
``ratio`` kernel blocks, and vLLM hands connectors those views: ``len(tensor) ==
num_blocks * ratio``. ``engine_kv`` regroups them into whole vLLM blocks
(``kvtier.connector.engine_blocks``) and checks that a block's elements are exactly the
spec's page, so any view that matches no known layout is refused too.
"""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    KVQuantMode,
    MLAAttentionSpec,
)

from kvtier.connector import EngineKV, engine_blocks, engine_layout
from kvtier.layout import DTYPES, KVLayout

# Quantization modes whose blocks hold the KV elements and nothing else.
PLAIN_QUANT_MODES = (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR)

# What a user knows each kind of KV cache group by, for the refusal's sentence.
SPEC_KINDS = {
    "FullAttentionSpec": "full attention",
    "MLAAttentionSpec": "MLA",
    "SlidingWindowSpec": "sliding-window attention",
    "SlidingWindowMLASpec": "sliding-window MLA",
    "ChunkedLocalAttentionSpec": "chunked local attention",
    "MambaSpec": "Mamba or linear-attention state",
    "CrossAttentionSpec": "cross-attention (an encoder-decoder model)",
    "EncoderOnlyAttentionSpec": "encoder-only attention",
    "SinkFullAttentionSpec": "attention with sink tokens",
    "UniformTypeKVCacheSpecs": "layers whose KV blocks differ in shape",
}


class UnsupportedKVCache(ValueError):
    """A model's KV cache that kvtier cannot hold. The message is one sentence: the model
    feature, and what to change to serve it (without kvtier, or with other settings)."""


def _kind(spec: KVCacheSpec) -> str:
    name = type(spec).__name__
    return SPEC_KINDS.get(name, name)


def cached_spec(kv_cache_config: KVCacheConfig) -> FullAttentionSpec:
    """The spec of the model's one KV cache group, which kvtier caches; raises
    ``UnsupportedKVCache`` for every model kvtier cannot hold (module docstring)."""
    groups = kv_cache_config.kv_cache_groups
    kinds = ", ".join(_kind(g.kv_cache_spec) for g in groups)
    if len(groups) != 1:
        raise UnsupportedKVCache(
            f"kvtier caches models whose KV cache is one group of full-attention or MLA "
            f"layers, and this model's has {len(groups)} ({kinds}): serve it without "
            f"kvtier's connector."
        )
    spec = groups[0].kv_cache_spec
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        raise UnsupportedKVCache(
            f"kvtier caches full-attention and MLA KV, not {_kind(spec)}: serve this model "
            f"without kvtier's connector."
        )
    if spec.kv_quant_mode not in PLAIN_QUANT_MODES:
        raise UnsupportedKVCache(
            f"kvtier does not cache KV quantized as {spec.kv_quant_mode.name.lower()}, whose "
            f"scales are kept outside the blocks it copies: set kv_cache_dtype to 'auto' "
            f"or 'fp8' to serve this model with kvtier."
        )
    if spec.dtype not in DTYPES.values():
        raise UnsupportedKVCache(
            f"kvtier does not cache KV of dtype {spec.dtype}: set kv_cache_dtype to "
            f"'auto' or 'fp8' to serve this model with kvtier."
        )
    mla = type(spec) is MLAAttentionSpec
    packed = spec.num_head_slots is not None or spec.state_content_bytes is not None
    if packed or spec.tokens_per_state != 1 or (not mla and spec.head_size_v != spec.head_size):
        raise UnsupportedKVCache(
            f"kvtier does not cache KV blocks packed other than as {spec.block_size} tokens "
            f"x {spec.num_kv_heads} heads x K and V of one width (or one MLA latent), as "
            f"this model's are: serve it without kvtier's connector."
        )
    return spec


def engine_kv(
    kv_caches: dict[str, torch.Tensor], names: list[str], spec: FullAttentionSpec, num_blocks: int
) -> tuple[EngineKV, KVLayout]:
    """vLLM's per-layer tensors ``kv_caches`` (layers ``names`` in model order), grouped
    into ``num_blocks`` blocks of ``spec``, and their layout; ``UnsupportedKVCache`` when
    the tensors hold anything but those blocks."""
    mla = type(spec) is MLAAttentionSpec
    try:
        kv = EngineKV([engine_blocks(kv_caches[name], num_blocks) for name in names])
        layout = engine_layout(
            kv, spec.block_size, spec.num_kv_heads, spec.head_size, kv_factor=1 if mla else 2
        )
    except ValueError as e:
        raise UnsupportedKVCache(
            f"kvtier cannot address this model's KV tensors as {num_blocks} blocks of "
            f"{spec.block_size} tokens ({e}): serve it without kvtier's connector, or with "
            f"another attention backend."
        ) from None
    return kv, layout
