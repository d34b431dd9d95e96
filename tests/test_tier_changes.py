"""The spill manager's journal of values that land in a tier or leave it
(``track_tiers`` / ``take_tier_changes``), which the vLLM connector's KV events use."""

from __future__ import annotations

from test_cache_spill import (
    BLOCK_NBYTES,
    config,
    first_spilled_value,
    make_cache,
    prompt,
    push_down,
)

from kvtier.cache import TieredCache
from kvtier.config import parse_config
from kvtier.synthetic import serve
from kvtier.tiers.lmdb import LMDBTier


def blocks_of(tier: LMDBTier, header: int) -> dict[bytes, int]:
    keys = list(tier.keys())
    return {k: (size - header) // BLOCK_NBYTES for k, size in zip(keys, tier.sizes_many(keys))}


def test_without_track_tiers_nothing_is_journaled(tmp_path):
    cache, _ = make_cache(tmp_path)
    serve(cache, "a", prompt(1, 12))
    push_down(cache, range(8))
    assert cache.spill.take_tier_changes() == {}
    cache.close()


def test_each_value_that_lands_is_journaled_with_the_blocks_of_its_run(tmp_path):
    cache, (disk,) = make_cache(tmp_path)
    cache.spill.track_tiers()
    serve(cache, "a", prompt(1, 12))
    push_down(cache, range(8))
    changes = cache.spill.take_tier_changes()
    assert changes["disk"] == blocks_of(disk, cache.spill.shape.header_nbytes)
    assert cache.spill.take_tier_changes() == {}  # taken: the journal starts again
    cache.close()


def test_values_a_full_tier_evicts_are_journaled_as_gone(tmp_path):
    disk = LMDBTier(tmp_path / "lmdb", capacity=4 * (4 * BLOCK_NBYTES + 200), chunk_blocks=4)
    cfg = config(tmp_path)
    del cfg["tiers"]["redis"]
    cache = TieredCache(parse_config(cfg), tiers=[disk])
    cache.spill.track_tiers()
    serve(cache, "a", prompt(1, 12))
    push_down(cache, range(16))  # far more than the disk holds
    changes = cache.spill.take_tier_changes()["disk"]
    gone = {key for key, blocks in changes.items() if not blocks}
    assert gone and not gone & set(disk.keys())
    assert {k for k, blocks in changes.items() if blocks} == set(disk.keys())
    cache.close()


def test_a_value_rejected_on_read_is_journaled_as_gone(tmp_path):
    cache, (disk,) = make_cache(tmp_path)
    cache.spill.track_tiers()
    a = prompt(1, 12)
    key, value = first_spilled_value(cache, disk, a)
    value[-1] ^= 0x40
    disk.put_many([(key, bytes(value))])
    cache.spill.take_tier_changes()
    serve(cache, "a2", a)
    cache.flush()
    assert cache.spill.take_tier_changes()["disk"][key] == 0
    cache.close()
