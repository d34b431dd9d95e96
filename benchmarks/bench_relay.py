"""What relaying a load costs against a raw broadcast of its bytes (``kvtier.relay``).

Where every tensor-parallel rank holds the same KV (MLA), the first rank holds it below
for the group and each load reaches the other ranks over the group: the blocks are
gathered from the holder's KV tensors into a buffer, broadcast in pieces of at most
16 MiB, and scattered into the other rank's KV tensors. The ceiling is one broadcast of
the same bytes, already contiguous, over the same group in the same run.

Two ranks in two processes on this machine, over gloo (vLLM's CPU build; on CUDA the
blocks travel over the device group, NCCL). KV shaped as DeepSeek V3's: 61 layers of
a 576-wide bf16 latent, 64-token blocks (4.5 MB a block over all layers), 128 blocks
per rank; hits of 4 and 32 blocks at scattered block ids. Cases run in rounds, one
sample of each per round, in an order reversed every other round; medians, min, max.

    python benchmarks/bench_relay.py [--quick] [--out FILE.json]
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _report import Result, report_cpu_run, standard_args, summarize

from kvtier.connector import EngineKV
from kvtier.progress import progress
from kvtier.relay import Relay

BENCHMARK = "bench_relay"
LAYERS, BLOCK, LATENT, BLOCKS = 61, 64, 576, 128
HITS = (4, 32)
TARGET = 0.8  # of the raw broadcast's throughput


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, rounds: int, out: dict) -> None:
    """One rank: the relay and the raw broadcast of each hit, ``rounds`` samples each
    after a warm-up; rank 0 puts its seconds per case in ``out``."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
    groups = [
        dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, 2, timedelta(seconds=120))
        for name in ("data", "control")
    ]
    make = torch.randn if rank == 0 else torch.zeros
    kv = EngineKV([make(BLOCKS, 1, BLOCK, LATENT).to(torch.bfloat16) for _ in range(LAYERS)])
    relay = Relay(kv, *groups, holder=rank == 0)
    ids = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    opts = dist.BroadcastOptions()
    opts.rootRank = 0

    def barrier() -> None:
        groups[1].broadcast([torch.zeros(1)], opts).wait()

    def relay_hit(n: int) -> None:
        relay.run([ids[:n]], [n])

    def raw_hit(n: int) -> None:
        flat = raw[n]
        groups[0].broadcast([flat], opts).wait()

    nbytes = {n: n * LAYERS * BLOCK * LATENT * 2 for n in HITS}
    raw = {n: torch.zeros(nbytes[n], dtype=torch.uint8) for n in HITS}
    cases = [
        (f"{kind} {n}", fn, n)
        for n in HITS
        for kind, fn in (("relay", relay_hit), ("raw", raw_hit))
    ]
    samples: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for r in progress(range(rounds + 1), desc="rounds", enabled=rank == 0):
        order = cases if r % 2 else cases[::-1]
        for name, fn, n in order:
            barrier()
            start = time.perf_counter()
            fn(n)
            barrier()
            if r:  # the first round warms up
                samples[name].append(time.perf_counter() - start)
    if rank == 0:
        out.update(samples)
        out["nbytes"] = nbytes


def main() -> None:
    args = standard_args(__doc__.splitlines()[0]).parse_args()
    rounds = 3 if args.quick else 10
    load_before = os.getloadavg()[0]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, (_free_port(), rounds, out), nprocs=2)
        samples = dict(out)
    results = []
    for n in HITS:
        gb = samples["nbytes"][n] / 1e9
        value, fastest, slowest = (gb / s for s in summarize(samples[f"relay {n}"]))
        ceiling = gb / summarize(samples[f"raw {n}"])[0]
        results.append(
            Result(
                f"relay {n} blocks ({gb * 1000:.0f} MB)",
                "throughput",
                "GB/s",
                value,
                min=slowest,
                max=fastest,
                ceiling=ceiling,
                ceiling_what="gloo broadcast of the same bytes, contiguous",
                target=TARGET,
            )
        )
    details = f"2 ranks over gloo, {rounds} rounds, DeepSeek V3-shaped KV ({LAYERS} layers)"
    report_cpu_run(BENCHMARK, args.quick, details, results, args.out, load_before)


if __name__ == "__main__":
    sys.exit(main())
