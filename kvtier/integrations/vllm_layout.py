"""What kvtier holds of a vLLM model's KV cache, and the sentence that refuses the rest.

vLLM describes a model's KV cache in its ``KVCacheConfig``: groups of layers that share
a block table, each with one spec (full attention, MLA, sliding window, Mamba state,
...), and hands each worker one tensor per layer with blocks on dim 0. kvtier caches a
model whose attention groups are full attention, sliding windows or MLA, all with blocks
of one shape, stored as plain elements (unquantized, or fp8 with per-tensor scales,
which live in the layers and not in the blocks), beside which it may have Mamba or
linear-attention state kept as vLLM's prefix caching keeps it (``mamba_cache_mode``
'align'). Every other model is refused when the connector is built, in both roles and
before any request, with one sentence that names the model feature and what to change
(``UnsupportedKVCache``): never a shape error later, never KV read back in a layout that
did not write it.

Groups. A kvtier block is one chain position in every position group, its engine block
one id per group (``kvtier.connector.EngineKV``): a hit restores every group at once, so
a position is never restored in one group and not another. A sliding window needs, at a
hit's end, only the KV of the last ``window_blocks`` positions before it (vLLM's table
holds its null block for the earlier ones). Beside full attention or MLA, a window's KV
is therefore a state too (``window_groups``): stored only before chosen positions, as
the pieces after them, not in every position. In a model of sliding windows alone the
windows are the position groups: every position keeps its KV, and a position that a
window's table no longer holds is neither saved nor loaded into.

State. A Mamba group's block holds the layer's state after one position, and vLLM keeps
it only at some positions (where a prefill chunk ended on a block boundary): it hands
the connector those it commits (``boundary_state_offloads``; a state after part of a
block has no block hash, and kvtier keeps none). kvtier stores each, with the windows
before that position, as a few blocks of their own after that position's block
(``kvtier.connector.StatePiece``), and a hit ends only at a position whose state it
holds: attention KV is never restored without the state after it, nor a state without
the KV before it.

Kernel blocks. An attention kernel that takes smaller blocks than vLLM's ``--block-size``
(FlashInfer's or FlashMLA's, vLLM's CPU MLA backend's 16 tokens) sees each vLLM block as
``ratio`` kernel blocks, and vLLM hands connectors those views: ``len(tensor) ==
num_blocks * ratio``. ``engine_kv`` regroups them into whole vLLM blocks
(``kvtier.connector.engine_blocks``) and checks that a block's elements are exactly the
spec's page, so any view that matches no known layout is refused too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvtier.connector import EngineKV, LayerGroup, StatePiece, engine_blocks, engine_layout
from kvtier.layout import DTYPES, KVLayout

# The kinds of KV cache group kvtier caches (exactly these: their subclasses keep other
# things in their blocks, or drop tokens from them).
CACHED_SPECS = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec)
# vLLM's null block: the first block of its pool, which a sliding window's block table
# holds in place of the blocks that fell out of the window.
NULL_BLOCK = 0
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


def _refuse_state(spec: MambaSpec) -> None:
    """``UnsupportedKVCache`` unless kvtier can hold the states of a Mamba group."""
    if spec.mamba_cache_mode != "align":
        raise UnsupportedKVCache(
            f"kvtier caches Mamba and linear-attention state as vLLM's prefix caching keeps "
            f"it with mamba_cache_mode 'align', not '{spec.mamba_cache_mode}': serve this "
            f"model with --mamba-cache-mode align, or without kvtier's connector."
        )
    if spec.num_speculative_blocks:
        raise UnsupportedKVCache(
            "kvtier does not cache Mamba or linear-attention state beside the extra state "
            "blocks of speculative decoding: serve this model without speculative "
            "decoding, or without kvtier's connector."
        )


def _refuse_spec(spec: KVCacheSpec) -> None:
    """``UnsupportedKVCache`` unless kvtier can hold a group of ``spec``'s blocks."""
    if type(spec) is MambaSpec:
        return _refuse_state(spec)
    if type(spec) not in CACHED_SPECS:
        raise UnsupportedKVCache(
            f"kvtier caches full-attention, sliding-window and MLA KV and Mamba state, not "
            f"{_kind(spec)}: serve this model without kvtier's connector."
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


def _page(spec: AttentionSpec) -> tuple:
    """What makes a layer's blocks alike: tokens, heads, widths, dtype."""
    return (spec.block_size, spec.num_kv_heads, spec.head_size, spec.head_size_v, spec.dtype)


def cached_groups(kv_cache_config: KVCacheConfig) -> list[KVCacheSpec]:
    """The specs of the model's KV cache groups (vLLM's order), which kvtier caches
    together: a kvtier block is one chain position in every attention group, and a state
    holds the state groups' blocks after one. Raises ``UnsupportedKVCache`` for every
    model kvtier cannot hold (module docstring)."""
    specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
    for spec in specs:
        _refuse_spec(spec)
    attention = [specs[i] for i in attention_groups(specs)]
    if not attention:
        raise UnsupportedKVCache(
            "kvtier caches Mamba and linear-attention state beside attention layers, not a "
            "model of state layers alone: serve it without kvtier's connector."
        )
    if len({_page(spec) for spec in attention}) > 1:
        kinds = ", ".join(f"{_kind(s)} of {s.num_kv_heads} x {s.head_size}" for s in attention)
        raise UnsupportedKVCache(
            f"kvtier caches models whose attention groups have blocks of one shape, and this "
            f"model's differ ({kinds}): serve it without kvtier's connector."
        )
    return specs


def attention_groups(specs: Sequence[KVCacheSpec]) -> list[int]:
    """The indexes of the attention groups (a kvtier block's positions), in order."""
    return [i for i, spec in enumerate(specs) if type(spec) is not MambaSpec]


def state_groups(specs: Sequence[KVCacheSpec]) -> list[int]:
    """The indexes of the Mamba groups (a state's blocks), in order."""
    return [i for i, spec in enumerate(specs) if type(spec) is MambaSpec]


def position_groups(specs: Sequence[KVCacheSpec]) -> list[int]:
    """The indexes of the groups a chain position holds, in order: the attention groups
    but the sliding windows, or the windows where the model has no other attention."""
    attention = attention_groups(specs)
    return [i for i in attention if not isinstance(specs[i], SlidingWindowSpec)] or attention


def window_groups(specs: Sequence[KVCacheSpec]) -> list[int]:
    """The indexes of the sliding-window groups whose KV is kept as a state, in order."""
    positions = position_groups(specs)
    return [i for i in attention_groups(specs) if i not in positions]


def window_blocks(spec: SlidingWindowSpec) -> int:
    """The blocks before a hit's end whose KV a window's layers need there: the blocks
    vLLM allocates for loaded tokens in a window's group (it gives the earlier ones its
    null block)."""
    return -(-(spec.sliding_window - 1) // spec.block_size)


def windowed(specs: Sequence[AttentionSpec]) -> list[bool]:
    """Per group, whether its block table holds the null block where a block fell out of
    its sliding window."""
    return [isinstance(spec, SlidingWindowSpec) for spec in specs]


def holds_all(ids: tuple[int, ...], windowed: Sequence[bool]) -> bool:
    """Whether every group holds this position's block (none of them is the null block
    of a sliding window)."""
    return not any(w and i == NULL_BLOCK for i, w in zip(ids, windowed))


def engine_ids(
    blocks: Iterable[tuple[int, ...] | StatePiece], windowed: Sequence[bool]
) -> set[int]:
    """vLLM's block ids of ``blocks`` (one id per attention group each, or a state's
    pieces), the null block of a window left out."""
    out: set[int] = set()
    for ids in blocks:
        if isinstance(ids, StatePiece):
            out.update(i for i in ids.ids if i != NULL_BLOCK)
        else:
            out.update(i for i, w in zip(ids, windowed) if not (w and i == NULL_BLOCK))
    return out


def _layer_group(spec: AttentionSpec, layers: int) -> LayerGroup:
    """A group of ``layers`` layers of ``spec``, as kvtier's engine KV holds it."""
    if isinstance(spec, SlidingWindowSpec):
        return LayerGroup(f"window {spec.sliding_window}", layers, windowed=True)
    return LayerGroup("mla" if isinstance(spec, MLAAttentionSpec) else "full", layers)


def _state_layer(tensor: torch.Tensor, spec: MambaSpec, num_blocks: int) -> torch.Tensor:
    """A Mamba layer's tensor as ``num_blocks`` blocks, each exactly its state's bytes."""
    layer = engine_blocks(tensor, num_blocks)
    nbytes = layer[0].numel() * layer.element_size()
    if nbytes != spec.state_content_size_bytes:
        raise ValueError(f"a state block of {nbytes} B is not a state of {spec.shapes}")
    return layer


def engine_kv(
    kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig, specs: list[KVCacheSpec]
) -> tuple[EngineKV, KVLayout]:
    """vLLM's per-layer tensors ``kv_caches``, group by group (``specs``, from
    ``cached_groups``; each group's layers in model order), as ``num_blocks`` blocks of
    one id per position group, the state layers of the Mamba groups and the windows kept
    as a state, and their layout; ``UnsupportedKVCache`` when the tensors hold anything
    but those blocks, or a layer outside every group holds KV of its own."""
    num_blocks = kv_cache_config.num_blocks
    groups = [
        sorted(g.layer_names, key=extract_layer_index) for g in kv_cache_config.kv_cache_groups
    ]
    names = [name for group in groups for name in group]
    own = {kv_caches[name].data_ptr() for name in names if name in kv_caches}
    for name in kv_caches.keys() - set(names):
        if kv_caches[name].data_ptr() not in own:  # else it shares another layer's KV
            raise UnsupportedKVCache(
                f"kvtier cannot cache layer {name}, which is in none of vLLM's KV cache "
                f"groups: serve this model without kvtier's connector."
            )
    positions, state = position_groups(specs), state_groups(specs)
    spec = specs[positions[0]]
    try:
        layers = [engine_blocks(kv_caches[n], num_blocks) for g in positions for n in groups[g]]
        states = [
            _state_layer(kv_caches[n], specs[g], num_blocks) for g in state for n in groups[g]
        ]
        kinds = [_layer_group(specs[g], len(groups[g])) for g in positions]
        of = [k for k, g in enumerate(state) for _ in groups[g]]
        windows: list[tuple[torch.Tensor, int]] = []
        index = len(state)  # a window block's id in a StatePiece: after the states'
        for g in window_groups(specs):
            for _ in range(window_blocks(specs[g])):
                windows += [(engine_blocks(kv_caches[n], num_blocks), index) for n in groups[g]]
                index += 1
        kv = EngineKV(layers, kinds, NULL_BLOCK, states, of, windows)
        mla = type(spec) is MLAAttentionSpec
        layout = engine_layout(
            kv, spec.block_size, spec.num_kv_heads, spec.head_size, kv_factor=1 if mla else 2
        )
    except (KeyError, ValueError) as e:
        raise UnsupportedKVCache(
            f"kvtier cannot address this model's KV tensors as {num_blocks} blocks of "
            f"{spec.block_size} tokens ({e}): serve it without kvtier's connector, or with "
            f"another attention backend."
        ) from None
    return kv, layout
