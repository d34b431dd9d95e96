"""Stateful test of BlockManager over a small GPUBlockPool against a reference model.

The reference model below is written from the documented semantics (DESIGN.md and
the docstrings of ``gpu_pool`` / ``block_manager``), not from the implementation:

- a block is in use (ref > 0), cached free (ref 0, holds a hash, in the LRU queue) or
  empty free (ref 0, no hash);
- freeing a request drops one ref per block; blocks reaching 0 are queued tail first
  (the request's last block is the first to be evicted); blocks without a hash are
  reused before any cached block is evicted;
- a hit (touched) block leaves the queue; eviction takes the head of the queue;
- ``allocate`` returns None, changing nothing, when the new blocks needed exceed
  ``num_free - hit blocks with ref 0``;
- publishing is first writer wins: a hash cached in another block leaves the new
  block unhashed;
- a lookup returns the longest run of leading cached blocks, never covering the
  prompt's last token.

The model names a block's content by its token prefix; hashes are recomputed here from
the documented chain formula (xxh3_128 of parent || tokens as little-endian uint32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvtier.block_manager import BlockManager, StaleHitError
from kvtier.gpu_pool import GPUBlockPool
from kvtier.hashing import BlockHasher, namespace_root
from kvtier.layout import KVLayout

BS = 4
LAYOUT = KVLayout(1, 2, BS, 1, 2, torch.float32)
ROOT = namespace_root("test-model", LAYOUT.fingerprint)

# Shared prefixes: bases 0 and 1 agree on their first two blocks, base 2 is unrelated.
BASES: list[list[int]] = [
    [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29],
    [10, 11, 12, 13, 14, 15, 16, 17, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49],
    [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69],
]

Key = tuple[int, ...]  # a full-block token prefix: names the content of one block


@cache
def chain_hash(prefix: Key) -> bytes:
    """Hash of the last block of ``prefix`` (a whole number of blocks), or the root."""
    if not prefix:
        return ROOT
    assert len(prefix) % BS == 0
    block = prefix[-BS:]
    return xxhash.xxh3_128_digest(chain_hash(prefix[:-BS]) + struct.pack(f"<{BS}I", *block))


def block_key(tokens: list[int], i: int) -> Key:
    """The content name of block ``i`` of ``tokens``."""
    return tuple(tokens[: (i + 1) * BS])


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BS)


# ------------------------------------------------------------------ reference model
@dataclass
class ModelRequest:
    tokens: list[int]  # every token that has a slot
    blocks: list[int]  # block table, in token order
    published: int  # leading blocks already published (or taken as a hit)
    committed: int = 0  # tokens committed so far


@dataclass
class ModelPool:
    num_blocks: int
    ref: list[int] = field(init=False)
    key: list[Key | None] = field(init=False)
    cached: dict[Key, int] = field(default_factory=dict)
    empty: set[int] = field(init=False)
    lru: list[int] = field(default_factory=list)  # eviction order, head first

    def __post_init__(self) -> None:
        self.ref = [0] * self.num_blocks
        self.key = [None] * self.num_blocks
        self.empty = set(range(self.num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.empty) + len(self.lru)

    def lookup(self, tokens: list[int]) -> list[int]:
        out: list[int] = []
        for i in range((len(tokens) - 1) // BS):
            b = self.cached.get(block_key(tokens, i))
            if b is None:
                break
            out.append(b)
        return out

    def can_take(self, need: int, hit: list[int]) -> bool:
        return need <= self.num_free - sum(self.ref[b] == 0 for b in hit)

    def touch(self, hit: list[int]) -> None:
        for b in hit:
            if self.ref[b] == 0:
                self.lru.remove(b)
            self.ref[b] += 1

    def plan_allocate(self, n: int) -> tuple[int, list[int]]:
        """(how many empty blocks, which cached victims in order) ``n`` blocks take."""
        k = min(n, len(self.empty))
        return k, self.lru[: n - k]

    def apply_allocate(self, new: list[int], victims: list[int]) -> None:
        del self.lru[: len(victims)]
        for b in victims:
            del self.cached[self.key[b]]
            self.key[b] = None
        for b in new:
            self.empty.discard(b)
            self.ref[b] = 1

    def publish(self, req: ModelRequest, upto: int) -> int:
        count = 0
        for i in range(req.published, upto):
            k = block_key(req.tokens, i)
            if k in self.cached:  # first writer wins
                continue
            b = req.blocks[i]
            assert self.key[b] is None
            self.cached[k] = b
            self.key[b] = k
            count += 1
        req.published = max(req.published, upto)
        return count

    def free(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.key[b] is None:
                    self.empty.add(b)
                else:
                    self.lru.append(b)


# ------------------------------------------------------------------ strategies
def _prompt(base: int, length: int, tail: list[int]) -> list[int]:
    return BASES[base][:length] + tail


prompts = st.builds(
    _prompt,
    st.integers(0, len(BASES) - 1),
    st.integers(1, 20),
    st.lists(st.integers(0, 3), max_size=3),
)
indices = st.integers(0, 1_000)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.evicted: list[Any] = []
        self.live: dict[int, ModelRequest] = {}
        self.pending: dict[int, tuple[list[int], list[int]]] = {}  # looked up, not allocated
        self.next_id = 0

    @initialize(num_blocks=st.integers(4, 12))
    def setup(self, num_blocks: int) -> None:
        self.pool = GPUBlockPool(num_blocks, LAYOUT, on_evict=self.evicted.append)
        self.bm = BlockManager(self.pool, BlockHasher(ROOT, BS))
        self.model = ModelPool(num_blocks)

    # -------------------------------------------------------------- helpers
    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _pick(self, ids, i: int) -> int:
        ids = sorted(ids)
        return ids[i % len(ids)]

    def _take_evictions(self) -> list[Any]:
        out, self.evicted[:] = list(self.evicted), []
        return out

    def _check_evictions(self, victims: list[int]) -> None:
        batches = self._take_evictions()
        got = [b for batch in batches for b in batch.block_ids]
        assert got == victims, f"evicted {got}, model expects the queue head {victims}"
        for batch in batches:
            for b, h, pos, parent in zip(
                batch.block_ids, batch.hashes, batch.positions, batch.parents, strict=True
            ):
                key = self.model.key[b]
                assert key is not None
                assert h == chain_hash(key)
                assert pos == len(key) // BS - 1
                assert parent == chain_hash(key[:-BS])

    def _allocate(
        self, rid: int, n_new: int, hit: list[int], need: int, req: ModelRequest | None
    ) -> list[int] | None:
        """Call ``bm.allocate`` and check it against the model; returns the new blocks."""
        m = self.model
        self._take_evictions()
        ok = m.can_take(need, hit)
        empty_before = set(m.empty)
        new = self.bm.allocate(rid, n_new, hit)
        if not ok:
            assert new is None, f"allocate should fail: need {need}, free {m.num_free}, hit {hit}"
            assert not self._take_evictions()
            event("allocate refused")
            return None
        assert new is not None, f"allocate failed: need {need}, free {m.num_free}, hit {hit}"
        assert len(new) == max(need, 0)
        assert len(set(new)) == len(new)
        # touch first (hit blocks leave the queue), then empties, then the queue head
        m.touch(hit)
        k, victims = m.plan_allocate(len(new))
        fresh = [b for b in new if b not in victims]
        assert len(fresh) == k and set(fresh) <= empty_before, "cached block evicted too early"
        assert set(victims) <= set(new)
        self._check_evictions(victims)
        if victims:
            event("allocate evicted cached blocks")
        if any(m.ref[b] == 1 for b in hit):
            event("hit taken from the free queue")
        m.apply_allocate(new, victims)
        if req is not None:
            req.blocks.extend(new)
        return new

    def _start(self, rid: int, prompt: list[int], hit: list[int], commit: bool) -> None:
        n_new = len(prompt) - len(hit) * BS
        need = blocks_for(len(prompt)) - len(hit)
        req = ModelRequest(tokens=list(prompt), blocks=list(hit), published=len(hit))
        new = self._allocate(rid, n_new, hit, need, None)
        if new is None:
            assert self.bm.free(rid) is True  # lookup registered it
            return
        req.blocks.extend(new)
        self.live[rid] = req
        if commit:
            self._commit(rid, len(prompt))

    def _commit(self, rid: int, n: int) -> None:
        req = self.live[rid]
        got = self.bm.commit(rid, req.tokens[:n])
        newly_full = max(0, n // BS - req.published)
        want = self.model.publish(req, n // BS)
        req.committed = max(req.committed, n)
        assert got == want, f"commit published {got}, model expects {want}"
        if got < newly_full:
            event("duplicate publish (first writer wins)")

    def _lookup_check(self, tokens: list[int]) -> list[int]:
        got = self.bm.lookup("probe", tokens)
        assert self.bm.free("probe") is True
        want = self.model.lookup(tokens)
        assert got == want, f"lookup of {tokens}: {got}, model (longest prefix) {want}"
        return got

    # -------------------------------------------------------------- rules
    @rule(prompt=prompts, commit=st.booleans())
    def new_request(self, prompt: list[int], commit: bool) -> None:
        rid = self._new_id()
        hit = self.bm.lookup(rid, prompt)
        assert hit == self.model.lookup(prompt)
        self._start(rid, prompt, hit, commit)

    @precondition(lambda self: len(self.pending) < 3)
    @rule(prompt=prompts)
    def lookup_only(self, prompt: list[int]) -> None:
        """Look up now, allocate in a later step (the hit may go stale meanwhile)."""
        rid = self._new_id()
        hit = self.bm.lookup(rid, prompt)
        assert hit == self.model.lookup(prompt)
        self.pending[rid] = (prompt, hit)

    @precondition(lambda self: self.pending)
    @rule(i=indices, commit=st.booleans())
    def allocate_pending(self, i: int, commit: bool) -> None:
        rid = self._pick(self.pending, i)
        prompt, hit = self.pending.pop(rid)
        m = self.model
        stale = any(m.key[b] != block_key(prompt, j) for j, b in enumerate(hit))
        if stale:
            lru, ref = list(m.lru), list(m.ref)
            with pytest.raises(StaleHitError):
                self.bm.allocate(rid, len(prompt) - len(hit) * BS, hit)
            assert self.pool.eviction_order() == lru and self.pool.ref_counts() == ref
            assert self.bm.free(rid) is True
            event("stale hit")
            return
        self._start(rid, prompt, hit, commit)

    @precondition(lambda self: self.live)
    @rule(i=indices, follow=st.booleans(), token=st.integers(0, 3))
    def decode(self, i: int, follow: bool, token: int) -> None:
        """Allocate one more token and commit everything so far."""
        rid = self._pick(self.live, i)
        req = self.live[rid]
        if follow:  # continue a base when the request is a prefix of it: makes duplicates
            n = len(req.tokens)
            for base in BASES:
                if n < len(base) and base[:n] == req.tokens:
                    token = base[n]
                    break
        need = blocks_for(len(req.tokens) + 1) - len(req.blocks)
        new = self._allocate(rid, 1, [], need, req)
        if new is None:
            return
        req.tokens.append(token)
        self._commit(rid, len(req.tokens))

    @precondition(lambda self: self.live)
    @rule(i=indices, upto=st.integers(0, 100))
    def commit(self, i: int, upto: int) -> None:
        rid = self._pick(self.live, i)
        req = self.live[rid]
        n = req.committed + upto * (len(req.tokens) - req.committed) // 100
        self._commit(rid, n)

    @precondition(lambda self: self.live or self.pending)
    @rule(i=indices)
    def free(self, i: int) -> None:
        rid = self._pick([*self.live, *self.pending], i)
        assert self.bm.free(rid) is True
        if rid in self.pending:
            del self.pending[rid]
        else:
            self.model.free(self.live.pop(rid).blocks)
        assert rid not in self.bm
        assert self.bm.free(rid) is False

    @rule()
    def free_unknown(self) -> None:
        assert self.bm.free(-1) is False

    @rule(prompt=prompts)
    def lookup(self, prompt: list[int]) -> None:
        self._lookup_check(prompt)

    # -------------------------------------------------------------- invariants
    @invariant()
    def pool_matches_model(self) -> None:
        pool, m = self.pool, self.model
        pool.check_invariants()
        ref = pool.ref_counts()
        # 1. free + used == total
        assert pool.num_free + sum(r > 0 for r in ref) == pool.num_blocks
        assert pool.num_free == m.num_free
        assert ref == m.ref
        # 2. no block both queued and referenced
        lru = pool.eviction_order()
        empty = pool.empty_blocks()
        assert all(ref[b] == 0 for b in lru + empty)
        assert len(set(lru) | set(empty)) == len(lru) + len(empty)
        # 5. the LRU queue, in eviction order
        assert lru == m.lru, f"LRU order {lru}, model {m.lru}"
        assert set(empty) == m.empty
        # 3. every cached hash maps to a block holding it; same set as the model
        held = pool.cached_blocks(range(pool.num_blocks))
        assert dict(zip(held.hashes, held.block_ids)) == {
            chain_hash(k): b for k, b in m.cached.items()
        }
        assert {b: h for b, h in zip(held.block_ids, held.hashes)} == {
            b: chain_hash(k) for b, k in enumerate(m.key) if k is not None
        }
        # requests
        assert not self.evicted, "eviction outside an allocation"
        for rid, req in self.live.items():
            assert self.bm.block_ids(rid) == req.blocks
            assert self.bm.request(rid).num_tokens == len(req.tokens)

    @invariant()
    def lookups_are_longest_cached_prefix(self) -> None:
        # 4. (a sentinel token lets the cap reach every full block of the sequence)
        for seq in [*BASES, *(r.tokens for r in self.live.values())]:
            self._lookup_check(seq)
            self._lookup_check([*seq, 0])


PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestPoolStateful = PoolMachine.TestCase


# ------------------------------------------------------------------ example-based tests
class Harness:
    def __init__(self, num_blocks: int) -> None:
        self.evicted: list[Any] = []
        self.pool = GPUBlockPool(num_blocks, LAYOUT, on_evict=self.evicted.append)
        self.bm = BlockManager(self.pool, BlockHasher(ROOT, BS))

    def run(self, rid: int, prompt: list[int], commit: bool = True) -> list[int] | None:
        """Look up, allocate and (optionally) commit a prompt; the request's block table."""
        hit = self.bm.lookup(rid, prompt)
        new = self.bm.allocate(rid, len(prompt) - len(hit) * BS, hit)
        if new is None:
            return None
        if commit:
            self.bm.commit(rid, prompt)
        return self.bm.block_ids(rid)

    def evicted_ids(self) -> list[int]:
        return [b for batch in self.evicted for b in batch.block_ids]


