"""kvtier's tiers as KV events, derived on the scheduler side (``TierEvents``) from the
workers' reports, without vLLM: requests are stand-ins with the two fields it reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.connector import ShardReport, ShardSpec, shard_keys
from kvtier.integrations import vllm_events
from kvtier.integrations.vllm_events import Removed, Stored, TierEvents
from kvtier.spill import ValueShape

BLOCK = 4
ALGO = "xxh3_128"


def shards(n: int) -> list[ShardSpec]:
    return [ShardSpec(f"tp{i}/{n} pp0/1", bytes([i + 1]) * 16, ValueShape(0, 1)) for i in range(n)]


def request(num_blocks: int, seed: int = 0) -> SimpleNamespace:
    """vLLM's hashes ``h<seed>.<i>`` and tokens ``seed*1000 + position``."""
    return SimpleNamespace(
        block_hashes=[f"h{seed}.{i}".encode() for i in range(num_blocks)],
        all_token_ids=[seed * 1000 + t for t in range(num_blocks * BLOCK)],
    )


def base_keys(num_blocks: int, seed: int = 0) -> list[bytes]:
    return [f"k{seed}.{i}".encode().ljust(16, b".") for i in range(num_blocks)]


def tracker(num_shards: int, num_blocks: int) -> tuple[TierEvents, list[ShardSpec], list[bytes]]:
    events = TierEvents(ALGO)
    specs = shards(num_shards)
    events.set_shards(specs)
    keys = base_keys(num_blocks)
    events.note(request(num_blocks), keys, 0, num_blocks, BLOCK)
    return events, specs, keys


def own(spec: ShardSpec, keys: list[bytes]) -> list[bytes]:
    return shard_keys(spec.root, keys, ALGO)


def held(spec: ShardSpec, keys: list[bytes], present: bool = True) -> dict[str, ShardReport]:
    return {spec.name: ShardReport(held=dict.fromkeys(own(spec, keys), present))}


def landed(spec: ShardSpec, tier: str, last: bytes, blocks: int) -> dict[str, ShardReport]:
    return {spec.name: ShardReport(stored={tier: {own(spec, [last])[0]: blocks}})}


def test_host_blocks_are_stored_once_as_one_chain_with_hashes_parent_and_tokens():
    events, [spec], keys = tracker(1, 3)
    events.apply(held(spec, keys[1:]))
    [event] = events.take()
    assert isinstance(event, Stored) and event.tier == "cpu"
    assert [b.block_hash for b in event.blocks] == [b"h0.1", b"h0.2"]
    assert event.blocks[0].parent_hash == b"h0.0"
    assert [t for b in event.blocks for t in b.token_ids] == list(range(BLOCK, 3 * BLOCK))
    events.apply(held(spec, keys[1:]))  # reported again: nothing new
    assert events.take() == []


def test_a_block_counts_as_held_only_when_every_shard_holds_it():
    events, (s0, s1), keys = tracker(2, 2)
    events.apply(held(s0, keys))
    assert events.take() == []
    events.apply(held(s1, keys[:1]))
    assert [[b.block_hash for b in e.blocks] for e in events.take()] == [[b"h0.0"]]


def test_a_block_one_shard_loses_is_removed_for_the_replica():
    events, (s0, s1), keys = tracker(2, 2)
    events.apply({**held(s0, keys), **held(s1, keys)})
    events.take()
    events.apply(held(s1, keys[1:], present=False))
    assert events.take() == [Removed("cpu", [b"h0.1"])]
    events.apply(held(s0, keys[1:], present=False))  # no longer held by all already
    assert events.take() == []


def test_a_spill_value_stores_every_block_of_its_run_in_chain_order():
    events, [spec], keys = tracker(1, 4)
    events.apply(landed(spec, "disk", keys[3], 3))
    [event] = events.take()
    assert event.tier == "disk"
    assert [b.block_hash for b in event.blocks] == [b"h0.1", b"h0.2", b"h0.3"]


def test_a_dropped_value_removes_only_blocks_no_other_value_holds():
    events, [spec], keys = tracker(1, 4)
    events.apply(landed(spec, "disk", keys[1], 2))  # a head run: blocks 0-1
    events.apply(landed(spec, "disk", keys[3], 4))  # the whole chunk: blocks 0-3
    events.take()
    events.apply(landed(spec, "disk", keys[3], 0))
    assert events.take() == [Removed("disk", [b"h0.2", b"h0.3"])]


def test_a_longer_run_under_the_same_key_replaces_the_shorter_one():
    events, [spec], keys = tracker(1, 4)
    events.apply(landed(spec, "redis", keys[3], 1))
    events.apply(landed(spec, "redis", keys[3], 4))
    stored = [b.block_hash for e in events.take() for b in e.blocks]
    assert stored == [b"h0.3", b"h0.0", b"h0.1", b"h0.2"]
    events.apply(landed(spec, "redis", keys[3], 0))
    assert events.take() == [Removed("redis", [b"h0.0", b"h0.1", b"h0.2", b"h0.3"])]


