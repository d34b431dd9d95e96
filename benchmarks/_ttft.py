"""What the TTFT benchmarks share (``bench_vllm_ttft.py``, ``bench_hf_ttft.py``).

Each timed request gives a ``Sample``: its TTFT, its phases (``kvtier.trace.phases``)
and, for a spill hit, the raw read of as many values of the same size from the same
tier (``RawReader``). ``results`` turns the samples of one prompt size into the rows
BENCHMARKS.md describes: recompute; the host hit against the recompute; each spill
hit against its limit ``TTFT(host hit) + T(raw read)``, target ``TARGET``.
"""

from __future__ import annotations

import argparse
import os
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
from _report import Result, machine_info, print_table, standard_args, summarize, write_json

from kvtier.progress import progress

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
        # The values are strings; the store's namespace records are a hash beside them.
        values = client.scan_iter(match=f"{self._prefix}*", count=1000, _type="string")
        keys = list(values)[:n]

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


Plan = tuple[str, Callable[[], list[Sample]]]  # a case and what measures it


def run_plans(
    plans: list[Plan], n_tokens: int, redis_url: str | None, key_prefix: str
) -> tuple[list[Result], dict[str, dict[str, float]]]:
    """Measure each case of ``plans`` at one prompt size (deleting the Redis keys under
    ``key_prefix`` afterwards): its rows and breakdown, as ``results`` gives them."""
    samples: dict[str, list[Sample]] = {}
    try:
        for case, run in progress(plans, desc=f"cases, {n_tokens}-token prompts"):
            samples[case] = run()
    finally:
        if redis_url is not None:
            delete_prefix(redis_url, key_prefix)
    return results(samples, f"{n_tokens}-token prompt")


def ttft_args(description: str) -> argparse.ArgumentParser:
    """``standard_args`` and the options every TTFT benchmark takes."""
    parser = standard_args(description)
    parser.add_argument("--prompt-tokens", type=int, nargs="+",
                        help="prompt sizes (default 2048 8192; 2048 with --quick)")  # fmt: skip
    parser.add_argument("--repeats", type=int, help="timed prompts per case (default 3; 1 quick)")
    return parser


def sizes_and_repeats(args: argparse.Namespace) -> tuple[list[int], int]:
    """The prompt sizes and timed prompts per case ``ttft_args``' options ask for."""
    sizes = args.prompt_tokens or ([2048] if args.quick else [2048, 8192])
    return sizes, args.repeats or (1 if args.quick else 3)


def measure_sizes(
    benchmark: str,
    title: str,
    sizes: list[int],
    measure: Callable[[int], tuple[list[Result], dict[str, dict[str, float]]]],
    out: str | None,
) -> int:
    """Run ``measure`` (rows and breakdown of one prompt size) at every size, print the
    table and the breakdown under ``title``, write the JSON to ``out`` if given."""
    rows: list[Result] = []
    breakdown: dict[str, dict[str, float]] = {}
    for n_tokens in sizes:
        size_rows, size_breakdown = measure(n_tokens)
        rows += size_rows
        breakdown |= size_breakdown
    print(title)
    print_table(rows)
    print_breakdown(breakdown)
    if out:
        write_json(out, benchmark, rows, machine_info(), {"breakdown": breakdown})
    return 0


def bench_redis_url() -> str | None:
    """``KVTIER_BENCH_REDIS`` (default the local server), or None when none answers."""
    url = os.environ.get("KVTIER_BENCH_REDIS", "redis://127.0.0.1:6379/0")
    if redis_reachable(url):
        return url
    print(f"note: no Redis at {url}: the redis case is skipped", file=sys.stderr)
    return None


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
    """Delete every key under ``prefix`` (in batches: a benchmark's can be many)."""
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        for i in range(0, len(keys), 1000):
            client.unlink(*keys[i : i + 1000])
    finally:
        client.close()


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
