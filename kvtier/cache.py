"""``TieredCache``: the engine-facing facade over the GPU pool, the host pool and the
spill tiers.

Protocol for one request (native mode: kvtier owns the GPU blocks)::

    hit = cache.lookup(req_id, token_ids)           # cached prefix, tokens per tier
    table = cache.allocate(req_id, n, hit)          # block table; starts the prefetch
    valid = cache.wait(req_id)                      # tokens whose KV is in place
    ... engine writes KV of tokens [valid:] into cache.kv[table] ...
    cache.commit(req_id, token_ids)                 # publish newly full blocks
    cache.free(req_id)

Every request that was looked up must be freed.

Data flow. When the GPU pool evicts cached blocks, ``_on_gpu_evict`` copies their KV
into host slots (one batched copy per allocation) before the GPU blocks are handed
out; on CUDA the copy runs on the offload stream and the engine's stream waits on
its event. When the host pool evicts slots, the spill manager writes their chunks to
the spill tiers. A hit below the GPU is loaded into freshly allocated GPU blocks by
an I/O worker (tier reads into pinned host slots, then one copy up); until it is
done those blocks are held by the request only: no one else can hit them, nothing
can evict them.

Threads. Every public method takes ``self._lock`` (spill-tier existence checks in
``lookup`` run outside it). I/O workers never touch bookkeeping: a prefetch's
completion is observed under the lock (``_poll``), which publishes and unpins.
``wait`` blocks outside the lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from os import PathLike
from typing import NamedTuple

import torch

from kvtier.block_manager import BlockManager, StaleHitError
from kvtier.block_pool import CachedBlocks
from kvtier.config import ConfigError, KVTierConfig, load_config
from kvtier.eviction import use_counts_for
from kvtier.gpu_pool import GPUBlockPool
from kvtier.hashing import BlockHasher, ExtraKeys, TokenIds, namespace_root
from kvtier.host_tiers import HostTiers
from kvtier.layout import KVLayout
from kvtier.metrics import CacheStats, TierStats
from kvtier.prometheus import MetricsServer, serve_metrics
from kvtier.spill import LoadResult, SpillRun, hit_blocks
from kvtier.tiers import spill_namespace
from kvtier.tiers.base import SpillTier, TierUsage
from kvtier.trace import LoadTimes, Trace
from kvtier.transfer import Transfer, TransferEngine

log = logging.getLogger(__name__)
# ``allocate``'s held spill writes when there are no spill tiers: none, ever.
_NOTHING_HELD = nullcontext(())


class LoadError(RuntimeError):
    """A request's KV was used before its prefetch was waited for."""


class PrefixHit(NamedTuple):
    """The longest cached prefix of a prompt: GPU blocks, then host slots, then spill runs.

    Valid for the ``allocate`` that follows the ``lookup`` that made it. A named tuple
    rather than a frozen dataclass: every ``lookup`` makes one, and a frozen
    dataclass's ``__init__`` (one ``object.__setattr__`` per field) measured 4x slower.
    """

    block_size: int
    gpu_blocks: tuple[int, ...] = ()
    host_slots: tuple[int, ...] = ()
    spill: tuple[SpillRun, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.gpu_blocks) + len(self.host_slots) + self.spill_blocks

    @property
    def spill_blocks(self) -> int:
        return sum([run.num_blocks for run in self.spill]) if self.spill else 0

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def tokens_per_tier(self) -> dict[str, int]:
        """Hit tokens by tier name (``gpu``, ``cpu``, then each spill tier that holds some)."""
        out = {
            "gpu": len(self.gpu_blocks) * self.block_size,
            "cpu": len(self.host_slots) * self.block_size,
        }
        for run in self.spill:
            out[run.tier] = out.get(run.tier, 0) + run.num_blocks * self.block_size
        return out


