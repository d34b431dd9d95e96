"""Eviction policies of the block pools (kvtier.eviction): the reuse policy's contract in
``_core.BlockTable``, checked against a plain-Python reference and one behaviour at a
time, and the use counts it ranks by."""

from __future__ import annotations

import random
from collections import OrderedDict, deque

import pytest
import torch
from kvtier._core import BlockTable, UseCounts
from test_block_table import Reference, key

from kvtier.block_manager import BlockManager
from kvtier.cache import TieredCache
from kvtier.config import parse_config
from kvtier.connector import ConnectorCache, ConnectorHit, EngineKV, engine_layout
from kvtier.eviction import REUSE_DELTA0, REUSE_DELTA_MAX, REUSE_STEP
from kvtier.gpu_pool import GPUBlockPool
from kvtier.hashing import BlockHasher, namespace_root
from kvtier.layout import KVLayout

ROOT = key(10**6)


class ReuseReference(Reference):
    """The reuse policy as kvtier.eviction states it: probation (``lru``) and protected
    queues of stamped blocks, delta, and two ghost lists of at most n hashes each."""

    def __init__(self, n: int, uses: UseCounts) -> None:
        super().__init__(n)
        self.n = n
        self.uses = uses
        self.protected: OrderedDict[int, None] = OrderedDict()
        self.stamp: dict[int, int] = {}
        self.tick = 0
        self.delta = REUSE_DELTA0 * n
        self.ghosts: tuple[deque, deque] = (deque(), deque())  # (hash, token), oldest first
        self.ghost_of: dict[bytes, tuple[int, int]] = {}
        self.live = [0, 0]
        self.tokens = 0

    def order(self) -> list[int]:
        probation, protected, out = list(self.lru), list(self.protected), []
        while probation or protected:
            older = probation and (
                not protected or self.stamp[probation[0]] - self.delta <= self.stamp[protected[0]]
            )
            out.append((probation if older else protected).pop(0))
        return out

    def allocate(self, n: int) -> tuple[list[int], list[int]]:
        out = [self.empty.pop() for _ in range(min(n, len(self.empty)))]
        victims = self.order()[: n - len(out)]
        for b in victims:
            self.remember(1 if b in self.protected else 0, self.hash[b])
            self.lru.pop(b, None)
            self.protected.pop(b, None)
            self.hash[b] = None
            self.ref[b] = 1
        for b in out:
            self.ref[b] = 1
        return out + victims, victims

    def touch(self, ids: list[int]) -> None:
        for b in ids:
            self.protected.pop(b, None)
        super().touch(ids)

    def publish(self, ids: list[int], hashes: list[bytes]) -> int:
        held = {h for h in self.hash if h is not None}
        for h in hashes:
            if h not in held:
                held.add(h)
                self.returned(h)
        return super().publish(ids, hashes)

    def free(self, ids: list[int]) -> None:
        for b in reversed(ids):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash[b] is None:
                    self.empty.append(b)
                else:
                    self.stamp[b], self.tick = self.tick, self.tick + 1
                    twice = self.uses.counts([self.hash[b]])[0] >= 2
                    (self.protected if twice else self.lru)[b] = None

    def remember(self, ghosts: int, h: bytes) -> None:
        fifo = self.ghosts[ghosts]
        if len(fifo) == self.n:
            old, token = fifo.popleft()
            if self.ghost_of.get(old) == (ghosts, token):
                del self.ghost_of[old]
                self.live[ghosts] -= 1
        self.take(h)
        self.tokens += 1
        fifo.append((h, self.tokens))
        self.ghost_of[h] = (ghosts, self.tokens)
        self.live[ghosts] += 1

    def take(self, h: bytes) -> int:
        if h not in self.ghost_of:
            return -1
        ghosts, _ = self.ghost_of.pop(h)
        self.live[ghosts] -= 1
        return ghosts

    def returned(self, h: bytes) -> None:
        ghosts = self.take(h)
        if ghosts < 0:
            return
        step = REUSE_STEP * max(1.0, self.live[1 - ghosts] / max(self.live[ghosts], 1))
        delta = self.delta - step if ghosts == 0 else self.delta + step
        self.delta = min(max(delta, 0.0), REUSE_DELTA_MAX * self.n)

    def state(self) -> tuple[list[int], list[int], list[int], dict[bytes, int]]:
        ref, _, empty, cached = super().state()
        return ref, self.order(), empty, cached


