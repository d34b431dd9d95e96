"""Offload (GPU->host) and prefetch (host->GPU) bandwidth of kvtier's copy path vs raw torch.

Batches of 1, 16 and 256 blocks of a realistic layout (32 layers x 2 (K, V) x 16 tokens
x 8 KV heads x head_dim 128, fp16: 2 MiB per block; ``--layers`` scales it down, and it
is scaled down by itself when the machine's free memory is short). Cases, GB/s unless
said otherwise:

- ``offload N blocks``: ``TransferEngine.copy(gpu.kv, blocks, host.slab, slots)``, how
  ``TieredCache`` moves N evicted GPU blocks down: random scattered GPU block ids, host
  slots from the host pool's allocator (consecutive after a reset).
  ``... scattered slots``: the same with random host slots.
- ``prefetch N blocks``: ``TransferEngine.copy(host.slab, slots, gpu.kv, blocks)``,
  how a host hit is loaded: slots from the allocator, random scattered GPU blocks.
- Ceiling of both: one ``torch.index_select(src, 0, idx, out=buf)`` of the same blocks
  into a preallocated contiguous buffer (``... raw index_select``), and for reference
  a plain contiguous ``copy_`` of the same bytes (``... raw contiguous copy_``). When
  the two sides are on different devices (CUDA) no gather crosses the bus, and the
  contiguous copy is the ceiling. kvtier's figure is reported as a ratio to the
  ceiling; target >= 0.8 for batches of 16 blocks and more.
- ``prefetch scatter N blocks: OPTION``: the ways to write N consecutive host slots
  into N scattered GPU blocks (a loop of per-block ``copy_``; ``index_copy_``;
  ``index_copy_`` on a view of the rows as 16-byte complex128 elements, which moves
  the same bytes with 8x fewer per-element steps than fp16; ``index_put_``; and
  ``copy_blocks``), informational: the data behind the choice in
  ``kvtier.transfer.copy_blocks``. On CUDA the index ops read a device staging
  buffer that one contiguous copy filled first.
- ``prefetch API N blocks``: a ``TieredCache`` request whose N-block prefix sits in the
  host pool: ``lookup`` + ``allocate`` + ``wait``, GB/s (informational), and
  ``prefetch API overhead N blocks``: (``lookup`` + ``allocate`` + ``wait`` + ``free``)
  minus the copy itself, in µs per request; target <= 50 µs. The copy is the
  copy of the request's host slots into its GPU blocks inside ``wait`` (the load
  stream's on CUDA, the copier thread's on CPU), as the transfer engine timed it (the
  cache's ``copy_seconds`` counter): the same blocks at the same moment, so the
  difference is what the API adds (hashing, bookkeeping, the hand-off to the copy and
  back). ``prefetch API overhead N blocks warm``: the same with the CPU cache left
  warm, the request timed right after ``WARM_REQUESTS`` untimed ones of the same size
  (as in a serving loop), where the cold rows pay for the interpreter's code and data
  fetched from memory. A raw
  ``copy_blocks`` of the same blocks timed right after is reported next to it. Each
  repetition first, untimed, evicts the prefix from the GPU pool back to the host
  pool (a filler request takes every GPU block) and shuffles the GPU pool's free
  blocks, so the request gets scattered GPU blocks as on a server whose pool has been
  churning. ``prefetch API N blocks[ warm]: STEP`` rows break the request down; the
  last of them, ``pools and copier called directly``, is the floor under the overhead:
  the same request's work as direct calls on the pools and the transfer engine
  (hashing, prefix probes, pinning, allocation, the copy's hand-off, publishing,
  freeing; no ``TieredCache`` or ``BlockManager``), minus its copy, sampled after
  the API request in the same CPU cache state.

Every timed repetition (but the warm API ones) starts with the last-level CPU cache
flushed (an untimed read of 64 MiB), so each copy reads memory cold, as a server's
does, and kvtier and raw torch start alike. All pool memory is written once before
timing (no first-touch page faults in the timed region). Cases run in rounds, each
taking one sample of every case of one batch size in turn (order reversed every other
round; a warm-up in the first), so that a noisy or drifting machine skews kvtier and
its ceiling alike.

    python benchmarks/bench_transfer.py [--quick] [--out FILE.json] [--device cpu]
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from _report import (
    Result,
    machine_info,
    measure_samples,
    print_table,
    standard_args,
    summarize,
    write_json,
)

from kvtier.cache import PrefixHit, TieredCache
from kvtier.config import parse_config
from kvtier.gpu_pool import GPUBlockPool
from kvtier.host_pool import HostPool
from kvtier.layout import KVLayout
from kvtier.progress import progress
from kvtier.transfer import TransferEngine, copy_blocks

BENCHMARK = "bench_transfer"
SIZES = (1, 16, 256)  # blocks per batch
POOL_BLOCKS = 512  # blocks in each raw pool (GPU side and host side)
LAYERS = 32
MEMORY_BUDGET = 6 << 30  # bytes of pool and buffer memory this benchmark may take
FLUSH_BYTES = 64 << 20  # read before every sample: twice this machine's 32 MiB L3
RATIO_TARGET = 0.8  # of the ceiling, for batches of RATIO_MIN_BLOCKS and more
RATIO_MIN_BLOCKS = 16
OVERHEAD_TARGET_US = 50.0
WARM_REQUESTS = 2  # untimed requests before a warm one
CHECK_MAX_BLOCKS = 16  # bit-exactness is checked up to this batch size (same code paths)
VOCAB = 128_000
GBS = "GB/s"
US = "µs"

Fn = Callable[[Any], Any]


def blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


def wide_rows(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``t`` as rows of 16-byte (complex128) elements: the same bytes."""
    return t.view(len(t), -1).view(torch.uint8).view(torch.complex128)


