import pytest
import torch

from kvtier.block_manager import BlockManager, StaleHitError
from kvtier.block_pool import CachedBlocks
from kvtier.gpu_pool import GPUBlockPool
from kvtier.hashing import BlockHasher, ExtraKeys, namespace_root
from kvtier.layout import KVLayout

LAYOUT = KVLayout(2, 2, 4, 2, 8, torch.float32)
BS = LAYOUT.block_size


def make(num_blocks: int = 8) -> tuple[BlockManager, list[CachedBlocks]]:
    evicted: list[CachedBlocks] = []
    pool = GPUBlockPool(num_blocks, LAYOUT, on_evict=evicted.append)
    hasher = BlockHasher(namespace_root("m", LAYOUT.fingerprint), BS)
    return BlockManager(pool, hasher), evicted


def run(bm: BlockManager, req: str, tokens: list[int]) -> list[int]:
    """A whole prefill: lookup, allocate, commit; returns the hit block ids."""
    hit = bm.lookup(req, tokens)
    assert bm.allocate(req, len(tokens) - len(hit) * BS, hit) is not None
    bm.commit(req, tokens)
    return hit


def test_cold_prompt_misses():
    bm, _ = make()
    assert bm.lookup("a", list(range(12))) == []


def test_committed_prefix_hits_for_the_next_request():
    bm, _ = make()
    run(bm, "a", list(range(13)))
    bm.free("a")
    assert len(bm.lookup("b", list(range(13)) + [99])) == 3


def test_hit_never_covers_the_prompts_last_token():
    bm, _ = make()
    prompt = list(range(12))
    run(bm, "a", prompt)
    assert len(bm.lookup("b", prompt)) == 2  # the third block holds the last token


def test_allocate_takes_the_hit_and_only_new_blocks():
    bm, _ = make()
    run(bm, "a", list(range(9)))
    hit = bm.lookup("b", list(range(10)))
    new = bm.allocate("b", 2, hit)
    assert bm.block_ids("b") == hit + new and len(new) == 1


def test_hit_blocks_are_shared_not_copied():
    bm, _ = make()
    run(bm, "a", list(range(9)))
    hit = run(bm, "b", list(range(9)))
    assert bm.block_ids("b")[:2] == bm.block_ids("a")[:2] == hit


def test_allocation_failure_changes_nothing():
    bm, _ = make(num_blocks=4)
    run(bm, "a", list(range(9)))
    free_before = bm.pool.num_free
    assert bm.allocate("b", 100) is None
    assert bm.pool.num_free == free_before and bm.block_ids("b") == []
    bm.pool.check_invariants()


def test_stale_hit_is_refused():
    bm, _ = make(num_blocks=3)
    run(bm, "a", list(range(9)))
    bm.free("a")
    hit = bm.lookup("b", list(range(9)))
    bm.allocate("c", 12)  # evicts a's blocks
    with pytest.raises(StaleHitError):
        bm.allocate("b", 1, hit)


def test_decode_publishes_blocks_as_they_fill():
    bm, _ = make()
    tokens = list(range(6))
    run(bm, "a", tokens)
    published = []
    for t in range(6, 13):
        bm.allocate("a", 1)
        tokens.append(t)
        published.append(bm.commit("a", tokens))
    assert sum(published) == 2 and published[1] == 1 and published[5] == 1
    bm.free("a")
    assert len(bm.lookup("b", list(range(14)))) == 3


def test_commit_beyond_allocated_slots_is_an_error():
    bm, _ = make()
    bm.allocate("a", 4)
    with pytest.raises(ValueError, match="slots for 4"):
        bm.commit("a", list(range(5)))


def test_free_returns_blocks_and_unknown_request_is_a_noop():
    bm, _ = make()
    run(bm, "a", list(range(9)))
    assert bm.free("a") is True
    assert bm.pool.num_free == bm.pool.num_blocks
    assert bm.free("a") is False


def test_evicted_blocks_report_hash_position_and_parent():
    bm, evicted = make(num_blocks=3)
    tokens = list(range(12))
    run(bm, "a", tokens)
    hashes = list(bm.request("a").hashes)
    bm.free("a")
    bm.allocate("b", 12)
    (batch,) = evicted
    # tail first: the chain's last block is the least recently used
    assert batch.hashes == hashes[::-1]
    assert batch.positions == [2, 1, 0]
    assert batch.parents == [hashes[1], hashes[0], bm.hasher.root]


def test_requests_with_different_lora_do_not_share_blocks():
    bm, _ = make()
    tokens = list(range(9))
    hit = bm.lookup("a", tokens, ExtraKeys(lora="x"))
    bm.allocate("a", 9, hit)
    bm.commit("a", tokens)
    assert bm.lookup("b", tokens) == []
    assert len(bm.lookup("c", tokens, ExtraKeys(lora="x"))) == 2


def test_duplicate_content_keeps_the_first_writer():
    bm, _ = make()
    tokens = list(range(9))
    for req in ("a", "b"):  # both computed before either committed
        bm.lookup(req, tokens)
        bm.allocate(req, 9)
    assert bm.commit("a", tokens) == 2
    assert bm.commit("b", tokens) == 0
    assert bm.lookup("c", tokens) == bm.block_ids("a")[:2]
    bm.pool.check_invariants()


def test_reset_forgets_the_cache_only_when_idle():
    bm, _ = make()
    run(bm, "a", list(range(9)))
    assert bm.pool.reset() is False
    bm.free("a")
    assert bm.pool.reset() is True
    assert bm.lookup("b", list(range(9))) == []
    bm.pool.check_invariants()


def test_stats_count_queries_hits_and_evictions():
    bm, _ = make(num_blocks=3)
    run(bm, "a", list(range(9)))
    bm.free("a")
    run(bm, "b", list(range(9)))  # 2 queried, 2 hit
    bm.free("b")
    bm.allocate("c", 12)
    stats = bm.pool.stats()
    assert (stats.queries, stats.hits, stats.evictions) == (4, 2, 2)
    assert stats.usage == 1.0
