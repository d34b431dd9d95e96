"""TieredCache with spill tiers: chunks go down to LMDB and Redis and come back exact."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from pathlib import Path

import fakeredis
import numpy as np
import pytest
import torch
from redis_servers import unique_prefix, wait_until
from tier_contract import read_all

from kvtier import spill as spill_module
from kvtier.cache import TieredCache
from kvtier.chunk import ChunkCodec, byte_rows
from kvtier.config import parse_config
from kvtier.host_pool import HostPool
from kvtier.layout import KVLayout
from kvtier.spill import SpillManager, SpillRun
from kvtier.synthetic import serve
from kvtier.tiers.lmdb import LMDBTier
from kvtier.tiers.redis import RedisTier
from kvtier.workloads import multi_turn_chat

BLOCK_NBYTES = 2 * 2 * 4 * 2 * 8 * 4  # the layout below: 1 KiB per block


def config(tmp_path: Path, cpu_policy: str = "on_evict", gpu: int = 16, host: int = 16) -> dict:
    return {
        "model": "spill-test",
        "layout": {
            "num_layers": 2,
            "block_size": 4,
            "num_kv_heads": 2,
            "head_dim": 8,
            "dtype": "float32",
        },
        "tiers": {
            "gpu": {"num_blocks": gpu, "device": "cpu"},
            "cpu": {"capacity": host * BLOCK_NBYTES, "write_policy": cpu_policy},
            "disk": {"path": str(tmp_path / "lmdb"), "capacity": "64MiB", "chunk_blocks": 4},
            "redis": {"chunk_blocks": 8, "write_policy": "write_through"},
        },
    }


def make_cache(
    tmp_path: Path, redis: RedisTier | None = None, disk: bool = True, **kw
) -> tuple[TieredCache, list]:
    """A cache over an LMDB tier (chunks of 4) under ``tmp_path`` and/or ``redis``."""
    cfg = parse_config(config(tmp_path, **kw))
    tiers = [LMDBTier(tmp_path / "lmdb", 64 << 20, chunk_blocks=4)] if disk else []
    if redis is not None:
        tiers.append(redis)
    return TieredCache(cfg, tiers=tiers), tiers


def fake_redis(chunk_blocks: int = 8) -> RedisTier:
    return RedisTier(fakeredis.FakeRedis(), "test", chunk_blocks, ttl=None)


def spill_manager(
    tiers: list, write_through: list[str], host: HostPool, max_pending_bytes: int = 1 << 30
) -> SpillManager:
    """A spill manager over ``host`` (guarded by a lock of its own), one write worker."""
    return SpillManager(
        tiers, write_through, host, threading.Lock(), 1, max_pending_bytes=max_pending_bytes
    )


def stored_headers(tier, codec: ChunkCodec) -> list:
    keys = list(tier.keys())
    headers = []
    tier.get_many(keys, lambda i, v: headers.append(codec.decode(v, keys[i])[0]))
    return headers


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(blocks * 4 + 1)]


def push_down(cache: TieredCache, seeds: range, blocks: int = 6) -> None:
    """Serve fresh prompts until earlier ones have left the GPU and host pools."""
    for s in seeds:
        serve(cache, f"filler{s}", prompt(1000 + s, blocks))
    cache.flush()


def test_evicted_chains_come_back_from_disk_bit_exact(tmp_path):
    cache, _ = make_cache(tmp_path)
    a = prompt(1, 12)
    serve(cache, "a", a)
    push_down(cache, range(8))
    again = serve(cache, "a2", a)  # serve() checks every loaded block bit for bit
    assert again.hit.tokens_per_tier().get("disk", 0) > 0
    assert again.valid_tokens == again.hit.num_tokens == 48
    assert cache.stats()["disk"].blocks_out > 0
    cache.close()


def test_a_chunk_covering_blocks_held_above_loads_only_the_missing_ones(tmp_path):
    cache, _ = make_cache(tmp_path)
    a = prompt(1, 12)
    serve(cache, "a", a)
    push_down(cache, range(8))
    serve(cache, "head", a[: 6 * 4 + 1])  # blocks 0-3 load from disk, 4-5 are computed
    hit = cache.lookup("probe", a)
    cache.free("probe")
    assert len(hit.gpu_blocks) == 6
    (run,) = hit.spill
    assert run.chunks[0].start == 4 and run.first_block == 6  # chunk [4, 8) overlaps the GPU
    loaded_before = cache.stats()["disk"].blocks_out
    served = serve(cache, "a2", a)
    assert served.valid_tokens == 48
    assert cache.stats()["disk"].blocks_out - loaded_before == 6  # blocks 6-11 only
    cache.close()


def test_each_tier_stores_chunks_of_its_own_size(tmp_path):
    cache, (disk, redis) = make_cache(tmp_path, fake_redis(), cpu_policy="eager", gpu=24, host=24)
    for s in range(6):
        serve(cache, f"r{s}", prompt(s, 17))
    push_down(cache, range(10))
    codec = ChunkCodec(cache.layout)
    for tier, c in ((disk, 4), (redis, 8)):
        headers = stored_headers(tier, codec)
        assert headers, f"{tier.name} holds no chunk"
        # each value is a run inside one aligned chunk of the tier's size
        assert all(
            h.first_position // c == (h.first_position + h.num_blocks - 1) // c for h in headers
        )
        assert any(h.num_blocks == c for h in headers)
        assert all(h.payload_nbytes == h.num_blocks * cache.layout.block_nbytes for h in headers)
    cache.close()


def test_two_caches_sharing_redis_reuse_each_others_prefixes(tmp_path, backend):
    prefix = unique_prefix("share")
    shared = [backend.tier(key_prefix=prefix, chunk_blocks=8) for _ in range(2)]
    first, _ = make_cache(
        tmp_path / "a", shared[0], disk=False, cpu_policy="eager", gpu=24, host=24
    )
    second, _ = make_cache(tmp_path / "b", shared[1], disk=False, gpu=24, host=24)
    p = prompt(7, 17)
    serve(first, "p", p)
    first.flush()  # write-through chunks are on their way as soon as they are complete
    served = serve(second, "p", p)  # checks the loaded KV bit for bit
    assert served.hit.tokens_per_tier()["redis"] == 64
    assert served.valid_tokens == 64
    first.close()
    second.close()


def test_lookup_costs_one_redis_round_trip(tmp_path, backend):
    cache, (redis,) = make_cache(tmp_path, backend.tier(chunk_blocks=8), disk=False)
    cache.lookup("first", prompt(5, 64))  # learns whether the server runs scripts
    cache.free("first")
    before = redis.round_trips
    cache.lookup("long", prompt(3, 1024))  # a 4k-token prompt
    assert redis.round_trips - before == 1
    cache.free("long")
    cache.close()


def first_spilled_value(
    cache: TieredCache, disk: LMDBTier, a: list[int]
) -> tuple[bytes, bytearray]:
    """Serve ``a``, push it down to ``disk``: the key and a copy of the value holding its
    first blocks."""
    serve(cache, "a", a)
    push_down(cache, range(8))
    hit = cache.lookup("probe", a)
    cache.free("probe")
    key = hit.spill[0].chunks[0].key
    values = []
    disk.get_many([key], lambda i, v: values.append(bytearray(v)))
    return key, values[0]


@pytest.mark.parametrize("damage", ["fingerprint", "truncate", "flip"])
def test_a_damaged_value_is_a_miss_is_deleted_and_counted(tmp_path, damage):
    cache, (disk,) = make_cache(tmp_path)
    a = prompt(1, 12)
    key, value = first_spilled_value(cache, disk, a)
    if damage == "fingerprint":  # the same bytes, claimed by another layout
        fp = cache.layout.fingerprint
        value[value.index(fp) : value.index(fp) + len(fp)] = bytes(16)
    elif damage == "truncate":
        del value[-7:]
    else:
        value[-1] ^= 0x40
    disk.put_many([(key, bytes(value))])
    served = serve(cache, "a2", a)  # recomputes what did not load; checks what did
    assert served.valid_tokens < served.hit.num_tokens
    cache.flush()
    assert disk.contains_many([key]) == [False]
    assert cache.stats()["disk"].rejected == 1
    cache.close()


def test_disk_tier_hits_after_a_restart_in_a_new_process(tmp_path):
    tests_dir = Path(__file__).parent
    code = f"""
