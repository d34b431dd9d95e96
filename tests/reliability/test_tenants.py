"""Tenants sharing kvtier never see each other's KV.

- A cache salt (``hashing.salt``) starts a disjoint chain: a request under one salt
  never hits blocks stored under another salt, or under no salt, in any tier.
- LoRA names and multimodal inputs are domain-separated extra keys: no choice of
  name reaches another adapter's, another input's, or a salt's key space.
- A Redis ``key_prefix`` separates deployments on one Redis even when their chains
  are identical; Redis ACLs can confine a deployment to its prefix, and a user that
  may not touch the prefix only produces counted errors.

The salt is per cache (config), not per request: ``lookup`` takes only ``ExtraKeys``
(LoRA, multimodal). GPU and host pools therefore belong to one salt; what the pool
test shows is that another salt's chain hashes are not in them at all.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path
from typing import Any

import fakeredis
import pytest
from redis_servers import LOCAL_URL, RedisServer, delete_prefix, unique_prefix

from kvtier.cache import PrefixHit, TieredCache
from kvtier.config import parse_config
from kvtier.hashing import BlockHasher, ExtraKeys, MultiModalInput, namespace_root
from kvtier.synthetic import serve
from kvtier.tiers.base import SpillTier
from kvtier.tiers.lmdb import LMDBTier
from kvtier.tiers.redis import RedisTier

BLOCK_SIZE = 4
BLOCK_NBYTES = 2 * 2 * BLOCK_SIZE * 2 * 8 * 4  # the layout below: 1 KiB per block
PROMPT_BLOCKS = 12
FULL_HIT = PROMPT_BLOCKS * BLOCK_SIZE  # a hit never covers the prompt's last token
MODEL = "tenants"


def config(
    salt: str = "", redis: dict[str, Any] | None = None, gpu: int = 16, host: int = 16
) -> dict:
    tiers: dict[str, Any] = {
        "gpu": {"num_blocks": gpu, "device": "cpu"},
        "cpu": {"capacity": host * BLOCK_NBYTES, "write_policy": "eager"},
    }
    if redis is not None:
        tiers["redis"] = {
            "chunk_blocks": 4,
            "write_policy": "write_through",
            "ttl": None,
            "socket_timeout": 0.5,
            "connect_timeout": 0.5,
            **redis,
        }
    return {
        "model": MODEL,
        "layout": {
            "num_layers": 2,
            "block_size": BLOCK_SIZE,
            "num_kv_heads": 2,
            "head_dim": 8,
            "dtype": "float32",
        },
        "hashing": {"salt": salt},
        "tiers": tiers,
    }


def make_cache(
    salt: str = "",
    tiers: list[SpillTier] | None = None,
    redis: dict[str, Any] | None = None,
    **kw: Any,
) -> TieredCache:
    return TieredCache(parse_config(config(salt, redis, **kw)), tiers=tiers)


def prompt(seed: int, blocks: int = PROMPT_BLOCKS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(blocks * BLOCK_SIZE + 1)]


def push_down(cache: TieredCache, seeds: range = range(8), blocks: int = 6) -> None:
    """Serve fresh prompts until earlier ones have left the GPU and host pools."""
    for s in seeds:
        serve(cache, f"filler{s}", prompt(10_000 + s, blocks))
    cache.flush()


def probe(cache: TieredCache, tokens: list[int], extra: ExtraKeys | None = None) -> PrefixHit:
    """A lookup that leaves nothing behind."""
    hit = cache.lookup("probe", tokens, extra)
    cache.free("probe")
    return hit


def serve_with(
    cache: TieredCache, req_id: str, tokens: list[int], extra: ExtraKeys | None
) -> tuple[PrefixHit, int]:
    """``serve`` with extra keys (every loaded block checked); returns (hit, valid)."""
    served = serve(cache, req_id, tokens, extra=extra)
    return served.hit, served.valid_tokens


def hashes_under(cache: TieredCache, salt: str, tokens: list[int]) -> list[bytes]:
    """The block hashes of ``tokens`` that a cache with ``salt`` (and otherwise the same
    model, layout and algorithm as ``cache``) computes."""
    algorithm = cache.config.hashing.algorithm
    root = namespace_root(MODEL, cache.layout.fingerprint, salt, algorithm)
    return BlockHasher(root, BLOCK_SIZE, algorithm).hash_blocks(tokens)


# --- cache salts ----------------------------------------------------------------------


def test_another_salts_chain_is_in_neither_the_gpu_nor_the_host_pool():
    cache = make_cache("tenant-a", gpu=32, host=32)
    try:
        tokens = prompt(1)
        serve(cache, "a", tokens)  # eager: every committed block is on the GPU and on host
        own = hashes_under(cache, "tenant-a", tokens)
        assert own == cache.manager.hasher.hash_blocks(tokens)
        assert len(cache.gpu.lookup(own)) == len(cache.host.lookup(own)) == PROMPT_BLOCKS
        for other in ("tenant-b", ""):
            theirs = hashes_under(cache, other, tokens)
            assert not set(theirs) & set(own)
            assert cache.gpu.lookup_each(theirs) == [None] * PROMPT_BLOCKS
            assert cache.host.lookup_each(theirs) == [None] * PROMPT_BLOCKS
    finally:
        cache.close()


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_a_salt_never_hits_another_salts_chunks_in_a_shared_spill_tier(kind, tmp_path):
    """Every cache here shares one LMDB directory (opened in turn) or one Redis key
    prefix and namespace (fakeredis): only the salted chain root separates them. Each
    reader starts with empty GPU and host pools, so any hit comes from the shared tier."""
    server = fakeredis.FakeServer()

    def shared() -> SpillTier:
        if kind == "disk":
            return LMDBTier(tmp_path / "lmdb", 64 << 20, chunk_blocks=4)
        client = fakeredis.FakeRedis(server=server)
        return RedisTier(client, "shared", 4, ttl=None, key_prefix="tenants")

    tokens = prompt(1)
    with make_cache("tenant-a", [shared()]) as writer:
        serve(writer, "w", tokens)
        push_down(writer)  # the prompt's chunks are in the shared tier now
    for other in ("tenant-b", ""):
        with make_cache(other, [shared()]) as reader:
            hit = probe(reader, tokens)
            assert hit.num_tokens == 0, f"salt {other!r} hit salt 'tenant-a': {hit}"
            assert reader.stats()[kind].errors == 0  # a clean miss
    with make_cache("tenant-a", [shared()]) as same:
        served = serve(same, "r", tokens)  # checks the loaded KV bit for bit
        assert served.hit.tokens_per_tier()[kind] == served.valid_tokens == FULL_HIT


# --- extra keys -------------------------------------------------------------------------


def test_lora_adapters_never_share_blocks_with_each_other_or_the_base_model():
    cache = make_cache(gpu=64, host=64)
    try:
        tokens = prompt(2)
        adapter = ExtraKeys(lora="adapter-1")
        serve_with(cache, "a", tokens, adapter)
        for other in (None, ExtraKeys(lora="adapter-2"), ExtraKeys(lora="")):
            assert probe(cache, tokens, other).num_tokens == 0, other
        hit, valid = serve_with(cache, "again", tokens, adapter)
        assert hit.num_tokens == valid == FULL_HIT
    finally:
        cache.close()


def test_a_lora_named_like_a_salt_does_not_reach_that_salts_chunks():
    """Salt "tenant-a" without LoRA and no salt with LoRA "tenant-a" write to one Redis
    namespace (fakeredis); neither finds the other's chunks."""
    server = fakeredis.FakeServer()

    def cache(salt: str) -> TieredCache:
        tier = RedisTier(fakeredis.FakeRedis(server=server), "shared", 4, None, key_prefix="t")
        return make_cache(salt, [tier], redis={})  # write-through to the shared namespace

    tokens = prompt(3)
    lora = ExtraKeys(lora="tenant-a")
    with cache("tenant-a") as salted, cache("") as adapted:
        serve(salted, "s", tokens)
        serve_with(adapted, "l", tokens, lora)
        salted.flush()
        adapted.flush()
    admin = fakeredis.FakeRedis(server=server)
    assert len(admin.keys("t:shared:*")) == 2 * PROMPT_BLOCKS // 4  # two disjoint chains
    with cache("tenant-a") as salted, cache("") as adapted:
        assert probe(salted, tokens, lora).num_tokens == 0
        assert probe(adapted, tokens).num_tokens == 0
        assert probe(salted, tokens).tokens_per_tier()["redis"] == FULL_HIT
        assert probe(adapted, tokens, lora).tokens_per_tier()["redis"] == FULL_HIT


