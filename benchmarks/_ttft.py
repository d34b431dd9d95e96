"""What the TTFT benchmarks share (``bench_vllm_ttft.py``, ``bench_hf_ttft.py``).

Each timed request gives a ``Sample``: its TTFT, its phases (``kvtier.trace.phases``)
and, for a spill hit, the raw read of as many values of the same size from the same
tier (``RawReader``). ``results`` turns the samples of one prompt size into the rows
BENCHMARKS.md describes: recompute; the host hit against the recompute; each spill
hit against its limit ``TTFT(host hit) + T(raw read)``, target ``TARGET``.
"""

from __future__ import annotations

import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import lmdb
import numpy as np
import redis
from _report import Result, summarize

TARGET = 1.25  # a spill hit's TTFT over its limit
LIMIT = "limit: TTFT(host hit) + raw read of the same bytes (same run)"


class Sample(NamedTuple):
    """One timed request: seconds to first token, its phases (seconds), and the raw read
    of what its hit read (seconds; None for recompute and host hits)."""

    ttft: float
    phases: dict[str, float]
    raw: float | None


def prompts(prefix_tokens: int, question_tokens: int, count: int, vocab: int, seed: int):
    """``count`` prompts of token ids: one shared prefix, then a question each."""
    rng = random.Random(seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(200, vocab) for _ in range(n)]

    prefix = text(prefix_tokens)
    return [prefix + text(question_tokens) for _ in range(count)]


class RawReader:
    """Reads stored values of a tier at its raw speed: lmdb, or redis-py, no kvtier."""

    def __init__(self, disk: Path | None = None, url: str | None = None, prefix: str = ""):
        self._disk, self._url, self._prefix = disk, url, prefix

    def seconds(self, n: int, repeats: int = 3) -> float:
        """Seconds to read ``n`` stored values into a staging buffer: the fastest of
        ``repeats`` reads (the first one maps the pages in), of the first ``n`` values in
        the store's order (the benchmarks store values of one size). An LMDB store is
        read from a process of its own: the cache may have it open in this one."""
        if self._disk is not None:
            args = [sys.executable, __file__, str(self._disk), str(n), str(repeats)]
            return float(subprocess.run(args, capture_output=True, text=True, check=True).stdout)
        client = redis.Redis.from_url(self._url)
        keys = list(client.scan_iter(match=f"{self._prefix}*", count=1000))[:n]

        def read() -> None:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            _stage(pipe.execute())

        try:
            return min(_timed(read) for _ in range(repeats))
        finally:
            client.close()


def _lmdb_seconds(path: str, n: int, repeats: int) -> float:
    """``RawReader.seconds`` of an LMDB store, in this process."""
    with lmdb.open(path, readonly=True, max_dbs=8) as env:
        db = env.open_db(b"data", create=False)
        with env.begin(db=db) as txn:
            keys = [k for k, _ in zip(txn.cursor().iternext(values=False), range(n))]

        def read() -> None:
            with env.begin(db=db, buffers=True) as txn:
                _stage([txn.get(k) for k in keys])

        return min(_timed(read) for _ in range(repeats))


def results(
    samples: dict[str, list[Sample]], size: str
) -> tuple[list[Result], dict[str, dict[str, float]]]:
    """The rows of one prompt size (cases ``recompute``, ``host hit``, then spill hits,
    in ``samples``' order) and each hit case's median phases, ms."""

    def ttft_ms(case: str) -> list[float]:
        return [s.ttft * 1e3 for s in samples[case]]

    recompute = summarize(ttft_ms("recompute"))
    host_ms = statistics.median(ttft_ms("host hit"))
    rows = [
        Result(f"recompute {size}", "time to first token", "ms", *recompute,
               higher_is_better=False),
        Result(f"host hit {size}", "time to first token", "ms", *summarize(ttft_ms("host hit")),
               ceiling=recompute[0], ceiling_what="TTFT recomputing the same prompt",
               higher_is_better=False),
    ]  # fmt: skip
    breakdown = {}
    for case, got in samples.items():
        if case == "recompute":
            continue
        names = dict.fromkeys(name for s in got for name in s.phases)
        medians = {n: statistics.median(s.phases.get(n, 0.0) for s in got) for n in names}
        breakdown[f"{case} {size}"] = {n: round(v * 1e3, 2) for n, v in medians.items()}
        if case == "host hit":
            continue
        raw_ms = statistics.median(s.raw * 1e3 for s in got)
        breakdown[f"{case} {size}"]["raw read (limit's part)"] = round(raw_ms, 2)
        rows.append(
            Result(f"{case} {size}", "time to first token", "ms", *summarize(ttft_ms(case)),
                   ceiling=host_ms + raw_ms, ceiling_what=LIMIT, target=TARGET,
                   higher_is_better=False)
        )  # fmt: skip
    return rows, breakdown


def print_breakdown(breakdown: dict[str, dict[str, float]]) -> None:
    """Each case's phases (medians, ms) as columns, one row per case."""
    names = list(dict.fromkeys(n for phases in breakdown.values() for n in phases))
    width = max(len(c) for c in breakdown)
    cols = [max(len(n), 6) for n in names]
    print("\nwhere the time goes (medians, ms; kvtier's trace)")
    print("case".ljust(width) + "".join(f"  {n:>{w}}" for n, w in zip(names, cols)))
    for case, p in breakdown.items():
        cells = [f"{p[n]:.1f}" if n in p else "-" for n in names]
        print(case.ljust(width) + "".join(f"  {c:>{w}}" for c, w in zip(cells, cols)))


def redis_reachable(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def delete_prefix(url: str, prefix: str) -> None:
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)


def _stage(values: list) -> None:
    """Copy ``values`` into one staging buffer, as a load scatters them into host slots."""
    views = [memoryview(v) for v in values]
    buffer = np.empty(sum(v.nbytes for v in views), np.uint8)
    offset = 0
    for v in views:
        buffer[offset : offset + v.nbytes] = np.frombuffer(v, np.uint8)
        offset += v.nbytes


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":  # RawReader's reader of an LMDB store: PATH N REPEATS
    print(_lmdb_seconds(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