@dataclass(slots=True)
class _Prefetch:
    """Blocks ``[first, first + len(blocks))`` of a request being filled from pinned host
    slots: ``host_slots`` (host hits) then ``spill_slots`` (loaded from ``runs``).

    ``work`` reads the spill runs, copies up and returns how many leading blocks it
    filled. It runs once: on an I/O worker, or on the engine's thread if that waits
    before a worker took it (no thread hand-off then). A host-only hit needs no work:
    ``transfer`` is the copy up itself, queued on the load stream (CUDA) or the copier
    thread (CPU; run by the engine's thread if it waits before the copier started it).
    """

    first: int
    blocks: list[int]
    host_slots: list[int]
    spill_slots: list[int]
    runs: tuple[SpillRun, ...]
    work: Callable[[], int] | None = None
    transfer: Transfer | None = None
    claim: threading.Lock | None = None  # with ``work``: taken by whoever runs it
    finished: threading.Event | None = None  # with ``work``: set once it is over
    valid: int = 0
    error: BaseException | None = None
    load: LoadResult | None = None
    result: int | None = None  # tokens of valid KV once settled
    acknowledged: bool = False  # the engine has seen ``result`` through wait()
    held: list = field(default_factory=list)  # spill writes started after the reads
    nbytes: int = 0
    seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)  # at allocate
    finished_at: float = 0.0  # when ``work`` returned (its KV in place)
    times: LoadTimes = field(default_factory=LoadTimes)  # for the trace

    def set_work(self, work: Callable[[], int]) -> None:
        self.work, self.claim, self.finished = work, threading.Lock(), threading.Event()

    def run(self) -> None:
        """Do the work unless another thread has taken it."""
        if not self.claim.acquire(blocking=False):
            return
        try:
            self.valid = self.work()
        except Exception as e:  # settled as a load failure, never raised
            self.error = e
        finally:
            self.finished_at = time.perf_counter()
            self.finished.set()

    def cancel(self) -> bool:
        """Take the work (or the copy) so that it never runs; False once it has started."""
        if self.work is None:
            return self.transfer.cancel()
        if not self.claim.acquire(blocking=False):
            return False
        self.finished.set()
        return True

    def done(self) -> bool:
        return self.finished.is_set() if self.work is not None else self.transfer.done()

    def join(self) -> None:
        """Run the work here if no worker has started it, then wait until it is over."""
        if self.work is not None:
            self.run()
            self.finished.wait()
        else:
            self.transfer.join()

    def latency(self) -> float:
        """Seconds from ``allocate`` until the KV was in place. A copy up without
        ``work`` has no host-side end time: the copy's own time stands in for it."""
        return self.finished_at - self.started if self.work is not None else self.seconds

    def outcome(self) -> tuple[int, BaseException | None]:
        """(leading blocks filled, the failure if any) of finished work."""
        if self.work is not None:
            return (0, self.error) if self.error is not None else (self.valid, None)
        t = self.transfer
        self.nbytes, self.seconds = t.nbytes, t.seconds
        return (0, t.error) if t.error is not None else (len(self.host_slots), None)