def test_a_lora_name_spelling_a_multimodal_item_does_not_collide_with_it():
    cache = make_cache(gpu=64, host=64)
    try:
        tokens = prompt(4)
        content = b"0123456789abcdef"
        image = ExtraKeys(mm_inputs=(MultiModalInput(content, offset=0, length=BLOCK_SIZE),))
        # Names whose bytes are the image's item payload, and its whole tagged encoding.
        payload = content + struct.pack("<q", 0)
        encoded = b"M" + struct.pack("<I", len(payload)) + payload
        forged = [ExtraKeys(lora=raw.decode("latin-1")) for raw in (payload, encoded)]
        serve_with(cache, "image", tokens, image)
        for extra in forged:
            assert extra.block_suffix(0, BLOCK_SIZE) != image.block_suffix(0, BLOCK_SIZE)
            assert probe(cache, tokens, extra).num_tokens == 0
        assert probe(cache, tokens, image).num_tokens == FULL_HIT
        other_image = ExtraKeys(mm_inputs=(MultiModalInput(b"x" * 16, 0, BLOCK_SIZE),))
        assert probe(cache, tokens, other_image).num_tokens == 0
        assert probe(cache, tokens).num_tokens == 0  # block 0 differs, so the whole chain
    finally:
        cache.close()


