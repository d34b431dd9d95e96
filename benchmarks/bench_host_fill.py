"""A fresh host pool's first copy into its slots vs the same copy into warm slots.

A pageable (CPU) host slab's pages are mapped on their first write, one page fault per
4 KiB, unless the pool populated them ahead (``kvtier.host_pool``: a ``kvtier-fill``
thread at idle priority keeps ``FILL_AHEAD_BYTES`` past the allocation frontier
populated). Each repetition creates a fresh ``HostPool`` of ``--pool-mib`` MiB
(pageable), allocates the slots of ``--copy-mib`` MiB of blocks (128 KiB each: 16
tokens of a model with 8 KiB of KV per token, so 64 MiB is 8k tokens) and times the
copy of as many warm source blocks into them on the copier thread (``_core.Copier``,
what the spill manager's loads and the CPU copy engine use), then the same copy again
into the now warm slots: the ceiling, same run, same memory. Cases, ms, and the ratio
fresh / warm (lower is better):

- ``fill off (before)``: ``fill_ahead=0``, kvtier as it was: the copy pays the faults.
- ``fill on, copy at once``: the copy starts right after the pool is created, racing
  the fill (a request that arrives as the server starts).
- ``fill on, after the fill``: the copy starts once the fill is over (a first request
  arriving a moment after start-up; the fill took ``fill time``). Target: ratio <= 1.25.
- ``fill on, a copy that moves the fill on``: the same, but the slots are the last
  ones before the frontier reaches half of ``FILL_AHEAD_BYTES`` (slots before them
  taken untimed): the fill starts populating the next range as the copy runs, on the
  other core, sharing the memory bus (informational; the work a first copy into fresh
  slots would have done itself, moved off its path).

And start-up: ``start-up: HostPool(N MiB)``, the creation of a pool with the fill on,
in a process where nothing else runs (no earlier pool's fill or release), against the
same with the fill off (the ceiling; target: at most 1 ms more: starting the thread);
``fill time`` (creation to the end of the background fill, informational) and
``populated after start-up`` (MiB of the slab resident once the fill is over, by
``mincore``; target: at most ``FILL_AHEAD_BYTES``, whatever the pool's size).

Cases run in rounds, one sample of each per round, in an order reversed every other
round, after a warm-up round.

    python benchmarks/bench_host_fill.py [--quick] [--out FILE.json]
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import sys
import time
from collections.abc import Callable

import torch
from _report import Result, report_cpu_run, standard_args, summarize
from kvtier._core import Copier

from kvtier.chunk import byte_rows
from kvtier.host_pool import FILL_AHEAD_BYTES, HostPool
from kvtier.layout import KVLayout
from kvtier.progress import progress

BENCHMARK = "bench_host_fill"
LAYOUT = KVLayout(8, 2, 16, 2, 128, torch.float16)  # 128 KiB a block, 8 KiB a token
MiB = 1 << 20
RATIO_TARGET = 1.25
STARTUP_EXTRA_MS = 1.0
MS = "ms"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the pages under ``t`` that are mapped (Linux ``mincore``)."""
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    end = t.data_ptr() + t.numel() * t.element_size()
    vec = (ctypes.c_ubyte * ((end - start + page - 1) // page))()
    if _libc.mincore(start, end - start, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) * page


class Bench:
    def __init__(self, quick: bool, pool_mib: int, copy_mib: int) -> None:
        self.rounds = 5 if quick else 15
        self.pool_slots = pool_mib * MiB // LAYOUT.block_nbytes
        self.n = copy_mib * MiB // LAYOUT.block_nbytes
        self.src = torch.ones((self.n, *LAYOUT.block_shape), dtype=LAYOUT.dtype)  # warm
        self.src_rows = byte_rows(self.src)
        self.ids = list(range(self.n))
        self.copier = Copier(name="kvtier-copy")
        self.fresh: dict[str, list[float]] = {}
        self.warm: dict[str, list[float]] = {}
        self.startup: dict[bool, list[float]] = {False: [], True: []}
        self.fill_time: list[float] = []
        self.populated: list[float] = []

    def copy(self, pool: HostPool, slots: list[int]) -> float:
        dst = byte_rows(pool.slab)
        t0 = time.perf_counter()
        self.copier.submit(self.src_rows, self.ids, dst, slots, dst.shape[1]).wait()
        return time.perf_counter() - t0

    def create(self, fill: bool) -> HostPool:
        return HostPool(self.pool_slots, LAYOUT, pin_memory=False, fill_ahead=None if fill else 0)

    def start(self, fill: bool) -> None:
        """One start-up sample, the process quiet before it (the last pool released)."""
        gc.collect()
        time.sleep(0.02)
        HostPool(1, LAYOUT, pin_memory=False)  # unmaps what a fill thread let go of last
        t0 = time.perf_counter()
        pool = self.create(fill)
        self.startup[fill].append(time.perf_counter() - t0)
        pool.wait_filled()
        pool.close()

    def case(self, name: str, fill: bool, wait: bool, move_on: bool = False) -> None:
        t0 = time.perf_counter()
        pool = self.create(fill)
        if wait:
            pool.wait_filled()
            if not move_on:
                self.fill_time.append(time.perf_counter() - t0)
                self.populated.append(resident_bytes(pool.slab) / MiB)
        if move_on:  # the copy's slots end where the frontier reaches half the distance
            before = FILL_AHEAD_BYTES // 2 // LAYOUT.block_nbytes - self.n
            pool.allocate(before)
            pool.wait_filled()
        slots = pool.allocate(self.n)
        self.fresh.setdefault(name, []).append(self.copy(pool, slots))
        self.warm.setdefault(name, []).append(self.copy(pool, slots))
        pool.close()

    def run(self) -> None:
        cases: list[tuple[str, Callable[[], None]]] = [
            ("fill off (before)", lambda: self.case("fill off (before)", False, False)),
            ("fill on, copy at once", lambda: self.case("fill on, copy at once", True, False)),
            ("fill on, after the fill", lambda: self.case("fill on, after the fill", True, True)),
            (
                "fill on, a copy that moves the fill on",
                lambda: self.case("fill on, a copy that moves the fill on", True, True, True),
            ),
            ("start-up, fill off", lambda: self.start(False)),
            ("start-up, fill on", lambda: self.start(True)),
        ]
        for r in progress(range(self.rounds + 1), desc=BENCHMARK):
            for _, fn in cases if r % 2 else reversed(cases):
                fn()
            if r == 0:  # warm-up round
                self.fresh.clear()
                self.warm.clear()
                self.startup = {False: [], True: []}
                self.fill_time.clear()
                self.populated.clear()

    def results(self) -> list[Result]:
        rows = []
        ms = lambda xs: [x * 1e3 for x in xs]  # noqa: E731
        for name, fresh in self.fresh.items():
            m, lo, hi = summarize(ms(fresh))
            rows.append(
                Result(
                    case=f"first copy of {self.n} blocks into fresh slots, {name}",
                    metric="copy time",
                    unit=MS,
                    value=m,
                    min=lo,
                    max=hi,
                    ceiling=summarize(ms(self.warm[name]))[0],
                    ceiling_what="the same copy again, into the same slots, now warm",
                    target=RATIO_TARGET if name == "fill on, after the fill" else None,
                    higher_is_better=False,
                )
            )
        on, off = summarize(ms(self.startup[True])), summarize(ms(self.startup[False]))
        rows.append(
            Result(
                case=f"start-up: HostPool({self.pool_slots * LAYOUT.block_nbytes // MiB} MiB)",
                metric="creation time, fill on",
                unit=MS,
                value=on[0],
                min=on[1],
                max=on[2],
                ceiling=off[0],
                ceiling_what="the same HostPool created with the fill off",
                target=off[0] + STARTUP_EXTRA_MS,
                target_kind="value",
                higher_is_better=False,
            )
        )
        m, lo, hi = summarize(ms(self.fill_time))
        rows.append(
            Result(
                case="fill time (in the background)",
                metric="creation to the end of the fill",
                unit=MS,
                value=m,
                min=lo,
                max=hi,
                higher_is_better=False,
            )
        )
        m, lo, hi = summarize(self.populated)
        rows.append(
            Result(
                case="populated after start-up",
                metric="slab resident once the fill is over",
                unit="MiB",
                value=m,
                min=lo,
                max=hi,
                target=FILL_AHEAD_BYTES / MiB + 1,  # the pages the slab's ends share
                higher_is_better=False,
            )
        )
        return rows


def main() -> int:
    parser = standard_args(__doc__.split("\n", 1)[0])
    parser.add_argument("--pool-mib", type=int, default=1024, help="host pool size (1024)")
    parser.add_argument("--copy-mib", type=int, default=64, help="bytes copied (64)")
    args = parser.parse_args()
    if sys.platform != "linux":
        print("needs Linux (mincore)", file=sys.stderr)
        return 1
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    bench = Bench(args.quick, args.pool_mib, args.copy_mib)
    bench.run()
    details = (
        f"layout {LAYOUT.describe()}; fresh pageable pool of {args.pool_mib} MiB, copy of "
        f"{args.copy_mib} MiB; {bench.rounds} rounds after 1 warm-up, "
        f"{time.perf_counter() - start:.0f} s"
    )
    report_cpu_run(BENCHMARK, args.quick, details, bench.results(), args.out, load_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
