"""Which vLLM KV caches kvtier holds, as vLLM's workers hand them to connectors.

Each worker's per-layer views are made by vLLM's own allocator
(``vllm.v1.worker.utils.allocate_kv_cache``) from a ``KVCacheConfig``, in the physical
layout and with the kernel block size of the attention backend named in each case: the
same tensors, strides included, that a GPU worker registers, on the CPU. A model kvtier
cannot hold is refused with one sentence (``UnsupportedKVCache``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvtier.config import parse_config  # noqa: E402
from kvtier.connector import ConnectorCache, ConnectorHit, StatePiece  # noqa: E402
from kvtier.integrations.vllm_layout import (  # noqa: E402
    NULL_BLOCK,
    UnsupportedKVCache,
    cached_groups,
    engine_kv,
)

pytestmark = pytest.mark.vllm

NUM_BLOCKS = 12
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def _attention(block_size: int, **kw) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, **kw
    )


def _mla(block_size: int) -> MLAAttentionSpec:  # DeepSeek's latent: 512 + 64 rope
    return MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
    )


def _config(*groups: tuple[list[str], object]) -> KVCacheConfig:
    """A ``KVCacheConfig`` of ``NUM_BLOCKS`` blocks, each group's layers contiguous."""
    tensors, specs = [], []
    for names, spec in groups:
        page = spec.page_size_bytes
        size = page * NUM_BLOCKS * len(names)
        tensors.append(
            KVCacheTensor(size, names, layer_stride=page * NUM_BLOCKS, block_stride=page)
        )
        specs.append(KVCacheGroupSpec(names, spec))
    return KVCacheConfig(NUM_BLOCKS, tensors, specs)


def _views(
    config: KVCacheConfig, layout: KVCacheLayout, kernel_block: int
) -> dict[str, torch.Tensor]:
    """The per-layer views a worker registers: vLLM's allocator, random KV."""
    kernel_blocks = [kernel_block] * len(config.kv_cache_groups)
    views = allocate_kv_cache(config, torch.device("cpu"), layout, kernel_blocks)
    for view in views.values():
        view.copy_(torch.randn(view.shape).to(view.dtype))
    return views


def _worker(views: dict[str, torch.Tensor], config: KVCacheConfig) -> ConnectorCache:
    """A worker's cache below ``views``, its host pool 8 blocks large."""
    kv, layout = engine_kv(views, config, cached_groups(config))
    tiers = {"cpu": {"capacity": 8 * layout.block_nbytes}}
    return ConnectorCache(parse_config({"tiers": tiers}), kv, layout, "model", "rank0")


def _round_trip(cache: ConnectorCache, saved: list[tuple], loaded: list[tuple]) -> None:
    """Save engine blocks ``saved`` (one id per group each) as a chain, then load it
    into ``loaded``."""
    keys = cache.keys([i.to_bytes(16, "little") for i in range(len(saved))])
    cache.save(saved, keys, cache.root, 0)
    cache.pin("r", keys, cache.root, ConnectorHit(0, host_blocks=len(saved)), loaded)
    cache.load("r")
    assert dict(cache.finished_loads()) == {"r": []}


