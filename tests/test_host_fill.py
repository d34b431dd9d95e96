"""A pageable host pool populates its slots ahead of their first use, a bounded way past
the slots handed out, on an idle-priority kvtier thread, never changing a byte
(``kvtier.host_pool``'s module docstring)."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import threading
import time

import pytest
import torch
from kvtier._core import populate

from kvtier.host_pool import HostPool
from kvtier.layout import KVLayout

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getscheduler"), reason="needs Linux (mincore, /proc, SCHED_IDLE)"
)

MiB = 1 << 20
LAYOUT = KVLayout(2, 2, 16, 2, 128, torch.float16)  # 32 KiB a slot
SLOT = LAYOUT.block_nbytes
PAGE = mmap.PAGESIZE
SLACK = 2 * MiB  # a transparent huge page the kernel may map around a fault
# Slabs above glibc's largest mmap threshold (32 MiB): fresh pages of their own.
POOL_SLOTS = 96 * MiB // SLOT

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident(t: torch.Tensor) -> int:
    """Bytes of the pages under ``t`` that are mapped (``mincore``)."""
    start = t.data_ptr() // PAGE * PAGE
    end = t.data_ptr() + t.numel() * t.element_size()
    vec = (ctypes.c_ubyte * ((end - start + PAGE - 1) // PAGE))()
    assert _libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * PAGE


def pool(fill_ahead: int | None) -> HostPool:
    p = HostPool(POOL_SLOTS, LAYOUT, pin_memory=False, fill_ahead=fill_ahead)
    assert p.wait_filled(10)
    return p


def test_a_fresh_pool_populates_its_first_slots_before_any_is_handed_out() -> None:
    p = pool(16 * MiB)
    assert 16 * MiB <= resident(p.slab) <= 16 * MiB + SLACK
    p.close()


def test_slots_are_populated_ahead_of_the_ones_handed_out_as_these_advance() -> None:
    p = pool(16 * MiB)
    p.allocate(12 * MiB // SLOT)  # three quarters of the distance ahead: the fill moves on
    assert p.wait_filled(10)
    assert 28 * MiB <= resident(p.slab) <= 28 * MiB + SLACK
    p.close()


def test_a_pool_never_populates_more_than_its_bound_past_the_slots_handed_out() -> None:
    p = pool(8 * MiB)
    for _ in range(40):
        p.allocate(MiB // SLOT + 3)
        assert p.wait_filled(10)
        assert resident(p.slab) <= p.frontier * SLOT + 8 * MiB + SLACK
    p.close()


def test_a_pool_with_fill_ahead_0_populates_nothing() -> None:
    p = pool(0)
    p.allocate(POOL_SLOTS // 2)
    assert resident(p.slab) <= SLACK
    p.close()


def test_the_fill_leaves_data_in_slots_handed_out_as_it_is() -> None:
    """Slots taken and written while the fill runs over them keep what was written."""
    want = (torch.arange(POOL_SLOTS) % 251 + 1).to(LAYOUT.dtype)[:, None]
    for _ in range(5):
        p = HostPool(POOL_SLOTS, LAYOUT, pin_memory=False, fill_ahead=POOL_SLOTS * SLOT)
        rows = p.slab.view(POOL_SLOTS, -1)
        rows[p.allocate(POOL_SLOTS)] = want  # from slot 0 up, as the fill's first piece
        assert p.wait_filled(10)
        assert torch.equal(rows, want.expand_as(rows))
        p.close()


def test_populating_never_changes_a_byte_even_under_a_concurrent_writer() -> None:
    buf = torch.empty(64 * MiB, dtype=torch.uint8)  # fresh pages
    buf[: 32 * MiB] = torch.randint(0, 3, (32 * MiB,), dtype=torch.uint8)  # zeros among them
    before = buf[: 32 * MiB].clone()
    populate(buf.data_ptr(), 32 * MiB)
    assert torch.equal(buf[: 32 * MiB], before)

    tail = buf[32 * MiB :]
    done = threading.Event()

    def write() -> None:  # fills the fresh half with 7s, piece by piece, as populate runs
        for start in range(0, len(tail), MiB):
            tail[start : start + MiB].fill_(7)
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    while not done.is_set():
        populate(tail.data_ptr(), len(tail))
    writer.join()
    assert bool((tail == 7).all())


def test_the_fill_runs_on_a_kvtier_thread_at_idle_priority() -> None:
    def fill_threads() -> dict[int, int]:
        """tid -> scheduling policy of each ``kvtier-fill`` thread."""
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().startswith("kvtier-fill"):
                        out[int(tid)] = os.sched_getscheduler(int(tid))
            except OSError:  # it has just exited
                pass
        return out

    caller = os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)
    before = fill_threads()
    p = pool(MiB)
    started = {tid: policy for tid, policy in fill_threads().items() if tid not in before}
    assert list(started.values()) == [os.SCHED_IDLE]
    assert (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)) == caller
    p.close()


def mapped(address: int, nbytes: int) -> bool:
    """Whether every page of ``nbytes`` from ``address`` is mapped. The kernel merges
    an anonymous mapping with a neighbour of the same kind, so the range may be part
    of a larger line of /proc/self/maps, or of several."""
    start, end = address, address + (nbytes + PAGE - 1) // PAGE * PAGE
    with open("/proc/self/maps") as f:
        spans = sorted(tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f)
    for lo, hi in spans:
        if lo <= start < hi:
            start = hi
    return start >= end


def test_the_memory_of_a_pool_released_while_it_fills_is_unmapped() -> None:
    for _ in range(5):
        p = HostPool(POOL_SLOTS, LAYOUT, pin_memory=False, fill_ahead=POOL_SLOTS * SLOT)
        address, nbytes = p.slab.data_ptr(), POOL_SLOTS * SLOT
        time.sleep(0.002)  # mid-fill
        assert mapped(address, nbytes)
        del p
        gc.collect()
        deadline = time.monotonic() + 5
        while mapped(address, nbytes) and time.monotonic() < deadline:
            HostPool(1, LAYOUT, pin_memory=False)  # creation and release unmap what the
            time.sleep(0.001)  # fill threads let go of last
        assert not mapped(address, nbytes)
