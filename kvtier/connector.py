"""Connector mode: kvtier's host pool and spill tiers below KV blocks an engine owns.

In native mode ``TieredCache`` owns the GPU block pool. An engine with its own block
manager (vLLM) keeps its GPU blocks and its own chained block hashes; kvtier supplies
everything below: the (pinned) host pool, the spill tiers, chunking and the copy
engine. ``ConnectorCache`` is that part, engine-agnostic; ``kvtier.integrations.vllm``
maps vLLM's connector API onto it.

Keys. The engine hashes its blocks; kvtier never re-hashes tokens here, so whatever
the engine mixes into its hashes (cache salt, LoRA, multimodal inputs) carries
through. A block's key is ``H(root || engine hash)`` truncated to 16 bytes, where the
namespace root names the model and the layout of the engine's KV tensors: an engine
hash names its whole prefix, so the key does too, and different models or layouts
never share a key. Chain parents are the previous block's key (the root for block 0).

Engine KV. ``EngineKV`` wraps the engine's per-layer KV tensors, each indexed by block
id on dim 0 (any strides). A host slot holds one block of every layer, each layer's
block in the engine's own element order; the namespace root includes that order
(``EngineKV.describe``), so bytes are only ever read back into the same layout.

Protocol (one request)::

    keys = cache.keys(engine_hashes)
    hit = cache.lookup(keys, start)                # blocks past the engine's own hit
    n = cache.pin(req_id, keys, hit, engine_blocks)  # pinned: nothing evicts them now
    cache.load(req_id)                             # host hits copy at once; spill reads
    ... cache.finished_loads() -> [(req_id, failed engine blocks)] ...   # run on a worker
    cache.save(req_id, engine_blocks, keys, first)  # after the engine wrote their KV

Ordering. A load is never reported done while any part of it is outstanding; blocks
that did not load (a bad value, a tier error, a copy failure) are reported as failed
so the engine recomputes them. A save copies out of the engine's blocks before the
engine may reuse them: on CPU the copy runs inline; on CUDA it runs on the offload
stream and the engine's current stream waits on its event (no host sync), so any
later kernel that overwrites those blocks runs after the copy. Host slots are
published only once their copy has completed, and pinned while a copy reads them.

Threads. Every public method takes ``self._lock``; spill-tier I/O (existence checks in
``lookup``, reads in a load) runs outside it, on the transfer engine's workers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from kvtier.block_pool import CachedBlocks
from kvtier.cache import _truncate, open_spill_tiers
from kvtier.config import ConfigError, KVTierConfig
from kvtier.hashing import HASH_NBYTES, get_digest, namespace_root
from kvtier.host_pool import HostPool
from kvtier.layout import KVLayout
from kvtier.metrics import CacheStats, TierStats
from kvtier.spill import LoadResult, SpillManager, SpillRun
from kvtier.transfer import Transfer, TransferEngine, copy_blocks

log = logging.getLogger(__name__)


class EngineKV:
    """The engine's KV: one tensor per layer, ``[num_blocks, ...]`` with blocks on dim 0.

    Copies move a batch of blocks per layer (``copy_blocks`` coalesces runs) between
    these tensors and the host slab, viewed as ``[slots, layers, *layer block shape]``.
    """

    def __init__(self, layers: Sequence[torch.Tensor]) -> None:
        if not layers:
            raise ValueError("EngineKV needs at least one layer tensor")
        first = layers[0]
        for i, t in enumerate(layers):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(
                    f"KV layer {i} is {tuple(t.shape)} {t.dtype} on {t.device}; expected "
                    f"{tuple(first.shape)} {first.dtype} on {first.device} like layer 0"
                )
        self.layers = list(layers)
        self.device = first.device
        self.dtype = first.dtype
        self.block_shape = tuple(first.shape[1:])
        self.block_numel = int(np.prod(self.block_shape))

    def describe(self) -> str:
        """The element order of one block (part of the namespace root)."""
        dims = "x".join(str(d) for d in self.block_shape)
        return f"{len(self.layers)} layers of [{dims}] {self.dtype} on {self.device.type}"

    def host_view(self, slab: torch.Tensor) -> torch.Tensor:
        """``slab`` as ``[slots, layers, *block_shape]`` (same bytes)."""
        return slab.view(len(slab), len(self.layers), *self.block_shape)

    def copy_to(self, host: torch.Tensor, block_ids: list[int], slots: list[int]) -> None:
        """``host[slots[i], l] = layer_l[block_ids[i]]`` for every layer l."""
        for i, layer in enumerate(self.layers):
            copy_blocks(layer, block_ids, host[:, i], slots, non_blocking=True)

    def copy_from(self, host: torch.Tensor, slots: list[int], block_ids: list[int]) -> None:
        """``layer_l[block_ids[i]] = host[slots[i], l]`` for every layer l."""
        for i, layer in enumerate(self.layers):
            copy_blocks(host[:, i], slots, layer, block_ids, non_blocking=True)


def engine_layout(kv: EngineKV, block_size: int, num_kv_heads: int, head_dim: int) -> KVLayout:
    """The ``KVLayout`` of the engine's blocks; ``ValueError`` when the tensors do not hold
    ``block_size`` tokens of ``num_kv_heads`` x ``head_dim`` K and V (or MLA's one latent)."""
    per_factor = block_size * num_kv_heads * head_dim
    kv_factor, rest = divmod(kv.block_numel, per_factor)
    if rest or kv_factor not in (1, 2):
        raise ValueError(
            f"a KV block of shape {list(kv.block_shape)} does not hold {block_size} tokens x "
            f"{num_kv_heads} KV heads x {head_dim} for K and V (or one MLA latent)"
        )
    return KVLayout(len(kv.layers), kv_factor, block_size, num_kv_heads, head_dim, kv.dtype)


@dataclass(frozen=True)
class ConnectorHit:
    """Blocks ``[start, start + num_blocks)`` of a chain held below the engine: host
    slots first, then spill runs. Valid for the ``pin`` that follows the lookup."""

    start: int
    host_slots: tuple[int, ...] = ()
    spill: tuple[SpillRun, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.host_slots) + sum(run.num_blocks for run in self.spill)

    def blocks_per_tier(self) -> dict[str, int]:
        """Hit blocks by tier name (``cpu``, then each spill tier that holds some)."""
        out = {"cpu": len(self.host_slots)} if self.host_slots else {}
        for run in self.spill:
            out[run.tier] = out.get(run.tier, 0) + run.num_blocks
        return out

    def truncated(self, n: int) -> ConnectorHit:
        """The first ``n`` blocks of this hit."""
        host = self.host_slots[:n]
        return ConnectorHit(self.start, host, _truncate(self.spill, n - len(host)))


@dataclass
class _Load:
    """A pinned hit being copied into engine blocks ``blocks`` (in chain order):
    ``host_slots`` hold the first blocks, ``spill_slots`` stage the spill runs."""

    keys: list[bytes]  # keys of the loaded blocks, in order
    parent: bytes  # key of the block before keys[0] (the root for block 0)
    start: int  # chain position of keys[0]
    blocks: list[int]
    host_slots: list[int]
    spill_slots: list[int]
    runs: tuple[SpillRun, ...]
    unpinned: list[int]  # engine blocks that could not be pinned: failed from the start
    started: float = 0.0
    valid: int = 0  # leading blocks loaded and checked
    result: LoadResult | None = None
    transfer: Transfer | None = None
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)

    @property
    def slots(self) -> list[int]:
        return self.host_slots + self.spill_slots

    def failed_blocks(self) -> list[int]:
        """Engine blocks that hold no valid KV once the load is over."""
        return self.blocks[self.valid :] + self.unpinned