# (backend, spec, physical layout, kernel block size): ratio = block_size / kernel block
BACKENDS = {
    "CPU attention, ratio 1": (_attention(32), KVCacheLayout.LBHNC, 32),
    "FlashInfer HND, ratio 2": (_attention(64), KVCacheLayout.LBHNC, 32),
    "FlashAttention NHD, ratio 2": (_attention(32), KVCacheLayout.LBNHC, 16),
    "FlashInfer HND, ratio 4": (_attention(128), KVCacheLayout.LBHNC, 32),
    "FlashMLA, ratio 2": (_mla(128), KVCacheLayout.LBHNC, 64),
    "CPU MLA, ratio 4": (_mla(64), KVCacheLayout.LBHNC, 16),
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_block_views_save_and_load_whole_vllm_blocks_bit_exact(backend: str) -> None:
    spec, layout, kernel_block = BACKENDS[backend]
    config = _config((LAYERS, spec))
    views = _views(config, layout, kernel_block)
    ratio = spec.block_size // kernel_block
    saved = {name: view[: 4 * ratio].clone() for name, view in views.items()}
    untouched = {name: view[8 * ratio :].clone() for name, view in views.items()}
    cache = _worker(views, config)
    try:
        assert cache.layout.block_size == spec.block_size
        assert cache.layout.kv_factor == (1 if isinstance(spec, MLAAttentionSpec) else 2)
        _round_trip(cache, [(0,), (1,), (2,), (3,)], [(4,), (5,), (6,), (7,)])
    finally:
        cache.close()
    for name, view in views.items():  # vLLM blocks 4-7 are kernel blocks 4r..8r
        assert torch.equal(view[4 * ratio : 8 * ratio], saved[name])
        assert torch.equal(view[8 * ratio :], untouched[name])


def test_a_ratio_2_attention_view_is_two_kernel_blocks_of_k_and_v_not_one_mla_latent() -> None:
    spec, layout, kernel_block = BACKENDS["FlashInfer HND, ratio 2"]
    config = _config((LAYERS, spec))
    kv, kv_layout = engine_kv(_views(config, layout, kernel_block), config, [spec])
    assert kv.block_shape[0] == 2  # the kernel blocks of one vLLM block
    assert (kv_layout.kv_factor, kv_layout.block_size) == (2, 64)


def test_views_that_are_no_whole_number_of_kernel_blocks_per_block_are_refused() -> None:
    views = {name: torch.zeros(NUM_BLOCKS * 2 + 1, 2, 32, 64) for name in LAYERS}
    config = _config((LAYERS, _attention(64)))
    with pytest.raises(UnsupportedKVCache, match=r"^kvtier cannot address .* 12 blocks of 64"):
        engine_kv(views, config, cached_groups(config))


def test_views_whose_blocks_are_not_the_specs_pages_are_refused() -> None:
    views = {name: torch.zeros(NUM_BLOCKS, 2, 32, 48, dtype=torch.bfloat16) for name in LAYERS}
    config = _config((LAYERS, _attention(32)))
    with pytest.raises(UnsupportedKVCache, match="does not hold 32 tokens x 2 KV heads x 32"):
        engine_kv(views, config, cached_groups(config))


def test_a_layer_with_kv_of_its_own_outside_every_group_is_refused() -> None:
    config = _config((LAYERS[:1], _attention(32)))
    views = _views(_config((LAYERS, _attention(32))), KVCacheLayout.LBHNC, 32)
    with pytest.raises(UnsupportedKVCache, match=f"layer {LAYERS[1]}, which is in none"):
        engine_kv(views, config, cached_groups(config))


def _window(block_size: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=2,
        head_size=32,
        dtype=torch.bfloat16,
        sliding_window=window,
    )


def test_a_window_is_kept_as_the_state_after_a_position_and_loads_around_the_null_block() -> None:
    config = _config((LAYERS[:1], _attention(32)), (LAYERS[1:], _window(32, 64)))
    views = _views(config, KVCacheLayout.LBHNC, 32)
    full, window = views[LAYERS[0]], views[LAYERS[1]]
    before = {name: view.clone() for name, view in views.items()}
    cache = _worker(views, config)
    try:
        # A position holds the full-attention layer alone; the 64-token window needs the
        # last 2 blocks before a hit's end: a piece each (a slot holds one layer block).
        assert cache.layout.num_layers == 1 and cache.kv.num_pieces == 2
        # Positions 0-3 computed into full-attention blocks 1-4 and window blocks 5-8, the
        # window after position 3 is in blocks 7 and 8. A hit of positions 1-3 past vLLM's
        # own block 0 loads into blocks 9-11 and its window into window block 4 alone: its
        # other block is vLLM's own (the null block in the piece's ids).
        saved = [(1,), (2,), (3,), (4,), *(StatePiece((7, 8), j) for j in range(2))]
        keys = cache.keys([i.to_bytes(16, "little") for i in range(6)])
        cache.save(saved, keys, cache.root, 0)
        loaded = [(9,), (10,), (11,), *(StatePiece((NULL_BLOCK, 4), j) for j in range(2))]
        hit = ConnectorHit(1, host_blocks=5)
        cache.pin("r", keys[1:], keys[0], hit, loaded)
        cache.load("r")
        assert dict(cache.finished_loads()) == {"r": []}
    finally:
        cache.close()
    assert torch.equal(full[9:12], before[LAYERS[0]][2:5])
    assert torch.equal(window[4], before[LAYERS[1]][8])
    untouched = [b for b in range(NUM_BLOCKS) if b not in (4, 9, 10, 11)]  # the null block too
    for name, view in views.items():  # the groups' blocks are views of one buffer
        assert torch.equal(view[untouched], before[name][untouched])


def _state(**kw) -> MambaSpec:  # a gated delta net's conv and recurrent state
    shapes, dtypes = ((3, 64), (2, 16, 32)), (torch.bfloat16, torch.float32)
    page = _attention(32).page_size_bytes  # vLLM pads every group's page to one size
    return MambaSpec(block_size=32, shapes=shapes, dtypes=dtypes, page_size_padded=page, **kw)


REFUSED = {
    "Mamba state kept without prefix caching": (
        _config((LAYERS[:1], _attention(32)), (LAYERS[1:], _state())),
        "mamba_cache_mode 'align', not 'none'",
    ),
    "Mamba state beside speculative decoding's state blocks": (
        _config(
            (LAYERS[:1], _attention(32)),
            (LAYERS[1:], _state(mamba_cache_mode="align", num_speculative_blocks=1)),
        ),
        "beside the extra state blocks of speculative decoding",
    ),
    "groups whose blocks differ in shape": (
        _config((LAYERS[:1], _attention(32)), (LAYERS[1:], _mla(32))),
        "groups have blocks of one shape, and this model's differ (full attention of 2 x 32",
    ),
    "Mamba state alone": (
        _config((LAYERS, _state(mamba_cache_mode="align"))),
        "not a model of state layers alone",
    ),
    "attention sinks": (
        _config(
            (
                LAYERS,
                SinkFullAttentionSpec(
                    block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sink_len=4
                ),
            )
        ),
        "not attention with sink tokens",
    ),
    "KV quantized per token and head": (
        _config((LAYERS, _attention(32, kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD))),
        "quantized as int8_per_token_head",
    ),
    "V narrower than K": (
        _config((LAYERS, _attention(32, head_size_v=16))),
        "packed other than as 32 tokens x 2 heads",
    ),
}


@pytest.mark.parametrize("model", REFUSED)
def test_a_model_kvtier_cannot_hold_is_refused_with_one_sentence(model: str) -> None:
    config, words = REFUSED[model]
    with pytest.raises(UnsupportedKVCache) as refused:
        cached_groups(config)
    message = str(refused.value)
    assert words in message
    assert message.startswith("kvtier ") and message.endswith(".") and "\n" not in message


CACHED = {
    "full attention": [(LAYERS, _attention(32))],
    "MLA": [(LAYERS, _mla(64))],
    "sliding window beside full attention": [
        (LAYERS[:1], _attention(32)),
        (LAYERS[1:], _window(32, 64)),
    ],
}


@pytest.mark.parametrize("model", CACHED)
def test_full_attention_sliding_windows_and_mla_are_cached_group_by_group(model: str) -> None:
    groups = CACHED[model]
    assert cached_groups(_config(*groups)) == [spec for _, spec in groups]


def test_a_positions_kv_and_the_state_after_it_load_bit_exact_into_other_blocks() -> None:
    linear = ["model.layers.0.linear_attn", "model.layers.1.linear_attn"]
    state = _state(mamba_cache_mode="align")
    config = _config(
        (linear[:1], state),
        (linear[1:], state),
        (["model.layers.2.self_attn.attn"], _attention(32)),
    )
    views = _views(config, KVCacheLayout.LBHNC, 32)
    full = views["model.layers.2.self_attn.attn"]
    before = {name: view.clone() for name, view in views.items()}
    cache = _worker(views, config)
    try:
        pieces = cache.kv.num_pieces
        assert pieces == 2  # two layers' state of 4480 B each, slots of 8192 B
        # Positions 0-1 in attention blocks 1-2, the state after position 1 in the state
        # groups' blocks 3 and 4; loaded into blocks 5-6, and 7 and 8.
        saved = [(1,), (2,), *(StatePiece((3, 4), j) for j in range(pieces))]
        loaded = [(5,), (6,), *(StatePiece((7, 8), j) for j in range(pieces))]
        _round_trip(cache, saved, loaded)
    finally:
        cache.close()
    assert torch.equal(full[5:7], before["model.layers.2.self_attn.attn"][1:3])
    assert torch.equal(views[linear[0]][7], before[linear[0]][3])
    assert torch.equal(views[linear[1]][8], before[linear[1]][4])
    untouched = [b for b in range(NUM_BLOCKS) if b not in (5, 6, 7, 8)]
    for name, view in views.items():
        assert torch.equal(view[untouched], before[name][untouched])


def test_a_store_written_with_another_state_layout_is_never_read() -> None:
    linear, full = ["model.layers.0.linear_attn"], ["model.layers.1.self_attn.attn"]
    narrow = _state(mamba_cache_mode="align")
    wide = MambaSpec(
        block_size=32,
        shapes=((3, 64), (2, 16, 48)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=_attention(32).page_size_bytes,
        mamba_cache_mode="align",
    )
    roots = []
    for state in (narrow, wide):
        config = _config((linear, state), (full, _attention(32)))
        cache = _worker(_views(config, KVCacheLayout.LBHNC, 32), config)
        roots.append(cache.root)
        cache.close()
    assert roots[0] != roots[1]  # the same attention, other state: keys of their own
