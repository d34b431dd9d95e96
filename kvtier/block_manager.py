"""Requests on top of the GPU block pool: which blocks each request holds and publishes.

A request's life: ``lookup`` (hash its full prompt blocks, find the cached prefix),
``allocate`` (take the hit and fresh blocks for the tokens to compute), ``commit``
after the engine has written KV (publish every newly full block; during decode this
is called as tokens are appended), ``free`` (give the blocks back, tail first).

Not thread-safe: the caller serialises calls (``TieredCache`` holds a lock).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from kvtier._core import UseCounts
from kvtier.gpu_pool import GPUBlockPool
from kvtier.hashing import BlockHasher, ExtraKeys, TokenIds


class StaleHitError(RuntimeError):
    """A hit's blocks were reused between ``lookup`` and ``allocate``; look up again."""


@dataclass(slots=True)
class RequestState:
    """What the manager knows about one request.

    ``hashes`` covers the full blocks of the tokens seen so far and may run ahead of
    ``block_ids`` (a prompt is hashed at lookup, before its blocks exist). The first
    ``num_published`` blocks are hittable by other requests; the first ``num_used``
    are recorded as used by this request in the use counts.
    """

    hashes: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    num_published: int = 0
    num_used: int = 0
    extra: ExtraKeys | None = None