@dataclass
class _Save:
    """Engine blocks being copied into host slots; published when the copy is done."""

    req_id: str
    transfer: Transfer
    slots: CachedBlocks


class ConnectorCache:
    """Host pool and spill tiers below an engine's own KV blocks (see module docstring).

    ``root_name`` names what the engine's keys mean (model, KV tensor layout); it goes
    into the namespace root with the layout fingerprint and the config's salt.
    """

    def __init__(self, config: KVTierConfig, kv: EngineKV, layout: KVLayout, root_name: str):
        cpu = config.tiers.cpu
        if cpu is None:
            raise ConfigError("tiers.cpu", None, "a cpu section: connector mode stages in it")
        if layout.block_numel != len(kv.layers) * kv.block_numel or layout.dtype != kv.dtype:
            raise ValueError(f"layout {layout.describe()} does not match the engine's KV")
        self._hashing = config.hashing
        self._digest = get_digest(config.hashing.algorithm)
        self.kv = kv
        self.layout = layout
        self._root_name = root_name
        self._resets = 0
        self.root = self._namespace_root()
        self.block_size = layout.block_size
        self.host = HostPool.with_capacity(cpu.capacity, layout, cpu.pin_memory)
        self._host_view = kv.host_view(self.host.slab)
        self.transfer = TransferEngine(kv.device, config.transfer.io_threads)
        self._cuda = kv.device.type == "cuda"
        self._lock = threading.RLock()
        tiers, failed = open_spill_tiers(config, self.root.hex()[:16])
        self.spill: SpillManager | None = None
        if tiers:
            through = [
                t.name
                for t in tiers
                if getattr(config.tiers, t.name).write_policy == "write_through"
            ]
            self.spill = SpillManager(
                tiers,
                through,
                self.host,
                self._lock,
                config.transfer.io_threads,
                max_pending_bytes=max(cpu.capacity // 2, 64 << 20),
            )
            self.host.on_evict = self.spill.on_host_evict
        self._stats = CacheStats(
            {"cpu": TierStats(), **{name: TierStats(errors=1) for name in failed}}
        )
        self._loads: dict[str, _Load] = {}
        self._saves: list[_Save] = []

    # ------------------------------------------------------------------ keys
    def keys(self, engine_hashes: Sequence[bytes]) -> list[bytes]:
        """The 16-byte kvtier key of each engine block hash (see module docstring)."""
        digest, root = self._digest, self.root
        return [digest(root + bytes(h))[:HASH_NBYTES] for h in engine_hashes]

    # ------------------------------------------------------------------ loads
    def lookup(self, keys: Sequence[bytes], start: int) -> ConnectorHit:
        """The longest run of ``keys[start:]`` held in the host pool, then the spill tiers,
        as much of it as the host pool can stage now (a hit that could not be pinned
        would only come back as a load error).

        Pins nothing. Costs one batched existence check per spill tier, outside the lock.
        """
        with self._lock:
            self._poll_saves()
            slots = self.host.lookup(keys[start:])
            stats = self._stats["cpu"]
            stats.hits += len(slots)
            stats.misses += len(keys) - start - len(slots)
            room = self.host.num_free - self.host.num_queued(slots)
        below = start + len(slots)
        if not self.spill or below == len(keys) or not room:
            return ConnectorHit(start, tuple(slots))
        runs = _truncate(tuple(self.spill.lookup(keys, below)), room)
        return ConnectorHit(start, tuple(slots), runs)

    def pin(self, req_id: str, keys: Sequence[bytes], hit: ConnectorHit, blocks: list[int]) -> int:
        """Pin ``hit`` for loading into engine ``blocks`` (one per hit block); returns how
        many leading blocks it pinned. Those that could not be pinned (host slots reused
        since the lookup, no staging slots free) are reported failed by the load."""
        if len(blocks) != hit.num_blocks:
            raise ValueError(f"{len(blocks)} engine blocks for a hit of {hit.num_blocks}")
        with self._lock:
            if req_id in self._loads:
                raise ValueError(f"request {req_id!r} already has a load pinned")
            start, end = hit.start, hit.start + hit.num_blocks
            host_slots = list(hit.host_slots)
            if host_slots and not self.host.holds(
                host_slots, keys[start : start + len(host_slots)]
            ):
                host_slots, hit = [], ConnectorHit(start)
            self.host.touch(host_slots)
            spill_blocks = hit.num_blocks - len(host_slots)
            staging = self.host.allocate(min(spill_blocks, self.host.num_free))
            hit = hit.truncated(len(host_slots) + len(staging))
            n = hit.num_blocks
            self._loads[req_id] = _Load(
                keys=list(keys[start : start + n]),
                parent=keys[start - 1] if start else self.root,
                start=start,
                blocks=blocks[:n],
                host_slots=host_slots,
                spill_slots=staging,
                runs=hit.spill,
                unpinned=blocks[n : end - start],
            )
            return n

    def load(self, req_id: str) -> None:
        """Start the pinned load of ``req_id``. A host-only load is copied here (queued
        on the load stream after the engine's current work on CUDA, so the engine's next
        kernels see it); spill reads run on an I/O worker. Never raises for a failure:
        ``finished_loads`` reports it."""
        with self._lock:
            p = self._loads[req_id]
            p.started = time.perf_counter()
            if not p.runs:
                self._copy_up(p, p.host_slots, after=None)
                if self._cuda:
                    p.transfer.order_current_stream()
                else:
                    p.finished.set()
                return
            after = self.transfer.mark()
        self.transfer.submit(self._run_load, p, after)

    def finished_loads(self) -> list[tuple[str, list[int]]]:
        """Loads that are over, each with the engine blocks that did not load (recompute
        them); unpins their slots and publishes what came from the spill tiers."""
        with self._lock:
            done = [
                (r, p)
                for r, p in self._loads.items()
                if p.started and (p.finished.is_set() if p.runs else p.transfer.done())
            ]
            out = []
            for req_id, p in done:
                del self._loads[req_id]
                self._settle(p)
                out.append((req_id, p.failed_blocks()))
            return out

    def has_load(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._loads

    # ------------------------------------------------------------------ saves
    def save(
        self, req_id: str, blocks: list[int], keys: Sequence[bytes], parent: bytes, start: int
    ) -> None:
        """Copy engine ``blocks`` (chain positions ``start..``, keys ``keys``, the first
        one's parent ``parent``) into host slots, unless already there (then they are
        only refreshed in the LRU order). Call after the engine has queued the writes
        of their KV; the engine may reuse the blocks as soon as this returns.

        A batch larger than the free slots goes in pieces: each piece is published
        (once its copy is done) before the next one evicts, so on CPU a chain longer
        than the host pool passes through it into the spill tiers.
        """
        with self._lock:
            self._poll_saves()
            host = self.host
            present = host.lookup_each(keys)
            refresh = [s for s in present if s is not None]
            if refresh:
                host.touch(refresh)
                host.free(refresh[::-1])
            parents = [parent, *keys[:-1]]
            todo = [i for i, s in enumerate(present) if s is None]
            while todo and host.num_free:
                piece, todo = todo[: host.num_free], todo[host.num_free :]
                self._save_piece(
                    req_id,
                    [blocks[i] for i in piece],
                    CachedBlocks(
                        [],  # slots: filled in by _save_piece
                        [keys[i] for i in piece],
                        [start + i for i in piece],
                        [parents[i] for i in piece],
                    ),
                )
            self._stats["cpu"].dropped += len(todo)

    def reset(self) -> None:
        """Forget every block stored so far, as new model weights need: keys move to a
        new namespace (``root``; call ``keys`` again), so nothing stored before, in the
        host pool or in the spill tiers, is ever found again through this cache. The
        spill tiers are shared with other engines and keep their values (to age out);
        the host pool drops its blocks now unless a load, a copy or a write-through
        encode holds some (then they age out too)."""
        with self._lock:
            self._resets += 1
            self.root = self._namespace_root()
            self.host.reset()

    def saving(self, req_id: str) -> bool:
        """True while a save of ``req_id``'s blocks is still copying."""
        with self._lock:
            self._poll_saves()
            return any(s.req_id == req_id for s in self._saves)

    # ------------------------------------------------------------------ misc
    def stats(self) -> CacheStats:
        """A snapshot of the host pool's and each spill tier's counters."""
        with self._lock:
            self._poll_saves()
            snapshot = self._stats.snapshot()
        if self.spill:
            snapshot.tiers.update(self.spill.stats())
        return snapshot

    def flush(self) -> None:
        """Wait for every copy and spill write in flight (tests, shutdown)."""
        with self._lock:
            for s in self._saves:
                s.transfer.join()
            self._poll_saves()
        if self.spill:
            self.spill.flush()

    def wait_loads(self) -> None:
        """Wait until the spill reads (and their copies up) of every started load are
        over; ``finished_loads`` then reports them (host-only loads are copies that ``load``
        itself ran or queued)."""
        with self._lock:
            reading = [p for p in self._loads.values() if p.runs and p.started]
        for p in reading:
            p.finished.wait()

    def close(self) -> None:
        """Finish loads, copies and writes in flight, then close the tiers."""
        self.wait_loads()
        self.finished_loads()
        self.flush()
        self.transfer.close()
        if self.spill:
            self.spill.close()
        self.host.close()

    # ------------------------------------------------------------------ internals
    def _namespace_root(self) -> bytes:
        """The root of every key: ``root_name`` (with the reset count after a reset),
        the layout's fingerprint and the config's salt."""
        name = f"{self._root_name}#reset{self._resets}" if self._resets else self._root_name
        h = self._hashing
        return namespace_root(name, self.layout.fingerprint, h.salt, h.algorithm)

    def _copy(
        self, fn, stream: torch.cuda.Stream | None, n: int, after: torch.cuda.Event | None = None
    ) -> Transfer:
        """Run ``fn`` (a batch of copies of ``n`` blocks): inline on CPU, on ``stream``
        after ``after`` (else the current stream's work) on CUDA. Failures are kept in
        the handle, never raised."""
        nbytes = n * self.layout.block_nbytes
        if stream is None:
            start = time.perf_counter()
            try:
                fn()
            except Exception as e:
                return Transfer(nbytes, error=e)
            return Transfer(nbytes, seconds=time.perf_counter() - start)
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            events[0].record(stream)
            try:
                fn()
            except Exception as e:
                return Transfer(nbytes, error=e)
            finally:
                events[1].record(stream)
        return Transfer(nbytes, events=events)

    def _copy_up(self, p: _Load, slots: list[int], after: torch.cuda.Event | None) -> None:
        blocks = p.blocks[: len(slots)]
        p.transfer = self._copy(
            lambda: self.kv.copy_from(self._host_view, slots, blocks),
            self.transfer.load_stream if self._cuda else None,
            len(slots),
            after,
        )

    def _run_load(self, p: _Load, after: torch.cuda.Event | None) -> None:
        """On an I/O worker: read the spill runs into the staging slots, copy every
        loaded block up, and wait for the copy. ``p.valid`` is set only at the end."""
        try:
            p.result = self.spill.load(p.runs, p.spill_slots)
            valid = len(p.host_slots) + p.result.num_blocks
            self._copy_up(p, p.slots[:valid], after)
            error = p.transfer.join()
            if error is not None:
                raise error
            p.valid = valid
        except Exception as e:  # settled as a failed load, never raised
            p.error = e
        finally:
            p.finished.set()

    def _settle(self, p: _Load) -> None:
        """Count a finished load, publish what it read from the spill tiers, unpin."""
        stats = self._stats["cpu"]
        if not p.runs:  # host-only: the copy is the whole load
            error = p.transfer.join()
            if error is None:
                p.valid = len(p.host_slots)
            else:
                p.error = error
        if p.error is not None:
            log.warning("kvtier: load of %d blocks failed: %s", len(p.blocks), p.error)
            stats.errors += 1
            p.valid = 0
        if p.result is not None:
            self.spill.settle_load(p.result)
        n_host = len(p.host_slots)
        loaded = max(0, min(p.valid, n_host + (p.result.num_blocks if p.result else 0)) - n_host)
        if loaded:  # blocks read from the spill tiers are host-cached now too
            keys = p.keys[n_host : n_host + loaded]
            parents = [p.keys[n_host - 1] if n_host else p.parent, *keys[:-1]]
            first = p.start + n_host
            self.host.publish(p.spill_slots[:loaded], keys, range(first, first + loaded), parents)
        self.host.free(p.slots[::-1])
        from_host = min(p.valid, n_host)
        if from_host:
            stats.count_out(from_host, from_host * self.layout.block_nbytes)
        self._stats.prefetch_latency.observe(time.perf_counter() - p.started)

    def _save_piece(self, req_id: str, src: list[int], chain: CachedBlocks) -> None:
        """Copy engine blocks ``src`` into newly allocated slots that will hold ``chain``."""
        n = len(src)
        evictions = self.host.stats().evictions
        slots = self.host.allocate(n)  # evicted slots are spilled by the hook, first
        self._stats["cpu"].evictions += self.host.stats().evictions - evictions
        transfer = self._copy(
            lambda: self.kv.copy_to(self._host_view, src, slots),
            self.transfer.offload_stream if self._cuda else None,
            n,
        )
        transfer.order_current_stream()  # the engine reuses the blocks after the copy
        save = _Save(req_id, transfer, replace(chain, block_ids=slots))
        if transfer.done():
            self._finish_save(save)
        else:
            self._saves.append(save)

    def _poll_saves(self) -> None:
        if self._saves:
            pending = []
            for s in self._saves:
                if s.transfer.done():
                    self._finish_save(s)
                else:
                    pending.append(s)
            self._saves = pending

    def _finish_save(self, s: _Save) -> None:
        slots = s.slots.block_ids
        stats = self._stats["cpu"]
        if s.transfer.error is None:
            b = s.slots
            self.host.publish(slots, b.hashes, b.positions, b.parents)
            stats.count_in(len(slots), s.transfer.nbytes, s.transfer.seconds)
        else:
            log.warning("kvtier: save to the host pool failed: %s", s.transfer.error)
            stats.errors += 1
        self.host.free(slots[::-1])  # the chain's head is freed last: evicted last
        if s.transfer.error is None and self.spill:
            self.spill.on_host_publish(s.slots)
