"""``TieredCache``: the engine-facing facade over the GPU pool, the host pool and copies.

Protocol for one request (native mode: kvtier owns the GPU blocks)::

    hit = cache.lookup(req_id, token_ids)           # cached prefix, tokens per tier
    table = cache.allocate(req_id, n, hit)          # block table; starts the prefetch
    cache.wait(req_id)                              # -> tokens whose KV is in place
    ... engine writes KV of the remaining tokens into cache.kv[table] ...
    cache.commit(req_id, token_ids)                 # publish newly full blocks
    cache.free(req_id)

Data flow: when the GPU pool evicts cached blocks, ``_on_gpu_evict`` copies their KV
into host slots (one batched copy per allocation) before the GPU blocks are handed
out; on CUDA the copy runs on the offload stream and the engine's stream waits on its
event. A hit that continues into the host pool is loaded into freshly allocated GPU
blocks in the background; until the copy has finished those blocks are held by the
request only (unpublished: no one else can hit them, nothing can evict them).

Threads: every public method takes ``self._lock``. Copies run on the transfer engine's
streams or worker threads and never touch bookkeeping; their completion is observed
under the lock (``_poll``), which publishes and unpins. ``wait`` blocks outside the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from os import PathLike

import torch

from kvtier.block_manager import BlockManager, StaleHitError
from kvtier.block_pool import CachedBlocks
from kvtier.config import ConfigError, KVTierConfig, load_config
from kvtier.gpu_pool import GPUBlockPool
from kvtier.hashing import BlockHasher, ExtraKeys, TokenIds, namespace_root
from kvtier.host_pool import HostPool
from kvtier.layout import KVLayout
from kvtier.metrics import CacheStats, TierStats
from kvtier.transfer import Transfer, TransferEngine


class LoadError(RuntimeError):
    """A request's prefetch failed; its KV must be recomputed from ``wait()``'s answer."""


@dataclass(frozen=True)
class PrefixHit:
    """The longest cached prefix of a prompt: GPU blocks first, then host slots.

    Valid for the ``allocate`` that follows the ``lookup`` that made it.
    """

    block_size: int
    gpu_blocks: tuple[int, ...] = ()
    host_slots: tuple[int, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.gpu_blocks) + len(self.host_slots)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def tokens_per_tier(self) -> dict[str, int]:
        return {
            "gpu": len(self.gpu_blocks) * self.block_size,
            "cpu": len(self.host_slots) * self.block_size,
        }


@dataclass
class _Prefetch:
    """Host slots being copied into a request's blocks ``[first, first + len(slots))``."""

    transfer: Transfer
    slots: list[int]
    first: int
    result: int | None = None  # tokens of valid KV once settled
    acknowledged: bool = False  # the engine has seen ``result`` through wait()


