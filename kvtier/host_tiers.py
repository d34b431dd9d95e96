"""``HostTiers``: everything below the blocks an engine computes into.

The (pinned) host pool, the spill tiers under it with their ``SpillManager``, and the
``TransferEngine`` that copies blocks and runs the tier reads. Both facades stand on
one: ``TieredCache`` puts kvtier's own GPU block pool on top (native mode),
``ConnectorCache`` an engine's own KV tensors (connector mode). What differs between
them is only where blocks come from and go to; how they are staged, spilled, loaded
and published below is here.

Threads. Not locked itself: the facade's lock (``lock``) guards the host pool, and the
spill manager takes it for the work its own threads do to host slots.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvtier._core import UseCounts
from kvtier.config import ConfigError, KVTierConfig
from kvtier.host_pool import HostPool
from kvtier.layout import KVLayout
from kvtier.metrics import TierStats
from kvtier.spill import HeldWrite, SpillManager, SpillRun, truncate_runs
from kvtier.tiers import open_spill_tiers
from kvtier.tiers.base import SpillTier
from kvtier.transfer import TransferEngine


class HostTiers:
    """The host pool of ``config.tiers.cpu``, the spill tiers in spill order (``tiers``:
    already-open stores instead of the configured ones) and the copy engine.

    ``failed`` names the configured spill tiers that could not be opened (left out,
    with a warning). ``namespace`` keeps this cache's keys apart in shared tiers.
    ``uses``: the cache's use counts, which the host pool and the spill tiers rank by
    where their eviction policy is ``reuse`` (``kvtier.eviction``).
    """

    def __init__(
        self,
        config: KVTierConfig,
        layout: KVLayout,
        device: torch.device,
        lock: threading.RLock,
        namespace: str,
        tiers: list[SpillTier] | None = None,
        uses: UseCounts | None = None,
    ) -> None:
        cpu = config.tiers.cpu
        if cpu is None:
            raise ConfigError("tiers.cpu", None, "a cpu section: spill tiers stage through it")
        self.layout = layout
        self.host = HostPool.with_capacity(
            cpu.capacity, layout, cpu.pin_memory, eviction=cpu.eviction, uses=uses
        )
        self.transfer = TransferEngine(device, config.transfer.io_threads)
        self.failed: list[str] = []
        if tiers is None:
            tiers, self.failed = open_spill_tiers(config, namespace)
        if uses is not None:
            for tier in tiers:
                tier.uses = uses.counts
        self.spill: SpillManager | None = None
        if tiers:
            through = [
                t.name
                for t in tiers
                if getattr(config.tiers, t.name, None) is not None
                and getattr(config.tiers, t.name).write_policy == "write_through"
            ]
            self.spill = SpillManager(
                tiers,
                through,
                self.host,
                lock,
                config.transfer.io_threads,
                max_pending_bytes=max(cpu.capacity // 2, 64 << 20),
            )
            self.host.on_evict = self.spill.on_host_evict

    def tier_stats(self) -> dict[str, TierStats]:
        """Fresh counters for the host pool and for each tier left out at start-up
        (one error each: it stays visible)."""
        return {"cpu": TierStats(), **{name: TierStats(errors=1) for name in self.failed}}

    def stage(
        self, runs: Sequence[SpillRun], held: list[HeldWrite] | None = None
    ) -> tuple[list[int], tuple[SpillRun, ...]]:
        """Host slots to read ``runs`` into, as many as are free (pinned), and the runs
        cut to them. Where too few are free, the write-through encodes among ``held``
        (writes the caller holds back) run first: they pin slots only until they have
        read them, and a load the lookup promised comes before that deferral."""
        needed = sum(run.num_blocks for run in runs)
        if held and needed > self.host.num_free:
            self.spill.encode_held(held)
        n = min(needed, self.host.num_free)
        return self.host.allocate(n), truncate_runs(runs, n)

    def publish_loaded(
        self,
        slots: Sequence[int],
        keys: Sequence[bytes],
        first: int,
        parent: bytes,
        runs: Sequence[SpillRun],
    ) -> None:
        """Make ``slots``, which a load filled from the spill ``runs`` with the blocks
        ``keys`` at chain positions ``first..`` (``parent`` before the first), hittable
        in the host pool too; the spill manager learns which tier holds each."""
        parents = [parent, *keys[:-1]]
        self.host.publish(slots, keys, range(first, first + len(keys)), parents)
        self.spill.on_loaded(runs, keys, first)

    def flush(self) -> None:
        """Wait for every spill write in flight (and the writes they cascade into)."""
        if self.spill:
            self.spill.flush()

    def close(self) -> None:
        """Finish queued work, close the spill tiers and release the host pool."""
        self.transfer.close()
        if self.spill:
            self.spill.close()
        self.host.close()
