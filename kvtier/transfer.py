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
- CPU: a copy runs inline, or, with ``background=True``, on one of the engine's
  worker threads (torch copies release the GIL, so the caller keeps working).

A ``Transfer`` that failed keeps its exception: ``done()`` is True and ``wait()``
re-raises it, so a failed copy is reported by the caller, never loaded silently.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch


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
    """``copy_blocks(*args)``; returns the seconds it took (run inline or on a worker)."""
    start = time.perf_counter()
    copy_blocks(*args)  # type: ignore[arg-type]
    return time.perf_counter() - start


class Transfer:
    """A handle on one batched copy: poll with ``done``, block with ``wait``."""

    def __init__(
        self,
        nbytes: int,
        events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None,
        future: Future[float] | None = None,
        error: BaseException | None = None,
        seconds: float = 0.0,
    ) -> None:
        self.nbytes = nbytes
        self._events = events
        self._event = events[1] if events else None
        self._future = future
        self._error = error
        self._seconds = seconds

    def cancel(self) -> bool:
        """Drop a background copy that has not started; True if it will never run."""
        return self._future is not None and self._future.cancel()

    def done(self) -> bool:
        """Never blocks."""
        if self._future is not None:
            return self._future.done()
        if self._event is not None:
            return bool(self._event.query())
        return True

    def wait(self) -> None:
        """Block until the copy has finished; re-raise its error if it failed."""
        if self._future is not None:
            self._future.result()
        elif self._event is not None:
            self._event.synchronize()
        if self._error is not None:
            raise self._error

    def join(self) -> BaseException | None:
        """Block until the copy has finished; return its error instead of raising it."""
        try:
            self.wait()
        except Exception as e:
            return e
        return None

    @property
    def error(self) -> BaseException | None:
        """The copy's exception once done, else None."""
        if self._future is not None and self._future.done():
            return self._future.exception()
        return self._error

    @property
    def seconds(self) -> float:
        """Time the copy took (0.0 until it is done or when it failed)."""
        if self._future is not None:
            done = self._future.done() and self._future.exception() is None
            return self._future.result() if done else 0.0
        if self._events is not None and self._event.query():
            return self._events[0].elapsed_time(self._events[1]) / 1000.0
        return self._seconds

    def order_current_stream(self) -> None:
        """Make later work on the current stream run after this copy (no host sync on CUDA).

        Never raises: a failure stays readable through ``error``.
        """
        if self._event is not None:
            torch.cuda.current_stream(self._event.device).wait_event(self._event)
        else:
            self.join()


class TransferEngine:
    """Runs ``copy_blocks`` batches on side streams (CUDA) or worker threads (CPU)."""

    def __init__(self, device: torch.device | str, workers: int = 1) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self.offload_stream = torch.cuda.Stream(self.device)
            self.load_stream = torch.cuda.Stream(self.device)
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="kvtier-copy")
        self._closed = threading.Event()

    def copy(
        self,
        src: torch.Tensor,
        src_ids: Sequence[int] | np.ndarray,
        dst: torch.Tensor,
        dst_ids: Sequence[int] | np.ndarray,
        background: bool = False,
    ) -> Transfer:
        """Start ``dst[dst_ids] = src[src_ids]``; returns its handle.

        The ids are copied before returning, so callers may reuse their lists.
        """
        s = np.array(src_ids, dtype=np.int64)
        d = np.array(dst_ids, dtype=np.int64)
        nbytes = len(d) * dst[0].nbytes if len(dst) else 0
        if self._cuda and (src.is_cuda or dst.is_cuda):
            stream = self.load_stream if dst.is_cuda else self.offload_stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                copy_blocks(src, s, dst, d, non_blocking=True)
                end.record(stream)
            return Transfer(nbytes, events=(start, end))
        if background:
            if self._closed.is_set():
                raise RuntimeError("transfer engine is closed")
            return Transfer(nbytes, future=self._pool.submit(_timed_copy, src, s, dst, d))
        try:
            seconds = _timed_copy(src, s, dst, d)
        except Exception as e:  # reported through the handle, like a background failure
            return Transfer(nbytes, error=e)
        return Transfer(nbytes, seconds=seconds)

    def close(self) -> None:
        """Finish queued copies and stop the workers."""
        self._closed.set()
        self._pool.shutdown(wait=True)
