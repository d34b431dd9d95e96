"""Counters per tier, as plain dataclasses that snapshot cleanly.

The cache mutates its ``TierStats`` under its own lock; ``stats()`` hands out copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class TierStats:
    """What one tier did. Blocks "in" were written into it, blocks "out" were read out of
    it towards the GPU; hits and misses count blocks looked up in this tier."""

    hits: int = 0
    misses: int = 0
    blocks_in: int = 0
    bytes_in: int = 0
    blocks_out: int = 0
    bytes_out: int = 0
    evictions: int = 0
    dropped: int = 0  # blocks that could not be stored (no free space, all pinned)
    errors: int = 0  # failed copies or I/O; each one a miss or a load error, never raised
    rejected: int = 0  # stored values that failed their checks: deleted, never loaded
    copy_seconds: float = 0.0

    def count_in(self, blocks: int, nbytes: int, seconds: float = 0.0) -> None:
        self.blocks_in += blocks
        self.bytes_in += nbytes
        self.copy_seconds += seconds

    def count_out(self, blocks: int, nbytes: int, seconds: float = 0.0) -> None:
        self.blocks_out += blocks
        self.bytes_out += nbytes
        self.copy_seconds += seconds


@dataclass
class CacheStats:
    """One ``TierStats`` per configured tier, by tier name, in hierarchy order."""

    tiers: dict[str, TierStats] = field(default_factory=dict)

    def snapshot(self) -> CacheStats:
        return CacheStats({name: replace(s) for name, s in self.tiers.items()})

    def __getitem__(self, tier: str) -> TierStats:
        return self.tiers[tier]