def reuse_table(n: int, capacity: int = 1000) -> tuple[BlockTable, UseCounts]:
    uses = UseCounts(capacity)
    return BlockTable(n, "reuse", uses), uses


def queue_chain(t: BlockTable, first_key: int, length: int) -> list[int]:
    """Allocate, publish and free one request's chain; returns its blocks, head first."""
    ids = t.allocate(length, None)
    hashes = [key(first_key + i) for i in range(length)]
    t.publish(ids, hashes, range(length), [ROOT, *hashes[:-1]])
    t.free(ids)
    return ids


def requeue(t: BlockTable, ids: list[int]) -> None:
    """A request hits ``ids`` and frees them: they are queued again, as the newest."""
    t.touch(ids)
    t.free(ids)


# --- the reference ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    n = 12
    t, uses = reuse_table(n, capacity=40)
    ref = ReuseReference(n, uses)
    requests: list[list[int]] = []
    for _ in range(1500):
        op = rng.random()
        if op < 0.3 and t.num_free:
            k = rng.randint(1, min(4, t.num_free))
            seen: list[int] = []
            got = t.allocate(k, lambda ids, *_, seen=seen: seen.extend(ids))
            want, victims = ref.allocate(k)
            assert (got, seen) == (want, victims)
            requests.append(got)
        elif op < 0.5 and requests:
            req = rng.choice(requests)
            fresh = [b for b in req if b not in t.cached(req)[0]]
            hashes = [key(rng.randrange(30)) for _ in fresh]
            assert t.publish(fresh, hashes, range(len(fresh)), hashes) == ref.publish(fresh, hashes)
        elif op < 0.6:
            uses.record([key(rng.randrange(30)) for _ in range(rng.randint(1, 3))])
        elif op < 0.75:
            hits = [b for b in t.eviction_order() if rng.random() < 0.3]
            t.touch(hits)
            ref.touch(hits)
            if hits:
                requests.append(hits)
        elif requests:
            req = requests.pop(rng.randrange(len(requests)))
            t.free(req)
            ref.free(req)
        assert state_of(t) == ref.state()
        assert t.delta == ref.delta and t.ghosts() == tuple(ref.live)


def state_of(t: BlockTable) -> tuple[list[int], list[int], list[int], dict[bytes, int]]:
    return t.refs(), t.eviction_order(), sorted(t.empty_blocks()), dict(t.index.items())


# --- victims ---------------------------------------------------------------------------


def test_reuse_evicts_a_block_one_request_used_before_an_older_one_two_requests_used() -> None:
    t, uses = reuse_table(4)
    uses.record([key(0)])
    uses.record([key(0)])
    [twice] = queue_chain(t, 0, 1)  # freed first: the older
    [once] = queue_chain(t, 1, 1)
    assert t.eviction_order() == [once, twice]


def test_reuse_evicts_a_protected_block_once_it_is_older_than_probation_by_delta() -> None:
    t, uses = reuse_table(2)  # delta starts at 4 * 2 = 8 ticks
    uses.record([key(0)])
    uses.record([key(0)])
    [protected] = queue_chain(t, 0, 1)  # tick 0
    [probation] = queue_chain(t, 1, 1)  # tick 1
    for _ in range(7):  # ticks 2..8
        requeue(t, [probation])
    assert t.eviction_order() == [probation, protected]  # 8 - 8 <= 0
    requeue(t, [probation])  # tick 9: 9 - 8 > 0
    assert t.eviction_order() == [protected, probation]


def test_a_block_computed_again_after_eviction_is_admitted_by_the_uses_it_had() -> None:
    t, uses = reuse_table(2)
    uses.record([key(0)])
    queue_chain(t, 0, 1)
    t.free(t.allocate(2, None))  # evicted from every queue; the use counts keep it
    uses.record([key(0)])  # a later request uses it again: computed anew
    [again] = queue_chain(t, 0, 1)
    [fresh] = queue_chain(t, 1, 1)
    assert t.eviction_order() == [fresh, again]  # the older one is protected


def test_lru_evicts_the_block_queued_longest_ago_whatever_its_uses() -> None:
    uses = UseCounts(10)
    t = BlockTable(4, "lru", uses)
    uses.record([key(0)])
    uses.record([key(0)])
    [twice] = queue_chain(t, 0, 1)
    [once] = queue_chain(t, 1, 1)
    assert t.eviction_order() == [twice, once]


