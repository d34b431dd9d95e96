"""kvtier._core.BlockTable: the per-block state behind every pool (ref counts, hashes,
LRU ring, empty stack), checked against a plain-Python reference and for bad input."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from kvtier._core import BlockTable


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def state(t: BlockTable) -> tuple[list[int], list[int], list[int], dict[bytes, int]]:
    return t.refs(), t.eviction_order(), sorted(t.empty_blocks()), dict(t.index.items())


def published(n: int, ids: list[int], first_key: int = 0) -> BlockTable:
    """A table of n blocks whose ``ids`` are allocated and published as one chain."""
    t = BlockTable(n)
    taken = t.allocate(max(ids) + 1, None)
    t.free([b for b in taken if b not in ids])
    hashes = [key(first_key + i) for i in range(len(ids))]
    assert t.publish(ids, hashes, range(len(ids)), [key(999), *hashes[:-1]]) == len(ids)
    return t


class Reference:
    """The documented semantics, written plainly: an OrderedDict is the LRU queue."""

    def __init__(self, n: int) -> None:
        self.ref = [0] * n
        self.hash: list[bytes | None] = [None] * n
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.empty = list(range(n))[::-1]
        self.frontier = 0  # one past the highest block ever allocated

    def allocate(self, n: int) -> tuple[list[int], list[int]]:
        out = [self.empty.pop() for _ in range(min(n, len(self.empty)))]
        self.frontier = max([self.frontier, *(b + 1 for b in out)])
        victims = []
        while len(out) < n:
            b, _ = self.lru.popitem(last=False)
            victims.append(b)
            out.append(b)
        for b in out:
            self.ref[b] = 1
        for b in victims:
            self.hash[b] = None
        return out, victims

    def touch(self, ids: list[int]) -> None:
        for b in ids:
            self.lru.pop(b, None)
            self.ref[b] += 1

    def publish(self, ids: list[int], hashes: list[bytes]) -> int:
        held = {h for h in self.hash if h is not None}
        n = 0
        for b, h in zip(ids, hashes):
            if h not in held:
                self.hash[b] = h
                held.add(h)
                n += 1
        return n

    def free(self, ids: list[int]) -> None:
        for b in reversed(ids):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash[b] is None:
                    self.empty.append(b)
                else:
                    self.lru[b] = None

    def state(self) -> tuple[list[int], list[int], list[int], dict[bytes, int]]:
        cached = {h: b for b, h in enumerate(self.hash) if h is not None}
        return list(self.ref), list(self.lru), sorted(self.empty), cached


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_match_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    n = 24
    t, ref = BlockTable(n), Reference(n)
    requests: list[list[int]] = []
    next_key = 0
    for _ in range(600):
        op = rng.random()
        if op < 0.35 and t.num_free:
            k = rng.randint(1, min(6, t.num_free))
            seen: list[int] = []
            got = t.allocate(k, lambda ids, *_, seen=seen: seen.extend(ids))
            want, victims = ref.allocate(k)
            assert got == want
            assert seen == victims
            requests.append(got)
        elif op < 0.55 and requests:
            req = rng.choice(requests)
            fresh = [b for b in req if b not in t.cached(req)[0]]
            hashes = [key(rng.randint(0, next_key + 3)) for _ in fresh]
            next_key += 2
            assert t.publish(fresh, hashes, range(len(fresh)), hashes) == ref.publish(fresh, hashes)
        elif op < 0.7:
            hits = [b for b in t.eviction_order() if rng.random() < 0.3]
            t.touch(hits)
            ref.touch(hits)
            if hits:
                requests.append(hits)
        elif requests:
            req = requests.pop(rng.randrange(len(requests)))
            t.free(req)
            ref.free(req)
        assert state(t) == ref.state()
        assert t.num_free == len(ref.lru) + len(ref.empty)
        assert t.frontier == ref.frontier


def test_the_frontier_is_how_far_allocate_has_ever_reached() -> None:
    """Blocks from ``frontier`` on were never handed out: empty blocks freed back go out
    first, then never used ones in ascending order; a reset forgets no use."""
    t = BlockTable(8)
    assert t.frontier == 0
    a = t.allocate(3, None)
    assert a == [0, 1, 2] and t.frontier == 3
    t.free([a[1]])  # back empty: handed out again first
    assert t.allocate(2, None) == [1, 3] and t.frontier == 4
    t.free([0, 1, 2, 3])
    assert t.reset() and t.frontier == 4
    assert t.allocate(5, None) == [0, 1, 2, 3, 4] and t.frontier == 5


def test_the_eviction_hook_sees_hashes_positions_and_parents_before_they_are_dropped() -> None:
    t = published(4, [0, 1, 2])
    t.free([0, 1, 2])
    seen = []
    assert t.allocate(2, lambda *info: seen.append((info, dict(t.index.items())))) == [3, 2]
    (ids, hashes, positions, parents), index_then = seen[0]
    assert (ids, hashes, positions, parents) == ([2], [key(2)], [2], [key(1)])
    assert index_then[key(2)] == 2  # still held while the hook runs
    assert key(2) not in dict(t.index.items())


def test_a_failing_eviction_hook_changes_nothing() -> None:
    t = published(3, [0, 1, 2])
    t.free([0, 1, 2])
    before = state(t)

    def hook(*_: object) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError):
        t.allocate(2, hook)
    assert state(t) == before


def test_the_eviction_hook_cannot_change_the_table() -> None:
    t = published(2, [0, 1])
    t.free([0, 1])
    with pytest.raises(RuntimeError, match="inside its eviction hook"):
        t.allocate(1, lambda *_: t.touch([1]))
    assert t.eviction_order() == [1, 0]


def test_walk_back_follows_parents_or_names_the_missing_hash() -> None:
    t = published(8, [5, 3, 6])
    assert t.walk_back(key(2), 3) == ([5, 3, 6], None)
    assert t.walk_back(key(2), 2) == ([3, 6], None)
    assert t.walk_back(key(2), 4) == ([], key(999))
    assert t.walk_back(key(7), 1) == ([], key(7))


def test_walk_back_further_than_the_table_has_blocks_names_the_missing_hash() -> None:
    t = published(3, [0, 1, 2])  # a chunk longer than a whole (host) pool
    assert t.walk_back(key(2), 5) == ([], key(999))


def test_holds_and_num_queued() -> None:
    t = published(4, [0, 1])
    assert t.holds([0, 1], [key(0), key(1)]) and not t.holds([1], [key(0)])
    assert not t.holds([2], [key(2)])  # an unhashed block holds nothing
    t.free([1])
    assert t.num_queued([0, 1, 1]) == 2


def test_reset_refuses_while_a_block_is_in_use() -> None:
    t = published(4, [0, 1])
    assert t.reset() is False and t.num_free == 2
    t.free([0, 1])
    assert t.reset() is True
    assert state(t) == ([0] * 4, [], [0, 1, 2, 3], {})


@pytest.mark.parametrize("bad", [[4], [-1]])
def test_ids_out_of_range_raise_index_error(bad: list[int]) -> None:
    t = BlockTable(4)
    for call in (t.touch, t.free, t.num_queued, t.cached):
        with pytest.raises(IndexError, match="out of range"):
            call(bad)


def test_ids_that_are_not_ints_raise_type_error() -> None:
    with pytest.raises(TypeError):
        BlockTable(4).free(["a"])
    with pytest.raises(TypeError, match="sequence"):
        BlockTable(4).free(3)


def test_freeing_a_block_more_often_than_held_raises_and_changes_nothing() -> None:
    t = BlockTable(4)
    t.allocate(2, None)
    with pytest.raises(ValueError, match="freed more often"):
        t.free([0, 1, 1])
    assert t.refs() == [1, 1, 0, 0]


def test_touching_an_empty_block_raises_and_changes_nothing() -> None:
    t = published(4, [0])
    t.free([0])
    with pytest.raises(ValueError, match="empty"):
        t.touch([0, 2])
    assert t.refs() == [0] * 4 and t.eviction_order() == [0]


@pytest.mark.parametrize(
    ("ids", "hashes", "positions", "parents", "error", "message"),
    [
        ([0, 1], [key(0)], [0, 1], [key(9)] * 2, ValueError, "as many"),
        ([3], [key(0)], [0], [key(9)], ValueError, "in-use blocks"),  # free block
        ([0, 0], [key(0), key(1)], [0, 1], [key(9)] * 2, ValueError, "each once"),
        ([0], [key(0)], [-1], [key(9)], ValueError, ">= 0"),
        ([0], [b"short"], [0], [key(9)], ValueError, "16 bytes"),
        ([0], ["text"], [0], [key(9)], TypeError, "16 bytes"),
    ],
)
def test_bad_publish_raises_and_changes_nothing(ids, hashes, positions, parents, error, message):
    t = BlockTable(4)
    t.allocate(2, None)
    before = state(t)
    with pytest.raises(error, match=message):
        t.publish(ids, hashes, positions, parents)
    assert state(t) == before
    assert t.publish([0, 1], [key(0), key(1)], [0, 1], [key(9), key(0)]) == 2


def test_publishing_a_block_twice_raises() -> None:
    t = published(4, [0])
    with pytest.raises(ValueError, match="hold no hash"):
        t.publish([0], [key(5)], [0], [key(9)])


def test_allocating_more_than_free_raises() -> None:
    t = BlockTable(2)
    with pytest.raises(ValueError, match="cannot allocate 3 blocks, 2 free"):
        t.allocate(3, None)
    with pytest.raises(TypeError, match="callable"):
        t.allocate(1, 5)


@pytest.mark.parametrize("n", [0, -1])
def test_num_blocks_must_be_positive(n: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockTable(n)


def test_a_full_ring_is_compacted_keeping_the_order() -> None:
    t = published(3, [0, 1, 2])
    t.free([0, 1, 2])
    for _ in range(10):  # each round adds ring entries; stale ones must be dropped
        t.touch([1])
        t.free([1])
    assert t.eviction_order() == [2, 0, 1]
