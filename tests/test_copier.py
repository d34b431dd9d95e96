"""kvtier._core.Copier: row copies between host buffers on a C thread, and the
transfer engine's background copies built on it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from kvtier._core import Copier

from kvtier.transfer import TransferEngine

PIECE = 256 << 10  # the C side's sharing unit: rows larger than this are split


@pytest.fixture
def copier():
    c = Copier()
    yield c
    c.close()


def rows(n: int, row: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, row), dtype=np.uint8)


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("row", [16, PIECE, 3 * PIECE + 5])
def test_a_job_copies_exactly_the_given_rows(copier, row: int, cached: bool) -> None:
    # cached=True takes plain stores instead of streaming ones: the same bytes land.
    src, dst = rows(6, row), np.zeros((6, row), np.uint8)
    job = copier.submit(src, [1, 4, 0], dst, [5, 0, 2], row, cached=cached)
    job.wait()
    assert job.done()
    expected = np.zeros_like(dst)
    expected[[5, 0, 2]] = src[[1, 4, 0]]
    assert np.array_equal(dst, expected)


@pytest.mark.parametrize("dst_offset", range(0, 17, 3))
@pytest.mark.parametrize("row", [4095, 4096, 64 * 1000 + 13])
def test_streaming_copies_are_exact_at_any_alignment_and_length(copier, row, dst_offset) -> None:
    # Rows of 4 KiB and more bypass the caches (16-byte aligned streaming stores): the
    # unaligned head and the tail shorter than 64 bytes go through memcpy.
    src = rows(3, row)
    raw = np.zeros(3 * row + dst_offset, np.uint8)
    dst = raw[dst_offset:].reshape(3, row)
    copier.submit(src, [2, 0], dst, [0, 2], row).wait()
    assert np.array_equal(dst[[0, 2]], src[[2, 0]]) and not dst[1].any()
    assert not raw[:dst_offset].any()


def test_many_jobs_match_numpy_fancy_indexing(copier) -> None:
    rng = np.random.default_rng(1)
    src, dst = rows(64, 96), np.zeros((64, 96), np.uint8)
    expected = dst.copy()
    jobs = []
    for _ in range(50):
        s = rng.choice(64, 8, replace=False).tolist()
        d = rng.choice(64, 8, replace=False).tolist()
        expected[d] = src[s]
        jobs.append(copier.submit(src, s, dst, d, 96))
        jobs[-1].wait()  # in order: later jobs may overwrite earlier rows
    assert np.array_equal(dst, expected)


def test_a_job_finishes_without_a_waiter(copier) -> None:
    src, dst = rows(2, 64), np.zeros((2, 64), np.uint8)
    job = copier.submit(src, [0], dst, [1], 64)
    copier.close()  # runs what is queued, then stops
    assert job.done() and np.array_equal(dst[1], src[0]) and job.seconds >= 0


def test_a_cancelled_job_never_runs() -> None:
    c = Copier()
    src, dst = rows(2, 64), np.zeros((2, 64), np.uint8)
    # A job queued behind a large one is still queued when cancelled.
    big_src, big_dst = rows(64, 1 << 20), np.zeros((64, 1 << 20), np.uint8)
    first = c.submit(big_src, list(range(64)), big_dst, list(range(64)), 1 << 20)
    job = c.submit(src, [0], dst, [1], 64)
    if job.cancel():
        first.wait()
        c.close()
        assert job.done() and not dst.any()
    else:  # the machine ran the big copy first after all: the job ran, whole
        job.wait()
        assert np.array_equal(dst[1], src[0])
        c.close()


def test_an_empty_job_is_done_at_once(copier) -> None:
    job = copier.submit(rows(2, 8), [], np.zeros((2, 8), np.uint8), [], 8)
    assert job.done()
    job.wait()


@pytest.mark.parametrize(
    ("src_rows", "dst_rows", "row", "error", "message"),
    [
        ([2], [0], 8, IndexError, "source row 2 out of range"),
        ([0], [-1], 8, IndexError, "destination row -1 out of range"),
        ([0, 1], [0], 8, ValueError, "2 source rows but 1 destination rows"),
        ([0], [0], 5, ValueError, "not whole rows of 5"),
        ([0], [0], 0, ValueError, "row_nbytes must be positive"),
        (["a"], [0], 8, TypeError, "integer"),
    ],
)
def test_bad_input_raises_and_queues_nothing(copier, src_rows, dst_rows, row, error, message):
    src, dst = rows(2, 8), np.zeros((2, 8), np.uint8)
    with pytest.raises(error, match=message):
        copier.submit(src, src_rows, dst, dst_rows, row)
    assert not dst.any()


def test_submit_takes_cached_as_its_only_keyword(copier) -> None:
    src, dst = rows(2, 8), np.zeros((2, 8), np.uint8)
    with pytest.raises(TypeError, match="5 positional arguments and cached="):
        copier.submit(src, [0], dst, [1], 8, streaming=False)
    with pytest.raises(TypeError, match="5 or 6 arguments, got 7"):
        copier.submit(src, [0], dst, [1], 8, True, cached=True)
    assert not dst.any()


def test_the_destination_must_be_writable(copier) -> None:
    dst = np.zeros((2, 8), np.uint8)
    dst.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        copier.submit(rows(2, 8), [0], dst, [1], 8)


def test_a_closed_copier_takes_no_job() -> None:
    c = Copier()
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.submit(rows(2, 8), [0], np.zeros((2, 8), np.uint8), [1], 8)


def test_a_thread_name_longer_than_linux_allows_is_refused() -> None:
    with pytest.raises(ValueError, match="at most 15 bytes"):
        Copier(name="kvtier-" + "x" * 9)


def test_waiters_on_other_threads_all_see_the_copy(copier) -> None:
    src, dst = rows(16, 3 * PIECE), np.zeros((16, 3 * PIECE), np.uint8)
    job = copier.submit(src, list(range(16)), dst, list(range(16))[::-1], 3 * PIECE)
    threads = [threading.Thread(target=job.wait) for _ in range(3)]
    for t in threads:
        t.start()
    job.wait()
    for t in threads:
        t.join()
    assert np.array_equal(dst[::-1], src)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_background_engine_copy_is_bit_exact(dtype: torch.dtype) -> None:
    engine = TransferEngine("cpu")
    src = torch.randn(8, 2, 3, 16, dtype=torch.float32).to(dtype)
    dst = torch.zeros_like(src)
    transfer = engine.copy(src, [3, 1, 7], dst, [0, 6, 2], background=True)
    assert transfer.join() is None and transfer.done()
    assert torch.equal(dst[[0, 6, 2]], src[[3, 1, 7]])
    assert transfer.nbytes == 3 * src[0].nbytes
    engine.close()


def test_a_background_engine_copy_reports_bad_ids_through_the_handle() -> None:
    engine = TransferEngine("cpu")
    src = torch.zeros(4, 8)
    transfer = engine.copy(src, [9], torch.zeros(4, 8), [0], background=True)
    assert isinstance(transfer.join(), IndexError)
    engine.close()