@pytest.mark.parametrize("policy", ["lru", "reuse"])
def test_a_requests_deeper_blocks_are_evicted_before_its_shallower_ones(policy: str) -> None:
    uses = UseCounts(100)
    t = BlockTable(8, policy, uses)
    uses.record([key(i) for i in range(3)])
    uses.record([key(i) for i in range(3)])  # all protected under reuse
    chain = queue_chain(t, 0, 3)
    assert t.eviction_order() == chain[::-1]


@pytest.mark.parametrize("policy", ["lru", "reuse"])
def test_a_parent_is_never_evicted_while_its_child_stays_cached(policy: str) -> None:
    rng = random.Random(3)
    layout = KVLayout(1, 1, 4, 1, 1, torch.uint8)
    uses = UseCounts(10_000)
    kept: dict[bytes, bytes] = {}  # cached hash -> its parent hash

    def evicted(victims) -> None:
        for h in victims.hashes:
            del kept[h]
        orphans = [h for h, parent in kept.items() if parent in victims.hashes]
        assert not orphans, "a child outlived its parent"

    pool = GPUBlockPool(40, layout, on_evict=evicted, eviction=policy, uses=uses)
    manager = BlockManager(pool, BlockHasher(namespace_root("m", layout.fingerprint), 4), uses)
    prompts = [[rng.randrange(50) for _ in range(4 * rng.randint(2, 8))] for _ in range(12)]
    for i in range(400):
        base = rng.choice(prompts)
        prompt = base[: 4 * rng.randint(1, len(base) // 4)] + [rng.randrange(50)] * 4 * (i % 2)
        hit = manager.lookup(i, prompt)
        manager.allocate(i, len(prompt) - 4 * len(hit), hit)
        manager.use(i, len(hit))
        req = manager.request(i)
        before = req.num_published
        manager.commit(i, prompt)
        published = pool.cached_blocks(req.block_ids[before : req.num_published])
        kept.update(zip(published.hashes, published.parents))
        manager.free(i)


# --- delta and the ghost lists -----------------------------------------------------------


def test_a_hash_published_again_after_eviction_from_probation_lowers_delta() -> None:
    t, _ = reuse_table(2)
    queue_chain(t, 0, 2)
    t.free(t.allocate(2, None))  # evicts both from probation
    assert t.ghosts() == (2, 0)
    queue_chain(t, 0, 1)
    assert t.delta == REUSE_DELTA0 * 2 - REUSE_STEP * 1
    assert t.ghosts() == (1, 0)


def test_a_hash_published_again_after_eviction_from_protected_raises_delta() -> None:
    t, uses = reuse_table(2)
    uses.record([key(0), key(1)])
    uses.record([key(0), key(1)])
    queue_chain(t, 0, 2)
    t.free(t.allocate(2, None))
    assert t.ghosts() == (0, 2)
    queue_chain(t, 1, 1)
    assert t.delta == REUSE_DELTA0 * 2 + REUSE_STEP * 1


def test_delta_moves_by_the_other_ghost_lists_share() -> None:
    t, uses = reuse_table(4)
    uses.record([key(0)])
    uses.record([key(0)])
    queue_chain(t, 0, 1)  # protected
    queue_chain(t, 1, 3)  # probation
    t.free(t.allocate(4, None))
    assert t.ghosts() == (3, 1)
    queue_chain(t, 0, 1)  # back from protected: G1 holds 3, G2 now 0
    assert t.delta == REUSE_DELTA0 * 4 + REUSE_STEP * 3


def test_delta_stays_between_zero_and_its_maximum() -> None:
    t, _ = reuse_table(1)
    for i in range(10):  # each round: evicted from probation, then published again
        queue_chain(t, i, 1)
        t.free(t.allocate(1, None))
        queue_chain(t, i, 1)
        t.free(t.allocate(1, None))
    assert t.delta == 0.0
    uses = UseCounts(100)
    t = BlockTable(1, "reuse", uses)
    for i in range(10):
        uses.record([key(i)])
        uses.record([key(i)])
        queue_chain(t, i, 1)
        t.free(t.allocate(1, None))
        queue_chain(t, i, 1)
        t.free(t.allocate(1, None))
    assert t.delta == REUSE_DELTA_MAX * 1


def test_each_ghost_list_remembers_at_most_num_blocks_hashes() -> None:
    t, _ = reuse_table(3)
    for i in range(10):
        queue_chain(t, 10 * i, 3)
        t.free(t.allocate(3, None))
    assert t.ghosts() == (3, 0)
    queue_chain(t, 0, 1)  # forgotten long ago: delta does not move
    assert t.delta == REUSE_DELTA0 * 3


def test_reset_forgets_the_ghosts_and_restores_delta() -> None:
    t, _ = reuse_table(2)
    queue_chain(t, 0, 2)
    t.free(t.allocate(2, None))
    queue_chain(t, 0, 1)
    assert t.reset()
    assert t.ghosts() == (0, 0) and t.delta == REUSE_DELTA0 * 2


# --- construction --------------------------------------------------------------------------


def test_reuse_needs_use_counts() -> None:
    with pytest.raises(TypeError, match="UseCounts"):
        BlockTable(4, "reuse")
    with pytest.raises(TypeError, match="UseCounts"):
        BlockTable(4, "reuse", {})


def test_an_unknown_policy_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match="'lfu'"):
        BlockTable(4, "lfu")


def test_a_table_reports_its_policy() -> None:
    assert BlockTable(4).policy == "lru" and BlockTable(4).delta is None
    assert reuse_table(4)[0].policy == "reuse"


# --- use counts ----------------------------------------------------------------------------


def test_use_counts_count_each_record_and_zero_for_unknown_hashes() -> None:
    uses = UseCounts(10)
    uses.record([key(0), key(1)])
    uses.record([key(0)])
    assert uses.counts([key(0), key(1), key(2)]) == [2, 1, 0]
    assert len(uses) == 2


def test_use_counts_forget_the_least_recently_used_beyond_their_capacity() -> None:
    uses = UseCounts(2)
    uses.record([key(0)])
    uses.record([key(1)])
    uses.record([key(0)])  # key(1) is now the least recently used
    uses.record([key(2)])
    assert uses.counts([key(0), key(1), key(2)]) == [2, 0, 1]
    assert len(uses) == 2 == uses.capacity


def test_use_counts_forget_a_chains_tail_before_its_head() -> None:
    uses = UseCounts(3)
    uses.record([key(0), key(1), key(2)])  # head, middle, tail
    uses.record([key(3)])
    uses.record([key(4)])
    assert uses.counts([key(i) for i in range(5)]) == [1, 0, 0, 1, 1]


# --- in a cache ----------------------------------------------------------------------------


def small_cache(policy: str) -> TieredCache:
    layout = {"num_layers": 1, "block_size": 4, "num_kv_heads": 1, "head_dim": 2}
    tiers = {
        "gpu": {"num_blocks": 8, "device": "cpu", "eviction": policy},
        "cpu": {"capacity": "4KiB", "eviction": policy},
    }
    return TieredCache(parse_config({"layout": layout, "tiers": tiers}))


def serve_once(cache: TieredCache, req_id: str, prompt: list[int]) -> None:
    hit = cache.lookup(req_id, prompt)
    cache.allocate(req_id, len(prompt) - hit.num_tokens, hit)
    cache.wait(req_id)
    cache.commit(req_id, prompt)
    cache.free(req_id)


def test_a_cache_counts_each_block_once_per_request_that_used_it() -> None:
    prompt = list(range(13))  # 3 full blocks and a token
    with small_cache("reuse") as cache:
        serve_once(cache, "a", prompt)
        serve_once(cache, "b", prompt)  # hits 3 blocks
        serve_once(cache, "c", prompt[:9])  # hits 2 blocks
        hashes = cache.manager.hasher.hash_blocks(prompt)
        assert cache.uses.counts(hashes) == [3, 3, 2]


def test_a_cache_whose_tiers_all_evict_by_lru_keeps_no_use_counts() -> None:
    with small_cache("lru") as cache:
        assert cache.uses is None
        assert cache.gpu.eviction == cache.host.eviction == "lru"


def test_a_connector_worker_counts_the_blocks_it_saves_and_loads_as_uses() -> None:
    kv = EngineKV([torch.zeros(8, 2, 4, 1, 2) for _ in range(2)])  # 8 blocks, 2 layers
    layout = engine_layout(kv, block_size=4, num_kv_heads=1, head_dim=2, kv_factor=2)
    config = parse_config({"tiers": {"cpu": {"capacity": 16 * layout.block_nbytes}}})
    cache = ConnectorCache(config, kv, layout, "model", "rank0")
    try:
        keys = cache.keys([key(0), key(1)])
        cache.save([0, 1], keys, cache.root, 0)  # computed by one request
        cache.pin("r", keys, cache.root, ConnectorHit(0, host_blocks=2), [2, 3])  # hit by another
        assert cache.uses.counts(keys) == [2, 2]
        assert cache.host.eviction == "reuse"
    finally:
        cache.abandon("r")
        cache.close()