def make_layout(layers: int) -> KVLayout:
    return KVLayout(layers, 2, 16, 8, 128, torch.float16)


def memory_needed(layout: KVLayout, cross_device: bool) -> int:
    """Bytes of pools and buffers: raw pools, ceiling buffer(s), the cache's two pools."""
    big = max(SIZES)
    buffers = 2 * big if cross_device else big
    cache = (big + 32) + (sum(SIZES) + 32)
    return (2 * POOL_BLOCKS + buffers + cache) * layout.block_nbytes + FLUSH_BYTES


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def choose_layers(requested: int | None, cross_device: bool) -> tuple[int, str | None]:
    """``requested``, or the most layers (<= 32) whose memory fits; a note when scaled."""
    if requested is not None:
        note = None if requested == LAYERS else f"layers set to {requested} by --layers"
        return requested, note
    avail = mem_available()
    budget = MEMORY_BUDGET if avail is None else min(MEMORY_BUDGET, avail // 2)
    layers = LAYERS
    while layers > 1 and memory_needed(make_layout(layers), cross_device) > budget:
        layers //= 2
    if layers == LAYERS:
        return layers, None
    return layers, (
        f"layers scaled down from {LAYERS} to {layers}: {LAYERS} layers would take "
        f"{memory_needed(make_layout(LAYERS), cross_device) / 2**30:.1f} GiB, "
        f"budget {budget / 2**30:.1f} GiB"
    )


@dataclass
class Case:
    """One timed operation of ``nbytes``: ``fn(setup())`` per repetition."""

    name: str
    size: int  # blocks per batch: the round group
    nbytes: int
    fn: Fn
    setup: Callable[[], Any]
    samples: list[float] = field(default_factory=list)

    def gbps(self) -> tuple[float, float, float]:
        med, lo, hi = summarize(self.samples)
        return self.nbytes / med / 1e9, self.nbytes / hi / 1e9, self.nbytes / lo / 1e9


@dataclass
class ApiSamples:
    """Per repetition of the prefetch API case: step times and the paired raw copy."""

    lookup: list[float] = field(default_factory=list)
    allocate: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    free: list[float] = field(default_factory=list)
    copy: list[float] = field(default_factory=list)  # the copy inside wait, engine-timed
    raw: list[float] = field(default_factory=list)  # copy_blocks of the same blocks, after
    direct: list[float] = field(default_factory=list)  # PrefetchAPI.direct, minus its copy


class Bench:
    """The pools, the buffers and the cases of one run."""

    def __init__(self, quick: bool, device: torch.device, layout: KVLayout) -> None:
        self.rounds = 6 if quick else 24  # one sample of every case per round
        self.device = device
        self.layout = layout
        self.cuda = device.type == "cuda"
        self.rng = np.random.default_rng(20240611)
        self.block_nbytes = layout.block_nbytes
        big = max(SIZES)

        # Raw pools: kvtier's own pool classes, so the tensors are what the cache has.
        self.gpu = GPUBlockPool(POOL_BLOCKS, layout, device)
        self.host = HostPool(POOL_BLOCKS, layout)
        self.kv, self.slab = self.gpu.kv, self.host.slab
        self.cross = self.kv.device != self.slab.device
        # Ceiling buffers: offload gathers into host memory, prefetch into device memory.
        self.host_buf = self._empty(big, "cpu", self.host.pinned)
        self.dev_buf = self._empty(big, device, False) if self.cross else self.host_buf
        # Distinct contents per block (exact in fp16), and every page written once.
        self._fill(self.kv, 0)
        self._fill(self.slab, POOL_BLOCKS)
        self._fill(self.host_buf, 0)
        if self.cross:
            self._fill(self.dev_buf, 0)
        self.scratch = torch.ones(FLUSH_BYTES // 8, dtype=torch.int64)
        self.engine = TransferEngine(device)

        self.slots: dict[int, list[int]] = {}  # consecutive, from the allocator
        for n in SIZES:
            self.host.reset()
            self.slots[n] = self.host.allocate(n)
            self.host.free(self.slots[n])
        self.host.reset()
        self.ids: dict[int, dict[str, Any]] = {}
        self.cases: dict[int, list[Case]] = {n: [] for n in SIZES}
        self.api = PrefetchAPI(self, layout)

    # ------------------------------------------------------------- helpers
    def _empty(self, n: int, device: torch.device | str, pin: bool) -> torch.Tensor:
        shape = (n, *self.layout.block_shape)
        return torch.empty(shape, dtype=self.layout.dtype, device=device, pin_memory=pin)

    @staticmethod
    def _fill(t: torch.Tensor, base: int) -> None:
        values = torch.arange(base, base + len(t), dtype=t.dtype, device=t.device)
        t.view(len(t), -1).copy_(values[:, None].expand(len(t), t[0].numel()))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def flush(self) -> None:
        """Evict the CPU's last-level cache (a read of FLUSH_BYTES; untimed)."""
        self.scratch.sum()

    def draw(self, n: int) -> None:
        """New random ids for the batch size ``n``'s cases (once per round)."""
        rng = self.rng
        d = self.ids[n] = {
            "blocks": rng.choice(POOL_BLOCKS, n, replace=False).tolist(),
            "slots": self.slots[n],
            "rand_slots": rng.choice(POOL_BLOCKS, n, replace=False).tolist(),
            "run": int(rng.integers(0, POOL_BLOCKS - n + 1)),  # start of a contiguous run
        }
        dev = self.device
        d["blocks_idx"] = torch.tensor(d["blocks"], dtype=torch.int64, device=dev)
        d["slots_idx"] = torch.tensor(d["slots"], dtype=torch.int64)

    def add(self, n: int, name: str, fn: Fn) -> None:
        def setup() -> None:
            self.flush()

        self.cases[n].append(Case(name, n, n * self.block_nbytes, fn, setup))

    # ------------------------------------------------------------- cases
    def add_cases(self, n: int) -> None:
        kv, slab, eng, ids = self.kv, self.slab, self.engine, self.ids
        hbuf, dbuf = self.host_buf, self.dev_buf
        sync, nb = self.sync, True  # non_blocking: asynchronous on CUDA, ignored on CPU

        def engine_copy(src: torch.Tensor, s: str, dst: torch.Tensor, d: str) -> Fn:
            def fn(_: object) -> None:
                error = eng.copy(src, ids[n][s], dst, ids[n][d]).join()
                if error is not None:
                    raise error

            return fn

        def offload_gather(_: object) -> None:
            torch.index_select(kv, 0, ids[n]["blocks_idx"], out=hbuf[:n])
            sync()

        def offload_contiguous(_: object) -> None:
            r = ids[n]["run"]
            hbuf[:n].copy_(kv[r : r + n], non_blocking=nb)
            sync()

        def prefetch_gather(_: object) -> None:
            torch.index_select(slab, 0, ids[n]["slots_idx"], out=dbuf[:n])
            sync()

        def prefetch_contiguous(_: object) -> None:
            s0 = ids[n]["slots"][0]
            dbuf[:n].copy_(slab[s0 : s0 + n], non_blocking=nb)
            sync()

        def staged_src() -> torch.Tensor:
            """The consecutive slots as a tensor on the destination's device."""
            s0 = ids[n]["slots"][0]
            if not self.cross:
                return slab[s0 : s0 + n]
            dbuf[:n].copy_(slab[s0 : s0 + n], non_blocking=True)
            return dbuf[:n]

        def scatter_loop(_: object) -> None:
            for s, b in zip(ids[n]["slots"], ids[n]["blocks"]):
                kv[b].copy_(slab[s], non_blocking=nb)
            sync()

        def scatter_index_copy(_: object) -> None:
            kv.index_copy_(0, ids[n]["blocks_idx"], staged_src())
            sync()

        wide_kv = wide_rows(kv)

        def scatter_index_copy_wide(_: object) -> None:
            wide_kv.index_copy_(0, ids[n]["blocks_idx"], wide_rows(staged_src()))
            sync()

        def scatter_index_put(_: object) -> None:
            kv.index_put_((ids[n]["blocks_idx"],), staged_src())
            sync()

        def scatter_copy_blocks(_: object) -> None:
            copy_blocks(slab, ids[n]["slots"], kv, ids[n]["blocks"], non_blocking=nb)
            sync()

        b = blocks(n)
        self.add(n, f"offload {b}", engine_copy(kv, "blocks", slab, "slots"))
        self.add(n, f"offload {b} scattered slots", engine_copy(kv, "blocks", slab, "rand_slots"))
        if not self.cross:
            self.add(n, f"offload {b} raw index_select", offload_gather)
        self.add(n, f"offload {b} raw contiguous copy_", offload_contiguous)
        self.add(n, f"prefetch {b}", engine_copy(slab, "slots", kv, "blocks"))
        self.add(n, f"prefetch {b} scattered slots", engine_copy(slab, "rand_slots", kv, "blocks"))
        if not self.cross:
            self.add(n, f"prefetch {b} raw index_select", prefetch_gather)
        self.add(n, f"prefetch {b} raw contiguous copy_", prefetch_contiguous)
        staged = " (staged)" if self.cross else ""
        self.add(n, f"prefetch scatter {b}: copy_ loop", scatter_loop)
        self.add(n, f"prefetch scatter {b}: index_copy_{staged}", scatter_index_copy)
        self.add(
            n, f"prefetch scatter {b}: index_copy_ 16-byte view{staged}", scatter_index_copy_wide
        )
        self.add(n, f"prefetch scatter {b}: index_put_{staged}", scatter_index_put)
        self.add(n, f"prefetch scatter {b}: copy_blocks", scatter_copy_blocks)

    def check(self, n: int) -> None:
        """Every path moves exactly the right blocks (untimed, once, before timing).

        The destination rows are poisoned first, so a copy that does nothing fails.
        """
        self.draw(n)
        d = self.ids[n]
        for case in self.cases[n]:
            name = case.name
            slots = d["rand_slots"] if "scattered" in name else d["slots"]
            if "contiguous" in name:
                src, dst = None, None  # the same bytes, no ids to check
            elif "index_select" in name and name.startswith("offload"):
                src, dst = self.kv[d["blocks"]], self.host_buf[:n]
            elif "index_select" in name:
                src, dst = self.slab[d["slots"]], self.dev_buf[:n]
            elif name.startswith("offload"):
                src, dst = self.kv[d["blocks"]], (self.slab, slots)
            else:
                src, dst = self.slab[slots], (self.kv, d["blocks"])
            if isinstance(dst, tuple):
                dst[0][dst[1]] = -1
            elif dst is not None:
                dst.fill_(-1)
            case.fn(None)
            if src is None:
                continue
            got = dst[0][dst[1]] if isinstance(dst, tuple) else dst
            if not torch.equal(got.cpu(), src.cpu()):
                raise AssertionError(f"{name}: wrong blocks copied")

    # ------------------------------------------------------------- running
    def run(self) -> None:
        for n in SIZES:
            self.add_cases(n)
            if n <= CHECK_MAX_BLOCKS:
                self.check(n)
                self.api.check(n)
        steps = [(r, n) for r in range(self.rounds) for n in SIZES]
        for r, n in progress(steps, desc=BENCHMARK):
            self.draw(n)
            warmup = 1 if r == 0 else 0
            cases = self.cases[n] if r % 2 == 0 else self.cases[n][::-1]
            for case in cases:
                case.samples += measure_samples(case.fn, 1, warmup, setup=case.setup)
            self.api.sample(n, warmup)

    # ------------------------------------------------------------- results
    def results(self) -> tuple[list[Result], list[Result]]:
        """The table's rows, and the prefetch API's step rows."""
        rows: list[Result] = []
        steps: list[Result] = []
        for n in SIZES:
            by_name = {c.name: c for c in self.cases[n]}
            b = blocks(n)
            for direction in ("offload", "prefetch"):
                gather = by_name.get(f"{direction} {b} raw index_select")
                contiguous = by_name[f"{direction} {b} raw contiguous copy_"]
                ceiling_case = gather or contiguous
                ceiling = ceiling_case.gbps()[0]
                what = (
                    "one torch.index_select(out=) of the same blocks into a preallocated "
                    "contiguous buffer"
                    if gather
                    else "one contiguous copy_ of the same bytes across devices"
                )
                names = [f"{direction} {b}", f"{direction} {b} scattered slots"]
                if direction == "prefetch":
                    names += [c.name for c in self.cases[n] if c.name.startswith("prefetch scat")]
                for name in names:
                    case = by_name[name]
                    kvtier = name in (f"{direction} {b}", f"{direction} {b} scattered slots")
                    target = RATIO_TARGET if kvtier and n >= RATIO_MIN_BLOCKS else None
                    rows.append(self._gbps_row(case, ceiling, what, target))
                for raw in (gather, contiguous):
                    if raw is not None:
                        c = None if raw is ceiling_case else ceiling
                        rows.append(self._gbps_row(raw, c, what if c else None, None))
                if direction == "prefetch":
                    api_rows, step_rows = self.api.results(n, ceiling, what)
                    rows += api_rows
                    steps += step_rows
        return rows, steps

    @staticmethod
    def _gbps_row(
        case: Case, ceiling: float | None, what: str | None, target: float | None
    ) -> Result:
        value, lo, hi = case.gbps()
        return Result(
            case=case.name,
            metric="throughput",
            unit=GBS,
            value=value,
            min=lo,
            max=hi,
            ceiling=ceiling,
            ceiling_what=what if ceiling is not None else None,
            target=target,
            target_kind="ratio" if target is not None else None,
        )


class PrefetchAPI:
    """A ``TieredCache`` whose host pool holds one prefix per batch size."""

    def __init__(self, bench: Bench, layout: KVLayout) -> None:
        self.bench = bench
        self.n_gpu = max(SIZES) + 32
        self.n_host = sum(SIZES) + 32  # every prefix fits: the host pool never evicts
        config = parse_config(
            {
                "model": "bench-transfer",
                "tiers": {
                    "gpu": {"num_blocks": self.n_gpu, "device": str(bench.device)},
                    "cpu": {"capacity": self.n_host * layout.block_nbytes},
                },
            }
        )
        self.cache = TieredCache(config, layout, bench.device)
        Bench._fill(self.cache.gpu.kv, 0)
        Bench._fill(self.cache.host.slab, POOL_BLOCKS)
        self.block_size = layout.block_size
        self.req_ids = iter(range(1 << 62))
        rng = bench.rng
        self.tokens = {n: rng.integers(0, VOCAB, n * self.block_size + 1).tolist() for n in SIZES}
        self.hashes = {n: self.cache.manager.hasher.hash_blocks(self.tokens[n])[:n] for n in SIZES}
        # Per batch size and CPU cache state (cold: flushed before the request).
        self.samples = {(n, cold): ApiSamples() for n in SIZES for cold in (True, False)}
        self.last: tuple[PrefixHit, list[int] | None, int] | None = None
        self.steps: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
        self.direct_overhead = 0.0
        self.before = self.cache.stats().tiers["cpu"]
        for n in SIZES:  # serve each prompt once: its blocks become cached
            self.serve(self.tokens[n])

    def serve(self, tokens: list[int]) -> None:
        cache, req = self.cache, next(self.req_ids)
        hit = cache.lookup(req, tokens)
        assert cache.allocate(req, len(tokens) - hit.num_tokens, hit) is not None
        cache.wait(req)
        cache.commit(req, tokens)
        cache.free(req)

    def prepare(self, n: int, cold: bool = True) -> tuple[int, list[int]]:
        """Untimed: the n-block prefix only in the host pool, the GPU pool's free blocks
        empty and shuffled, the CPU cache flushed if ``cold``. Returns a new request."""
        cache = self.cache
        filler = next(self.req_ids)  # takes every GPU block: evicts (copies down) the prefix
        assert cache.allocate(filler, self.n_gpu * self.block_size) is not None
        cache.free(filler)
        cache.flush()
        gpu = cache.gpu
        assert gpu.num_cached == 0 and gpu.num_free == gpu.num_blocks
        ids = gpu.allocate(gpu.num_blocks)
        self.bench.rng.shuffle(ids)
        gpu.free(ids)  # unhashed: back on the empty stack, in random order
        assert len(cache.host.lookup(self.hashes[n])) == n, "prefix not in the host pool"
        if cold:
            self.bench.flush()
        self.before = self.cache.stats().tiers["cpu"]
        return next(self.req_ids), self.tokens[n]

    def check(self, n: int) -> None:
        """One request loads exactly its host blocks (untimed)."""
        self.request(self.prepare(n))
        hit, table, valid = self.last
        assert table is not None and not hit.gpu_blocks and len(hit.host_slots) == n
        assert valid == n * self.block_size, f"prefetch of {n} blocks loaded {valid} tokens"
        kv, slab = self.cache.gpu.kv, self.cache.host.slab
        if not torch.equal(kv[table[:n]].cpu(), slab[list(hit.host_slots)].cpu()):
            raise AssertionError(f"prefetch API {n} blocks: wrong blocks loaded")

    def request(self, arg: tuple[int, list[int]]) -> None:
        """Timed: one request's lookup, allocate, wait and free."""
        req, tokens = arg
        cache = self.cache
        t0 = time.perf_counter()
        hit = cache.lookup(req, tokens)
        t1 = time.perf_counter()
        table = cache.allocate(req, 1, hit)
        t2 = time.perf_counter()
        valid = cache.wait(req)
        t3 = time.perf_counter()
        cache.free(req)
        t4 = time.perf_counter()
        self.last = (hit, table, valid)
        self.steps = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)

    def direct(self, arg: tuple[int, list[int]]) -> None:
        """Timed: the request's work called straight on the pools and the transfer engine,
        with no ``TieredCache`` or ``BlockManager`` around it: hash the prompt, find its
        prefix in both pools, pin the host slots, take GPU blocks, copy them up, unpin,
        publish, free. Its time minus the copy's is the floor under the API's overhead."""
        _, tokens = arg
        cache, hasher = self.cache, self.cache.manager.hasher
        gpu, host = cache.gpu, cache.host
        start = time.perf_counter()
        wanted = hasher.hash_blocks(tokens)[: (len(tokens) - 1) // self.block_size]
        slots = host.lookup(wanted[len(gpu.lookup(wanted)) :])
        n = len(slots)
        host.touch(slots)
        blocks = gpu.allocate(n + 1)
        copy = cache.transfer.copy(host.slab, slots, gpu.kv, blocks[:n], background=True)
        copy.join()
        host.free(slots)
        gpu.publish(blocks[:n], wanted, range(n), [hasher.root, *wanted[:-1]])
        gpu.free(blocks)
        self.direct_overhead = time.perf_counter() - start - copy.seconds
        assert n == len(wanted) and copy.error is None, "direct request: not a full host hit"

    def raw_copy(self, arg: tuple[list[int], list[int]]) -> None:
        """Timed: copy_blocks of the same host slots into the same GPU blocks."""
        slots, table = arg
        copy_blocks(self.cache.host.slab, slots, self.cache.gpu.kv, table, non_blocking=True)
        self.bench.sync()

    def sample(self, n: int, warmup: int) -> None:
        """One sample with the CPU cache cold and one with it warm (the step times, the
        copy inside, the raw copy after, then the direct request), each after ``warmup``
        untimed ones (warm: and ``WARM_REQUESTS`` more, back to back)."""
        for cold in (True, False):
            out = self.samples[n, cold]
            # Warm: after requests of the same size back to back, as in a serving loop.
            warmup_here = warmup if cold else warmup + WARM_REQUESTS
            for i in range(warmup_here + 1):
                # Timed inside: the steps, not the call of ``request`` and its bookkeeping.
                measure_samples(self.request, 1, 0, setup=partial(self.prepare, n, cold))
                hit, table, valid = self.last
                assert table is not None and valid == n * self.block_size, "prefetch failed"
                assert not hit.gpu_blocks and len(hit.host_slots) == n
                steps = self.steps
                after = self.cache.stats().tiers["cpu"]
                assert after.blocks_in == self.before.blocks_in, "the request offloaded blocks"
                assert after.blocks_out == self.before.blocks_out + n
                copy = after.copy_seconds - self.before.copy_seconds
                if i < warmup_here:
                    continue
                # Only after the timed request: a raw copy between warm-up requests (plain
                # stores of up to 512 MiB) would empty the CPU cache they warm.
                pair = (list(hit.host_slots), table[:n])

                def setup(pair: tuple[list[int], list[int]] = pair, cold: bool = cold):
                    if cold:
                        self.bench.flush()
                    return pair

                raw = measure_samples(self.raw_copy, 1, 0, setup=setup)[0]
                out.copy.append(copy)
                out.raw.append(raw)
                for lst, t in zip((out.lookup, out.allocate, out.wait, out.free), steps):
                    lst.append(t)
            for _ in range(warmup_here + 1):  # the same, its steps called directly
                measure_samples(self.direct, 1, 0, setup=partial(self.prepare, n, cold))
            out.direct.append(self.direct_overhead)

    def results(self, n: int, ceiling: float, what: str) -> tuple[list[Result], list[Result]]:
        """The API's throughput row (cold), its overhead rows (cold, warm) and its step
        rows (cold, warm)."""
        b = blocks(n)
        nbytes = n * self.bench.block_nbytes
        cold = self.samples[n, True]
        api = [lk + a + w for lk, a, w in zip(cold.lookup, cold.allocate, cold.wait)]
        med, lo, hi = summarize(api)
        rows = [
            Result(
                case=f"prefetch API {b}",
                metric="throughput of lookup + allocate + wait",
                unit=GBS,
                value=nbytes / med / 1e9,
                min=nbytes / hi / 1e9,
                max=nbytes / lo / 1e9,
                ceiling=ceiling,
                ceiling_what=what,
            )
        ]
        step_rows = []
        for is_cold, suffix in ((True, ""), (False, " warm")):
            s = self.samples[n, is_cold]
            api_times = zip(s.lookup, s.allocate, s.wait, s.free, s.copy)
            over = [(lk + a + w + f - c) * 1e6 for lk, a, w, f, c in api_times]
            o_med, o_lo, o_hi = summarize(over)
            rows.append(
                Result(
                    case=f"prefetch API overhead {b}{suffix}",
                    metric="lookup + allocate + wait + free minus the copy_blocks inside "
                    f"wait, CPU cache {'flushed before' if is_cold else 'warm'}",
                    unit=US,
                    value=o_med,
                    min=o_lo,
                    max=o_hi,
                    target=OVERHEAD_TARGET_US,
                    target_kind="value",
                    higher_is_better=False,
                )
            )
            steps = (
                ("lookup", s.lookup),
                ("allocate", s.allocate),
                ("wait", s.wait),
                ("free", s.free),
                ("copy_blocks inside wait", s.copy),
                ("raw copy_blocks, same blocks after", s.raw),
                ("pools and copier called directly, minus the copy", s.direct),
            )
            for step, samples in steps:
                m, lo, hi = summarize(samples)
                step_rows.append(
                    Result(
                        case=f"prefetch API {b}{suffix}: {step}",
                        metric=f"time of {step}",
                        unit=US,
                        value=m * 1e6,
                        min=lo * 1e6,
                        max=hi * 1e6,
                        higher_is_better=False,
                    )
                )
        return rows, step_rows


def main() -> int:
    parser = standard_args(__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cpu", help="device of the GPU pool (default cpu)")
    parser.add_argument(
        "--layers", type=int, default=None, help=f"layers per block (default {LAYERS}, "
        "fewer when memory is short)"
    )  # fmt: skip
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cross = device.type != "cpu"
    layers, note = choose_layers(args.layers, cross)
    layout = make_layout(layers)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    bench = Bench(args.quick, device, layout)
    bench.run()
    results, steps = bench.results()
    elapsed = time.perf_counter() - start
    machine = machine_info(device)
    print(
        f"{BENCHMARK}{' --quick' if args.quick else ''}: {machine['cpu']}, "
        f"{machine['cores']} cores, torch {machine['torch']} ({torch.get_num_threads()} "
        f"threads), device {machine['device']}; layout {layout.describe()}, "
        f"{memory_needed(layout, cross) / 2**30:.1f} GiB of pools and buffers; "
        f"{bench.rounds} rounds of one sample of every case after 1 warm-up, "
        "CPU cache flushed before each sample but the warm API ones; "
        f"load average {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after; {elapsed:.0f} s"
    )
    if note:
        print(f"note: {note}")
    print_table(results)
    print()
    print_table(steps, title="prefetch API steps (informational)")
    if args.out:
        write_json(args.out, BENCHMARK, results + steps, machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