import sys; sys.path.insert(0, {str(tests_dir)!r})
from pathlib import Path
from test_cache_spill import make_cache, prompt, push_down
from kvtier.synthetic import serve
from redis_servers import unique_prefix
cache, _ = make_cache(Path({str(tmp_path)!r}))
serve(cache, "a", prompt(1, 12))
push_down(cache, range(8))
cache.close()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    cache, _ = make_cache(tmp_path)
    served = serve(cache, "a", prompt(1, 12))
    assert served.hit.tokens_per_tier().get("disk", 0) >= 32
    assert served.valid_tokens == served.hit.num_tokens
    cache.close()


def test_a_full_disk_tier_passes_its_evictions_to_redis(tmp_path):
    cfg = config(tmp_path)
    cfg["tiers"]["redis"] = {"chunk_blocks": 4, "write_policy": "write_back"}
    disk = LMDBTier(tmp_path / "lmdb", capacity=8 * (4 * BLOCK_NBYTES + 200), chunk_blocks=4)
    redis = fake_redis(chunk_blocks=4)
    cache = TieredCache(parse_config(cfg), tiers=[disk, redis])
    a = prompt(1, 12)
    serve(cache, "a", a)
    push_down(cache, range(16))  # far more than the disk holds
    assert redis.usage().entries > 0 and cache.stats()["redis"].blocks_in > 0
    served = serve(cache, "a2", a)  # checks every block bit for bit
    assert served.hit.tokens_per_tier().get("redis", 0) > 0
    assert served.valid_tokens == served.hit.num_tokens
    cache.close()


