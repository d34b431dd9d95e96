"""Copy engine: batched block copies between block-major tensors, asynchronous where possible.

Every pool stores blocks block-major (``[num_blocks, *block_shape]``), so a batch of
blocks moves as a handful of calls. The pairs are split into runs that are
consecutive on both sides (one ``copy_`` each); when both tensors are on one device,
a run may also be consecutive on the destination only (one ``index_select(out=)``
gather) or on the source only (one ``index_copy_`` scatter), whichever grouping
needs fewer calls. Blocks that fit no run are copied one ``copy_`` each.

Across devices (host <-> GPU) each call is a ``cudaMemcpyAsync`` that costs the
calling thread 15-20 µs to issue (H100), so a batch of scattered GPU blocks costs the
engine's thread that much per block. A batch in many runs goes through a device
staging buffer instead: host runs copied into it, then one ``index_copy_`` scatter
on the device (a load); or one ``index_select`` gather into it, then one copy per host
run (an offload). The staging memory comes from torch's caching allocator on the
copy's stream, in pieces of at most ``STAGE_NBYTES``. Measured on an H100 with 2 MiB
blocks: 256 scattered blocks take 1.3-1.5 ms to issue staged vs 4.3-4.6 ms per run,
for the same copy time (±6%); 16 blocks take 0.21-0.23 vs 0.27-0.29 ms to issue but
13% longer to copy, so staging starts at ``_STAGE_MIN_RUNS`` runs.

Scatters use a view of the rows as 16-byte elements (``complex128``, the widest
dtype torch has; the bytes are moved, never interpreted): on CPU ``index_copy_``
and ``index_put_`` cost per element, so in fp16 they run at under half the speed of
a per-block ``copy_`` loop, while on 16-byte elements ``index_copy_`` is as fast as
the ``index_select`` gather (``benchmarks/bench_transfer.py`` measures the options).
No host memory is allocated per call beyond the small index tensors.

Ownership of streams and threads:

- CUDA: device->host copies run on ``offload_stream``, host->device copies on
  ``load_stream``. Each copy first waits on the caller's current stream, so it sees
  every write the engine queued before it; an event recorded after it marks
  completion. Whoever reuses the source or reads the destination orders itself after
  the event (``Transfer.order_current_stream``) or blocks on it (``Transfer.join``);
  nobody syncs the host on the engine's path. Host memory must be pinned for the
  copies to be truly asynchronous.
- CPU: a copy runs inline on the calling thread, or, with ``background=True`` (a
  prefetch of host hits), on the copier: a C thread (``kvtier._core.Copier``) that
  copies rows without ever taking the GIL. A Python worker would cost the engine a GIL
  hand-off each way, more than the copy of a block; and whoever joins a copy the
  thread has not started runs it itself, so a request that waits at once hands off
  nothing. Work that must not block the engine and is more than a copy (a prefetch
  with tier reads) runs on the engine's I/O worker threads (``submit``); torch copies
  and LMDB/socket I/O release the GIL.

A ``Transfer`` that failed keeps its exception (``error``), so a failed copy is
reported by the caller, never loaded silently.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

import numpy as np
import torch

from kvtier._core import Copier, CopyJob
from kvtier.chunk import byte_rows
from kvtier.threads import thread_pool

T = TypeVar("T")
_WIDE = torch.complex128  # 16-byte elements: the widest dtype torch has
# Device memory one staged cross-device copy holds at a time: enough that each piece
# is one large copy, small next to the pool it copies into.
STAGE_NBYTES = 64 << 20
# A cross-device batch in this many runs or more is staged (see the module docstring).
_STAGE_MIN_RUNS = 32


def _id_list(ids: Sequence[int] | np.ndarray) -> list[int]:
    return ids.tolist() if isinstance(ids, np.ndarray) else [int(i) for i in ids]


def _sorted_by(key: list[int], other: list[int]) -> tuple[list[int], list[int]]:
    """Both lists in ascending ``key`` order (stable)."""
    if all(a <= b for a, b in zip(key, key[1:])):
        return key, other
    order = sorted(range(len(key)), key=key.__getitem__)
    return [key[i] for i in order], [other[i] for i in order]


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """[start, end) index ranges of ``ids`` whose values are consecutive integers."""
    bounds = [0, *(i for i in range(1, len(ids)) if ids[i] != ids[i - 1] + 1), len(ids)]
    return list(zip(bounds[:-1], bounds[1:]))


def _consecutive(ids: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(ids, ids[1:]))


def _device_index(ids: list[int], device: torch.device) -> torch.Tensor:
    """``ids`` as an int64 index tensor on ``device``. On CUDA it is copied from pinned
    memory: a copy from pageable memory would first wait for everything already
    queued on the stream, the staging copies it is to follow included."""
    index = torch.tensor(ids, dtype=torch.int64)
    if device.type == "cuda":
        index = index.pin_memory()
    return index.to(device, non_blocking=True)


def _wide_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[len(t), k]`` 16-byte elements over the same bytes, or None when its
    layout does not allow it (not contiguous, rows not a multiple of 16 B, unaligned)."""
    if t.dim() == 0 or not len(t) or not t.is_contiguous():
        return None
    row = t[0].numel() * t.element_size()
    if not row or row % 16 or t.data_ptr() % 16:
        return None
    return t.view(len(t), -1).view(torch.uint8).view(_WIDE)


