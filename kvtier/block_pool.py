"""Block bookkeeping shared by the GPU pool and the host pool: ref counts, a prefix-cache
map from block hash to block, and reuse of cached blocks in the order of an eviction
policy (``kvtier.eviction``). It owns no memory: subclasses add the tensor whose rows
the block ids index.

Every block is in exactly one of three states:

- *in use*: ref count > 0; held by one or more requests.
- *cached free*: ref 0 and holding a published hash. It sits in the eviction queue
  and can be hit again (``touch`` takes it back out) until it is reused for new data.
- *empty free*: ref 0 and holding no hash. Nothing can hit it, so these are reused
  before any cached block is evicted.

The per-block state lives in ``kvtier._core.BlockTable`` (compiled): every operation
is one call that does a few word operations per block, where numpy paid about a
microsecond per step and a small request took dozens of steps. The queue there is a
ring of block ids with lazy deletion (two under the reuse policy), so touch, free and
allocate are O(1) per block (see ``docs/architecture.md``).

Before a cached block's memory is reused, the eviction hook receives the whole batch
of victims (ids, hashes, chain positions, parent hashes) so that a lower tier can copy
their KV out first; only then are their hashes dropped. The hook must not change the
pool that calls it.

Not thread-safe: the owner (``BlockManager`` / ``TieredCache``) serialises calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier._core import BlockTable, UseCounts
from kvtier.config import EvictionPolicy


@dataclass(frozen=True)
class CachedBlocks:
    """Cached blocks with where each sits in its chain; the lists are parallel.

    ``parents[i]`` is the hash of the block before ``hashes[i]`` in its chain (the
    namespace root for position 0). Given to the eviction hook in eviction order
    (within one request, tail blocks before head blocks).
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
    """Bookkeeping for ``num_blocks`` blocks with prefix caching; cached blocks are
    reused in the order of the ``eviction`` policy (``reuse`` ranks by ``uses``, the
    cache's shared use counts, which it needs; ``lru`` takes none).

    Invariants (checked by ``check_invariants``):
    free (empty + cached-free) + in-use == num_blocks; a block is never both
    referenced and queued; the hash map holds ``h -> b`` exactly when block ``b``
    holds hash ``h``.
    """

    def __init__(
        self,
        num_blocks: int,
        on_evict: EvictionHook | None = None,
        eviction: EvictionPolicy = "lru",
        uses: UseCounts | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.on_evict = on_evict
        self._table = BlockTable(num_blocks, eviction, uses)
        # hash -> block; compiled so that a batch of probes into a pool of a million
        # blocks overlaps its cache misses instead of paying them one by one.
        self._cached = self._table.index
        self._queries = 0
        self._hits = 0
        self._evictions = 0

    # ---------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        """Blocks that ``allocate`` can hand out now (empty plus cached-free)."""
        return self._table.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def frontier(self) -> int:
        """Blocks ``frontier..num_blocks-1`` have never been handed out: ``allocate``
        hands out empty blocks freed back first, then never used ones in ascending order."""
        return self._table.frontier

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
        return self._table.walk_back(last, count)

    def cached_blocks(self, block_ids: Sequence[int]) -> CachedBlocks:
        """The hashed ones among ``block_ids``, with their chain positions and parents."""
        return CachedBlocks(*self._table.cached(block_ids))

    def holds(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> bool:
        """True when each ``block_ids[i]`` still holds ``hashes[i]`` (a hit is not stale)."""
        return self._table.holds(block_ids, hashes)

    def num_queued(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` are queued (ref 0): touching them uses free space."""
        return self._table.num_queued(block_ids)

    def ref_counts(self) -> list[int]:
        """The reference count of every block (for tests and inspection)."""
        return self._table.refs()

    def empty_blocks(self) -> list[int]:
        """The empty free blocks (for tests and inspection)."""
        return self._table.empty_blocks()

    # ---------------------------------------------------------------- mutations
    @property
    def eviction(self) -> EvictionPolicy:
        """The policy that orders the cached free blocks: ``lru`` or ``reuse``."""
        return self._table.policy

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on each block; a cached-free block leaves the queue."""
        self._table.touch(block_ids)

    def requeue(self, block_ids: Sequence[int]) -> None:
        """Queue cached free blocks (given in chain order) again as the newest, the chain's
        tail first, as ``free`` queues them; blocks someone holds stay as they are."""
        if block_ids:
            self._table.touch(block_ids)
            self._table.free(block_ids)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with ref 1, empty ones first, then cached ones in eviction order.

        Raises ``ValueError`` when fewer than ``n`` are free; the caller checks
        ``num_free`` first. The eviction hook sees the victims before their hashes
        are dropped and before this returns (so before anyone can overwrite them).
        """
        if n <= 0:
            return []
        victims = max(0, n - self._table.num_empty)
        out = self._table.allocate(n, self._report_evicted if self.on_evict is not None else None)
        self._evictions += victims
        return out

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
        return self._table.publish(block_ids, hashes, positions, parents)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each of a request's blocks (given in request order).

        Blocks reaching ref 0 are queued tail first: the request's last block is queued
        first, so a chain's suffix is evicted before its prefix.
        """
        self._table.free(block_ids)

    def reset(self) -> bool:
        """Forget every cached hash (no eviction hook); False, changing nothing, if any in use."""
        return self._table.reset()

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

    def eviction_order(self) -> list[int]:
        """Cached-free block ids in eviction order (for tests and inspection; O(ring))."""
        return self._table.eviction_order()

    def check_invariants(self) -> None:
        """Assert the pool's structural invariants (tests call this after every step)."""
        ref = self.ref_counts()
        assert all(r >= 0 for r in ref), "negative ref count"
        empty, queued = self.empty_blocks(), self.eviction_order()
        assert len(set(empty) | set(queued)) == len(empty) + len(queued), (
            "block both empty and cached-queued, or queued twice"
        )
        assert all(ref[b] == 0 for b in empty + queued), "queued block is referenced"
        assert self.num_free == len(empty) + len(queued), "free count mismatch"
        assert self.num_free + sum(r > 0 for r in ref) == self.num_blocks, "free + used != total"
        never_used = range(self.frontier, self.num_blocks)
        assert set(never_used) <= set(empty), "a block past the frontier was handed out"
        held = self.cached_blocks(range(self.num_blocks))
        assert not set(empty) & set(held.block_ids), "empty block holds a hash"
        assert set(queued) <= set(held.block_ids), "queued cached block holds no hash"
        assert dict(self._cached.items()) == dict(zip(held.hashes, held.block_ids)), (
            "cache map differs from the hashes the blocks hold"
        )

    # ---------------------------------------------------------------- internals
    def _report_evicted(
        self, ids: list[int], hashes: list[bytes], positions: list[int], parents: list[bytes]
    ) -> None:
        """The table's eviction callback: the victims, as the hook takes them."""
        self.on_evict(CachedBlocks(ids, hashes, positions, parents))
