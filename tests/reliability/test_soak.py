"""Soak: several processes share one LMDB store and one Redis through ``TieredCache``.

Every process serves requests drawn from one shared set of prompts; every block any
tier hands back is checked bit for bit against a recompute (``serve``), so a chunk
torn by a concurrent writer, or read under the wrong key, fails the run.

Bounded by ``KVTIER_SOAK_REQUESTS`` per process (default 500, what CI runs); a long
soak is ``KVTIER_SOAK_REQUESTS=20000 pytest -m soak``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis_servers import LOCAL_URL, delete_prefix, local_client, unavailable, unique_prefix

from kvtier.chunk import ChunkCodec
from kvtier.config import parse_config
from kvtier.hashing import namespace_root
from kvtier.tiers.lmdb import LMDBTier
from kvtier.tiers.redis import RedisTier

REQUESTS = int(os.environ.get("KVTIER_SOAK_REQUESTS", "500"))
PROCESSES = 3

WORKER = """
import json, random, sys
from kvtier.cache import TieredCache
from kvtier.config import parse_config
from kvtier.hashing import namespace_root
from kvtier.synthetic import serve

config, seed, requests = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
prompts = [
    [random.Random(1000 + i).randrange(50000) for _ in range(4 * (3 + i % 6) + 1)]
    for i in range(24)
]
rng = random.Random(seed)
with TieredCache(parse_config(config)) as cache:
    hit_tokens = 0
    for i in range(requests):
        served = serve(cache, f"p{seed}-{i}", prompts[rng.randrange(len(prompts))])
        hit_tokens += served.valid_tokens
    cache.flush()
    assert cache.gpu.num_free == cache.gpu.num_blocks, "a GPU block leaked"
    assert cache.host.num_free == cache.host.num_blocks, "a host slot leaked"
    cache.gpu.check_invariants()
    cache.host.check_invariants()
    stats = cache.stats()
    print(json.dumps({
        "requests": requests,
        "hit_tokens": hit_tokens,
        "disk_hits": stats["disk"].hits,
        "redis_hits": stats["redis"].hits,
        "errors": sum(s.errors for s in stats.tiers.values()),
        "rejected": sum(s.rejected for s in stats.tiers.values()),
    }))
"""


def soak_config(tmp_path: Path, prefix: str) -> dict:
    return {
        "model": "soak",
        "layout": {
            "num_layers": 2,
            "block_size": 4,
            "num_kv_heads": 2,
            "head_dim": 8,
            "dtype": "float32",
        },
        "tiers": {
            "gpu": {"num_blocks": 24, "device": "cpu"},
            "cpu": {"capacity": "32KiB"},  # 32 blocks: most hits come from below
            "disk": {"path": str(tmp_path / "lmdb"), "capacity": "256KiB", "chunk_blocks": 4},
            "redis": {
                "url": LOCAL_URL,
                "key_prefix": prefix,
                "chunk_blocks": 4,
                "ttl": "10m",
                "write_policy": "write_through",
            },
        },
    }


@pytest.mark.soak
@pytest.mark.redis
@pytest.mark.timeout(600)
def test_processes_sharing_lmdb_and_redis_serve_exact_kv_and_leak_nothing(tmp_path):
    admin = local_client()
    if admin is None:
        unavailable(f"no Redis server answers at {LOCAL_URL}")
    prefix = unique_prefix("soak")
    config = soak_config(tmp_path, prefix)
    start = time.monotonic()
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", WORKER, json.dumps(config), str(seed), str(REQUESTS)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for seed in range(PROCESSES)
        ]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=540)
            assert p.returncode == 0, f"a soak process failed:\n{err[-3000:]}"
            results.append(json.loads(out.strip().splitlines()[-1]))
        elapsed = time.monotonic() - start
        print(
            f"\n[soak] {PROCESSES} processes x {REQUESTS} requests in {elapsed:.1f} s "
            f"(~{5 * PROCESSES * REQUESTS} cache operations): {results}"
        )
        assert sum(r["disk_hits"] for r in results) > 0
        assert sum(r["redis_hits"] for r in results) > 0
        assert all(r["rejected"] == 0 and r["errors"] == 0 for r in results)
        # Every value left in either tier is whole and valid.
        cfg = parse_config(config)
        codec = ChunkCodec(cfg.layout)
        root = namespace_root(cfg.model, cfg.layout.fingerprint)
        stores = [
            LMDBTier.from_config(cfg.tiers.disk),
            RedisTier.from_config(cfg.tiers.redis, root.hex()[:16]),
        ]
        for tier in stores:
            keys = list(tier.keys())
            assert keys, f"{tier.name} holds nothing after the soak"
            tier.get_many(keys, lambda i, v, keys=keys: codec.decode(v, keys[i]))
            tier.close()
    finally:
        delete_prefix(admin, prefix)
