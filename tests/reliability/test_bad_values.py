"""Reliability: every way a stored chunk value can be wrong is a miss, is deleted, is
counted, and is never loaded into KV (design rule 3); and nothing ever unpickles.
An empty value is the one exception to "deleted, counted": a size query cannot tell
it from an absent key (Redis STRLEN), so the lookup never reads it: a plain miss.

Values are injected straight into a tier (LMDB, fakeredis) under the key of a real
chunk of a prompt whose every chunk is stored there, so a lookup finds them. Chunk 0
of the prompt stays intact: a probe must load exactly its 4 blocks, reject chunk 1,
and recompute the rest.
"""

from __future__ import annotations

import logging
import pickle
import random
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import fakeredis
import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kvtier
from kvtier.cache import TieredCache
from kvtier.chunk import MAGIC, BadChunk, ChunkCodec, byte_rows
from kvtier.config import parse_config
from kvtier.layout import KVLayout
from kvtier.synthetic import expected_block, serve
from kvtier.tiers.base import SpillTier
from kvtier.tiers.lmdb import LMDBTier
from kvtier.tiers.redis import RedisTier

BS = 4  # tokens per block
C = 4  # blocks per chunk in both tiers
LAYOUT = {"num_layers": 2, "block_size": BS, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"}
BLOCK_NBYTES = 2 * 2 * BS * 2 * 8 * 4  # 1 KiB
PROMPT_BLOCKS = 12  # three chunks: [0, 4), [4, 8), [8, 12)
BAD = 1  # the chunk that gets corrupted; chunk 0 stays good
REJECTED = re.compile(r"rejected (\w+) value ([0-9a-f]+) \((\w+)\)")


def make_config(tmp_path: Path, kind: str, gpu: int = 32, host: int = 32) -> dict:
    spill = (
        {"disk": {"path": str(tmp_path / "lmdb"), "capacity": "64MiB", "chunk_blocks": C}}
        if kind == "disk"
        else {"redis": {"chunk_blocks": C, "write_policy": "write_back"}}
    )
    return {
        "model": "reliability",
        "layout": dict(LAYOUT),
        "tiers": {
            "gpu": {"num_blocks": gpu, "device": "cpu"},
            "cpu": {"capacity": host * BLOCK_NBYTES},
            **spill,
        },
    }


def open_tier(tmp_path: Path, kind: str) -> SpillTier:
    if kind == "disk":
        return LMDBTier(tmp_path / "lmdb", 64 << 20, chunk_blocks=C)
    return RedisTier(fakeredis.FakeRedis(), "reliability", C, ttl=None)


@pytest.fixture(params=["disk", "redis"])
def setup(request, tmp_path: Path) -> Iterator[tuple[TieredCache, SpillTier]]:
    tier = open_tier(tmp_path, request.param)
    cache = TieredCache(parse_config(make_config(tmp_path, request.param)), tiers=[tier])
    yield cache, tier
    cache.close()


def prompt(seed: int, blocks: int = PROMPT_BLOCKS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(blocks * BS + 1)]


def chunk_values(cache: TieredCache, tier: SpillTier, tokens: list[int]) -> list[tuple]:
    """The (key, value) of every chunk of ``tokens``, encoded as the spill path does,
    from the KV a recompute writes."""
    hashes = cache.manager.hasher.hash_blocks(tokens)
    blocks = torch.stack([expected_block(cache, tokens, i) for i in range(len(hashes))])
    rows = byte_rows(blocks)
    codec = ChunkCodec(cache.layout)
    c = tier.chunk_blocks
    out = []
    for start in range(0, len(hashes), c):
        end = min(start + c, len(hashes))
        key = hashes[end - 1]
        out.append((key, bytes(codec.encode(key, start, rows, range(start, end)))))
    return out


def store_prompt(cache: TieredCache, tier: SpillTier, tokens: list[int]) -> list[tuple]:
    items = chunk_values(cache, tier, tokens)
    assert tier.put_many(items) == len(items)
    return items


def spy_gpu_loads(cache: TieredCache, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """GPU block ids that prefetch copies write into (filled as they happen)."""
    written: list[int] = []
    real = cache.transfer.copy

    def copy(src, src_ids, dst, dst_ids, after=None):
        if dst is cache.gpu.kv:
            written.extend(int(i) for i in dst_ids)
        return real(src, src_ids, dst, dst_ids, after)

    monkeypatch.setattr(cache.transfer, "copy", copy)
    return written


def probe(cache: TieredCache, tier: SpillTier, tokens: list[int], written: list[int]):
    """Serve ``tokens`` (checked bit for bit) and return (served, whether bad values
    were only ever loaded into blocks that wait() reported valid)."""
    written.clear()
    served = serve(cache, "probe", tokens)
    cache.flush()
    valid_blocks = served.valid_tokens // BS
    return served, set(written) <= set(served.table[:valid_blocks])


def reheader(codec: ChunkCodec, key: bytes, value: bytes, **changes: object) -> bytes:
    """``value`` with its header rewritten in msgpack's general form, fields changed."""
    h, payload = codec.decode(value, key)
    fields = {
        "v": h.version,
        "fp": h.layout_fingerprint,
        "key": h.key,
        "n": h.num_blocks,
        "pos": h.first_position,
        "len": h.payload_nbytes,
        "sum": h.checksum,
    }
    fields.update(changes)
    head = msgpack.packb(fields, use_bin_type=True)
    return MAGIC + struct.pack("<I", len(head)) + head + payload.tobytes()


def _flip(value: bytes, at: int) -> bytes:
    out = bytearray(value)
    out[at] ^= 0x5A
    return bytes(out)


OTHER_LAYOUT = KVLayout(2, 2, BS, 2, 8, torch.float16)

# name -> (corrupt(codec, items) -> value for chunk BAD, expected reject reason)
Corrupt = Callable[[ChunkCodec, list[tuple]], bytes]
CORRUPTIONS: dict[str, tuple[Corrupt, str]] = {
    "truncated_payload": (lambda c, it: it[BAD][1][:-7], "truncated"),
    "truncated_in_header": (lambda c, it: it[BAD][1][:20], "truncated"),
    "payload_byte_flipped": (lambda c, it: _flip(it[BAD][1], len(it[BAD][1]) - 700), "checksum"),
    "other_format_version": (lambda c, it: reheader(c, *it[BAD], v=2), "version"),
    "other_layout_fingerprint": (
        lambda c, it: reheader(c, *it[BAD], fp=OTHER_LAYOUT.fingerprint),
        "layout",
    ),
    "header_not_msgpack": (
        lambda c, it: MAGIC + struct.pack("<I", 16) + b"\xc1" * 16 + it[BAD][1][-4096:],
        "header",
    ),
    "pickle_not_a_chunk": (lambda c, it: pickle.dumps({"kv": list(range(64))}), "magic"),
    "absurd_payload_length": (lambda c, it: reheader(c, *it[BAD], len=2**64 - 1), "length"),
    "absurd_block_count": (
        lambda c, it: reheader(c, *it[BAD], n=2**40, len=2**40 * BLOCK_NBYTES),
        "truncated",
    ),
    "absurd_header_length": (
        lambda c, it: MAGIC + struct.pack("<I", 2**32 - 1) + it[BAD][1][8:],
        "header",
    ),
    "stored_under_the_wrong_key": (lambda c, it: it[0][1], "key"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_bad_value_is_a_miss_is_deleted_counted_and_never_loaded(
    setup, corruption, monkeypatch, caplog
) -> None:
    cache, tier = setup
    tokens = prompt(1)
    items = store_prompt(cache, tier, tokens)
    corrupt, reason = CORRUPTIONS[corruption]
    bad_key = items[BAD][0]
    tier.put_many([(bad_key, corrupt(ChunkCodec(cache.layout), items))])
    written = spy_gpu_loads(cache, monkeypatch)

    hit = cache.lookup("look", tokens)
    cache.free("look")
    assert hit.tokens_per_tier() == {"gpu": 0, "cpu": 0, tier.name: PROMPT_BLOCKS * BS}
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        served, only_valid_loaded = probe(cache, tier, tokens, written)  # checks KV exactly

    assert served.valid_tokens == BAD * C * BS  # chunk 0 loaded, the rest recomputed
    assert only_valid_loaded, "a bad value was copied into GPU blocks"
    hashes = cache.manager.hasher.hash_blocks(tokens)
    assert cache.host.lookup_each(hashes[BAD * C : (BAD + 1) * C]) == [None] * C
    assert tier.contains_many([bad_key]) == [False]  # deleted
    stats = cache.stats()[tier.name]
    assert (stats.rejected, stats.errors) == (1, 0)
    rejects = [m.groups() for m in map(REJECTED.search, caplog.messages) if m]
    assert rejects == [(tier.name, bad_key.hex(), reason)]
    cache.gpu.check_invariants()
    cache.host.check_invariants()
    assert cache.host.num_free == cache.host.num_blocks


def test_an_empty_value_reads_as_absent_and_is_a_plain_miss(setup, monkeypatch) -> None:
    cache, tier = setup
    tokens = prompt(1)
    items = store_prompt(cache, tier, tokens)
    tier.put_many([(items[BAD][0], b"")])
    written = spy_gpu_loads(cache, monkeypatch)
    served, only_valid_loaded = probe(cache, tier, tokens, written)  # checks KV exactly
    assert served.hit.tokens_per_tier() == {"gpu": 0, "cpu": 0, tier.name: BAD * C * BS}
    assert served.valid_tokens == BAD * C * BS and only_valid_loaded
    assert cache.stats()[tier.name].rejected == 0


@pytest.mark.parametrize("control", ["intact", "general_msgpack_header"])
def test_control_a_valid_value_in_any_header_form_loads_whole(setup, control, monkeypatch):
    """The injection above is sound: a valid value there loads all 12 blocks."""
    cache, tier = setup
    tokens = prompt(2)
    items = store_prompt(cache, tier, tokens)
    if control == "general_msgpack_header":
        tier.put_many([(items[BAD][0], reheader(ChunkCodec(cache.layout), *items[BAD]))])
    written = spy_gpu_loads(cache, monkeypatch)
    served, _ = probe(cache, tier, tokens, written)
    assert served.valid_tokens == served.hit.num_tokens == PROMPT_BLOCKS * BS
    assert sorted(written) == sorted(served.table[:PROMPT_BLOCKS])
    assert cache.stats()[tier.name].rejected == 0


# --- arbitrary corruptions (hypothesis) ----------------------------------------------


def _mutations(size: int) -> st.SearchStrategy:
    pos = st.integers(0, size - 1)
    return st.one_of(
        st.tuples(
            st.just("flip"), st.lists(st.tuples(pos, st.integers(1, 255)), min_size=1, max_size=6)
        ),
        st.tuples(st.just("truncate"), pos),
        st.tuples(st.just("random"), st.binary(max_size=size + 64)),
        st.tuples(st.just("append"), st.binary(min_size=1, max_size=64)),
        st.tuples(st.just("splice"), pos, st.integers(0, 64), st.binary(max_size=64)),
    )


def _apply(value: bytes, mutation: tuple) -> bytes:
    kind = mutation[0]
    if kind == "flip":
        out = bytearray(value)
        for at, mask in mutation[1]:
            out[at] ^= mask
        return bytes(out)
    if kind == "truncate":
        return value[: mutation[1]]
    if kind == "random":
        return mutation[1]
    if kind == "append":
        return value + mutation[1]
    at, cut, insert = mutation[1:]
    return value[:at] + insert + value[at + cut :]


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_arbitrary_corruptions_of_a_stored_value_are_rejected(tmp_path, kind, monkeypatch):
    tier = open_tier(tmp_path, kind)
    cache = TieredCache(parse_config(make_config(tmp_path, kind)), tiers=[tier])
    codec = ChunkCodec(cache.layout)
    tokens = prompt(3)
    items = store_prompt(cache, tier, tokens)
    bad_key, original = items[BAD]
    good_header, good_payload = codec.decode(original, bad_key)
    good_payload = good_payload.copy()
    written = spy_gpu_loads(cache, monkeypatch)
    tried = {"rejected": 0, "equivalent": 0}

    @settings(
        max_examples=50,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(mutation=_mutations(len(original)))
    def check(mutation: tuple) -> None:
        value = _apply(original, mutation)
        assume(value != original)  # e.g. an empty splice, or two flips that cancel
        assume(value)  # reads as absent: test_an_empty_value_reads_as_absent_...
        try:
            header, payload = codec.decode(value, bad_key)
        except BadChunk:
            pass
        else:  # the codec accepts it: then it must mean exactly the original chunk
            assert header == good_header and np.array_equal(payload, good_payload), (
                f"codec accepted a changed chunk: {mutation!r}"
            )
            tried["equivalent"] += 1
            return
        # Only the stored chunks of the prompt, nowhere else: empty pools, a fresh store.
        assert cache.gpu.reset() and cache.host.reset()
        tier.put_many(items[:BAD] + [(bad_key, value)] + items[BAD + 1 :])
        before = cache.stats()[tier.name].rejected
        served, only_valid_loaded = probe(cache, tier, tokens, written)  # exact KV
        assert served.hit.num_tokens == PROMPT_BLOCKS * BS
        assert served.valid_tokens == BAD * C * BS
        assert only_valid_loaded
        assert tier.contains_many([bad_key]) == [False]
        assert cache.stats()[tier.name].rejected == before + 1
        tried["rejected"] += 1

    try:
        check()
        assert tried["rejected"] >= 45, tried
        cache.gpu.check_invariants()
        cache.host.check_invariants()
    finally:
        cache.close()


# --- no unpickling anywhere ------------------------------------------------------------

FORBIDDEN = [
    re.compile(r"^\s*(import|from)\s+(c?pickle|_pickle|marshal|shelve|dill|cloudpickle|joblib)\b"),
    re.compile(r"\b(pickle|_pickle|marshal|shelve|dill|cloudpickle|joblib)\.\w+"),
    re.compile(r"(?<![\w.])(eval|exec)\s*\("),
    re.compile(r"\btorch\.load\s*\("),
    re.compile(r"allow_pickle\s*=\s*True"),
    re.compile(r"\byaml\.(load|unsafe_load|full_load|load_all)\s*\("),
    re.compile(r"\b__import__\s*\("),
]


def test_the_kvtier_source_never_unpickles_or_evaluates() -> None:
    root = Path(kvtier.__file__).parent
    sources = sorted(root.rglob("*.py"))
    assert len(sources) > 10
    offending = [
        f"{path.relative_to(root.parent)}:{n}: {line.strip()}"
        for path in sources
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if not line.lstrip().startswith("#") and any(p.search(line) for p in FORBIDDEN)
    ]
    assert offending == []


def test_a_full_spill_and_load_workload_never_unpickles(tmp_path, monkeypatch) -> None:
    calls: list[str] = []

    def forbidden(name: str) -> Callable:
        def refuse(*args: object, **kwargs: object) -> None:
            calls.append(name)
            raise AssertionError(f"{name} called")

        return refuse

    import _pickle

    for module, names in (
        (pickle, ("load", "loads", "Unpickler")),
        (_pickle, ("load", "loads", "Unpickler")),
    ):  # not marshal: the import system loads every .pyc with marshal.loads
        for name in names:
            monkeypatch.setattr(module, name, forbidden(f"{module.__name__}.{name}"))

    cfg = make_config(tmp_path, "disk", gpu=16, host=16)
    cfg["tiers"]["redis"] = {"chunk_blocks": 8, "write_policy": "write_through"}
    disk = LMDBTier(tmp_path / "lmdb", 64 << 20, chunk_blocks=C)
    redis = RedisTier(fakeredis.FakeRedis(), "nopickle", 8, ttl=None)
    cache = TieredCache(parse_config(cfg), tiers=[disk, redis])
    try:
        prompts = [prompt(100 + s, 9) for s in range(12)]
        for i, p in enumerate(prompts):
            serve(cache, f"w{i}", p)
        cache.flush()
        (key, value), *_ = chunk_values(cache, disk, prompts[0])
        disk.put_many([(key, value[:-1])])  # the rejection path runs too
        for i, p in enumerate(prompts[:6]):
            serve(cache, f"disk{i}", p)  # exact KV, from the disk tier
        cache.flush()
        disk.clear()
        for i, p in enumerate(prompts[6:]):
            serve(cache, f"redis{i}", p)  # exact KV, from the Redis tier
        cache.flush()
        stats = cache.stats()
        assert stats["disk"].blocks_out > 0 and stats["redis"].blocks_out > 0
        assert stats["disk"].rejected == 1
    finally:
        cache.close()
    assert calls == []