class CountingCodec(ChunkCodec):
    """A codec that counts the values it encodes and the threads it encodes them on;
    it encodes once its ``gate`` is open (from the start, unless cleared)."""

    __slots__ = ("encoded", "threads", "gate")

    def __init__(self, layout) -> None:
        super().__init__(layout)
        self.encoded = 0
        self.threads: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def encode_many(self, src, chunks):
        self.threads.append(threading.current_thread().name)
        assert self.gate.wait(10)
        self.encoded += len(chunks)
        return super().encode_many(src, chunks)


class FailingCodec(ChunkCodec):
    """A codec whose every encode fails."""

    __slots__ = ()

    def encode_many(self, src, chunks):
        raise RuntimeError("encode failed")


def host_with_chain(blocks: int) -> tuple[HostPool, list[int]]:
    """A host pool holding one chain of ``blocks`` published blocks, in reversed slots."""
    layout = KVLayout(num_layers=2, kv_factor=2, block_size=4, num_kv_heads=2, head_dim=8,
                      dtype=torch.float32)  # fmt: skip
    host = HostPool(blocks, layout, pin_memory=False)
    slots = host.allocate(blocks)[::-1]
    hashes = [bytes([i]) * 16 for i in range(1, blocks + 1)]
    host.publish(slots, hashes, range(blocks), [bytes(16), *hashes[:-1]])
    byte_rows(host.slab)[:] = np.random.default_rng(0).integers(0, 256, (blocks, BLOCK_NBYTES))
    return host, slots


def test_write_through_sends_the_chunks_of_one_publish_as_one_batch():
    host, slots = host_with_chain(16)
    redis = fake_redis(chunk_blocks=4)
    redis.sizes_many([bytes(16)])  # learns that fakeredis runs no scripts
    spill = spill_manager([redis], ["redis"], host)
    before = redis.round_trips
    spill.on_host_publish(host.cached_blocks(slots))
    spill.flush()
    assert redis.round_trips == before + 1  # one write of all 4 chunks, no size query
    assert len(list(redis.keys())) == 4
    spill.close()


def test_write_through_encodes_on_the_encoder_thread_with_the_slots_pinned_until_then():
    host, slots = host_with_chain(8)
    host.free(slots)  # cached and evictable
    redis = fake_redis(chunk_blocks=4)
    spill = spill_manager([redis], ["redis"], host)
    spill.codec = codec = CountingCodec(host.layout)
    codec.gate.clear()
    spill.on_host_publish(host.cached_blocks(slots))  # returns before the encode
    assert host.num_free == 0  # no eviction can take the slots before they are encoded
    codec.gate.set()
    spill.flush()
    assert host.num_free == 8 and len(list(redis.keys())) == 2
    assert len(codec.threads) == 1 and codec.threads[0].startswith("kvtier-encode")
    spill.close()