def test_a_value_of_a_tier_with_a_ttl_leaves_the_index_that_long_after_it_last_landed():
    now = [0.0]
    events = TierEvents(ALGO, {"redis": 10.0}, clock=lambda: now[0])
    [spec] = shards(1)
    events.set_shards([spec])
    keys = base_keys(2)
    events.note(request(2), keys, 0, 2, BLOCK)
    events.apply(landed(spec, "redis", keys[1], 2))
    assert [e.tier for e in events.take()] == ["redis"]
    now[0] = 8.0
    events.apply(landed(spec, "redis", keys[1], 2))  # written again: lives on
    now[0] = 15.0
    assert events.take() == []
    now[0] = 18.0
    assert events.take() == [Removed("redis", [b"h0.0", b"h0.1"])]


def test_spill_blocks_need_every_shard_too():
    events, (s0, s1), keys = tracker(2, 2)
    events.apply(landed(s0, "disk", keys[1], 2))
    assert events.take() == []
    events.apply(landed(s1, "disk", keys[1], 2))
    assert [e.tier for e in events.take()] == ["disk"]


def test_reset_removes_every_held_block_of_every_tier_and_forgets_them():
    events, [spec], keys = tracker(1, 2)
    report = ShardReport(held=dict.fromkeys(own(spec, keys), True))
    report.stored = {"disk": {own(spec, keys[1:])[0]: 2}}
    events.apply({spec.name: report})
    events.take()
    events.reset()
    assert sorted((e.tier, e.hashes) for e in events.take()) == [
        ("cpu", [b"h0.0", b"h0.1"]),
        ("disk", [b"h0.0", b"h0.1"]),
    ]
    events.apply(held(spec, keys, present=False))  # old keys after the reset: ignored
    assert events.take() == []


def test_ranks_holding_the_same_kv_each_need_it_in_their_host_pool_and_one_copy_below():
    events = TierEvents(ALGO)
    s0, s1 = (ShardSpec(f"tp{i}/2 pp0/1", b"\x01" * 16, ValueShape(0, 1)) for i in range(2))
    events.set_shards([s0, s1])  # MLA's latent on both ranks: one root, one copy below
    keys = base_keys(2)
    events.note(request(2), keys, 0, 2, BLOCK)
    events.apply(held(s0, keys))
    assert events.take() == []  # rank 1's host pool does not hold them yet
    events.apply(held(s1, keys))
    assert [e.tier for e in events.take()] == ["cpu"]
    events.apply(landed(s0, "disk", keys[-1], 2))  # written by rank 0 alone
    [stored] = events.take()
    assert stored.tier == "disk" and [b.block_hash for b in stored.blocks] == [b"h0.0", b"h0.1"]


def test_the_same_shards_handed_again_keep_every_block_held():
    events, [spec], keys = tracker(1, 2)
    events.apply(held(spec, keys))
    events.take()
    events.set_shards(shards(1))  # vLLM repeats the handshake after a wake-up
    assert events.take() == []
    events.apply(held(spec, keys[1:], present=False))
    [removed] = events.take()
    assert isinstance(removed, Removed) and removed.hashes == [b"h0.1"]


def test_other_shards_remove_every_block_the_old_ones_held():
    events, [spec], keys = tracker(1, 2)
    events.apply(held(spec, keys))
    events.take()
    events.set_shards(shards(2))
    [removed] = events.take()
    assert isinstance(removed, Removed) and removed.hashes == [b"h0.0", b"h0.1"]


def test_keys_never_noted_and_other_replicas_shards_are_ignored():
    events, [spec], keys = tracker(1, 2)
    events.apply(held(spec, base_keys(2, seed=9)))
    events.apply({"tp1/2 pp0/1": ShardReport(held=dict.fromkeys(own(spec, keys), True))})
    assert events.take() == []


def test_metadata_of_blocks_no_tier_holds_is_kept_only_for_the_most_recent(monkeypatch):
    monkeypatch.setattr(vllm_events, "RECENT_BLOCKS", 2)
    events, [spec], keys = tracker(1, 4)  # four noted, held nowhere: two remembered
    events.apply(held(spec, keys))
    assert [b.block_hash for e in events.take() for b in e.blocks] == [b"h0.2", b"h0.3"]


def test_events_convert_to_vllms_block_stored_and_removed():
    pytest.importorskip("vllm.distributed.kv_events")
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as as_vllm  # GPU events'

    events, [spec], keys = tracker(1, 2)
    events.apply(held(spec, keys))
    events.apply(held(spec, keys[1:], present=False))
    stored, removed = vllm_events.to_vllm(events.take(), BLOCK)
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == [as_vllm(b"h0.0"), as_vllm(b"h0.1")]
    assert stored.parent_block_hash is None
    assert stored.token_ids == list(range(2 * BLOCK)) and stored.block_size == BLOCK
    assert (stored.medium, stored.locality, stored.ownership) == ("CPU", "LOCAL", "kvtier:cpu")
    assert removed.block_hashes == [as_vllm(b"h0.1")] and removed.medium == "CPU"
