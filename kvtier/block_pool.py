"""Block bookkeeping shared by the GPU pool and the host pool: ref counts, a prefix-cache
map from block hash to block, and LRU reuse. It owns no memory: subclasses add the
tensor whose rows the block ids index.

Every block is in exactly one of three states:

- *in use*: ref count > 0; held by one or more requests.
- *cached free*: ref 0 and holding a published hash. It sits in the LRU queue and
  can be hit again (``touch`` takes it back out) until it is reused for new data.
- *empty free*: ref 0 and holding no hash. Nothing can hit it, so these are reused
  before any cached block is evicted.

The LRU queue is a ring of block ids in eviction order with lazy deletion: an entry at
ring position ``p`` for block ``b`` is live only while ``_qpos[b] == p``. Touching a
block just clears ``_qpos[b]``; its stale entry is skipped when the head passes it.
This keeps touch, free and allocate O(1) per block and vectorised with numpy, and the
ring is compacted (amortised O(1)) when its end is reached.

Before a cached block's memory is reused, the eviction hook receives the whole batch
of victims (ids, hashes, chain positions, parent hashes) so that a lower tier can copy
their KV out first; only then are their hashes dropped.

Not thread-safe: the owner (``BlockManager`` / ``TieredCache``) serialises calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier._core import HashIndex


@dataclass(frozen=True)
class CachedBlocks:
    """Cached blocks with where each sits in its chain; the lists are parallel.

    ``parents[i]`` is the hash of the block before ``hashes[i]`` in its chain (the
    namespace root for position 0). Given to the eviction hook in eviction order
    (least recently used first; within one request, tail blocks before head blocks).
    """

    block_ids: list[int]
    hashes: list[bytes]
    positions: list[int]
    parents: list[bytes]

    def __len__(self) -> int:
        return len(self.block_ids)


EvictionHook = Callable[[CachedBlocks], None]


@dataclass(frozen=True)
class PoolStats:
    """Counters of one pool; ``usage`` is the fraction of blocks held by requests."""

    num_blocks: int
    num_free: int
    num_cached: int
    usage: float
    queries: int
    hits: int
    evictions: int


class BlockPool:
    """Bookkeeping for ``num_blocks`` blocks with prefix caching and LRU reuse.

    Invariants (checked by ``check_invariants``):
    free (empty + cached-free) + in-use == num_blocks; a block is never both
    referenced and queued; ``_cached[h] == b`` exactly when ``_hash[b] == h``.
    """

    def __init__(self, num_blocks: int, on_evict: EvictionHook | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.on_evict = on_evict
        self._ref = np.zeros(num_blocks, dtype=np.int64)
        self._hash = np.full(num_blocks, None, dtype=object)
        self._parent = np.full(num_blocks, None, dtype=object)
        self._pos = np.full(num_blocks, -1, dtype=np.int64)  # chain position; -1: no hash
        # hash -> block; compiled (kvtier._core) so that a batch of probes into a pool of
        # a million blocks overlaps its cache misses instead of paying them one by one.
        self._cached = HashIndex(num_blocks)
        # Empty free blocks: a stack; order is irrelevant since nothing can hit them.
        self._empty = np.arange(num_blocks, dtype=np.int64)[::-1].copy()
        self._num_empty = num_blocks
        # LRU ring of cached free blocks (see module docstring). Twice the pool size
        # so that a compaction always frees at least num_blocks slots.
        self._ring = np.empty(2 * num_blocks, dtype=np.int64)
        self._qpos = np.full(num_blocks, -1, dtype=np.int64)
        self._head = 0
        self._tail = 0
        self._num_lru = 0
        self._queries = 0
        self._hits = 0
        self._evictions = 0

    # ---------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        """Blocks that ``allocate`` can hand out now (empty plus cached-free)."""
        return self._num_empty + self._num_lru

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest prefix of ``hashes`` cached here. Pins nothing."""
        out = self._cached.prefix(hashes)
        self._queries += len(hashes)
        self._hits += len(out)
        return out

    def lookup_each(self, hashes: Sequence[bytes]) -> list[int | None]:
        """The block holding each hash, or None; not a prefix search, counts no query."""
        return self._cached.find(hashes)

    def walk_back(self, last: bytes, count: int) -> tuple[list[int], bytes | None]:
        """Blocks of the ``count`` chain positions ending at hash ``last``, oldest first.

        Follows parent hashes. Returns ``(blocks, None)`` when all are cached here,
        else ``([], missing)`` with the first hash (walking back) that is not.
        """
        out: list[int] = []
        h = last
        for _ in range(count):
            b = self._cached.get(h)
            if b is None:
                return [], h
            out.append(b)
            h = self._parent[b]
        out.reverse()
        return out, None

    def cached_blocks(self, block_ids: Sequence[int]) -> CachedBlocks:
        """The hashed ones among ``block_ids``, with their chain positions and parents."""
        ids = np.asarray(block_ids, dtype=np.int64)
        ids = ids[self._pos[ids] >= 0]
        return CachedBlocks(
            block_ids=ids.tolist(),
            hashes=self._hash[ids].tolist(),
            positions=self._pos[ids].tolist(),
            parents=self._parent[ids].tolist(),
        )

    def holds(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> bool:
        """True when each ``block_ids[i]`` still holds ``hashes[i]`` (a hit is not stale)."""
        held = self._hash[np.asarray(block_ids, dtype=np.int64)]
        return all(a == b for a, b in zip(held, hashes, strict=True))

    def num_queued(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` are queued (ref 0): touching them uses free space."""
        if not len(block_ids):
            return 0
        return int(np.count_nonzero(self._ref[np.asarray(block_ids, dtype=np.int64)] == 0))

    # ---------------------------------------------------------------- mutations
    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on each block; a cached-free block leaves the LRU queue."""
        if not len(block_ids):
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        leaving = ids[self._ref[ids] == 0]
        self._qpos[leaving] = -1  # their ring entries become stale
        self._num_lru -= len(leaving)
        self._ref[ids] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with ref 1, empty ones first, then LRU cached ones (evicted).

        Raises ``ValueError`` when fewer than ``n`` are free; the caller checks
        ``num_free`` first. The eviction hook sees the victims before their hashes
        are dropped and before this returns (so before anyone can overwrite them).
        """
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free} free")
        if n <= 0:
            return []
        k = min(n, self._num_empty)
        taken = self._empty[self._num_empty - k : self._num_empty][::-1]
        self._num_empty -= k
        if k < n:
            victims = self._pop_lru(n - k)
            self._evict(victims)
            taken = np.concatenate((taken, victims))
        self._ref[taken] = 1
        return taken.tolist()

    def publish(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[bytes],
        positions: Sequence[int],
        parents: Sequence[bytes],
    ) -> int:
        """Make unpublished in-use blocks hittable under their hashes; returns how many.

        ``positions[i]`` and ``parents[i]`` place ``hashes[i]`` in its chain. A hash
        already cached in another block keeps that block (first writer wins) and this
        block stays unhashed, so it is reused first.
        """
        ids = np.ascontiguousarray(block_ids, dtype=np.int64)
        if not len(ids) == len(hashes) == len(positions) == len(parents):
            raise ValueError("publish needs as many hashes, positions and parents as blocks")
        if not len(ids):
            return 0
        if (self._ref[ids] <= 0).any() or (self._pos[ids] >= 0).any():
            raise ValueError("publish needs in-use blocks that hold no hash yet")
        if isinstance(positions, range):
            pos = np.arange(positions.start, positions.stop, positions.step, dtype=np.int64)
        else:
            pos = np.asarray(positions, dtype=np.int64)
        taken = self._cached.insert(hashes, ids)  # positions whose hash another block holds
        if taken:  # another request published those first: these blocks stay unhashed
            keep = np.ones(len(ids), dtype=bool)
            keep[taken] = False
            ids, pos = ids[keep], pos[keep]
            hashes = [h for h, k in zip(hashes, keep.tolist()) if k]
            parents = [p for p, k in zip(parents, keep.tolist()) if k]
        self._hash[ids] = _objects(hashes)
        self._parent[ids] = _objects(parents)
        self._pos[ids] = pos
        return len(ids)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each of a request's blocks (given in request order).

        Blocks reaching ref 0 are queued tail first: the request's last block becomes
        the least recently used, so a chain's suffix is evicted before its prefix.
        """
        if not len(block_ids):
            return
        ids = np.asarray(block_ids, dtype=np.int64)[::-1]
        self._ref[ids] -= 1
        done = ids[self._ref[ids] == 0]
        if not len(done):
            return
        hashed = self._pos[done] >= 0
        if hashed.all():
            self._push_lru(done)
        else:
            self._push_empty(done[~hashed])
            self._push_lru(done[hashed])

    def reset(self) -> bool:
        """Forget every cached hash (no eviction hook); False, changing nothing, if any in use."""
        if self.num_free != self.num_blocks:
            return False
        self._cached.clear()
        self._hash[:] = None
        self._parent[:] = None
        self._pos[:] = -1
        self._qpos[:] = -1
        self._head = self._tail = self._num_lru = 0
        self._empty[:] = np.arange(self.num_blocks, dtype=np.int64)[::-1]
        self._num_empty = self.num_blocks
        return True

    def stats(self) -> PoolStats:
        used = self.num_blocks - self.num_free
        return PoolStats(
            num_blocks=self.num_blocks,
            num_free=self.num_free,
            num_cached=self.num_cached,
            usage=used / self.num_blocks,
            queries=self._queries,
            hits=self._hits,
            evictions=self._evictions,
        )

    def lru_order(self) -> list[int]:
        """Cached-free block ids in eviction order (for tests and inspection; O(ring))."""
        seg = self._ring[self._head : self._tail]
        live = self._qpos[seg] == np.arange(self._head, self._tail)
        return seg[live].tolist()

    def check_invariants(self) -> None:
        """Assert the pool's structural invariants (tests call this after every step)."""
        ref = self._ref
        assert (ref >= 0).all(), "negative ref count"
        empty = self._empty[: self._num_empty]
        lru = np.asarray(self.lru_order(), dtype=np.int64)
        assert len(lru) == self._num_lru, "LRU count mismatch"
        assert len(set(empty.tolist()) | set(lru.tolist())) == len(empty) + len(lru), (
            "block both empty-queued and LRU-queued, or queued twice"
        )
        assert (ref[empty] == 0).all() and (ref[lru] == 0).all(), "queued block is referenced"
        assert self.num_free + int(np.count_nonzero(ref)) == self.num_blocks, "free + used != total"
        assert all(self._hash[b] is None for b in empty.tolist()), "empty block holds a hash"
        assert all(self._hash[b] is not None for b in lru.tolist()), "LRU block holds no hash"
        for h, b in self._cached.items():
            assert self._hash[b] == h, "cache map points at a block holding another hash"
        assert sum(h is not None for h in self._hash) == len(self._cached), "unmapped hash"

    # ---------------------------------------------------------------- internals
    def _push_empty(self, ids: np.ndarray) -> None:
        k = len(ids)
        self._empty[self._num_empty : self._num_empty + k] = ids
        self._num_empty += k

    def _push_lru(self, ids: np.ndarray) -> None:
        k = len(ids)
        if not k:
            return
        if self._tail + k > len(self._ring):
            self._compact()
        self._ring[self._tail : self._tail + k] = ids
        self._qpos[ids] = np.arange(self._tail, self._tail + k)
        self._tail += k
        self._num_lru += k

    def _compact(self) -> None:
        """Drop stale ring entries and move the live ones to the front (order kept)."""
        live = np.asarray(self.lru_order(), dtype=np.int64)
        self._ring[: len(live)] = live
        self._qpos[live] = np.arange(len(live))
        self._head, self._tail = 0, len(live)

    def _pop_lru(self, n: int) -> np.ndarray:
        """Remove and return the ``n`` least recently used cached-free blocks."""
        got: list[np.ndarray] = []
        need = n
        while need:
            stop = min(self._tail, self._head + 2 * need)
            pos = np.arange(self._head, stop)
            seg = self._ring[self._head : stop]
            live = np.flatnonzero(self._qpos[seg] == pos)
            if len(live) >= need:
                live = live[:need]
                self._head += int(live[-1]) + 1
            else:
                self._head = stop
            got.append(seg[live])
            need -= len(live)
        out = np.concatenate(got) if len(got) > 1 else got[0]
        self._qpos[out] = -1
        self._num_lru -= n
        return out

    def _evict(self, victims: np.ndarray) -> None:
        """Report ``victims`` to the hook, then drop their hashes."""
        hashes = self._hash[victims].tolist()
        if self.on_evict is not None:
            self.on_evict(
                CachedBlocks(
                    block_ids=victims.tolist(),
                    hashes=hashes,
                    positions=self._pos[victims].tolist(),
                    parents=self._parent[victims].tolist(),
                )
            )
        self._cached.remove(hashes)
        self._hash[victims] = None
        self._parent[victims] = None
        self._pos[victims] = -1
        self._evictions += len(victims)


def _objects(items: list) -> np.ndarray:
    """A 1-D object array of ``items`` (numpy would turn a list of bytes into an S array)."""
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out
