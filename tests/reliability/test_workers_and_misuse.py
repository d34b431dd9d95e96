"""Reliability: background work that fails, pools with nothing to give, and API misuse.

A failing tier operation or copy must fail alone: it is a miss or a load error, it is
counted, the I/O worker goes on, and every host slot it held comes back. A full pool
answers at once. Misuse gets a clear error or a documented no-op, and the pools'
invariants hold afterwards.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import kvtier.transfer
from kvtier.block_manager import BlockManager
from kvtier.block_pool import PoolStats
from kvtier.cache import LoadError, TieredCache
from kvtier.chunk import ChunkCodec, byte_rows
from kvtier.config import parse_config
from kvtier.gpu_pool import GPUBlockPool
from kvtier.hashing import BlockHasher
from kvtier.layout import KVLayout
from kvtier.synthetic import expected_block, serve
from kvtier.tiers.base import Buffer, SpillTier, TierUsage, ValueSink
from kvtier.tiers.lmdb import LMDBTier

BS = 4  # tokens per block
C = 4  # blocks per disk chunk
LAYOUT = {"num_layers": 2, "block_size": BS, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"}
BLOCK_NBYTES = 2 * 2 * BS * 2 * 8 * 4  # 1 KiB


def make_config(tmp_path: Path, gpu: int = 16, host: int = 16, layout: dict | None = None):
    return parse_config(
        {
            "model": "reliability",
            "layout": dict(layout or LAYOUT),
            "tiers": {
                "gpu": {"num_blocks": gpu, "device": "cpu"},
                "cpu": {"capacity": host * BLOCK_NBYTES},
                "disk": {"path": str(tmp_path / "lmdb"), "capacity": "64MiB", "chunk_blocks": C},
            },
        }
    )


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(blocks * BS + 1)]


def chunk_values(cache: TieredCache, tokens: list[int]) -> list[tuple[bytes, bytes]]:
    """Every chunk of ``tokens`` as the spill path encodes it, from recomputed KV."""
    hashes = cache.manager.hasher.hash_blocks(tokens)
    rows = byte_rows(torch.stack([expected_block(cache, tokens, i) for i in range(len(hashes))]))
    codec = ChunkCodec(cache.layout)
    out = []
    for start in range(0, len(hashes), C):
        end = min(start + C, len(hashes))
        out.append(
            (hashes[end - 1], bytes(codec.encode(hashes[end - 1], start, rows, range(start, end))))
        )
    return out


class FaultyTier(SpillTier):
    """A real tier behind a switch: ``fail[op] = n`` makes the next n calls of ``op``
    raise RuntimeError (not TierError); ``gate`` (when set up) holds get_many until
    it opens. ``workers_only`` limits failures to calls from kvtier's I/O threads."""

    def __init__(self, inner: SpillTier) -> None:
        self.inner = inner
        self.name = inner.name
        self.chunk_blocks = inner.chunk_blocks
        self.fail: Counter[str] = Counter()
        self.raised: Counter[str] = Counter()
        self.workers_only = False
        self.gate: threading.Event | None = None

    def _maybe_fail(self, op: str) -> None:
        on_worker = threading.current_thread().name.startswith(("kvtier-io", "kvtier-spill"))
        if self.fail[op] > 0 and (on_worker or not self.workers_only):
            self.fail[op] -= 1
            self.raised[op] += 1
            raise RuntimeError(f"injected failure in {op}")

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        self._maybe_fail("contains_many")
        return self.inner.contains_many(keys)

    def sizes_many(self, keys: Sequence[bytes]) -> list[int]:
        self._maybe_fail("sizes_many")
        return self.inner.sizes_many(keys)

    def get_many(self, keys: Sequence[bytes], sink: ValueSink) -> list[bool]:
        if self.gate is not None:
            assert self.gate.wait(timeout=20), "gate never opened"
        self._maybe_fail("get_many")
        return self.inner.get_many(keys, sink)

    def put_many(self, items: Sequence[tuple[bytes, Buffer]], only_new: bool = False) -> int:
        self._maybe_fail("put_many")
        return self.inner.put_many(items, only_new)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        self._maybe_fail("delete_many")
        return self.inner.delete_many(keys)

    def keys(self) -> Iterator[bytes]:
        return self.inner.keys()

    def clear(self) -> int:
        return self.inner.clear()

    def usage(self) -> TierUsage:
        return self.inner.usage()

    def put_record(self, name: str, value: bytes) -> None:
        self.inner.put_record(name, value)

    def records(self) -> dict[str, bytes]:
        return self.inner.records()

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def faulty(tmp_path: Path) -> Iterator[tuple[TieredCache, FaultyTier]]:
    tier = FaultyTier(LMDBTier(tmp_path / "lmdb", 64 << 20, chunk_blocks=C))
    cache = TieredCache(make_config(tmp_path), tiers=[tier])
    yield cache, tier
    cache.close()