@dataclass
class _Offload:
    """GPU blocks being copied into host slots; the slots are published when it is done."""

    transfer: Transfer
    slots: list[int]
    hashes: list[bytes]
    positions: list[int]
    parents: list[bytes]
    gpu_pins: list[int] = field(default_factory=list)  # eager copies pin their source


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class TieredCache:
    """A prefix cache whose blocks live on the GPU, in host memory, and below."""

    def __init__(
        self,
        config: KVTierConfig,
        layout: KVLayout | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        layout = layout or config.layout
        if layout is None:
            raise ConfigError("layout", None, "a layout section, or a layout from the engine")
        self.config = config
        self.layout = layout
        self.block_size = layout.block_size
        self.device = torch.device(device) if device else _resolve_device(config.tiers.gpu.device)
        cpu = config.tiers.cpu
        self.host = HostPool.with_capacity(cpu.capacity, layout, cpu.pin_memory) if cpu else None
        self.gpu = GPUBlockPool(
            config.tiers.gpu.resolve_num_blocks(layout),
            layout,
            self.device,
            on_evict=self._on_gpu_evict if self.host else None,
        )
        algorithm = config.hashing.algorithm
        root = namespace_root(config.model, layout.fingerprint, config.hashing.salt, algorithm)
        self.manager = BlockManager(self.gpu, BlockHasher(root, self.block_size, algorithm))
        self.transfer = TransferEngine(self.device, config.transfer.io_threads)
        self._eager = cpu is not None and cpu.write_policy == "eager"
        self._lock = threading.RLock()
        self._offloads: list[_Offload] = []
        self._prefetches: dict[Hashable, _Prefetch] = {}
        self._stats = CacheStats({"gpu": TierStats(), **({"cpu": TierStats()} if cpu else {})})

    @classmethod
    def from_yaml(
        cls,
        path: str | PathLike[str],
        layout: KVLayout | None = None,
        device: torch.device | str | None = None,
    ) -> TieredCache:
        return cls(load_config(path), layout, device)

    @property
    def kv(self) -> torch.Tensor:
        """The device tensor the model reads and writes: ``[num_blocks, *block_shape]``."""
        return self.gpu.kv

    # ------------------------------------------------------------------ engine API
    def lookup(
        self, req_id: Hashable, token_ids: TokenIds, extra: ExtraKeys | None = None
    ) -> PrefixHit:
        """The longest cached prefix of the prompt, across tiers (pins nothing)."""
        with self._lock:
            self._poll()
            hashes = self.manager.hash_prompt(req_id, token_ids, extra)
            wanted = hashes[: (len(token_ids) - 1) // self.block_size]
            gpu = self.gpu.lookup(wanted)
            host = self.host.lookup(wanted[len(gpu) :]) if self.host else []
            self._count_lookup(len(wanted), len(gpu), len(host))
            return PrefixHit(self.block_size, tuple(gpu), tuple(host))

    def allocate(
        self, req_id: Hashable, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> list[int] | None:
        """Slots for ``num_new_tokens`` tokens after the hit; returns the block table.

        On a request's first allocation the hit is taken: its GPU blocks are shared,
        and its host part gets fresh GPU blocks that are filled in the background
        (``ready``/``wait``). None, changing nothing, when the GPU pool is full.
        ``StaleHitError`` if another allocation reused the hit's blocks since lookup.
        """
        with self._lock:
            self._poll()
            slots = list(hit.host_slots) if hit else []
            if slots:
                req = self.manager.request(req_id)
                first = len(hit.gpu_blocks)
                if not self.host.holds(slots, req.hashes[first : first + len(slots)]):
                    raise StaleHitError(f"hit of request {req_id!r} is stale; look it up again")
            # Pin the host part first: the GPU evictions this allocation causes copy
            # blocks down, and that must not reuse the slots we are about to read.
            if slots:
                self.host.touch(slots)
            try:
                new = self.manager.allocate(
                    req_id,
                    len(slots) * self.block_size + num_new_tokens,
                    list(hit.gpu_blocks) if hit else None,
                )
            except BaseException:
                if slots:
                    self.host.free(slots)
                raise
            if new is None:
                if slots:
                    self.host.free(slots)
                return None
            if slots:
                self._start_prefetch(req_id, slots, new[: len(slots)], len(hit.gpu_blocks))
            return list(self.manager.block_ids(req_id))

    def ready(self, req_id: Hashable) -> bool:
        """True when the request's prefetched KV is in place (or it had none). Never blocks."""
        with self._lock:
            self._poll()
            p = self._prefetches.get(req_id)
            return p is None or p.result is not None

    def wait(self, req_id: Hashable) -> int:
        """Block until the prefetch is done; returns how many leading tokens hold valid KV.

        That is the whole hit when every copy succeeded; after a failed load it is the
        GPU part only, and the engine computes the rest (its blocks are allocated).
        """
        with self._lock:
            p = self._prefetches.get(req_id)
            if p is None:
                return self.manager.request(req_id).num_published * self.block_size
        if p.result is None:
            p.transfer.join()
        with self._lock:
            self._poll()
            if self._prefetches.get(req_id) is not p:
                raise KeyError(f"request {req_id!r} was freed while waiting")
            assert p.result is not None
            p.acknowledged = True
            return p.result

    def commit(self, req_id: Hashable, token_ids: TokenIds) -> int:
        """Publish the request's newly full blocks (after the engine wrote their KV).

        With a prefetch, the engine must have called ``wait`` (and recomputed what a
        failed load left out) first; otherwise ``LoadError``, publishing nothing.
        """
        with self._lock:
            p = self._prefetches.get(req_id)
            if p is not None and not p.acknowledged:
                raise LoadError(f"commit of request {req_id!r} before wait() on its prefetch")
            req = self.manager.request(req_id)
            before = req.num_published
            n = self.manager.commit(req_id, token_ids)
            if self._eager and n:
                self._copy_down(
                    self.gpu.cached_blocks(req.block_ids[before : req.num_published]),
                    pin_source=True,
                )
            return n

    def free(self, req_id: Hashable) -> bool:
        """Release the request's blocks (tail first); a prefetch in flight is cancelled or
        completed first. False, a no-op, for an unknown request."""
        with self._lock:
            p = self._prefetches.pop(req_id, None)
            if p is not None and p.result is None:
                if not p.transfer.cancel():
                    p.transfer.join()
                self.host.free(p.slots)
            freed = self.manager.free(req_id)
            self._poll()
            return freed

    def block_ids(self, req_id: Hashable) -> list[int]:
        with self._lock:
            return list(self.manager.block_ids(req_id))

    def stats(self) -> CacheStats:
        """A snapshot of the per-tier counters."""
        with self._lock:
            self._poll()
            return self._stats.snapshot()

    def flush(self) -> None:
        """Wait for every copy in flight to land (tests, shutdown)."""
        with self._lock:
            for o in self._offloads:
                o.transfer.join()
            self._poll()

    def close(self) -> None:
        self.flush()
        self.transfer.close()
        if self.host:
            self.host.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _count_lookup(self, wanted: int, gpu: int, host: int) -> None:
        s = self._stats
        s["gpu"].hits += gpu
        s["gpu"].misses += wanted - gpu
        if self.host:
            s["cpu"].hits += host
            s["cpu"].misses += wanted - gpu - host

    def _start_prefetch(
        self, req_id: Hashable, slots: list[int], blocks: list[int], first: int
    ) -> None:
        """Copy pinned host ``slots`` into the request's new GPU ``blocks`` in the background."""
        transfer = self.transfer.copy(self.host.slab, slots, self.gpu.kv, blocks, background=True)
        self._prefetches[req_id] = _Prefetch(transfer, slots, first)

    def _settle(self, req_id: Hashable, p: _Prefetch) -> None:
        """Finish a prefetch whose copy is done: publish its blocks or count the failure."""
        error = p.transfer.error
        self.host.free(p.slots)
        n = len(p.slots)
        if error is None:
            self.manager.publish(req_id, p.first + n)
            self._stats["cpu"].count_out(n, p.transfer.nbytes, p.transfer.seconds)
            self._stats["gpu"].count_in(n, p.transfer.nbytes)
            p.result = (p.first + n) * self.block_size
        else:
            self._stats["cpu"].errors += 1
            p.result = p.first * self.block_size

    def _poll(self) -> None:
        """Observe finished copies: settle prefetches, publish and unpin offloads."""
        for req_id, p in self._prefetches.items():
            if p.result is None and p.transfer.done():
                self._settle(req_id, p)
        if self._offloads:
            pending = []
            for o in self._offloads:
                if o.transfer.done():
                    self._finish_offload(o)
                else:
                    pending.append(o)
            self._offloads = pending

    def _on_gpu_evict(self, evicted: CachedBlocks) -> None:
        """GPU eviction hook: copy the victims' KV into host slots before reuse."""
        self._copy_down(evicted, pin_source=False)

    def _copy_down(self, blocks: CachedBlocks, pin_source: bool) -> None:
        """Copy GPU blocks not yet in the host pool into host slots, as one batch.

        Blocks already in the host pool are only refreshed in its LRU order. When the
        host pool cannot supply enough slots (all pinned), the rest are dropped.
        ``pin_source`` holds the GPU blocks until the copy is done (eager copies of
        blocks that the request may free meanwhile).
        """
        host, stats = self.host, self._stats["cpu"]
        hashes = blocks.hashes
        present = host.lookup_each(hashes)
        refresh = [s for s in present if s is not None]
        if refresh:
            host.touch(refresh)
            host.free(refresh[::-1])
        todo = [i for i, s in enumerate(present) if s is None]
        n = min(len(todo), host.num_free)
        stats.dropped += len(todo) - n
        if not n:
            return
        todo = todo[:n]
        evictions_before = host.stats().evictions
        slots = host.allocate(n)
        stats.evictions += host.stats().evictions - evictions_before
        src = [blocks.block_ids[i] for i in todo]
        if pin_source:
            self.gpu.touch(src)
        transfer = self.transfer.copy(self.gpu.kv, src, host.slab, slots)
        transfer.order_current_stream()  # reuse of the source blocks waits for the copy
        offload = _Offload(
            transfer,
            slots,
            [hashes[i] for i in todo],
            [blocks.positions[i] for i in todo],
            [blocks.parents[i] for i in todo],
            src if pin_source else [],
        )
        if transfer.done():
            self._finish_offload(offload)
        else:
            self._offloads.append(offload)

    def _finish_offload(self, o: _Offload) -> None:
        error = o.transfer.error
        if error is None:
            self.host.publish(o.slots, o.hashes, o.positions, o.parents)
            n = len(o.slots)
            self._stats["cpu"].count_in(n, o.transfer.nbytes, o.transfer.seconds)
            self._stats["gpu"].count_out(n, o.transfer.nbytes)
        else:
            self._stats["cpu"].errors += 1
        # Oldest victim last in the list given to free(), so it is evicted first.
        self.host.free(o.slots[::-1])
        if o.gpu_pins:
            self.gpu.free(o.gpu_pins)