def publish_through_disk_and_redis(tmp_path: Path, disk_chunk_blocks: int) -> tuple:
    """A chain of 8 blocks published, written through to disk (chunks of
    ``disk_chunk_blocks``) and Redis (chunks of 4) by a spill manager whose codec counts
    its encodes: (host, slots, disk, redis, spill, codec)."""
    host, slots = host_with_chain(8)
    disk = LMDBTier(tmp_path / "lmdb", capacity=1 << 20, chunk_blocks=disk_chunk_blocks)
    redis = fake_redis(chunk_blocks=4)
    spill = spill_manager([disk, redis], ["disk", "redis"], host)
    spill.codec = codec = CountingCodec(host.layout)
    spill.on_host_publish(host.cached_blocks(slots))
    spill.flush()
    return host, slots, disk, redis, spill, codec


def test_write_through_tiers_of_one_chunk_size_share_each_chunks_encode(tmp_path):
    host, slots, disk, redis, spill, codec = publish_through_disk_and_redis(tmp_path, 4)
    assert codec.encoded == 2  # two chunks, each encoded once for both tiers
    keys = host.cached_blocks(slots[3::4]).hashes
    found, values = read_all(disk, keys)
    assert found == [True, True] and read_all(redis, keys) == (found, values)
    spill.close()


def test_write_through_tiers_of_different_chunk_sizes_each_encode_their_own_chunks(tmp_path):
    host, slots, disk, redis, spill, codec = publish_through_disk_and_redis(tmp_path, 8)
    assert codec.encoded == 1 + 2
    assert disk.contains_many([host.cached_blocks(slots[7:]).hashes[0]]) == [True]
    assert redis.contains_many(host.cached_blocks(slots[3::4]).hashes) == [True, True]
    spill.close()


def test_a_failed_shared_encode_is_counted_against_every_tier_and_unpins_its_slots(tmp_path):
    host, slots = host_with_chain(8)
    host.free(slots)
    disk = LMDBTier(tmp_path / "lmdb", capacity=1 << 20, chunk_blocks=4)
    redis = fake_redis(chunk_blocks=4)
    spill = spill_manager([disk, redis], ["disk", "redis"], host)
    spill.codec = FailingCodec(host.layout)
    spill.on_host_publish(host.cached_blocks(slots))
    spill.flush()
    counters = spill.counters()
    assert counters["disk"].errors == 1 and counters["redis"].errors == 1
    assert host.num_free == 8 and spill._pending == 0
    spill.close()


def test_a_stuck_write_through_does_not_keep_its_slots_pinned():
    host, slots = host_with_chain(8)
    host.free(slots)
    redis = fake_redis(chunk_blocks=4)
    gate, put_many = threading.Event(), redis.put_many
    redis.put_many = lambda items, only_new=False: gate.wait(10) and put_many(items, only_new)
    spill = spill_manager([redis], ["redis"], host)
    spill.on_host_publish(host.cached_blocks(slots[:4]))  # its write gets stuck
    spill.on_host_publish(host.cached_blocks(slots[4:]))  # its write waits for a worker
    wait_until(lambda: host.num_free == 8, 10, "both encodes to unpin their slots", 0.001)
    assert host.num_free == 8
    assert not any(redis.contains_many(host.cached_blocks(slots[3::4]).hashes))
    gate.set()
    spill.flush()
    assert all(redis.contains_many(host.cached_blocks(slots[3::4]).hashes))
    spill.close()


def test_a_write_larger_than_the_bound_on_bytes_in_flight_goes_when_nothing_else_is_queued():
    host, slots = host_with_chain(8)
    redis = fake_redis(chunk_blocks=4)
    spill = spill_manager([redis], ["redis"], host, max_pending_bytes=1)
    spill.on_host_publish(host.cached_blocks(slots))  # two chunks of 4 KiB in one write
    spill.flush()
    assert all(redis.contains_many(host.cached_blocks(slots[3::4]).hashes))
    assert spill.counters()["redis"].dropped == 0
    spill.close()


def test_a_write_past_the_bound_while_another_is_queued_is_dropped_and_counted():
    host, slots = host_with_chain(8)
    redis = fake_redis(chunk_blocks=4)
    gate, put_many = threading.Event(), redis.put_many
    redis.put_many = lambda items, only_new=False: gate.wait(10) and put_many(items, only_new)
    host.free(slots)
    spill = spill_manager([redis], ["redis"], host, max_pending_bytes=1)
    spill.on_host_publish(host.cached_blocks(slots[:4]))  # queued: its write gets stuck
    wait_until(lambda: host.num_free == 8, 10, "the first encode to unpin its slots", 0.001)
    spill.on_host_publish(host.cached_blocks(slots[4:]))  # past the bound: dropped
    gate.set()
    spill.flush()
    assert redis.contains_many(host.cached_blocks(slots[3::4]).hashes) == [True, False]
    assert spill.counters()["redis"].dropped == 4
    spill.close()