class BlockManager:
    """Maps requests to GPU blocks, with prefix caching through chained block hashes.

    With ``uses`` (the cache's use counts, ``kvtier.eviction``) every block a request
    takes as a hit or publishes is recorded there once, before the pool queues it.
    """

    def __init__(
        self, pool: GPUBlockPool, hasher: BlockHasher, uses: UseCounts | None = None
    ) -> None:
        if pool.layout.block_size != hasher.block_size:
            raise ValueError(
                f"pool block_size {pool.layout.block_size} != hasher block_size {hasher.block_size}"
            )
        self.pool = pool
        self.hasher = hasher
        self.uses = uses
        self.block_size = hasher.block_size
        self._requests: dict[Hashable, RequestState] = {}

    def __contains__(self, req_id: Hashable) -> bool:
        return req_id in self._requests

    def request(self, req_id: Hashable) -> RequestState:
        """The state of a live request; KeyError naming it otherwise."""
        try:
            return self._requests[req_id]
        except KeyError:
            raise KeyError(f"unknown request {req_id!r}") from None

    def hash_prompt(
        self, req_id: Hashable, token_ids: TokenIds, extra: ExtraKeys | None = None
    ) -> list[bytes]:
        """Hash the prompt's full blocks and register the request; returns the hashes.

        A request that already holds blocks keeps its state (re-lookup is a no-op).
        """
        req = self._requests.get(req_id)
        if req is None or not req.block_ids:
            req = RequestState(hashes=self.hasher.hash_blocks(token_ids, extra=extra), extra=extra)
            self._requests[req_id] = req
        return req.hashes

    def lookup(
        self, req_id: Hashable, token_ids: TokenIds, extra: ExtraKeys | None = None
    ) -> list[int]:
        """Block ids of the longest cached prefix of the prompt (pins nothing).

        The hit never covers the prompt's last token: the engine must compute at
        least one token to get logits, and must not write into a shared block.
        """
        hashes = self.hash_prompt(req_id, token_ids, extra)
        return self.pool.lookup(hashes[: (len(token_ids) - 1) // self.block_size])

    def allocate(
        self, req_id: Hashable, num_new_tokens: int, hit: list[int] | None = None
    ) -> list[int] | None:
        """Slots for ``num_new_tokens`` more tokens; returns the new block ids.

        On a request's first allocation ``hit`` (from ``lookup``) is taken: its blocks
        are referenced and count as the request's first tokens. Returns None, changing
        nothing, when the pool cannot supply the blocks; hit blocks still in the free
        queue count as not free, since taking them removes them from it. Raises
        ``StaleHitError`` if a hit block was reused since ``lookup``.
        """
        if num_new_tokens < 0:
            raise ValueError(
                f"request {req_id!r}: num_new_tokens must be >= 0, got {num_new_tokens}"
            )
        req = self._requests.get(req_id)
        if req is None:
            req = self._requests[req_id] = RequestState()
        elif not hit and req.num_tokens + num_new_tokens <= len(req.block_ids) * self.block_size:
            req.num_tokens += num_new_tokens  # decode within the last block: nothing to take
            return []
        hit = hit or []
        if hit:
            if req.block_ids:
                raise ValueError(f"request {req_id!r} already holds blocks; a hit is taken once")
            if len(hit) > len(req.hashes) or not self.pool.holds(hit, req.hashes[: len(hit)]):
                raise StaleHitError(f"hit of request {req_id!r} is stale; look it up again")
        num_tokens = (req.num_tokens or len(hit) * self.block_size) + num_new_tokens
        need = -(-num_tokens // self.block_size) - len(req.block_ids) - len(hit)
        if need > self.pool.num_free - (self.pool.num_queued(hit) if hit else 0):
            return None
        if hit:  # taken before allocating: the allocation must not evict them
            self.pool.touch(hit)
        new = self.pool.allocate(max(need, 0))
        if hit:
            req.block_ids.extend(hit)
            req.num_published = len(hit)
        req.block_ids.extend(new)
        req.num_tokens = num_tokens
        return new

    def commit(self, req_id: Hashable, token_ids: TokenIds) -> int:
        """Publish the request's newly full blocks; ``token_ids`` is all its tokens so far.

        Call after the engine has written the KV of those tokens. Hashes only the
        blocks not hashed before, so decode costs O(new blocks). Returns the number of
        blocks published (blocks whose hash another block holds are not).
        """
        req = self.request(req_id)
        if len(token_ids) > req.num_tokens:
            raise ValueError(
                f"commit of {len(token_ids)} tokens but request {req_id!r} has "
                f"slots for {req.num_tokens}"
            )
        bs = self.block_size
        full = len(token_ids) // bs
        start = len(req.hashes)
        if full > start:
            parent = req.hashes[-1] if start else None
            req.hashes.extend(
                self.hasher.hash_blocks(token_ids[start * bs : full * bs], parent, start, req.extra)
            )
        return self.publish(req_id, full)

    def publish(self, req_id: Hashable, num_blocks: int) -> int:
        """Publish the request's blocks up to ``num_blocks`` (their KV is in place).

        Returns how many became hittable (a hash another block holds stays there).
        """
        req = self.request(req_id)
        first = req.num_published
        if num_blocks <= first:
            return 0
        if num_blocks > min(len(req.hashes), len(req.block_ids)):
            raise ValueError(f"request {req_id!r} has no hashed block {num_blocks - 1} to publish")
        hashes = req.hashes[first:num_blocks]
        parent = req.hashes[first - 1] if first else self.hasher.root
        published = self.pool.publish(
            req.block_ids[first:num_blocks],
            hashes,
            range(first, num_blocks),
            [parent, *hashes[:-1]],
        )
        req.num_published = num_blocks
        self.use(req_id, num_blocks)
        return published

    def use(self, req_id: Hashable, num_blocks: int) -> None:
        """Record the request's first ``num_blocks`` blocks (hashed) as used by it, each
        once whatever the number of calls; a no-op without use counts."""
        req = self.request(req_id)
        if self.uses is not None and num_blocks > req.num_used:
            self.uses.record(req.hashes[req.num_used : num_blocks])
            req.num_used = num_blocks

    def free(self, req_id: Hashable) -> bool:
        """Give a request's blocks back, tail first; False (a no-op) for an unknown request."""
        req = self._requests.pop(req_id, None)
        if req is None:
            return False
        self.pool.free(req.block_ids)
        return True

    def block_ids(self, req_id: Hashable) -> list[int]:
        """The request's block table, in token order."""
        return self.request(req_id).block_ids