def copy_blocks(
    src: torch.Tensor,
    src_ids: Sequence[int] | np.ndarray,
    dst: torch.Tensor,
    dst_ids: Sequence[int] | np.ndarray,
    non_blocking: bool = False,
) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for every i, in as few calls as the ids allow.

    Runs are found on the pairs sorted by destination (or, for scatters, by source),
    so e.g. a chain stored in descending slots is one run. A destination given twice
    ends up holding its last source. The ids are walked in plain Python: cheaper than
    numpy's per-call cost at these sizes.
    """
    s = _id_list(src_ids)
    d = _id_list(dst_ids)
    n = len(d)
    if len(s) != n:
        raise ValueError(f"{len(s)} source blocks but {n} destination blocks")
    if n == 1:
        dst[d[0]].copy_(src[s[0]], non_blocking=non_blocking)
        return
    if not n:
        return
    d_sorted, s_by_d = _sorted_by(d, s)
    if src.device != dst.device:  # runs consecutive on both sides, or staged
        bounds = [0]
        bounds += [
            i
            for i in range(1, n)
            if d_sorted[i] != d_sorted[i - 1] + 1 or s_by_d[i] != s_by_d[i - 1] + 1
        ]
        bounds.append(n)
        if len(bounds) - 1 >= _STAGE_MIN_RUNS and _copy_staged(
            src, s, dst, d, d_sorted, s_by_d, non_blocking
        ):
            return
        for a, b in zip(bounds[:-1], bounds[1:]):
            d0, s0 = d_sorted[a], s_by_d[a]
            dst[d0 : d0 + b - a].copy_(src[s0 : s0 + b - a], non_blocking=non_blocking)
        return
    d_runs = _runs(d_sorted)
    if len(d_runs) > 1 and len(set(d)) == n:  # a scatter may take fewer calls
        s_sorted, d_by_s = _sorted_by(s, d)
        s_runs = _runs(s_sorted)
        wide_src, wide_dst = _wide_rows(src), _wide_rows(dst)
        if len(s_runs) < len(d_runs) and wide_src is not None and wide_dst is not None:
            for a, b in s_runs:
                s0, run = s_sorted[a], d_by_s[a:b]
                if len(run) == 1 or _consecutive(run):
                    d0 = run[0]
                    dst[d0 : d0 + b - a].copy_(src[s0 : s0 + b - a], non_blocking=non_blocking)
                else:
                    index = _device_index(run, dst.device)
                    wide_dst.index_copy_(0, index, wide_src[s0 : s0 + b - a])
            return
    for a, b in d_runs:
        d0, run = d_sorted[a], s_by_d[a:b]
        if len(run) == 1:
            dst[d0].copy_(src[run[0]], non_blocking=non_blocking)
        elif _consecutive(run):
            s0 = run[0]
            dst[d0 : d0 + b - a].copy_(src[s0 : s0 + b - a], non_blocking=non_blocking)
        else:
            index = _device_index(run, src.device)
            torch.index_select(src, 0, index, out=dst[d0 : d0 + b - a])


def _copy_staged(
    src: torch.Tensor,
    s: list[int],
    dst: torch.Tensor,
    d: list[int],
    d_sorted: list[int],
    s_by_d: list[int],
    non_blocking: bool,
) -> bool:
    """``copy_blocks`` across devices through a staging buffer on the non-CPU side, in
    pieces of at most ``STAGE_NBYTES``; False (nothing copied) when the rows have no
    16-byte view or a load names a destination twice (``index_copy_`` would then pick
    either source)."""
    wide_src, wide_dst = _wide_rows(src), _wide_rows(dst)
    if wide_src is None or wide_dst is None:
        return False
    loading = dst.device.type != "cpu"
    if loading and len(set(d)) != len(d):
        return False
    device = dst.device if loading else src.device
    width = wide_src.shape[1]
    piece = max(1, STAGE_NBYTES // (width * 16))
    if loading:  # host runs -> staging, one scatter on the device
        s_sorted, d_by_s = _sorted_by(s, d)
        for a in range(0, len(s), piece):
            rows = s_sorted[a : a + piece]
            stage = torch.empty((len(rows), width), dtype=_WIDE, device=device)
            for x, y in _runs(rows):
                stage[x:y].copy_(wide_src[rows[x] : rows[x] + y - x], non_blocking=non_blocking)
            wide_dst.index_copy_(0, _device_index(d_by_s[a : a + piece], device), stage)
    else:  # one gather on the device -> staging, staging -> host runs
        for a in range(0, len(d), piece):
            rows = d_sorted[a : a + piece]
            stage = wide_src.index_select(0, _device_index(s_by_d[a : a + piece], device))
            for x, y in _runs(rows):
                wide_dst[rows[x] : rows[x] + y - x].copy_(stage[x:y], non_blocking=non_blocking)
    return True


def _nbytes(dst: torch.Tensor, dst_ids: Sequence[int] | np.ndarray) -> int:
    """Bytes a copy into ``dst[dst_ids]`` moves."""
    return len(dst_ids) * (dst.nbytes // dst.shape[0]) if dst.shape[0] else 0


def _timed_copy(*args: object) -> float:
    """``copy_blocks(*args)``; returns the seconds it took."""
    start = time.perf_counter()
    copy_blocks(*args)  # type: ignore[arg-type]
    return time.perf_counter() - start


class Transfer:
    """A handle on one batched copy: poll with ``done``, block with ``join``.

    On CUDA it wraps the events around the copy on a side stream; on CPU it wraps a
    copier job (``background``), or the copy has already run (or failed) when the
    handle is made.
    """

    def __init__(
        self,
        nbytes: int,
        events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None,
        error: BaseException | None = None,
        seconds: float = 0.0,
        job: CopyJob | None = None,
    ) -> None:
        self.nbytes = nbytes
        self._events = events
        self._job = job
        self.error = error
        self._seconds = seconds

    def done(self) -> bool:
        """Never blocks."""
        if self._job is not None:
            return self._job.done()
        return self._events is None or bool(self._events[1].query())

    def join(self) -> BaseException | None:
        """Block until the copy has finished (running a copier job here if its thread has
        not started it); return its error (None when it succeeded)."""
        if self._job is not None:
            self._job.wait()
        elif self._events is not None:
            self._events[1].synchronize()
        return self.error

    def cancel(self) -> bool:
        """Make sure a copier job never runs; False once it has started, and always on
        CUDA (a queued stream copy cannot be taken back) or for an inline copy."""
        return self._job is not None and self._job.cancel()

    @property
    def seconds(self) -> float:
        """Time the copy took (0.0 while it runs, or when it failed)."""
        if self._job is not None:
            return self._job.seconds
        if self._events is not None:
            return self._events[0].elapsed_time(self._events[1]) / 1000 if self.done() else 0.0
        return self._seconds

    def order_current_stream(self) -> None:
        """Make later work on the current stream run after this copy (no host sync on CUDA)."""
        if self._events is not None:
            end = self._events[1]
            torch.cuda.current_stream(end.device).wait_event(end)


class TransferEngine:
    """Block copies on side streams (CUDA) or inline (CPU), and the I/O worker threads."""

    def __init__(self, device: torch.device | str, workers: int = 1) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self.offload_stream = torch.cuda.Stream(self.device)
            self.load_stream = torch.cuda.Stream(self.device)
        self.workers = max(1, workers)
        self._pool = thread_pool(self.workers, "kvtier-io")
        self._copier = None if self._cuda else Copier(name="kvtier-copy")
        # Byte-row views of the tensors given to background copies (the pools) and their
        # row size, kept with their tensor so that an id is never reused while its view
        # is cached. The size is kept too: reading it again (torch's nbytes, or numpy's
        # shape) costs µs per request.
        self._rows: dict[int, tuple[torch.Tensor, np.ndarray, int]] = {}

    def mark(self) -> torch.cuda.Event | None:
        """An event on the caller's current stream (None on CPU): pass it as ``after`` to
        order a copy started later, from another thread, after the work queued so far."""
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(
        self,
        src: torch.Tensor,
        src_ids: Sequence[int] | np.ndarray,
        dst: torch.Tensor,
        dst_ids: Sequence[int] | np.ndarray,
        after: torch.cuda.Event | None = None,
        background: bool = False,
    ) -> Transfer:
        """``dst[dst_ids] = src[src_ids]``: queued on a side stream on CUDA, done inline on
        CPU, or with ``background`` queued on the copier thread (block-major contiguous
        CPU tensors).

        On CUDA the copy first waits for ``after`` (else the caller's current stream), so
        it sees every write queued before it. A failure is reported through the handle.
        """
        if background and self._copier is not None:
            try:
                src_rows, _ = self._byte_rows(src)
                dst_rows, row = self._byte_rows(dst)
                job = self._copier.submit(src_rows, src_ids, dst_rows, dst_ids, row)
            except Exception as e:  # reported through the handle, never raised
                return Transfer(_nbytes(dst, dst_ids), error=e)
            return Transfer(len(dst_ids) * row, job=job)
        nbytes = _nbytes(dst, dst_ids)
        s = np.array(src_ids, dtype=np.int64)
        d = np.array(dst_ids, dtype=np.int64)
        if self._cuda and (src.is_cuda or dst.is_cuda):
            stream = self.load_stream if dst.is_cuda else self.offload_stream
            if after is not None:
                stream.wait_event(after)
            else:
                stream.wait_stream(torch.cuda.current_stream(self.device))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                copy_blocks(src, s, dst, d, non_blocking=True)
                end.record(stream)
            return Transfer(nbytes, events=(start, end))
        try:
            seconds = _timed_copy(src, s, dst, d)
        except Exception as e:  # reported through the handle, never raised
            return Transfer(nbytes, error=e)
        return Transfer(nbytes, seconds=seconds)

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Run ``fn(*args)`` on an I/O worker thread."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        """Finish queued work and stop the workers and the copier."""
        self._pool.shutdown(wait=True)
        if self._copier is not None:
            self._copier.close()

    def _byte_rows(self, t: torch.Tensor) -> tuple[np.ndarray, int]:
        """``t`` (contiguous, on the CPU, ``[rows, ...]``) as a uint8 ``[rows, bytes]`` view,
        and the bytes per row."""
        cached = self._rows.get(id(t))
        if cached is None or cached[0] is not t:
            rows = byte_rows(t)  # ValueError for another tensor
            cached = self._rows[id(t)] = (t, rows, rows.shape[1])
        return cached[1], cached[2]