def test_write_through_leaves_a_chunk_the_tier_holds_as_it_is():
    host, slots = host_with_chain(8)
    redis = fake_redis(chunk_blocks=4)
    spill = spill_manager([redis], ["redis"], host)
    held = bytes(spill.codec.encoded_nbytes(4))  # as long as the chunk: another writer's
    redis.put_many([(host.cached_blocks(slots[3:4]).hashes[0], held)])
    spill.on_host_publish(host.cached_blocks(slots))
    spill.flush()
    stored = {}
    keys = host.cached_blocks(slots[3::4]).hashes
    redis.get_many(keys, lambda i, v: stored.__setitem__(i, bytes(v)))
    assert stored[0] == held and len(stored[1]) == spill.codec.encoded_nbytes(4)
    stats = spill.stats()["redis"]
    assert (stats.blocks_in, stats.dropped) == (8, 0)  # the held chunk counts as written
    spill.close()


def test_chunks_a_write_through_landed_are_not_encoded_or_sent_again_on_eviction():
    host, slots = host_with_chain(8)
    redis = fake_redis(chunk_blocks=4)
    spill = spill_manager([redis], ["redis"], host)
    spill.codec = codec = CountingCodec(host.layout)
    spill.on_host_publish(host.cached_blocks(slots))
    spill.flush()
    before, encoded = redis.round_trips, codec.encoded
    spill.on_host_evict(host.cached_blocks(slots[::-1]))
    spill.flush()
    assert (redis.round_trips, codec.encoded) == (before, encoded)
    spill.close()


def test_blocks_a_load_read_from_a_write_through_tier_are_not_encoded_or_sent_again_on_eviction():
    host, slots = host_with_chain(8)
    redis = fake_redis(chunk_blocks=4)
    spill = spill_manager([redis], ["redis"], host)
    spill.codec = codec = CountingCodec(host.layout)
    spill.on_loaded([SpillRun("redis", 0, 8, ())], host.cached_blocks(slots).hashes, 0)
    before = redis.round_trips
    spill.on_host_evict(host.cached_blocks(slots[::-1]))
    spill.flush()
    assert (redis.round_trips, codec.encoded) == (before, 0)
    spill.close()


def test_a_block_read_again_from_a_write_through_tier_is_the_newest_of_its_records():
    """Records beyond twice the host pool's blocks go oldest first: a chain loaded again
    counts from its last load, so the records of other chains go before it."""
    host, slots = host_with_chain(8)
    redis = fake_redis(chunk_blocks=4)
    spill = spill_manager([redis], ["redis"], host)
    spill.codec = codec = CountingCodec(host.layout)
    chain = host.cached_blocks(slots).hashes
    run = [SpillRun("redis", 0, 8, ())]
    spill.on_loaded(run, chain, 0)
    spill.on_loaded(run, [bytes([0xA0, i]) * 8 for i in range(8)], 0)  # another chain
    spill.on_loaded(run, chain, 0)  # read again: now the newest
    spill.on_loaded(run, [bytes([0xB0, i]) * 8 for i in range(8)], 0)  # 24 records: 8 go
    before = redis.round_trips
    spill.on_host_evict(host.cached_blocks(slots[::-1]))
    spill.flush()
    assert (redis.round_trips, codec.encoded) == (before, 0)
    spill.close()


def test_chunks_that_landed_longer_ago_are_offered_again_at_one_size_query_and_no_write(
    monkeypatch,
):
    monkeypatch.setattr(spill_module, "LANDED_SECONDS", 0.0)  # the tier may have dropped them
    host, slots = host_with_chain(8)
    redis = fake_redis(chunk_blocks=4)
    redis.sizes_many([bytes(16)])  # learns that fakeredis runs no scripts
    spill = spill_manager([redis], ["redis"], host)
    spill.on_host_publish(host.cached_blocks(slots))
    spill.flush()
    before, sent = redis.round_trips, redis.commands_sent
    spill.on_host_evict(host.cached_blocks(slots[::-1]))
    spill.flush()
    assert (redis.round_trips, redis.commands_sent) == (before + 1, sent + 2)  # 2 STRLEN
    spill.close()


