"""What a lookup promises, a load delivers, or the shortfall is counted (``short_loads``).

A lookup tells the engine how many tokens it will get, and the engine plans its step on
that. The host slots a spill load stages into are taken at ``allocate``, after the
copies down of the blocks that allocation evicts from the GPU; slots those copies left
pinned only for a write-through encode are encoded then and there, so host-pool
pressure does not cut the load. Where the host pool has too few slots at all, the
blocks left out are counted.
"""

from __future__ import annotations

import random
from pathlib import Path

import fakeredis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvtier.cache import TieredCache
from kvtier.config import parse_config
from kvtier.synthetic import Served, serve
from kvtier.tiers.lmdb import LMDBTier
from kvtier.tiers.redis import RedisTier

BS = 16
LAYOUT = {"num_layers": 2, "block_size": BS, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"}
BLOCK_NBYTES = 4096


def disk_cache(
    path: Path, gpu: int, host: int, chunk_blocks: int, cpu_policy: str = "on_evict"
) -> TieredCache:
    """A cache over a write-through disk tier in ``path``."""
    disk = {
        "path": str(path / "lmdb"),
        "capacity": "64MiB",
        "chunk_blocks": chunk_blocks,
        "write_policy": "write_through",
    }
    tiers = {
        "gpu": {"num_blocks": gpu, "device": "cpu"},
        "cpu": {"capacity": host * BLOCK_NBYTES, "write_policy": cpu_policy},
    }
    return TieredCache(
        parse_config({"model": "promise", "layout": LAYOUT, "tiers": {**tiers, "disk": disk}})
    )


def short_loads(cache: TieredCache) -> int:
    return sum(s.short_loads for s in cache.stats().tiers.values())


def push_out(cache: TieredCache, prompt: list[int], others: int, rng: random.Random) -> Served:
    """Serve ``prompt``, then ``others`` prompts of 6-7 blocks that push it out of the GPU
    and host pools, and serve it again (every loaded block checked bit for bit).

    Each request's writes land before the next: a host pool whose slots all wait for a
    write-through encode takes no more copies down, so on a loaded machine the prompt
    could otherwise outlast the others in it."""
    serve(cache, "first", prompt)
    for i in range(others):
        cache.flush()
        serve(cache, f"o{i}", [rng.randrange(50000) for _ in range(BS * rng.choice((6, 7)) + 1)])
    cache.flush()
    return serve(cache, "again", prompt)


def test_a_disk_hit_under_host_pool_pressure_loads_every_promised_block(tmp_path) -> None:
    # 5 blocks on disk; the GPU allocation of the request evicts 6 blocks into a host
    # pool of 8 slots, whose write-through encodes would leave the load 2 free slots.
    for chunk_blocks in (1, 4):
        rng = random.Random(0)
        with disk_cache(tmp_path / str(chunk_blocks), 8, 8, chunk_blocks) as cache:
            served = push_out(cache, [rng.randrange(50000) for _ in range(83)], 40, rng)
            assert served.hit.tokens_per_tier() == {"gpu": 0, "cpu": 0, "disk": 80}
            assert served.valid_tokens == 80
            assert short_loads(cache) == 0


def test_blocks_beyond_the_host_pool_are_trimmed_at_allocate_and_counted(tmp_path) -> None:
    prompt = [random.Random(1).randrange(50000) for _ in range(161)]
    with disk_cache(tmp_path, 16, 16, 2, cpu_policy="eager") as cache:
        serve(cache, "first", prompt)  # all 10 blocks written through to disk
    # Restarted with a host pool of 4 slots: a 10-block disk hit cannot stage through it.
    with disk_cache(tmp_path, 16, 4, 2) as cache:
        served = serve(cache, "again", prompt)
        assert served.hit.tokens_per_tier()["disk"] == 160
        assert served.valid_tokens == 4 * BS
        assert short_loads(cache) == 6


@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict, list[list[int]]]:
    """Tier sizes, chunk sizes and write policies, and prompts that share prefixes: each
    one a new prompt, or an earlier one cut and/or extended (a chat's next turn, a
    shared document with another question)."""
    gpu = draw(st.integers(4, 12))
    tiers = {
        "gpu": {"num_blocks": gpu, "device": "cpu"},
        "cpu": {"capacity": draw(st.integers(1, 12)) * BLOCK_NBYTES},
        "disk": {
            "capacity": draw(st.sampled_from([8, 24, 4096])) * BLOCK_NBYTES,
            "chunk_blocks": draw(st.integers(1, 4)),
            "write_policy": draw(st.sampled_from(["write_back", "write_through"])),
        },
    }
    if draw(st.booleans()):
        tiers["redis"] = {
            "chunk_blocks": draw(st.integers(1, 4)),
            "write_policy": draw(st.sampled_from(["write_back", "write_through"])),
        }
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    prompts: list[list[int]] = []
    for _ in range(draw(st.integers(2, 14))):
        max_tokens = (gpu - 1) * BS  # fits the GPU pool with its last partial block
        base = rng.choice(prompts)[: rng.randrange(1, max_tokens)] if prompts else []
        if rng.random() < 0.3:
            base = []
        n = rng.randrange(max(0, BS + 1 - len(base)), max_tokens - len(base) + 1)
        prompts.append(base + [rng.randrange(50000) for _ in range(n)])
    return tiers, prompts


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_every_load_delivers_what_its_lookup_promised_or_counts_the_shortfall(
    tmp_path_factory, workload
) -> None:
    tiers, prompts = workload
    path = tmp_path_factory.mktemp("promise")
    disk = tiers["disk"]
    stores = [LMDBTier(path / "lmdb", disk["capacity"], disk["chunk_blocks"])]
    if "redis" in tiers:
        stores.append(
            RedisTier(fakeredis.FakeRedis(), "promise", tiers["redis"]["chunk_blocks"], None)
        )
    config = parse_config(
        {
            "model": "promise",
            "layout": LAYOUT,
            "tiers": {**tiers, "disk": {**disk, "path": str(path / "lmdb")}},
        }
    )
    with TieredCache(config, tiers=stores) as cache:
        for i, prompt in enumerate(prompts):
            before = short_loads(cache)
            served = serve(cache, f"r{i}", prompt)  # raises on any block not bit-equal
            short = short_loads(cache) - before
            assert served.valid_tokens == served.hit.num_tokens - short * BS
            below = served.hit.num_blocks - len(served.hit.gpu_blocks)
            event("hit below the GPU" if below else "no hit below the GPU")
            if short:
                event("a load fell short (counted)")
            cache.flush()  # steady state between requests; the next may hit below
