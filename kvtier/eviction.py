"""Eviction policies: the order in which a full tier gives up the blocks it caches.

Each tier that evicts by itself (the GPU pool's free queue, the host pool, the LMDB
disk tier) orders what it may evict by the policy its config names,
``tiers.<gpu|cpu|disk>.eviction``, implemented on the tier's own storage: C rings in
``_core.BlockTable`` for the pools, sub-databases for LMDB. Whatever its storage, a
policy keeps this contract:

- *admit*: every block a tier receives is cached; the policy only says where it queues.
- *touch*: a block queued again (freed by its last user, read, or written) becomes the
  newest of its queue; a request's blocks are queued deepest first.
- *victim*: the block to evict next; within one queue the oldest, so a chain's suffix
  leaves before its prefix.

Policies (``POLICIES``):

- ``lru``: one queue; the victim is the block queued longest ago.
- ``reuse``: what a prefix cache knows about a block is how many requests used it
  (``UseCounts``, one per cache, shared by its tiers; it remembers blocks after every
  tier evicted them). Blocks used by one request wait in *probation*, blocks used by two
  or more in *protected*. The victim is the older of the two queues' oldest, the
  probation one aged by ``delta`` queue ticks (one tick per block queued): a block seen
  once is worth a protected block ``delta`` ticks older. ``delta`` starts at
  ``REUSE_DELTA0`` times the tier's capacity in blocks and stays within ``[0,
  REUSE_DELTA_MAX]`` times it. Each tier remembers the hashes it last evicted from each
  queue (at most its capacity each); one that comes back moves ``delta`` by
  ``REUSE_STEP`` times the other list's share: from probation down (probation was too
  short), from protected up.

Tiers that do not evict by themselves (Redis: its server's ``maxmemory-policy``) have
no policy here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import get_args

from kvtier._core import REUSE_DELTA0, REUSE_DELTA_MAX, REUSE_STEP, UseCounts
from kvtier.config import EvictionPolicy, KVTierConfig
from kvtier.layout import KVLayout

__all__ = [
    "POLICIES",
    "REUSE_DELTA0",
    "REUSE_DELTA_MAX",
    "REUSE_STEP",
    "USE_HISTORY_FACTOR",
    "UseCounts",
    "policies_of",
    "use_counts_for",
    "with_policy",
]

POLICIES: tuple[str, ...] = get_args(EvictionPolicy)
# ``UseCounts`` remembers this many times the blocks the memory tiers (GPU and host
# pools) hold, plus the blocks the disk tier holds, at about 100 bytes each: a block
# used again after longer than that counts as new. On the shared Mooncake trace at
# 5.5% of its blocks, 4 times kept half the gain of an unbounded history, 16 times all.
USE_HISTORY_FACTOR = 16


def policies_of(config: KVTierConfig) -> dict[str, EvictionPolicy]:
    """The eviction policy of each configured tier that evicts by itself, by tier name."""
    tiers = config.tiers
    return {
        name: section.eviction
        for name in ("gpu", "cpu", "disk")
        if (section := getattr(tiers, name)) is not None
    }


def with_policy(config: KVTierConfig, policy: EvictionPolicy) -> KVTierConfig:
    """``config`` with ``policy`` for every configured tier that evicts by itself."""
    tiers = config.tiers
    changed = {name: replace(getattr(tiers, name), eviction=policy) for name in policies_of(config)}
    return replace(config, tiers=replace(tiers, **changed))


def use_counts_for(config: KVTierConfig, layout: KVLayout, gpu_blocks: int) -> UseCounts | None:
    """The use counts a cache's tiers share when any of them evicts by ``reuse`` (None
    when none does), sized by ``USE_HISTORY_FACTOR`` from ``gpu_blocks`` (0 when the
    engine owns them) and the host pool's and the disk tier's capacity in blocks."""
    tiers = config.tiers
    if "reuse" not in policies_of(config).values():
        return None
    host, disk = (s.capacity // layout.block_nbytes if s else 0 for s in (tiers.cpu, tiers.disk))
    return UseCounts(max(USE_HISTORY_FACTOR * (gpu_blocks + host) + disk, 1))
