"""The CPU host pool: one slab of (pinned) host memory divided into block slots.

Slots follow the same bookkeeping as GPU blocks (``BlockPool``): a hash -> slot map,
ref counts that pin a slot while it is read or written, and a queue of unpinned
slots that are reused in eviction-policy order (and reported to the spill hook) when
space runs out. Each slot records its block hash, parent hash and chain position, so
that a chain's aligned chunks can be reassembled for the spill tiers.

The slab is pinned when CUDA is available (``pin_memory`` None) or when asked, so
that copies to and from the GPU are truly asynchronous. Registering one huge range
fails on real machines, so a slab over ``PIN_PIECE_BYTES`` is allocated unpinned and
registered with CUDA in pieces of at most that size.
"""

from __future__ import annotations

import logging

import torch

from kvtier._core import UseCounts
from kvtier.block_pool import BlockPool, EvictionHook
from kvtier.config import EvictionPolicy
from kvtier.layout import KVLayout

log = logging.getLogger(__name__)

PIN_PIECE_BYTES = 64 << 30
_logged_choice = False


def _log_pinning_once(pinned: bool, nbytes: int) -> None:
    global _logged_choice
    if not _logged_choice:
        _logged_choice = True
        kind = "pinned" if pinned else "pageable (CUDA not in use)"
        log.info("kvtier host pool: %.1f MiB of %s memory", nbytes / 2**20, kind)


class HostPool(BlockPool):
    """``num_slots`` block slots in host memory; ``slab[s]`` is one block of KV.
    ``eviction`` and ``uses`` as for ``BlockPool``."""

    def __init__(
        self,
        num_slots: int,
        layout: KVLayout,
        pin_memory: bool | None = None,
        on_evict: EvictionHook | None = None,
        eviction: EvictionPolicy = "lru",
        uses: UseCounts | None = None,
    ) -> None:
        super().__init__(num_slots, on_evict, eviction, uses)
        self.layout = layout
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        if pin and not torch.cuda.is_available():
            raise ValueError("tiers.cpu.pin_memory is true but CUDA is not available")
        shape = (num_slots, *layout.block_shape)
        nbytes = num_slots * layout.block_nbytes
        self._registered: list[int] = []
        if pin and nbytes <= PIN_PIECE_BYTES:
            self.slab = torch.empty(shape, dtype=layout.dtype, pin_memory=True)
        else:
            self.slab = torch.empty(shape, dtype=layout.dtype)
            if pin:
                self._register_pieces(nbytes)
        self.pinned = pin
        _log_pinning_once(pin, nbytes)

    @classmethod
    def with_capacity(
        cls,
        capacity: int,
        layout: KVLayout,
        pin_memory: bool | None = None,
        on_evict: EvictionHook | None = None,
        eviction: EvictionPolicy = "lru",
        uses: UseCounts | None = None,
    ) -> HostPool:
        """As many slots as ``capacity`` bytes hold (at least one)."""
        slots = capacity // layout.block_nbytes
        if slots < 1:
            raise ValueError(
                f"tiers.cpu.capacity of {capacity} B holds no {layout.block_nbytes} B block"
            )
        return cls(slots, layout, pin_memory, on_evict, eviction, uses)

    def _register_pieces(self, nbytes: int) -> None:
        cudart = torch.cuda.cudart()
        base = self.slab.data_ptr()
        for offset in range(0, nbytes, PIN_PIECE_BYTES):
            size = min(PIN_PIECE_BYTES, nbytes - offset)
            err = cudart.cudaHostRegister(base + offset, size, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {size} B failed with error {int(err)}")
            self._registered.append(base + offset)

    def close(self) -> None:
        """Unregister pinned pieces (slabs pinned by torch are released by torch)."""
        if self._registered:
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
            self._registered.clear()