def test_tiers_of_one_chunk_size_share_each_encoded_value(tmp_path):
    host, slots = host_with_chain(16)
    disk = LMDBTier(tmp_path / "lmdb", 64 << 20, chunk_blocks=4)
    redis = fake_redis(chunk_blocks=4)
    spill = spill_manager([disk, redis], ["redis"], host)
    spill.codec = codec = CountingCodec(host.layout)
    spill.on_host_evict(host.cached_blocks(slots[::-1]))  # tail first, as the pool evicts
    spill.flush()
    assert codec.encoded == 4
    assert len(list(disk.keys())) == len(list(redis.keys())) == 4
    spill.close()


# --- runs inside a chunk: a chunk's tail may reach the tiers before its head -----------


def chat_hits_and_ceilings(cache: TieredCache) -> list[tuple[int, int]]:
    """Serve a multi-turn chat, every spill write landed before each request; for each
    request, (blocks hit, blocks an unbounded cache would hit: those committed before)."""
    committed: set[bytes] = set()
    out = []
    for r in multi_turn_chat(4, 5, system_tokens=16, user_tokens=10, reply_tokens=2, seed=3):
        hashes = cache.manager.hasher.hash_blocks(r.prompt)
        ceiling = 0
        while ceiling < (len(r.prompt) - 1) // 4 and hashes[ceiling] in committed:
            ceiling += 1
        committed.update(hashes)
        cache.flush()
        out.append((serve(cache, r.req_id, r.prompt).hit.num_blocks, ceiling))
    return out


def test_a_chat_finds_every_committed_prefix_though_chunk_tails_spill_before_heads(tmp_path):
    # The GPU evicts chain tails first, so a chunk's tail reaches the host, and leaves
    # it, while its head is still on the GPU: the tail is stored as a run of its own.
    cache, _ = make_cache(tmp_path, gpu=24, host=12)
    results = chat_hits_and_ceilings(cache)
    assert cache.stats()["disk"].blocks_out > 0
    assert cache.stats()["disk"].dropped == 0
    assert [hit for hit, _ in results] == [ceiling for _, ceiling in results]
    cache.close()


LAYOUT = KVLayout(num_layers=2, kv_factor=2, block_size=4, num_kv_heads=2, head_dim=8,
                  dtype=torch.float32)  # fmt: skip
CHAIN = [bytes([i + 1]) * 16 for i in range(8)]  # a chain's block hashes
ROOT = bytes(16)
KV = np.random.default_rng(1).integers(0, 256, (len(CHAIN), BLOCK_NBYTES), dtype=np.uint8)


def cache_blocks(host: HostPool, positions: range) -> list[int]:
    """Put chain blocks ``positions`` (KV ``KV[p]``) into the host pool, cached and free."""
    slots = host.allocate(len(positions))
    byte_rows(host.slab)[slots] = KV[list(positions)]
    parents = [CHAIN[p - 1] if p else ROOT for p in positions]
    host.publish(slots, [CHAIN[p] for p in positions], positions, parents)
    host.free(slots)
    return slots


def evict(spill: SpillManager, host: HostPool, slots: list[int]) -> None:
    """Run the host pool's eviction hook on ``slots`` (tail first) and let writes land."""
    spill.on_host_evict(host.cached_blocks(slots[::-1]))
    spill.flush()


def load(spill: SpillManager, host: HostPool, upto: int) -> tuple[list, int, np.ndarray]:
    """Look chain blocks ``[0, upto)`` up below the host pool and load them: (the runs,
    blocks loaded, their KV)."""
    runs = spill.lookup(CHAIN[:upto], 0)
    slots = host.allocate(upto)
    loaded = spill.load(runs, slots).num_blocks
    kv = byte_rows(host.slab)[slots[:loaded]].copy()
    host.free(slots)
    return runs, loaded, kv


def disk_spill(tmp_path: Path) -> tuple[HostPool, SpillManager, LMDBTier]:
    host = HostPool(8, LAYOUT, pin_memory=False)
    disk = LMDBTier(tmp_path / "lmdb", 64 << 20, chunk_blocks=4)
    spill = spill_manager([disk], [], host)
    return host, spill, disk


