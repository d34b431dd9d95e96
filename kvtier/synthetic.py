"""A synthetic engine: KV is a deterministic function of the token prefix.

Block ``i`` of a prompt gets KV drawn from a generator seeded by the CRC of tokens
``[0, (i + 1) * block_size)``: the same prefix always has the same KV, so any block
the cache hands back can be checked bit for bit against what a recompute would write.
The demo uses it where no model is involved, and the tests use it everywhere.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.cache import PrefixHit, TieredCache
from kvtier.hashing import ExtraKeys


class PoolExhausted(RuntimeError):
    """The GPU pool has no room for the request at the moment."""


class KVMismatch(AssertionError):
    """A block the cache supplied differs from what a recompute writes."""


def expected_block(cache: TieredCache, tokens: list[int], index: int) -> torch.Tensor:
    """The KV a recompute writes for block ``index`` of ``tokens``."""
    bs = cache.block_size
    seed = zlib.crc32(np.asarray(tokens[: (index + 1) * bs], dtype=np.uint32).tobytes())
    g = torch.Generator().manual_seed(seed)
    layout = cache.layout
    values = torch.randn(layout.block_shape, generator=g)
    return values.to(layout.dtype)


@dataclass
class Served:
    """What serving one request found: the hit, the tokens that loaded, its block table,
    and the seconds from ``allocate`` until ``wait`` returned (the engine's wait)."""

    hit: PrefixHit
    valid_tokens: int
    table: list[int]
    seconds: float


def serve(
    cache: TieredCache,
    req_id: str,
    tokens: list[int],
    free: bool = True,
    extra: ExtraKeys | None = None,
) -> Served:
    """lookup, then ``complete``: the whole request, every loaded block checked."""
    return complete(cache, req_id, tokens, cache.lookup(req_id, tokens, extra), free)


def complete(
    cache: TieredCache, req_id: str, tokens: list[int], hit: PrefixHit, free: bool = True
) -> Served:
    """The rest of a request looked up earlier: allocate, wait, check the loaded KV,
    write the rest, commit, free.

    Raises ``KVMismatch`` if a block the cache supplied differs from the recomputed
    KV, and ``PoolExhausted`` if the GPU pool cannot hold the request.
    """
    start = time.monotonic()
    table = cache.allocate(req_id, len(tokens) - hit.num_tokens, hit)
    if table is None:
        cache.free(req_id)
        raise PoolExhausted(f"{req_id}: the GPU pool cannot hold {len(tokens)} tokens now")
    valid = cache.wait(req_id)
    seconds = time.monotonic() - start
    bs = cache.block_size
    for i in range(valid // bs):
        if not torch.equal(cache.kv[table[i]].cpu(), expected_block(cache, tokens, i)):
            raise KVMismatch(f"{req_id}: block {i} differs from recompute")
    for i in range(valid // bs, len(table)):
        if (i + 1) * bs <= len(tokens):
            cache.kv[table[i]] = expected_block(cache, tokens, i).to(cache.kv.device)
    cache.commit(req_id, tokens)
    if free:
        cache.free(req_id)
    return Served(hit, valid, table, seconds)
