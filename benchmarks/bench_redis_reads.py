"""What Redis reads on a kvtier thread cost the engine's own thread, through the GIL.

kvtier's spill reads run on its I/O threads inside the engine's process. The engine
stands in here as a loop of small torch ops driven from Python on the main thread
(one step: 60 matmul + tanh of 128x128 float32, one intra-op thread); the reads
are batches of GETs of 16 values of 4 MiB (64 MiB: an 8k-token prefix of the demo
Llama in ``configs/vllm.yaml``'s 4-block chunks), as fast as they come, on one other
thread, from the Redis server the tests use. Cases, median step time and the ratio
to the loop alone (lower is better):

- ``alone``: the loop with no reads (the ceiling).
- ``redis-py pipeline``: the reads as redis-py makes them (``pipeline().get(...)``,
  hiredis where installed), each value a new ``bytes``: kvtier's read path before
  ``kvtier.tiers.redis_values``.
- ``RedisTier.get_many``: kvtier's read path (values received into a reused buffer).
  Target: ratio <= 1.3.
- ``redis-py, another process``: the same reads in a process of their own (no GIL
  shared; informational: what the CPU alone costs).

Each reading case also gives the reads' throughput (MiB/s) and, measured next while
the reads go on, what they cost another client of the server: the p99 latency of a
lookup (``RedisTier.sizes_many`` of the same keys, as the scheduler asks), against
the same lookups with no reads (``alone``). Cases run in rounds, one sample of each
per round, in an order reversed every other round.

    python benchmarks/bench_redis_reads.py [--quick] [--out FILE.json]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
import torch
from _report import Result, report_cpu_run, standard_args, summarize
from _ttft import bench_redis_url

from kvtier.config import RedisTierConfig
from kvtier.progress import progress
from kvtier.tiers.redis import RedisTier

BENCHMARK = "bench_redis_reads"
VALUES, VALUE_BYTES = 16, 4 << 20
TARGET = 1.3
MiB = 1 << 20

Reader = Callable[[Any, list[int]], None]  # (a stop event, [reads done])


def engine_step(a: torch.Tensor, b: torch.Tensor) -> None:
    """One step of the stand-in engine: small ops, each dispatched from Python."""
    for _ in range(60):
        a = torch.tanh(a @ b)


def engine_steps(seconds: float) -> list[float]:
    """Step times (s) of the stand-in engine over ``seconds``."""
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        engine_step(a, b)
        times.append(time.perf_counter() - start)
    return times


class Bench:
    def __init__(self, url: str, quick: bool) -> None:
        self.url = url
        self.seconds = 1.0 if quick else 3.0
        self.rounds = 3 if quick else 5
        self.prefix = f"kvtier-bench-reads-{uuid.uuid4().hex[:8]}"
        config = RedisTierConfig(url=url, key_prefix=self.prefix, ttl=None, socket_timeout=5.0)
        self.tier = RedisTier.from_config(config, "bench")
        self.looker = RedisTier.from_config(config, "bench")  # the scheduler's connection
        self.keys = [i.to_bytes(16, "big") for i in range(VALUES)]
        self.tier.put_many([(k, os.urandom(VALUE_BYTES)) for k in self.keys])
        self.redis_keys = [self.tier.redis_key(k) for k in self.keys]
        self.steps: dict[str, list[float]] = {}
        self.rates: dict[str, list[float]] = {}
        self.lookups: dict[str, list[float]] = {}

    def pipeline_reads(self, stop: threading.Event, done: list[int]) -> None:
        client = redis.Redis.from_url(self.url, socket_read_size=1 << 20)
        while not stop.is_set():
            pipe = client.pipeline(transaction=False)
            for key in self.redis_keys:
                pipe.get(key)
            pipe.execute()
            done[0] += 1
        client.close()

    def tier_reads(self, stop: threading.Event, done: list[int]) -> None:
        while not stop.is_set():
            self.tier.get_many(self.keys, lambda i, v: None)
            done[0] += 1

    def lookup_times(self) -> list[float]:
        """Times (ms, sorted) of lookups of the keys, one every 5 ms for ``seconds``."""
        times, end = [], time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            start = time.perf_counter()
            self.looker.sizes_many(self.keys)
            times.append((time.perf_counter() - start) * 1000)
            time.sleep(0.005)
        return sorted(times)

    def case(self, name: str, reader: Reader | None, process: bool = False) -> None:
        stop, done = threading.Event(), [0]
        worker: threading.Thread | mp.process.BaseProcess | None = None
        if reader is not None and process:
            ctx = mp.get_context("fork")
            stop, count = ctx.Event(), ctx.Value("q", 0)  # shared with the process
            worker = ctx.Process(target=_count_reads, args=(reader, stop, count))
            worker.start()
            time.sleep(0.2)  # the process is reading
        elif reader is not None:
            worker = threading.Thread(target=reader, args=(stop, done))
            worker.start()
        start = time.perf_counter()
        steps = engine_steps(self.seconds)
        elapsed = time.perf_counter() - start
        lookups = self.lookup_times()
        stop.set()
        if worker is not None:
            worker.join()
        if reader is not None and process:
            done[0] = round(count.value * elapsed / (elapsed + 0.2))
        self.steps.setdefault(name, []).append(statistics.median(steps) * 1000)
        self.lookups.setdefault(name, []).append(lookups[int(0.99 * len(lookups))])
        if reader is not None:
            rate = done[0] * VALUES * VALUE_BYTES / MiB / elapsed
            self.rates.setdefault(name, []).append(rate)

    def run(self) -> None:
        cases: list[tuple[str, Reader | None, bool]] = [
            ("alone", None, False),
            ("redis-py pipeline", self.pipeline_reads, False),
            ("RedisTier.get_many", self.tier_reads, False),
            ("redis-py, another process", self.pipeline_reads, True),
        ]
        for r in progress(range(self.rounds + 1), desc="rounds"):
            for name, reader, process in cases if r % 2 else cases[::-1]:
                self.case(name, reader, process)
            if r == 0:  # warm-up
                self.steps.clear()
                self.rates.clear()
                self.lookups.clear()

    def results(self) -> list[Result]:
        alone = summarize(self.steps["alone"])
        lookup = summarize(self.lookups["alone"])
        out = [
            Result("alone", "engine step median", "ms", *alone, higher_is_better=False),
            Result("alone, lookup p99", "lookup p99", "ms", *lookup, higher_is_better=False),
        ]
        for name, samples in self.steps.items():
            if name == "alone":
                continue
            target = TARGET if name == "RedisTier.get_many" else None
            out.append(
                Result(
                    f"reads: {name}", "engine step median", "ms", *summarize(samples),
                    ceiling=alone[0], ceiling_what="engine step, no reads", target=target,
                    higher_is_better=False,
                )
            )  # fmt: skip
            out.append(Result(f"reads: {name}", "reads", "MiB/s", *summarize(self.rates[name])))
            out.append(
                Result(
                    f"reads: {name}, lookup p99", "lookup p99", "ms",
                    *summarize(self.lookups[name]),
                    ceiling=lookup[0], ceiling_what="lookup p99, no reads",
                    higher_is_better=False,
                )
            )  # fmt: skip
        return out

    def close(self) -> None:
        self.tier.delete_many(self.keys)
        self.tier.close()
        self.looker.close()


def _count_reads(reader: Reader, stop: threading.Event, count: Any) -> None:
    done = [0]
    reader(stop, done)
    count.value = done[0]


def main() -> int:
    parser = standard_args(__doc__.split("\n", 1)[0])
    args = parser.parse_args()
    url = bench_redis_url()
    if url is None:
        print("needs a Redis server (KVTIER_BENCH_REDIS)", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    bench = Bench(url, args.quick)
    try:
        bench.run()
    finally:
        bench.close()
    details = (
        f"{VALUES} values of {VALUE_BYTES >> 20} MiB per read, {bench.rounds} rounds of "
        f"{bench.seconds:.0f} s per case after 1 warm-up, {time.perf_counter() - start:.0f} s"
    )
    report_cpu_run(BENCHMARK, args.quick, details, bench.results(), args.out, load_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