def test_freed_request_is_evicted_tail_first() -> None:
    h = Harness(4)
    a = h.run(1, BASES[0][:12])  # three full blocks, all published
    assert h.bm.free(1)
    assert h.pool.eviction_order() == [a[2], a[1], a[0]]
    h.run(2, BASES[2][:8])  # two blocks: the one empty block, then the tail of request 1
    assert h.evicted_ids() == [a[2]]
    assert h.evicted[0].positions == [2]
    assert h.evicted[0].hashes == [chain_hash(tuple(BASES[0][:12]))]
    assert h.evicted[0].parents == [chain_hash(tuple(BASES[0][:8]))]
    assert h.pool.eviction_order() == [a[1], a[0]]
    # the surviving prefix is still a hit
    assert h.bm.lookup(3, BASES[0][:9]) == [a[0], a[1]]


def test_empty_blocks_are_reused_before_cached_ones() -> None:
    h = Harness(4)
    a = h.run(1, BASES[0][:8])
    assert h.bm.free(1)
    b = h.run(2, BASES[2][:8])
    assert not h.evicted
    assert set(b).isdisjoint(a)
    assert h.pool.eviction_order() == [a[1], a[0]]
    assert h.pool.num_cached == 4


def test_hit_block_leaves_the_free_queue() -> None:
    h = Harness(4)
    a = h.run(1, BASES[0][:12])
    assert h.bm.free(1)
    b = h.run(2, BASES[0][:9], commit=False)  # hit: the first two blocks
    assert b[:2] == a[:2]
    assert h.pool.eviction_order() == [a[2]]
    assert h.pool.num_free == 1
    # the only cached-free block left is the one evicted next
    h.run(3, BASES[2][:4])
    assert h.evicted_ids() == [a[2]]
    assert h.pool.eviction_order() == []