def store(cache: TieredCache, tier: SpillTier, tokens: list[int]) -> list[tuple]:
    items = chunk_values(cache, tokens)
    assert tier.put_many(items) == len(items)
    return items


def total_errors(cache: TieredCache) -> int:
    return sum(s.errors for s in cache.stats().tiers.values())


def pool_state(pool) -> PoolStats:
    """A pool's counters, less the lookup counters that every lookup bumps."""
    return replace(pool.stats(), queries=0, hits=0)


def assert_settled(cache: TieredCache) -> None:
    """Nothing pinned, nothing leaked: every request is freed and all work is done."""
    cache.flush()
    cache.gpu.check_invariants()
    cache.host.check_invariants()
    assert cache.gpu.num_free == cache.gpu.num_blocks
    assert cache.host.num_free == cache.host.num_blocks


# --- 7. background workers never die silently ----------------------------------------


def test_a_crashing_get_many_is_a_miss_and_the_worker_goes_on(faulty) -> None:
    cache, tier = faulty
    a, b = prompt(1, 12), prompt(2, 12)
    store(cache, tier, a)
    store(cache, tier, b)
    tier.fail["get_many"] = 1
    served = serve(cache, "a", a)  # bit-exact: what did not load is recomputed
    assert served.hit.tokens_per_tier()["disk"] == 48
    assert served.valid_tokens == 0  # the whole load failed: a miss
    assert tier.raised["get_many"] == 1 and total_errors(cache) == 1
    for _ in range(3):  # the workers are alive: later loads succeed
        served = serve(cache, "b", b)
        assert served.valid_tokens == served.hit.num_tokens == 48
    assert_settled(cache)


def test_blocks_a_lookup_promised_and_its_load_did_not_deliver_are_short_loads(faulty) -> None:
    cache, tier = faulty
    a = prompt(1, 12)
    store(cache, tier, a)
    tier.fail["get_many"] = 1
    served = serve(cache, "a", a)
    assert served.hit.tokens_per_tier()["disk"] == 48 and served.valid_tokens == 0
    assert cache.stats()["disk"].short_loads == 12
    served = serve(cache, "b", a)  # on the GPU now: nothing more is short
    assert cache.stats()["disk"].short_loads == 12


def test_a_crashing_get_many_is_counted_against_its_tier(faulty) -> None:
    cache, tier = faulty
    a = prompt(1, 12)
    store(cache, tier, a)
    tier.fail["get_many"] = 1
    serve(cache, "a", a)
    assert cache.stats()["disk"].errors == 1


def test_a_crashing_sizes_many_in_lookup_is_a_miss(faulty) -> None:
    cache, tier = faulty
    a = prompt(1, 12)
    store(cache, tier, a)
    tier.fail["sizes_many"] = 1
    try:
        served = serve(cache, "a", a)  # must not raise
        assert served.hit.num_tokens == 0 and served.valid_tokens == 0
        assert cache.stats()["disk"].errors == 1
        served = serve(cache, "b", a[: 8 * BS + 1])  # the next lookup works
    finally:
        cache.free("a")
    assert_settled(cache)


def test_a_tier_that_flaps_logs_one_down_and_one_back_line_not_one_per_outage(
    faulty, caplog
) -> None:
    cache, tier = faulty
    caplog.set_level(logging.WARNING, logger="kvtier")
    for s in range(20):  # every other lookup fails: 10 outages in well under a minute
        tier.fail["sizes_many"] = s % 2
        serve(cache, f"r{s}", prompt(s, 4))
    assert tier.raised["sizes_many"] == 10
    lines = caplog.messages
    assert len(lines) == 2, lines
    assert "disk tier is down: injected failure in sizes_many" in lines[0]
    assert "disk tier is back; 1 failed calls since it went down" in lines[1]


