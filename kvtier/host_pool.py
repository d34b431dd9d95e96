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

Fresh slots are populated ahead of their first use. A pageable slab's pages are
mapped by the kernel on their first write, one fault per 4 KiB page; a fresh pool's
first loads and offloads would pay them inside the copy (``bench_host_fill``: a first
copy of 64 MiB into fresh slots takes 7-9 times as long as into warm ones).
So a pageable slab is a ``_core.Slab``, memory of kvtier's own whose pages a thread
populates in the background, a bounded distance ahead of the pool's allocation
frontier:

- The pool hands out never used slots in ascending order (``BlockPool.frontier``:
  slots from it on have never been handed out), so the slots a request gets next are
  the ones just past the frontier. Slots are populated up to ``fill_ahead`` bytes
  (``FILL_AHEAD_BYTES`` by default) past it: at creation the first ones, and again each
  time the frontier has moved half of that. Start-up only starts the thread;
  memory the pool never reaches is never committed; slots already handed out are
  skipped (their users write them).
- The thread, ``kvtier-fill``, is a C thread at idle priority (``SCHED_IDLE``, else
  nice 19; that thread alone), free of the engine's CPU binding (``threads.py``),
  working in pieces of ``FILL_PIECE_BYTES``; the engine's threads are not touched. It
  never takes the GIL: a Python thread at idle priority that wants the GIL makes the
  thread holding it wait until it is scheduled, which with the CPUs busy stalled the
  engine's Python code (measured: 30% slower, stalls of 60 ms; none with this one).
  ``close`` stops it without waiting; it never touches memory the pool has released
  and never unmaps (``_core.c`` says how).
- Populating never changes a byte, even in a slot someone writes meanwhile: one
  atomic compare-and-swap of 0 with 0 per page, which a racing write either precedes
  or follows. It is that rather than ``madvise(MADV_POPULATE_WRITE)``, which holds the
  process's mmap lock across its whole range: a thread at idle priority preempted
  inside it would stall the engine's own mmap and munmap calls until a CPU came free,
  while a page fault holds the lock (on recent kernels, the mapping's own lock) for
  one page. It needs no particular kernel either, and costs about 1.2 times the CPU
  time of the madvise.
- A pinned slab is not populated by kvtier: pinning (``cudaHostAlloc`` behind
  ``pin_memory=True``, or ``cudaHostRegister``) maps and locks every page at
  allocation.
"""

from __future__ import annotations

import logging

import torch

from kvtier._core import Slab, UseCounts
from kvtier.block_pool import BlockPool, EvictionHook
from kvtier.config import EvictionPolicy
from kvtier.layout import KVLayout

log = logging.getLogger(__name__)

PIN_PIECE_BYTES = 64 << 30
FILL_AHEAD_BYTES = 256 << 20  # populated past the allocation frontier (pageable slabs)
FILL_PIECE_BYTES = 8 << 20  # populated per step of the fill thread
_logged_choice = False


def _log_pinning_once(pinned: bool, nbytes: int) -> None:
    global _logged_choice
    if not _logged_choice:
        _logged_choice = True
        kind = "pinned" if pinned else "pageable (CUDA not in use)"
        log.info("kvtier host pool: %.1f MiB of %s memory", nbytes / 2**20, kind)


class HostPool(BlockPool):
    """``num_slots`` block slots in host memory; ``slab[s]`` is one block of KV.
    ``eviction`` and ``uses`` as for ``BlockPool``. A pageable slab is populated up to
    ``fill_ahead`` bytes (None: ``FILL_AHEAD_BYTES``; 0: not at all) past the slots
    handed out so far, in the background (module docstring)."""

    def __init__(
        self,
        num_slots: int,
        layout: KVLayout,
        pin_memory: bool | None = None,
        on_evict: EvictionHook | None = None,
        eviction: EvictionPolicy = "lru",
        uses: UseCounts | None = None,
        fill_ahead: int | None = None,
    ) -> None:
        super().__init__(num_slots, on_evict, eviction, uses)
        self.layout = layout
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        if pin and not torch.cuda.is_available():
            raise ValueError("tiers.cpu.pin_memory is true but CUDA is not available")
        shape = (num_slots, *layout.block_shape)
        nbytes = num_slots * layout.block_nbytes
        ahead = FILL_AHEAD_BYTES if fill_ahead is None else fill_ahead
        if ahead < 0:
            raise ValueError(f"fill_ahead must be >= 0 bytes, got {ahead}")
        self._registered: list[int] = []
        # Pinned memory is populated as it is pinned; pageable memory ahead of its use.
        self._memory: Slab | None = None
        if pin and nbytes <= PIN_PIECE_BYTES:
            self.slab = torch.empty(shape, dtype=layout.dtype, pin_memory=True)
        elif pin:
            self.slab = torch.empty(shape, dtype=layout.dtype)
            self._register_pieces(nbytes)
        else:
            self._memory = Slab(nbytes, ahead, FILL_PIECE_BYTES)
            self.slab = torch.frombuffer(self._memory, dtype=layout.dtype).view(shape)
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
        fill_ahead: int | None = None,
    ) -> HostPool:
        """As many slots as ``capacity`` bytes hold (at least one)."""
        slots = capacity // layout.block_nbytes
        if slots < 1:
            raise ValueError(
                f"tiers.cpu.capacity of {capacity} B holds no {layout.block_nbytes} B block"
            )
        return cls(slots, layout, pin_memory, on_evict, eviction, uses, fill_ahead)

    def allocate(self, n: int) -> list[int]:
        """As ``BlockPool.allocate``; past the frontier, the fill moves on."""
        out = super().allocate(n)
        if self._memory is not None:
            self._memory.follow(self._table.frontier * self.layout.block_nbytes)
        return out

    def wait_filled(self, timeout: float | None = None) -> bool:
        """Wait until the slots the fill has been asked for are populated; False on
        timeout (for tests and benchmarks; nothing else needs to wait)."""
        return self._memory is None or self._memory.wait_filled(timeout)

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
        """Stop the fill and unregister pinned pieces (slabs pinned by torch are
        released by torch)."""
        if self._memory is not None:
            self._memory.close()
        if self._registered:
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
            self._registered.clear()
