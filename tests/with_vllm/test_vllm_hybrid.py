"""Hybrid models in vLLM's CPU build with kvtier, under vLLM's hybrid KV cache manager:
a sliding-window model, and a gated-delta-net hybrid whose linear-attention state is
cached beside its attention KV.

Each engine is vLLM's offline ``LLM`` in a process of its own
(``kvtier.integrations.vllm_engine``), prefix caching on and vLLM's own cache dropped
before every request, so that a hit can only come from kvtier; vLLM's counters of
prompt tokens by source show where each came from. The reference is vLLM alone under
the same settings. The models are a tiny random Gemma 3 (``conftest.tiny_gemma3``:
sliding windows of 2 blocks beside full attention, four KV cache groups) and a tiny
random Qwen3-Next (``conftest.tiny_qwen3_next``: three gated-delta-net layers, each a
group of Mamba state, before a full-attention one).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from conftest import VOCAB, gemma3_config
from redis_servers import LOCAL_URL, delete_prefix, unique_prefix
from test_vllm_server import corrupt_disk

from kvtier.integrations.vllm_engine import (
    BLOCK_SIZE,
    EngineReport,
    EngineSpec,
    run_engine,
    save_model,
)
from kvtier.workloads import ChatShape

pytestmark = [pytest.mark.vllm, pytest.mark.long, pytest.mark.timeout(900)]

_rng = random.Random(7)
DOCUMENT = [_rng.randrange(3, VOCAB) for _ in range(5 * BLOCK_SIZE)]
# A prompt ending on a block boundary (its last block recomputed: vLLM needs the last
# token's logits) and one a token past it (every full block a hit).
PROMPTS = [DOCUMENT, DOCUMENT + [5]]
SERVED = PROMPTS + PROMPTS  # each once to compute it, then again to hit it


def _engine(model: str, tmp_path: Path, kvtier: dict | None, prompts=SERVED) -> EngineReport:
    # The SSM state in float32, as vLLM's CPU build picks it on CPUs with AVX-512 BF16
    # (without, it keeps it in the model's dtype): the Qwen3-Next's block is then the
    # same 288 tokens on every CPU. No other model here has one.
    spec = EngineSpec(
        model, prompts=prompts, kvtier=kvtier, reset_between=True, max_tokens=8,
        mamba_ssm_cache_dtype="float32",
    )  # fmt: skip
    return run_engine(spec, tmp_path)


def _tiers(disk: Path | None, redis_prefix: str, model: str = "tiny-gemma3") -> dict:
    tiers: dict = {
        "cpu": {"capacity": "4MiB"},
        "redis": {"url": LOCAL_URL, "key_prefix": redis_prefix, "chunk_blocks": 1,
                  "write_policy": "write_through"},
    }  # fmt: skip
    if disk is not None:
        tiers["disk"] = {"path": str(disk), "capacity": "64MiB", "chunk_blocks": 2,
                         "write_policy": "write_through"}  # fmt: skip
    return {"model": model, "tiers": tiers}


@pytest.fixture(scope="module")
def prefix(real_client):
    name = unique_prefix("kvtier-hybrid")
    yield name
    delete_prefix(real_client, name)


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hybrid")


@pytest.fixture(scope="module")
def reference(tiny_gemma3, space) -> list[list[int]]:
    return [r.tokens for r in _engine(tiny_gemma3, space / "alone", None).requests]


@pytest.fixture(scope="module")
def first(tiny_gemma3, space, prefix) -> EngineReport:
    return _engine(tiny_gemma3, space / "first", _tiers(space / "lmdb", prefix))


def test_vllm_keeps_its_hybrid_kv_cache_manager_on_with_kvtier(first):
    assert first.hybrid_kv_cache_manager


def test_a_sliding_window_models_host_hits_reply_as_vllm_alone(first, reference):
    assert [r.tokens for r in first.requests] == reference
    hits = [r.tokens_per_tier.get("cpu", 0) for r in first.requests]
    assert hits == [0, 5 * BLOCK_SIZE, 4 * BLOCK_SIZE, 5 * BLOCK_SIZE]


def test_a_sliding_window_models_hits_read_its_full_attention_layer_and_one_window(first):
    # Hits of 5, 4 and 5 positions: per position the full-attention layer's block, per
    # hit the last 2 blocks (64 tokens) of each of the 3 window layers.
    layer_block = BLOCK_SIZE * 2 * 32 * 2 * 2  # tokens x KV heads x head size x K, V x bf16
    host = first.tiers["cpu"]
    assert host["blocks_out"] == (5 + 4 + 5) + 3 * (3 * 2)
    assert host["bytes_out"] == host["blocks_out"] * layer_block  # 8 KiB a host slot


def test_after_a_restart_a_sliding_window_models_disk_hits_reply_as_vllm_alone(
    tiny_gemma3, space, prefix, first, reference
):
    again = _engine(tiny_gemma3, space / "restart", _tiers(space / "lmdb", prefix), PROMPTS)
    assert [r.tokens for r in again.requests] == reference[:2]
    boundary, past = (r.tokens_per_tier for r in again.requests)
    assert boundary == {"disk": 4 * BLOCK_SIZE}
    assert sum(past.values()) == 5 * BLOCK_SIZE  # the first four now in the host pool


def test_a_second_server_hits_what_the_first_stored_in_redis(
    tiny_gemma3, space, prefix, first, reference
):
    other = _engine(tiny_gemma3, space / "second", _tiers(None, prefix), PROMPTS[::-1])
    assert [r.tokens for r in other.requests] == reference[:2][::-1]
    past, boundary = (r.tokens_per_tier for r in other.requests)
    assert past == {"redis": 5 * BLOCK_SIZE}
    assert boundary == {"cpu": 4 * BLOCK_SIZE}


CONVERSATION = ChatShape(conversations=1, turns=3, system_tokens=40, user_tokens=30,
                         reply_tokens=70)  # fmt: skip


def test_a_sliding_window_models_next_turn_hits_the_last_reply_too(tiny_gemma3, space):
    def chat(kvtier: dict | None, name: str) -> EngineReport:
        spec = EngineSpec(
            tiny_gemma3, chat=CONVERSATION, max_tokens=CONVERSATION.reply_tokens,
            kvtier=kvtier, reset_between=True,
        )  # fmt: skip
        return run_engine(spec, space / name)

    host = {"model": "tiny-gemma3-chat", "tiers": {"cpu": {"capacity": "4MiB"}}}
    alone, cached = chat(None, "chat-alone"), chat(host, "chat")
    assert [r.tokens for r in cached.requests] == [r.tokens for r in alone.requests]
    for before, turn in zip(cached.requests, cached.requests[1:]):
        # Every full block of the last turn, its reply's included (vLLM computed all of it
        # but the last token), up to the block of this prompt's last token.
        computed = before.prompt_tokens + len(before.tokens) - 1
        blocks = min(computed, turn.prompt_tokens - 1) // BLOCK_SIZE
        assert turn.tokens_per_tier == {"cpu": blocks * BLOCK_SIZE}
        assert computed // BLOCK_SIZE > before.prompt_tokens // BLOCK_SIZE  # past the prompt


def test_a_model_of_other_groups_under_the_same_name_misses_what_the_first_stored(
    tmp_path_factory, space, prefix, first
):
    layers = ["sliding_attention", "full_attention"] * 2  # two groups of two layers
    model = save_model(tmp_path_factory.mktemp("tiny-gemma3-2x2"), gemma3_config(layers))
    other = _engine(model, space / "other", _tiers(space / "lmdb", prefix), PROMPTS)
    assert [r.tokens_per_tier for r in other.requests][0] == {}  # nothing below: a miss
    assert other.load_errors == 0


# vLLM makes this model's block 288 tokens (every group's page as large as a state's).
STATE_BLOCK = 288
STATE_DOCUMENT = [_rng.randrange(3, VOCAB) for _ in range(4 * STATE_BLOCK)]
# On a block boundary, and a token past it.
STATE_PROMPTS = [STATE_DOCUMENT, STATE_DOCUMENT + [5]]


def _states(disk: Path | None, redis_prefix: str) -> dict:
    return _tiers(disk, redis_prefix, model="tiny-qwen3-next")


@pytest.fixture(scope="module")
def state_reference(tiny_qwen3_next, space) -> list[list[int]]:
    served = STATE_PROMPTS * 2
    return [r.tokens for r in _engine(tiny_qwen3_next, space / "q-alone", None, served).requests]


@pytest.fixture(scope="module")
def state_first(tiny_qwen3_next, space, prefix) -> EngineReport:
    tiers = _states(space / "q-lmdb", prefix)
    return _engine(tiny_qwen3_next, space / "q-first", tiers, STATE_PROMPTS * 2)


def test_a_gated_delta_net_hybrid_starts_with_kvtier_and_its_host_hits_reply_as_vllm_alone(
    state_first, state_reference
):
    assert state_first.hybrid_kv_cache_manager
    assert [r.tokens for r in state_first.requests] == state_reference
    # vLLM keeps a state where a prefill chunk ended: 3 blocks into the boundary prompt
    # (its last token is computed on its own), 4 into the other once it was served.
    hits = [r.tokens_per_tier for r in state_first.requests]
    assert hits == [
        {},
        {"cpu": 3 * STATE_BLOCK},
        {"cpu": 3 * STATE_BLOCK},
        {"cpu": 4 * STATE_BLOCK},
    ]
    assert state_first.load_errors == 0


def test_after_a_restart_a_gated_delta_net_hybrids_disk_hits_reply_as_vllm_alone(
    tiny_qwen3_next, space, prefix, state_first, state_reference
):
    tiers = _states(space / "q-lmdb", prefix)
    again = _engine(tiny_qwen3_next, space / "q-restart", tiers, STATE_PROMPTS[::-1])
    assert [r.tokens for r in again.requests] == state_reference[:2][::-1]
    past, boundary = (r.tokens_per_tier for r in again.requests)
    assert past == {"disk": 4 * STATE_BLOCK}
    assert boundary == {"cpu": 3 * STATE_BLOCK}  # read from disk by the first one


def test_a_second_server_hits_the_state_the_first_stored_in_redis(
    tiny_qwen3_next, space, prefix, state_first, state_reference
):
    other = _engine(tiny_qwen3_next, space / "q-second", _states(None, prefix), STATE_PROMPTS[::-1])
    assert [r.tokens for r in other.requests] == state_reference[:2][::-1]
    past, boundary = (r.tokens_per_tier for r in other.requests)
    assert past == {"redis": 4 * STATE_BLOCK}
    assert boundary == {"cpu": 3 * STATE_BLOCK}


def test_a_hybrids_corrupt_values_on_disk_are_recomputed_with_vllm_alones_replies(
    tiny_qwen3_next, space, prefix, state_first, state_reference
):
    # vLLM stops the engine on failed block ids of a model with several KV cache groups:
    # the failed loads are reported by request, and vLLM recomputes them.
    store = space / "q-corrupt"
    shutil.copytree(space / "q-lmdb", store)
    corrupt_disk(store)
    again = _engine(tiny_qwen3_next, space / "q-corrupt-run", _states(store, prefix), STATE_PROMPTS)
    assert [r.tokens for r in again.requests] == state_reference[:2]
    assert again.load_errors > 0
