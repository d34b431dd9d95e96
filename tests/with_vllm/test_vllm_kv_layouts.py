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
from kvtier.connector import ConnectorCache, ConnectorHit  # noqa: E402
from kvtier.integrations.vllm_layout import (  # noqa: E402
    UnsupportedKVCache,
    cached_spec,
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


def _views(spec, layout: KVCacheLayout, kernel_block: int) -> dict[str, torch.Tensor]:
    """The per-layer views a worker registers: vLLM's allocator, random KV."""
    views = allocate_kv_cache(_config((LAYERS, spec)), torch.device("cpu"), layout, [kernel_block])
    for view in views.values():
        view.copy_(torch.randn(view.shape).to(view.dtype))
    return views


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
    views = _views(spec, layout, kernel_block)
    ratio = spec.block_size // kernel_block
    kv, kv_layout = engine_kv(views, LAYERS, spec, NUM_BLOCKS)
    assert kv_layout.block_size == spec.block_size
    assert kv_layout.kv_factor == (1 if isinstance(spec, MLAAttentionSpec) else 2)
    config = parse_config({"tiers": {"cpu": {"capacity": 8 * kv_layout.block_nbytes}}})
    cache = ConnectorCache(config, kv, kv_layout, "model", "rank0")
    try:
        keys = cache.keys([i.to_bytes(16, "little") for i in range(4)])
        saved = {name: view[: 4 * ratio].clone() for name, view in views.items()}
        untouched = {name: view[8 * ratio :].clone() for name, view in views.items()}
        cache.save([0, 1, 2, 3], keys, cache.root, 0)  # vLLM blocks 0-3
        cache.pin("r", keys, cache.root, ConnectorHit(0, host_blocks=4), [4, 5, 6, 7])
        cache.load("r")
        assert dict(cache.finished_loads()) == {"r": []}
        for name, view in views.items():  # vLLM blocks 4-7 are kernel blocks 4r..8r
            assert torch.equal(view[4 * ratio : 8 * ratio], saved[name])
            assert torch.equal(view[8 * ratio :], untouched[name])
    finally:
        cache.close()


def test_a_ratio_2_attention_view_is_two_kernel_blocks_of_k_and_v_not_one_mla_latent() -> None:
    spec, layout, kernel_block = BACKENDS["FlashInfer HND, ratio 2"]
    kv, kv_layout = engine_kv(_views(spec, layout, kernel_block), LAYERS, spec, NUM_BLOCKS)
    assert kv.block_shape[0] == 2  # the kernel blocks of one vLLM block
    assert (kv_layout.kv_factor, kv_layout.block_size) == (2, 64)


def test_views_that_are_no_whole_number_of_kernel_blocks_per_block_are_refused() -> None:
    views = {name: torch.zeros(NUM_BLOCKS * 2 + 1, 2, 32, 64) for name in LAYERS}
    with pytest.raises(UnsupportedKVCache, match=r"^kvtier cannot address .* 12 blocks of 64"):
        engine_kv(views, LAYERS, _attention(64), NUM_BLOCKS)


def test_views_whose_blocks_are_not_the_specs_pages_are_refused() -> None:
    views = {name: torch.zeros(NUM_BLOCKS, 2, 32, 48, dtype=torch.bfloat16) for name in LAYERS}
    with pytest.raises(UnsupportedKVCache, match="does not hold 32 tokens x 2 KV heads x 32"):
        engine_kv(views, LAYERS, _attention(32), NUM_BLOCKS)


REFUSED = {
    "sliding window beside full attention": (
        _config(
            (LAYERS[:1], _attention(32)),
            (
                LAYERS[1:],
                SlidingWindowSpec(
                    block_size=32,
                    num_kv_heads=2,
                    head_size=32,
                    dtype=torch.bfloat16,
                    sliding_window=64,
                ),
            ),
        ),
        "one group of full-attention or MLA layers, and this model's has 2 "
        "(full attention, sliding-window attention)",
    ),
    "Mamba state alone": (
        _config((LAYERS, MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.bfloat16,)))),
        "not Mamba or linear-attention state",
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
        cached_spec(config)
    message = str(refused.value)
    assert words in message
    assert message.startswith("kvtier ") and message.endswith(".") and "\n" not in message


@pytest.mark.parametrize("spec", [_attention(32), _mla(64)], ids=["full attention", "MLA"])
def test_one_group_of_full_attention_or_mla_is_cached(spec) -> None:
    assert cached_spec(_config((LAYERS, spec))) is spec
