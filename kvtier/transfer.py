"""Copy engine: batched block copies between block-major tensors, asynchronous where possible.

Every pool stores blocks block-major (``[num_blocks, *block_shape]``), so a batch of
blocks moves as a handful of calls: ids are split into runs that are consecutive on
both sides (one ``copy_`` each) or consecutive on the destination only (one
``index_select(out=)`` gather each, when both tensors are on one device).

Ownership of streams and threads:

- CUDA: device->host copies run on ``offload_stream``, host->device copies on
  ``load_stream``. Each copy first waits on the caller's current stream, so it sees
  every write the engine queued before it; an event recorded after it marks
  completion. Whoever reuses the source or reads the destination orders itself after
  the event (``Transfer.order_current_stream``) or blocks on it (``Transfer.wait``);
  nobody syncs the host on the engine's path. Host memory must be pinned for the
  copies to be truly asynchronous.
- CPU: a copy runs inline on the calling thread. Work that must not block the engine
  (prefetch: tier reads, then the copy up) runs on the engine's I/O worker threads
  (``submit``); torch copies and LMDB/socket I/O release the GIL.

A ``Transfer`` that failed keeps its exception (``error``), so a failed copy is
reported by the caller, never loaded silently.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T")


def _runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) index ranges of ``ids`` whose values are consecutive integers."""
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    bounds = [0, *breaks.tolist(), len(ids)]
    return list(zip(bounds[:-1], bounds[1:]))


def copy_blocks(
    src: torch.Tensor,
    src_ids: Sequence[int] | np.ndarray,
    dst: torch.Tensor,
    dst_ids: Sequence[int] | np.ndarray,
    non_blocking: bool = False,
) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for every i, in as few calls as the ids allow."""
    s = np.asarray(src_ids, dtype=np.int64)
    d = np.asarray(dst_ids, dtype=np.int64)
    if len(s) != len(d):
        raise ValueError(f"{len(s)} source blocks but {len(d)} destination blocks")
    if not len(s):
        return
    same_device = src.device == dst.device
    for a, b in _runs(d):
        run = s[a:b]
        d0, n = int(d[a]), b - a
        if run[-1] - run[0] == n - 1 and (n == 1 or (np.diff(run) == 1).all()):
            dst[d0 : d0 + n].copy_(src[int(run[0]) : int(run[0]) + n], non_blocking=non_blocking)
        elif same_device:
            index = torch.from_numpy(run).to(src.device, non_blocking=True)
            torch.index_select(src, 0, index, out=dst[d0 : d0 + n])
        else:  # across devices: one copy per source run inside this destination run
            for sa, sb in _runs(run):
                dd = d0 + sa
                s0 = int(run[sa])
                dst[dd : dd + sb - sa].copy_(src[s0 : s0 + sb - sa], non_blocking=non_blocking)


def _timed_copy(*args: object) -> float:
    """``copy_blocks(*args)``; returns the seconds it took."""
    start = time.perf_counter()
    copy_blocks(*args)  # type: ignore[arg-type]
    return time.perf_counter() - start


class Transfer:
    """A handle on one batched copy: poll with ``done``, block with ``join``.

    On CUDA it wraps the events around the copy on a side stream; on CPU the copy has
    already run (or failed) when the handle is made.
    """

    def __init__(
        self,
        nbytes: int,
        events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None,
        error: BaseException | None = None,
        seconds: float = 0.0,
    ) -> None:
        self.nbytes = nbytes
        self._events = events
        self.error = error
        self._seconds = seconds

    def done(self) -> bool:
        """Never blocks."""
        return self._events is None or bool(self._events[1].query())

    def join(self) -> BaseException | None:
        """Block until the copy has finished; return its error (None when it succeeded)."""
        if self._events is not None:
            self._events[1].synchronize()
        return self.error

    @property
    def seconds(self) -> float:
        """Time the copy took (0.0 while it runs, or when it failed)."""
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
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kvtier-io")

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
    ) -> Transfer:
        """``dst[dst_ids] = src[src_ids]``: queued on a side stream on CUDA, done inline on CPU.

        On CUDA the copy first waits for ``after`` (else the caller's current stream), so
        it sees every write queued before it. A failure is reported through the handle.
        """
        s = np.array(src_ids, dtype=np.int64)
        d = np.array(dst_ids, dtype=np.int64)
        nbytes = len(d) * dst[0].nbytes if len(dst) else 0
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
        """Finish queued work and stop the workers."""
        self._pool.shutdown(wait=True)