def test_allocation_counts_queued_hit_blocks_as_not_free() -> None:
    h = Harness(4)
    a = h.run(1, BASES[0][:12])
    assert h.bm.free(1)
    assert h.pool.num_free == 4
    # 17 tokens: a 3-block hit (all queued) plus 2 new blocks; only 1 block is left
    # once the hit is taken, so this must fail without touching anything.
    prompt = BASES[0][:17]
    assert h.bm.lookup(2, prompt) == a
    assert h.bm.allocate(2, len(prompt) - 12, a) is None
    assert not h.evicted
    assert h.pool.eviction_order() == [a[2], a[1], a[0]]
    assert h.pool.num_free == 4
    h.pool.check_invariants()
    # 16 tokens need only 1 new block: fits
    assert h.bm.free(2)
    assert h.run(2, BASES[0][:16]) is not None
    assert not h.evicted


def test_duplicate_publish_keeps_first_writer_and_is_reused_first() -> None:
    h = Harness(6)
    a = h.run(1, BASES[0][:8], commit=False)
    b = h.run(2, BASES[0][:8], commit=False)  # nothing cached yet: no hit
    assert set(a).isdisjoint(b)
    assert h.bm.commit(1, BASES[0][:8]) == 2
    assert h.bm.commit(2, BASES[0][:8]) == 0
    assert h.pool.lookup([chain_hash(tuple(BASES[0][:4])), chain_hash(tuple(BASES[0][:8]))]) == a
    assert h.bm.free(2)  # unhashed: back to the empty blocks, not the LRU queue
    assert h.pool.eviction_order() == []
    assert h.bm.free(1)
    assert h.pool.eviction_order() == [a[1], a[0]]
    h.run(3, BASES[2][:16])  # 4 blocks: exactly the 4 empty ones
    assert not h.evicted
    h.pool.check_invariants()


def test_freeing_an_unknown_request_returns_false() -> None:
    h = Harness(4)
    assert h.bm.free(99) is False
    h.run(1, BASES[0][:5])
    assert h.bm.free(1) is True
    assert h.bm.free(1) is False
    assert h.pool.num_free == 4
