"""The transformers adapter: a real Llama served through every tier computes what a
full recompute computes.

Tolerance: the suffix's logits are compared with ``atol=1e-5`` (float32). A hit
changes only how much of the prompt one forward pass covers, so the suffix's matmuls
may be blocked differently than in the full pass; on this CPU they come out equal,
but nothing promises bit equality of a float reduction across shapes. Greedy tokens
must be exactly equal. The model and the GPU tier run on CUDA where there is a device.
"""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from redis_servers import LOCAL_URL, delete_prefix, unique_prefix  # noqa: E402

from kvtier.config import parse_config  # noqa: E402
from kvtier.integrations.hf import CachedLM, layout_for, recompute, weights_id  # noqa: E402

BLOCK = 8
VOCAB = 256
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def model() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=512,
    )
    return transformers.LlamaForCausalLM(cfg).eval().to(DEVICE)


def block_nbytes(model) -> int:
    return layout_for(model, BLOCK).block_nbytes


def tiers(model, gpu_blocks: int = 64, host_blocks: int = 64, **spill) -> dict:
    return {
        "layout": {"block_size": BLOCK, "num_layers": 1, "num_kv_heads": 1, "head_dim": 1},
        "tiers": {
            "gpu": {"num_blocks": gpu_blocks, "device": str(DEVICE)},
            "cpu": {"capacity": host_blocks * block_nbytes(model), "write_policy": "eager"},
            **spill,
        },
    }


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def recompute_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens], device=DEVICE)).logits[0]


def plain_generate(model, tokens: list[int], n: int) -> list[int]:
    ids = torch.tensor([tokens], device=DEVICE)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(tokens) :].tolist()


def assert_served_like_recompute(lm: CachedLM, model, tokens: list[int], tier: str) -> None:
    """``tokens`` hits in ``tier``; suffix logits and greedy tokens equal a recompute."""
    result = lm.prefill(tokens)
    assert result.hit.tokens_per_tier().get(tier, 0) > 0, result.hit.tokens_per_tier()
    assert result.cached_tokens == result.hit.num_tokens > 0
    expected = recompute_logits(model, tokens)[result.cached_tokens :]
    torch.testing.assert_close(result.logits, expected, rtol=0, atol=1e-5)
    gen = lm.generate(tokens, 12)
    assert gen.cached_tokens > 0
    assert gen.tokens == plain_generate(model, tokens, 12)


def test_layout_comes_from_the_model_config(model):
    layout = layout_for(model, BLOCK)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 2, 16)
    assert layout.dtype == torch.float32 and layout.block_size == BLOCK


def test_a_model_without_a_name_must_be_given_an_id(model, tmp_path):
    with pytest.raises(ValueError, match="model_id"):
        CachedLM(model, parse_config(tiers(model)))


def test_a_sliding_window_model_is_refused_by_name():
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=32,
    )
    with pytest.raises(ValueError, match="MistralForCausalLM uses sliding-window"):
        layout_for(transformers.MistralForCausalLM(cfg))


def test_a_first_prompt_computes_everything_and_matches_generate(model):
    with CachedLM(model, parse_config(tiers(model)), model_id="tiny") as lm:
        tokens = prompt(45, seed=1)
        gen = lm.generate(tokens, 10)
        assert gen.cached_tokens == 0 and gen.ttft_seconds <= gen.seconds
        assert gen.tokens == plain_generate(model, tokens, 10)


def test_gpu_hit_serves_a_shared_prefix_like_recompute(model):
    with CachedLM(model, parse_config(tiers(model)), model_id="tiny") as lm:
        system = prompt(40, seed=2)
        lm.prefill(system + prompt(9, seed=3))
        assert_served_like_recompute(lm, model, system + prompt(13, seed=4), "gpu")


def test_host_hit_after_gpu_eviction_is_served_like_recompute(model):
    # 8 GPU blocks: every other prompt evicts the first one's blocks to the host pool.
    with CachedLM(model, parse_config(tiers(model, gpu_blocks=8)), model_id="tiny") as lm:
        first = prompt(40, seed=5)
        lm.prefill(first)
        lm.prefill(prompt(60, seed=6))
        assert_served_like_recompute(lm, model, first + prompt(10, seed=7), "cpu")


def test_the_reply_is_cached_for_the_next_turn(model):
    with CachedLM(model, parse_config(tiers(model)), model_id="tiny") as lm:
        turn1 = prompt(30, seed=8)
        reply = lm.generate(turn1, 20).tokens
        turn2 = turn1 + reply + prompt(6, seed=9)
        hit = lm.prefill(turn2).cached_tokens
        # Everything but the reply's last token (never fed back) is whole-block cached.
        assert hit == (len(turn1) + len(reply) - 1) // BLOCK * BLOCK


def second_instance_hits(model, config: dict, tier: str) -> None:
    """What one CachedLM computed, a fresh one (new GPU and host pools) loads from
    ``tier`` and serves like a recompute."""
    tokens = prompt(64, seed=10)
    with CachedLM(model, parse_config(config), model_id="tiny") as first:
        first.prefill(tokens)
        first.cache.flush()
    with CachedLM(model, parse_config(config), model_id="tiny") as second:
        assert_served_like_recompute(second, model, tokens + prompt(5, seed=11), tier)


def test_disk_hit_in_a_fresh_cache_is_served_like_recompute(model, tmp_path):
    disk = {
        "path": str(tmp_path / "lmdb"),
        "capacity": "16MiB",
        "chunk_blocks": 2,
        "write_policy": "write_through",
    }
    second_instance_hits(model, tiers(model, disk=disk), "disk")


@pytest.mark.redis
def test_redis_hit_in_a_fresh_cache_is_served_like_recompute(model, real_client):
    prefix = unique_prefix("kvtier-hf")
    redis = {"url": LOCAL_URL, "key_prefix": prefix, "chunk_blocks": 4}
    try:
        second_instance_hits(model, tiers(model, redis=redis), "redis")
    finally:
        assert delete_prefix(real_client, prefix) > 0  # it really went through Redis


def test_weights_id_names_the_weights_not_the_shapes(model):
    twin = transformers.LlamaForCausalLM(model.config).eval().to(DEVICE)
    twin.load_state_dict(model.state_dict())
    other = transformers.LlamaForCausalLM(model.config).eval().to(DEVICE)  # new weights
    assert weights_id(twin) == weights_id(model) != weights_id(other)


def test_recompute_is_plain_generate_with_its_time_to_first_token(model):
    tokens = prompt(33, seed=12)
    base = recompute(model, tokens, 8)
    assert base.tokens == plain_generate(model, tokens, 8)
    assert 0 < base.ttft_seconds <= base.seconds and base.hit is None