def test_a_crashing_put_many_is_counted_and_later_writes_land(faulty) -> None:
    cache, tier = faulty
    tier.fail["put_many"] = 3
    prompts = [prompt(10 + s, 6) for s in range(12)]
    for i, p in enumerate(prompts):  # 84 blocks through 16 GPU + 16 host: spills
        serve(cache, f"w{i}", p)
    cache.flush()
    stats = cache.stats()["disk"]
    assert tier.raised["put_many"] == 3 and stats.errors == 3
    assert stats.blocks_in > 0 and stats.dropped == 0  # later writes landed, none refused
    for i, p in enumerate(prompts):
        serve(cache, f"r{i}", p)  # bit-exact
    assert cache.stats()["disk"].blocks_out > 0
    assert_settled(cache)


def test_a_crashing_sizes_many_on_the_write_path_is_counted(faulty) -> None:
    cache, tier = faulty
    tier.workers_only = True  # the size check of a spill write, not of a lookup
    tier.fail["sizes_many"] = 2
    for i in range(12):
        serve(cache, f"w{i}", prompt(10 + i, 6))
    cache.flush()
    stats = cache.stats()["disk"]
    assert tier.raised["sizes_many"] == 2 and stats.errors == 2
    assert stats.blocks_in > 0
    assert_settled(cache)


def test_a_crashing_delete_keeps_rejecting_the_bad_value(faulty) -> None:
    cache, tier = faulty
    a = prompt(1, 12)
    items = store(cache, tier, a)
    key, value = items[1]
    tier.put_many([(key, value[:-3])])  # chunk 1 is truncated
    tier.fail["delete_many"] = 1
    assert serve(cache, "a", a).valid_tokens == 16
    cache.flush()
    stats = cache.stats()["disk"]
    assert (stats.rejected, stats.errors) == (1, 1)
    assert tier.contains_many([key]) == [True]  # the delete failed ...
    assert cache.gpu.reset() and cache.host.reset()  # (forget the recomputed blocks)
    assert serve(cache, "a", a).valid_tokens == 16  # ... so it is rejected again
    cache.flush()
    assert cache.stats()["disk"].rejected == 2
    assert tier.contains_many([key]) == [False]
    assert_settled(cache)