# --- Redis key prefixes and ACLs --------------------------------------------------------


@pytest.mark.redis
def test_deployments_with_different_key_prefixes_never_see_each_others_chunks(real_client):
    """Same model, layout and salt: identical chains and namespace; only the prefix
    differs, on the shared local Redis."""
    prefixes = unique_prefix("deploy-a"), unique_prefix("deploy-b")
    tokens = prompt(5)
    try:
        a, b = (make_cache(redis={"url": LOCAL_URL, "key_prefix": p}) for p in prefixes)
        with a, b:
            serve(a, "a", tokens)
            a.flush()
            assert probe(b, tokens).num_tokens == 0
            serve(b, "b", tokens)
            b.flush()
            assert a.stats()["redis"].errors == b.stats()["redis"].errors == 0
        for p in prefixes:
            assert len(list(real_client.scan_iter(match=p + ":*"))) == PROMPT_BLOCKS // 4
        with make_cache(redis={"url": LOCAL_URL, "key_prefix": prefixes[0]}) as again:
            served = serve(again, "again", tokens)  # checks the loaded KV bit for bit
            assert served.hit.tokens_per_tier()["redis"] == served.valid_tokens == FULL_HIT
    finally:
        for p in prefixes:
            delete_prefix(real_client, p)


ACL_PASSWORD = "acl-pw-" + unique_prefix("x")


@pytest.fixture
def acl_server(tmp_path: Path):
    """A throwaway Redis with two users, each confined to one key prefix."""
    server = RedisServer(tmp_path).start()
    admin = server.client()
    try:
        for user, prefix in (("kv", "tenant-a"), ("kv-b", "tenant-b")):
            admin.execute_command(
                "ACL", "SETUSER", user, "on", f">{ACL_PASSWORD}", f"~{prefix}:*", "+@all"
            )
        yield server, admin
    finally:
        admin.close()
        server.stop()  # nothing persisted: its keys go with it


def acl_cache(server: RedisServer, user: str) -> TieredCache:
    return make_cache(
        redis={
            "url": server.url,
            "username": user,
            "password": "${KVTIER_TEST_ACL_PASSWORD}",
            "key_prefix": "tenant-a",
        }
    )


@pytest.mark.redis
def test_a_user_confined_to_the_key_prefix_stores_and_finds_chunks(acl_server, monkeypatch):
    server, admin = acl_server
    monkeypatch.setenv("KVTIER_TEST_ACL_PASSWORD", ACL_PASSWORD)
    tokens = prompt(6)
    with acl_cache(server, "kv") as writer, acl_cache(server, "kv") as reader:
        serve(writer, "w", tokens)
        writer.flush()
        assert writer.stats()["redis"].blocks_in == PROMPT_BLOCKS
        served = serve(reader, "r", tokens)  # checks the loaded KV bit for bit
        assert served.hit.tokens_per_tier()["redis"] == served.valid_tokens == FULL_HIT
        assert writer.stats()["redis"].errors == reader.stats()["redis"].errors == 0
    keys = admin.keys("*")
    assert len(keys) == PROMPT_BLOCKS // 4
    assert all(k.startswith(b"tenant-a:") for k in keys)


@pytest.mark.redis
@pytest.mark.parametrize("who", ["user-of-another-prefix", "wrong-password"])
def test_a_user_without_access_to_the_prefix_gets_counted_errors_not_exceptions(
    acl_server, monkeypatch, caplog, who
):
    server, admin = acl_server
    if who == "wrong-password":
        monkeypatch.setenv("KVTIER_TEST_ACL_PASSWORD", "not-" + ACL_PASSWORD)
        user = "kv"
    else:
        monkeypatch.setenv("KVTIER_TEST_ACL_PASSWORD", ACL_PASSWORD)
        user = "kv-b"  # may only touch tenant-b:*, configured for tenant-a
    tokens = prompt(7)
    with acl_cache(server, user) as cache:
        for i in range(2):  # the second would hit if the first had stored anything
            served = serve(cache, f"r{i}", tokens)
            assert served.hit.tokens_per_tier().get("redis", 0) == 0
            cache.flush()
        stats = cache.stats()["redis"]
    assert stats.blocks_in == 0
    assert stats.errors >= 2  # the two lookups, and the writes
    assert admin.dbsize() == 0
    assert ACL_PASSWORD not in caplog.text