@dataclass
class _Offload:
    """GPU blocks being copied into host slots; the slots are published when it is done."""

    transfer: Transfer
    blocks: CachedBlocks  # the host slots, with the chain info of what they will hold
    gpu_pins: list[int] = field(default_factory=list)  # eager copies pin their source


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class TieredCache:
    """A prefix cache whose blocks live on the GPU, in host memory, on disk and in Redis."""

    def __init__(
        self,
        config: KVTierConfig,
        layout: KVLayout | None = None,
        device: torch.device | str | None = None,
        tiers: list[SpillTier] | None = None,
    ) -> None:
        """Build the tiers ``config`` names; ``tiers`` replaces the configured spill tiers
        (already-open stores, e.g. in tests)."""
        layout = layout or config.layout
        if layout is None:
            raise ConfigError("layout", None, "a layout section, or a layout from the engine")
        cpu = config.tiers.cpu
        if cpu is None and (tiers or config.tiers.spill_order):
            raise ConfigError(
                "tiers.cpu", None, "a cpu section: spill tiers stage through the host pool"
            )
        self.config = config
        self.layout = layout
        self.block_size = layout.block_size
        self.device = torch.device(device) if device else _resolve_device(config.tiers.gpu.device)
        algorithm = config.hashing.algorithm
        root = namespace_root(config.model, layout.fingerprint, config.hashing.salt, algorithm)
        self._lock = threading.RLock()
        gpu_blocks = config.tiers.gpu.resolve_num_blocks(layout)
        self.uses = use_counts_for(config, layout, gpu_blocks)  # None: no tier needs them
        self.below = (
            HostTiers(
                config,
                layout,
                self.device,
                self._lock,
                spill_namespace(config, layout),
                tiers,
                self.uses,
            )
            if cpu
            else None
        )
        self.host = self.below.host if self.below else None
        self.spill = self.below.spill if self.below else None
        self.transfer = (
            self.below.transfer
            if self.below
            else TransferEngine(self.device, config.transfer.io_threads)
        )
        self.gpu = GPUBlockPool(
            gpu_blocks,
            layout,
            self.device,
            on_evict=self._on_gpu_evict if self.host else None,
            eviction=config.tiers.gpu.eviction,
            uses=self.uses,
        )
        self.manager = BlockManager(
            self.gpu, BlockHasher(root, self.block_size, algorithm), self.uses
        )
        self._eager = cpu is not None and cpu.write_policy == "eager"
        self._offloads: list[_Offload] = []
        self._prefetches: dict[Hashable, _Prefetch] = {}  # until the request is freed
        self._unsettled: dict[Hashable, _Prefetch] = {}  # until ``_poll`` settles them
        self._metrics: MetricsServer | None = None
        self.trace = Trace(config.metrics.trace_path)
        self._stats = CacheStats(
            {"gpu": TierStats(), **(self.below.tier_stats() if self.below else {})}
        )
        # The pools' counters, held directly: the request path updates them on every call.
        self._gpu_stats = self._stats["gpu"]
        self._host_stats = self._stats["cpu"] if cpu else None
        if config.metrics.prometheus_port is not None:
            try:
                self._metrics = serve_metrics(self.stats, config.metrics)
            except BaseException:
                self.close()
                raise

    @classmethod
    def from_yaml(
        cls,
        path: str | PathLike[str],
        layout: KVLayout | None = None,
        device: torch.device | str | None = None,
    ) -> TieredCache:
        """A cache built from a YAML config (``ConfigError`` names any bad key)."""
        return cls(load_config(path), layout, device)

    @property
    def kv(self) -> torch.Tensor:
        """The device tensor the model reads and writes: ``[num_blocks, *block_shape]``."""
        return self.gpu.kv

    # ------------------------------------------------------------------ engine API
    def lookup(
        self, req_id: Hashable, token_ids: TokenIds, extra: ExtraKeys | None = None
    ) -> PrefixHit:
        """The longest cached prefix of the prompt, across tiers (pins nothing).

        Costs one batched existence check per spill tier, made outside the lock.
        """
        start = time.perf_counter()
        with self._lock:
            self._poll()
            hashes = self.manager.hash_prompt(req_id, token_ids, extra)
            wanted = hashes[: (len(token_ids) - 1) // self.block_size]
            gpu = self.gpu.lookup(wanted)
            host = self.host.lookup(wanted[len(gpu) :]) if self.host else []
            self._gpu_stats.hits += len(gpu)
            self._gpu_stats.misses += len(wanted) - len(gpu)
            if self.host:
                self._host_stats.hits += len(host)
                self._host_stats.misses += len(wanted) - len(gpu) - len(host)
            if self.spill is None:  # done: no second trip through the lock
                hit = PrefixHit(self.block_size, tuple(gpu), tuple(host))
                seconds = time.perf_counter() - start
                self._stats.lookup_latency.observe(seconds)
        if self.spill is not None:
            above = len(gpu) + len(host)
            runs = self.spill.lookup(wanted[above:], above)
            hit = PrefixHit(self.block_size, tuple(gpu), tuple(host), tuple(runs))
            seconds = time.perf_counter() - start
            with self._lock:
                self._stats.lookup_latency.observe(seconds)
        if self.trace:
            blocks = {t: n // self.block_size for t, n in hit.tokens_per_tier().items() if n}
            start = time.time() - seconds
            self.trace.event("lookup", req_id, start, seconds=seconds, blocks=blocks)
        return hit

    def allocate(
        self, req_id: Hashable, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> list[int] | None:
        """Slots for ``num_new_tokens`` tokens after the hit; returns the block table.

        On a request's first allocation the hit is taken: its GPU blocks are shared,
        and the rest gets fresh GPU blocks that an I/O worker fills (``ready``/``wait``).
        None, changing nothing, when the GPU pool is full. ``StaleHitError`` if another
        allocation reused the hit's GPU blocks or host slots since the lookup.
        """
        hit = hit or PrefixHit(self.block_size)
        with self._lock:
            self._poll()
            host_slots = list(hit.host_slots)
            first = len(hit.gpu_blocks)
            if host_slots:
                hashes = self.manager.request(req_id).hashes
                if not self.host.holds(host_slots, hashes[first : first + len(host_slots)]):
                    raise StaleHitError(f"hit of request {req_id!r} is stale; look it up again")
                # Pinned first: the evictions this allocation causes copy blocks down, and
                # that must not reuse the slots we are about to read.
                self.host.touch(host_slots)
            below = len(host_slots) + hit.spill_blocks
            # The spill writes this allocation causes wait for the prefetch's reads: on a
            # full tier they would otherwise evict the very chunks the hit found.
            with self.spill.holding_writes() if self.spill else _NOTHING_HELD as held:
                try:
                    new = self.manager.allocate(
                        req_id, below * self.block_size + num_new_tokens, list(hit.gpu_blocks)
                    )
                except BaseException:
                    if host_slots:
                        self.host.free(host_slots)
                    raise
                if new is not None:
                    self.manager.use(req_id, hit.num_blocks)  # before anything is queued
                if new is not None and below:
                    self._start_prefetch(req_id, hit, first, new[:below], held)
            if held:
                self.spill.start_writes(held)
            if new is None:
                if host_slots:
                    self.host.free(host_slots)
                return None
            return list(self.manager.block_ids(req_id))

    def ready(self, req_id: Hashable) -> bool:
        """True when the request's prefetched KV is in place (or it had none). Never blocks."""
        with self._lock:
            self._poll()
            p = self._prefetches.get(req_id)
            return p is None or p.result is not None

    def wait(self, req_id: Hashable) -> int:
        """Block until the prefetch is done; returns how many leading tokens hold valid KV.

        That is the whole hit when every read and copy succeeded; after a failure it is
        the prefix that did load, and the engine computes the rest (its blocks are
        allocated). Must be called before the engine uses the request's KV.
        """
        with self._lock:
            p = self._prefetches.get(req_id)
            if p is None:
                return self.manager.request(req_id).num_published * self.block_size
        if p.result is None:
            p.join()  # a failure is settled below
        with self._lock:
            self._poll()
            if self._prefetches.get(req_id) is not p:
                raise KeyError(f"request {req_id!r} was freed while waiting")
            p.acknowledged = True
            return p.result

    def commit(self, req_id: Hashable, token_ids: TokenIds) -> int:
        """Publish the request's newly full blocks (after the engine wrote their KV).

        ``LoadError``, publishing nothing, if the request has a prefetch the engine has
        not waited for.
        """
        with self._lock:
            p = self._prefetches.get(req_id)
            if p is not None and not p.acknowledged:
                raise LoadError(f"commit of request {req_id!r} before wait() on its prefetch")
            req = self.manager.request(req_id)
            before = req.num_published
            n = self.manager.commit(req_id, token_ids)
            if self._eager and n:
                new = req.block_ids[before : req.num_published]
                self._copy_down(self.gpu.cached_blocks(new[::-1]), pin_source=True)  # tail first
            return n

    def free(self, req_id: Hashable) -> bool:
        """Release the request's blocks (tail first); a prefetch in flight is cancelled or
        completed first. False, a no-op, for an unknown request."""
        with self._lock:
            p = self._prefetches.pop(req_id, None)
            self._unsettled.pop(req_id, None)
            if p is not None and p.result is None:
                if p.cancel():
                    if p.held:  # the worker never ran: its held writes start here
                        self.spill.start_writes(p.held)
                else:
                    p.join()  # a started load is short: let it finish
                if p.load is not None:
                    self.spill.settle_load(p.load)  # count and delete what it found bad
                self.host.free(p.host_slots + p.spill_slots)
            freed = self.manager.free(req_id)
            self._poll()
            return freed

    def block_ids(self, req_id: Hashable) -> list[int]:
        """The request's block table, in token order (a copy)."""
        with self._lock:
            return list(self.manager.block_ids(req_id))

    def stats(self) -> CacheStats:
        """A snapshot (deep copy) of the counters, latencies and usage of every tier.

        A spill tier's usage is asked of its store outside the lock (one LMDB read
        transaction; a SCAN of the namespace on Redis); one that fails to answer has
        ``usage`` None.
        """
        nbytes = self.layout.block_nbytes
        with self._lock:
            self._poll()
            snapshot = self._stats.snapshot()
            for name, pool in (("gpu", self.gpu), ("cpu", self.host)):
                if pool is not None:
                    # The pools count their own evictions, whoever's allocation caused them.
                    snapshot[name].evictions = pool.stats().evictions
                    snapshot[name].usage = TierUsage(
                        pool.num_cached, pool.num_cached * nbytes, pool.num_blocks * nbytes
                    )
        if self.spill:
            snapshot.tiers.update(self.spill.stats())
        return snapshot

    def flush(self) -> None:
        """Wait for every copy and spill write in flight to land (tests, shutdown)."""
        with self._lock:
            for o in self._offloads:
                o.transfer.join()
            self._poll()
        if self.below:
            self.below.flush()

    def close(self) -> None:
        """Stop the metrics server, finish every copy and write, release the tiers."""
        if self._metrics is not None:
            self._metrics.close()
        self.flush()
        if self.below:
            self.below.close()
        else:
            self.transfer.close()
        self.trace.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _start_prefetch(
        self, req_id: Hashable, hit: PrefixHit, first: int, blocks: list[int], held: list
    ) -> None:
        """Fill ``blocks`` from the hit's host slots (pinned) and spill runs, on a worker,
        which then starts the ``held`` spill writes (they now wait for the reads)."""
        runs = hit.spill
        spill_slots: list[int] = []
        if runs:  # staging slots for the spill part: as many as the host pool can give
            spill_slots, runs = self.below.stage(runs, held)
            if self.spill is not None:
                self.spill.count_unstaged(hit.spill, runs)
        p = _Prefetch(first, blocks, list(hit.host_slots), spill_slots, runs)
        if runs:  # the held writes wait for the tier reads; without reads they start now
            p.held = list(held)
            held.clear()
        if runs:  # tier reads, then the copy up: on an I/O worker
            p.set_work(partial(self._run_prefetch, p, self.transfer.mark()))
            self.transfer.submit(p.run)
        else:  # host hits only: one copy, asynchronous by itself (load stream, copier)
            p.transfer = self.transfer.copy(
                self.host.slab,
                p.host_slots,
                self.gpu.kv,
                blocks[: len(p.host_slots)],
                background=True,
            )
        self._prefetches[req_id] = self._unsettled[req_id] = p

    def _run_prefetch(self, p: _Prefetch, after: torch.cuda.Event | None) -> int:
        """On an I/O worker: read the spill runs into host slots, then copy up. Returns how
        many leading blocks of ``p.blocks`` now hold checked KV."""
        p.times.run = time.time()
        valid = len(p.host_slots)
        if p.runs:
            try:
                p.load = self.spill.load(p.runs, p.spill_slots)
            finally:
                self.spill.start_writes(p.held)
            valid += p.load.num_blocks
        p.times.read = time.time()
        slots = (p.host_slots + p.spill_slots)[:valid]
        transfer = self.transfer.copy(self.host.slab, slots, self.gpu.kv, p.blocks[:valid], after)
        error = transfer.join()
        if error is not None:
            raise error
        p.times.copied = time.time()
        p.nbytes, p.seconds = transfer.nbytes, transfer.seconds
        return valid

    def _settle(self, req_id: Hashable, p: _Prefetch) -> None:
        """Finish a prefetch whose worker is done: publish what loaded, unpin, count."""
        valid, error = p.outcome()
        if error is not None:
            log.warning("kvtier: prefetch of request %r failed: %s", req_id, error)
            self._host_stats.errors += 1
        if p.load is not None:
            self.spill.settle_load(p.load)
        n_host = len(p.host_slots)
        loaded = max(0, valid - n_host)
        if loaded:  # blocks read from spill tiers are host-cached now too
            hashes = self.manager.request(req_id).hashes
            lo = p.first + n_host
            parent = hashes[lo - 1] if lo else self.manager.hasher.root
            self.below.publish_loaded(
                p.spill_slots[:loaded], hashes[lo : lo + loaded], lo, parent, p.runs
            )
        self.host.free(p.host_slots + p.spill_slots)
        if valid:
            self.manager.publish(req_id, p.first + valid)
            from_host = min(valid, n_host)
            self._host_stats.count_out(from_host, from_host * self.layout.block_nbytes, p.seconds)
            self._gpu_stats.count_in(valid, p.nbytes)
        if error is None:
            self._stats.prefetch_latency.observe(p.latency())
        p.result = (p.first + valid) * self.block_size
        if self.trace:
            reads = p.load.read_seconds if p.load else {}
            self.trace.load(req_id, "", hit_blocks(n_host, p.runs), valid, p.times, reads)

    def _poll(self) -> None:
        """Observe finished work: settle prefetches, publish and unpin offloads."""
        if self._unsettled:  # only these: a serving loop holds many settled ones
            for req_id, p in list(self._unsettled.items()):
                if p.done():
                    self._settle(req_id, p)
                    del self._unsettled[req_id]
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
        """Copy GPU ``blocks`` (in eviction order: a chain's tail first) not yet in the
        host pool into host slots, as one batch; they are queued in that order.

        Blocks already in the host pool are only queued again (as the newest). When the
        host pool cannot supply enough slots (all pinned), the rest are dropped.
        ``pin_source`` holds the GPU blocks until the copy is done (eager copies of
        blocks that the request may free meanwhile).
        """
        host, stats = self.host, self._host_stats
        present = host.lookup_each(blocks.hashes)
        host.requeue([s for s in reversed(present) if s is not None])  # in chain order
        todo = [i for i, s in enumerate(present) if s is None]
        n = min(len(todo), host.num_free)
        stats.dropped += len(todo) - n
        if not n:
            return
        todo = todo[:n]
        slots = host.allocate(n)
        src = [blocks.block_ids[i] for i in todo]
        if pin_source:
            self.gpu.touch(src)
        transfer = self.transfer.copy(self.gpu.kv, src, host.slab, slots)
        transfer.order_current_stream()  # reuse of the source blocks waits for the copy
        offload = _Offload(
            transfer,
            CachedBlocks(
                slots,
                [blocks.hashes[i] for i in todo],
                [blocks.positions[i] for i in todo],
                [blocks.parents[i] for i in todo],
            ),
            src if pin_source else [],
        )
        if transfer.done():
            self._finish_offload(offload)
        else:
            self._offloads.append(offload)

    def _finish_offload(self, o: _Offload) -> None:
        slots = o.blocks.block_ids
        if o.transfer.error is None:
            b = o.blocks
            self.host.publish(slots, b.hashes, b.positions, b.parents)
            self._host_stats.count_in(len(slots), o.transfer.nbytes, o.transfer.seconds)
            self._gpu_stats.count_out(len(slots), o.transfer.nbytes)
        else:
            log.warning("kvtier: offload to host failed: %s", o.transfer.error)
            self._host_stats.errors += 1
        # Oldest victim last in the list given to free(), so it is evicted first.
        self.host.free(slots[::-1])
        if o.gpu_pins:
            self.gpu.free(o.gpu_pins)
        if o.transfer.error is None and self.spill:
            self.spill.on_host_publish(o.blocks)