class CopyFaults:
    """``kvtier.transfer._timed_copy`` that fails the next ``n`` copies into ``dst``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real = kvtier.transfer._timed_copy
        self.dst: torch.Tensor | None = None
        self.n = 0
        self.raised = 0
        monkeypatch.setattr(kvtier.transfer, "_timed_copy", self)

    def __call__(self, src, src_ids, dst, dst_ids) -> float:
        if self.n > 0 and dst is self.dst:
            self.n -= 1
            self.raised += 1
            raise RuntimeError("injected torch copy failure")
        return self.real(src, src_ids, dst, dst_ids)


def test_a_failing_offload_copy_is_counted_and_later_offloads_work(faulty, monkeypatch) -> None:
    cache, _ = faulty
    faults = CopyFaults(monkeypatch)
    faults.dst, faults.n = cache.host.slab, 2
    prompts = [prompt(20 + s, 6) for s in range(8)]
    for i, p in enumerate(prompts):
        serve(cache, f"w{i}", p)  # bit-exact
    for i, p in reversed(list(enumerate(prompts))):  # newest first: some come from host
        serve(cache, f"r{i}", p)  # bit-exact
    assert faults.raised == 2
    stats = cache.stats()["cpu"]
    assert stats.errors == 2 and stats.blocks_in > 0 and stats.blocks_out > 0
    assert_settled(cache)


def test_a_failing_prefetch_copy_is_a_miss_and_unpins_its_slots(faulty, monkeypatch) -> None:
    cache, tier = faulty
    a, b = prompt(1, 12), prompt(2, 12)
    store(cache, tier, a)
    store(cache, tier, b)
    faults = CopyFaults(monkeypatch)
    faults.dst, faults.n = cache.gpu.kv, 1
    served = serve(cache, "a", a)  # bit-exact
    assert served.hit.num_tokens == 48 and served.valid_tokens == 0
    assert faults.raised == 1 and total_errors(cache) == 1
    assert cache.host.num_free == cache.host.num_blocks  # staging slots came back
    served = serve(cache, "b", b)
    assert served.valid_tokens == served.hit.num_tokens == 48
    assert_settled(cache)


# --- 8. nothing to evict --------------------------------------------------------------


def hold_all_gpu_blocks(cache: TieredCache) -> list[str]:
    """Requests that hold every GPU block (their KV written and committed)."""
    held = []
    while cache.gpu.num_free >= 4:
        req = f"holder{len(held)}"
        served = serve(cache, req, prompt(900 + len(held), 3)[: 4 * BS], free=False)
        assert len(served.table) == 4
        held.append(req)
    assert cache.gpu.num_free == 0
    return held


def test_allocate_returns_none_at_once_when_every_gpu_block_is_held(faulty) -> None:
    cache, _ = faulty
    held = hold_all_gpu_blocks(cache)
    tables = {r: cache.block_ids(r) for r in held}
    before = pool_state(cache.host)
    p = prompt(5, 2)
    start = time.perf_counter()
    for i in range(100):
        hit = cache.lookup(f"x{i}", p)
        assert cache.allocate(f"x{i}", len(p), hit) is None
        assert cache.free(f"x{i}")
    assert time.perf_counter() - start < 1.0  # no waiting: 100 refusals
    assert (cache.gpu.num_free, pool_state(cache.host)) == (0, before)
    assert {r: cache.block_ids(r) for r in held} == tables
    cache.gpu.check_invariants()
    cache.host.check_invariants()
    for r in held:
        cache.free(r)
    served = serve(cache, "after", p)  # room again
    assert served.valid_tokens == 0
    assert_settled(cache)


def test_allocate_with_a_host_hit_returns_none_and_unpins_the_slots(faulty) -> None:
    cache, _ = faulty
    p = prompt(5, 3)
    serve(cache, "p", p)
    held = hold_all_gpu_blocks(cache)  # evicts p from the GPU into host memory
    hit = cache.lookup("x", p)
    assert len(hit.host_slots) == 3
    free_before = cache.host.num_free
    start = time.perf_counter()
    assert cache.allocate("x", len(p) - hit.num_tokens, hit) is None
    assert time.perf_counter() - start < 0.5  # no waiting
    assert cache.free("x")
    assert cache.host.num_free == free_before  # the hit's slots are not left pinned
    assert cache.host.lookup(cache.manager.hasher.hash_blocks(p)) == list(hit.host_slots)
    cache.gpu.check_invariants()
    cache.host.check_invariants()
    for r in held:
        cache.free(r)
    served = serve(cache, "again", p)
    assert served.valid_tokens == served.hit.num_tokens == 12
    assert_settled(cache)


def test_offloads_are_dropped_and_counted_while_the_host_pool_is_pinned(tmp_path) -> None:
    tier = FaultyTier(LMDBTier(tmp_path / "lmdb", 64 << 20, chunk_blocks=C))
    cache = TieredCache(make_config(tmp_path, gpu=32, host=8), tiers=[tier])
    try:
        p = prompt(1, 12)
        store(cache, tier, p)
        tier.gate = threading.Event()  # disk reads hang until it opens
        hit = cache.lookup("slow", p)
        table = cache.allocate("slow", len(p) - hit.num_tokens, hit)
        assert table is not None and not cache.ready("slow")
        assert cache.host.num_free == 0  # every host slot is staging the slow load

        start = time.perf_counter()
        for i in range(10):  # 50 blocks through the 19 GPU blocks left
            served = serve(cache, f"y{i}", prompt(100 + i, 4))  # bit-exact
            assert served.hit.num_tokens == 0
        assert time.perf_counter() - start < 2.0  # nothing waited for the pinned pool
        stats = cache.stats()["cpu"]
        assert stats.dropped > 0 and stats.blocks_in == 0
        cache.host.check_invariants()
        cache.gpu.check_invariants()

        tier.gate.set()
        valid = cache.wait("slow")
        assert valid == 8 * BS  # the load had 8 staging slots for its 12 blocks
        for i in range(valid // BS):
            assert torch.equal(cache.kv[table[i]], expected_block(cache, p, i))
        for i in range(valid // BS, len(table)):
            if (i + 1) * BS <= len(p):
                cache.kv[table[i]] = expected_block(cache, p, i)
        cache.commit("slow", p)
        assert cache.free("slow")
        assert_settled(cache)
    finally:
        if tier.gate is not None:
            tier.gate.set()
        cache.close()


# --- 9. API misuse --------------------------------------------------------------------


def test_freeing_an_unknown_or_freed_request_is_a_no_op(faulty) -> None:
    cache, _ = faulty
    serve(cache, "r", prompt(1, 3))
    before = (pool_state(cache.gpu), pool_state(cache.host))
    assert cache.free("never-seen") is False
    assert cache.free("r") is False  # serve() freed it already
    assert (pool_state(cache.gpu), pool_state(cache.host)) == before
    assert_settled(cache)


def test_allocating_beyond_the_gpu_pool_returns_none_and_changes_nothing(faulty) -> None:
    cache, _ = faulty
    serve(cache, "r", prompt(1, 3))
    before = pool_state(cache.gpu)
    p = prompt(2, 20)  # 21 blocks for a 16-block pool
    hit = cache.lookup("big", p)
    assert cache.allocate("big", len(p), hit) is None
    assert cache.block_ids("big") == []
    assert pool_state(cache.gpu) == before
    assert cache.free("big")
    assert serve(cache, "r2", prompt(1, 3)).valid_tokens == 12  # the cache still hits
    assert_settled(cache)


def test_committing_more_tokens_than_allocated_raises_naming_the_request(faulty) -> None:
    cache, _ = faulty
    p = prompt(1, 3)
    hit = cache.lookup("short", p)
    cache.allocate("short", 8, hit)
    with pytest.raises(ValueError, match="'short'"):
        cache.commit("short", p)  # 13 tokens, 8 allocated
    assert cache.gpu.num_cached == 0  # nothing was published
    assert cache.commit("short", p[:8]) == 2
    assert cache.free("short")
    assert_settled(cache)


def test_wait_or_commit_of_an_unknown_request_raises_key_error_naming_it(faulty) -> None:
    cache, _ = faulty
    with pytest.raises(KeyError, match="ghost"):
        cache.wait("ghost")
    with pytest.raises(KeyError, match="ghost"):
        cache.commit("ghost", prompt(1, 1))
    assert_settled(cache)


def test_allocating_a_negative_token_count_raises_value_error(faulty) -> None:
    cache, _ = faulty
    p = prompt(1, 3)
    hit = cache.lookup("neg", p)
    try:
        with pytest.raises(ValueError, match="'neg'"):
            cache.allocate("neg", -5, hit)
    finally:
        cache.free("neg")


def test_commit_before_wait_on_a_prefetch_raises_load_error(faulty) -> None:
    cache, tier = faulty
    p = prompt(1, 12)
    store(cache, tier, p)
    hit = cache.lookup("eager", p)
    table = cache.allocate("eager", len(p) - hit.num_tokens, hit)
    with pytest.raises(LoadError, match="'eager'"):
        cache.commit("eager", p)
    assert cache.gpu.num_cached == 0  # nothing was published
    assert cache.wait("eager") == 48
    for i in range(12):
        assert torch.equal(cache.kv[table[i]], expected_block(cache, p, i))
    cache.kv[table[12]] = 0.0  # the engine computes the last token (no full block)
    assert cache.commit("eager", p) == 0  # the 12 loaded blocks were published by wait()
    assert cache.gpu.num_cached == 12
    assert cache.free("eager")
    assert_settled(cache)


def test_a_cache_of_another_layout_never_hits_the_stored_chunks(tmp_path, caplog) -> None:
    p = prompt(1, 12)
    first = TieredCache(make_config(tmp_path))
    items = store(first, first.spill.tiers[0], p)
    first.close()

    other = dict(LAYOUT, head_dim=16)  # same store, another layout: another key space
    cache = TieredCache(make_config(tmp_path, layout=other))
    try:
        disk = cache.spill.tiers[0]
        assert disk.usage().entries == 3
        served = serve(cache, "p", p)  # bit-exact
        assert served.hit.num_tokens == 0
        assert cache.stats()["disk"].rejected == 0
        # Forced: the other layout's value under a key of this layout's chunk.
        (key, _), *_ = chunk_values(cache, p)
        disk.put_many([(key, items[0][1])])
        assert cache.gpu.reset() and cache.host.reset()
        with caplog.at_level("WARNING", logger="kvtier"):
            served = serve(cache, "forced", p)  # bit-exact
        cache.flush()
        assert served.hit.num_tokens == 16 and served.valid_tokens == 0
        assert cache.stats()["disk"].rejected == 1
        assert disk.contains_many([key]) == [False]
        assert any(f"{key.hex()} (layout)" in m for m in caplog.messages), caplog.messages
        assert_settled(cache)
    finally:
        cache.close()


def test_a_block_manager_refuses_a_hasher_of_another_block_size() -> None:
    layout = KVLayout(2, 2, BS, 2, 8, torch.float32)
    pool = GPUBlockPool(8, layout, torch.device("cpu"))
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(pool, BlockHasher(bytes(16), BS * 2))
    pool.check_invariants()
    assert pool.num_free == 8