def test_a_tail_run_and_the_head_run_written_after_it_load_as_one_chunk(tmp_path):
    host, spill, disk = disk_spill(tmp_path)
    evict(spill, host, cache_blocks(host, range(2, 4)))  # blocks 0-1 are not in the host
    assert host.reset()
    evict(spill, host, cache_blocks(host, range(0, 2)))
    headers = sorted((h.first_position, h.num_blocks) for h in stored_headers(disk, spill.codec))
    assert headers == [(0, 2), (2, 2)]
    (run,), loaded, kv = load(spill, host, 4)
    assert [(c.start, c.num_blocks) for c in run.chunks] == [(0, 2), (2, 2)]
    assert loaded == 4 and np.array_equal(kv, KV[:4])
    spill.close()


def test_lookup_covers_a_prefix_with_the_runs_reaching_furthest(tmp_path):
    host, spill, _ = disk_spill(tmp_path)
    for positions in (range(0, 2), range(0, 3), range(2, 4)):  # runs ending at 1, 2 and 3
        evict(spill, host, cache_blocks(host, positions))
        assert host.reset()
    (run,), loaded, kv = load(spill, host, 4)
    assert [(c.start, c.num_blocks) for c in run.chunks] == [(0, 3), (2, 2)]
    assert loaded == 4 and np.array_equal(kv, KV[:4])  # block 2 comes from the first run
    spill.close()


def test_a_longer_run_replaces_a_shorter_one_under_the_same_key(tmp_path):
    host, spill, disk = disk_spill(tmp_path)
    evict(spill, host, cache_blocks(host, range(2, 4)))
    assert host.reset()
    evict(spill, host, cache_blocks(host, range(0, 4)))
    headers = [(h.first_position, h.num_blocks) for h in stored_headers(disk, spill.codec)]
    assert headers == [(0, 4)]
    spill.close()


def test_a_run_rewritten_shorter_since_the_lookup_is_a_miss_and_is_kept(tmp_path):
    host, spill, disk = disk_spill(tmp_path)
    evict(spill, host, cache_blocks(host, range(0, 4)))
    runs = spill.lookup(CHAIN[:4], 0)
    shorter = spill.codec.encode(CHAIN[3], 2, KV, [2, 3])
    disk.put_many([(CHAIN[3], shorter)])  # e.g. by another process
    result = spill.load(runs, host.allocate(4))
    assert (result.num_blocks, result.bad) == (0, [])
    assert disk.sizes_many([CHAIN[3]]) == [len(shorter)]
    spill.close()


def test_a_shorter_run_in_flight_does_not_hide_the_longer_one_stored(tmp_path):
    host, spill, disk = disk_spill(tmp_path)
    evict(spill, host, cache_blocks(host, range(0, 4)))
    assert host.reset()
    with spill.holding_writes() as held:  # queued, not yet written
        evict(spill, host, cache_blocks(host, range(2, 4)))
    (run,), loaded, kv = load(spill, host, 4)
    assert [(c.start, c.num_blocks) for c in run.chunks] == [(0, 4)]
    assert loaded == 4 and np.array_equal(kv, KV[:4])  # from the tier, not the queue
    spill.start_writes(held)
    spill.flush()
    spill.close()


def test_a_chunk_whose_write_is_in_flight_is_found_and_loaded_from_memory(tmp_path):
    cache, (disk,) = make_cache(tmp_path, disk=True)
    gate = threading.Event()
    put_many = disk.put_many  # a slow disk:
    disk.put_many = lambda items, only_new=False: gate.wait(10) and put_many(items, only_new)
    a = prompt(1, 6)
    serve(cache, "a", a)
    for s in range(5):  # a leaves the GPU and the host pool; its write is stuck
        serve(cache, f"filler{s}", prompt(1000 + s, 6))
    assert disk.sizes_many(cache.manager.hasher.hash_blocks(a)[:6]) == [0] * 6
    served = serve(cache, "a2", a)  # bit-exact
    assert served.hit.tokens_per_tier()["disk"] > 0
    assert served.valid_tokens == served.hit.num_tokens == 24
    gate.set()
    cache.flush()
    assert any(disk.sizes_many(cache.manager.hasher.hash_blocks(a)[:6]))
    cache.close()
