"""The ``kvtier`` command."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from kvtier.cache import TieredCache
from kvtier.config import ConfigError, KVTierConfig, default_config, load_config
from kvtier.progress import progress
from kvtier.replay import read_trace, replay
from kvtier.synthetic import serve
from kvtier.workloads import multi_turn_chat


def _load(path: str | None) -> KVTierConfig:
    config = default_config() if path is None else load_config(path)
    if config.layout is None:
        raise ConfigError("layout", None, "a layout section (the demo has no model to derive it)")
    return config


@contextmanager
def _open_cache(config: KVTierConfig, args: argparse.Namespace) -> Iterator[TieredCache]:
    """A cache for one CLI run: its disk tier (if any) in a fresh scratch directory,
    so every run starts cold, unless ``--keep-cache``."""
    with tempfile.TemporaryDirectory(prefix="kvtier-") as scratch:
        disk = config.tiers.disk
        if disk is not None and not args.keep_cache:
            disk = replace(disk, path=f"{scratch}/lmdb")
            config = replace(config, tiers=replace(config.tiers, disk=disk))
        with TieredCache(config, device=args.device) as cache:
            yield cache


def demo(args: argparse.Namespace) -> int:
    """Serve a synthetic multi-turn chat through every configured tier; print hits per tier."""
    config = _load(args.config)
    with _open_cache(config, args) as cache:
        return _run_demo(cache, args)


def _run_demo(cache: TieredCache, args: argparse.Namespace) -> int:
    requests = list(
        multi_turn_chat(args.conversations, args.turns, system_tokens=512, user_tokens=128)
    )
    tiers = list(cache.stats().tiers)
    print(
        f"kvtier demo: {len(requests)} requests; tiers {', '.join(tiers)}; "
        f"GPU pool {cache.gpu.num_blocks} blocks of {cache.layout.describe()}"
    )
    rows = []
    for req in progress(requests, desc="serving"):
        served = serve(cache, req.req_id, req.prompt + req.reply)  # checks every hit block
        rows.append((req, served.hit.tokens_per_tier()))
    print(
        f"{'request':>9} {'prompt':>7}" + "".join(f" {t:>7}" for t in tiers) + f" {'computed':>9}"
    )
    for req, per_tier in rows:
        n = len(req.prompt) + len(req.reply)
        hit = sum(per_tier.values())
        cols = "".join(f" {per_tier.get(t, 0):>7}" for t in tiers)
        print(f"{req.req_id:>9} {n:>7}{cols} {n - hit:>9}")
    total = sum(len(r.prompt) + len(r.reply) for r, _ in rows)
    stats = cache.stats()
    print("\nhit rate by tier (share of all tokens):")
    for t in tiers:
        served = sum(p.get(t, 0) for _, p in rows)
        s = stats[t]
        print(
            f"  {t:>6}: {served / total:6.1%}   blocks in {s.blocks_in:>6}  out {s.blocks_out:>6}"
            f"  bytes in {s.bytes_in / 2**20:8.1f} MiB  out {s.bytes_out / 2**20:8.1f} MiB"
        )
    print("every block served from a tier matched a recompute bit for bit")
    return 0


def replay_trace(args: argparse.Namespace) -> int:
    """Replay a request trace through the configured tiers; print hit rates and latencies."""
    config = load_config(args.config)
    requests = read_trace(args.trace, args.limit)
    with _open_cache(config, args) as cache:
        result = replay(cache, requests, lambda r: progress(r, desc="replaying"))
        stats = cache.stats()
    bs = config.layout.block_size if config.layout else 0
    print(
        f"replayed {result.requests} requests ({result.skipped} skipped: GPU pool full), "
        f"{result.prompt_blocks} prompt blocks of {bs} tokens"
    )
    print(f"{'tier':>6} {'hit blocks':>11} {'hit rate':>9} {'MiB in':>9} {'MiB out':>9}")
    for tier, s in stats.tiers.items():
        n = result.hit_blocks.get(tier, 0)
        print(
            f"{tier:>6} {n:>11} {n / max(result.prompt_blocks, 1):>9.1%} "
            f"{s.bytes_in / 2**20:>9.1f} {s.bytes_out / 2**20:>9.1f}"
        )
    print(
        f" total {sum(result.hit_blocks.values()):>11} {result.hit_rate:>9.1%}   "
        f"ceiling (unbounded cache) {result.ceiling:.1%}"
    )
    for name, values in (("lookup", result.lookup_seconds), ("prefetch", result.prefetch_seconds)):
        if values:
            p50, p90, p99 = (np.percentile(values, q) * 1e3 for q in (50, 90, 99))
            print(f"{name} latency ms: p50 {p50:.2f}  p90 {p90:.2f}  p99 {p99:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "requests": result.requests,
                    "skipped": result.skipped,
                    "prompt_blocks": result.prompt_blocks,
                    "hit_blocks": result.hit_blocks,
                    "hit_rate": result.hit_rate,
                    "ceiling": result.ceiling,
                    "hit_rate_over_time": result.hit_rate_over_time,
                },
                f,
            )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="serve a multi-turn chat through every tier; print hits")
    p.add_argument("--config", help="YAML config (default: the embedded default)")
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--device", help="torch device of the GPU tier (default: from the config)")
    p.add_argument(
        "--keep-cache",
        action="store_true",
        help="use the configured disk path instead of a fresh scratch directory",
    )
    p.set_defaults(func=demo)
    r = sub.add_parser("replay", help="replay a request trace (Mooncake JSONL format)")
    r.add_argument("trace", help="JSONL trace: timestamp, input_length, hash_ids per line")
    r.add_argument("--config", default="configs/replay.yaml", help="YAML config")
    r.add_argument("--limit", type=int, help="replay only the first N requests")
    r.add_argument("--json", help="write the result as JSON here")
    r.add_argument("--device", help="torch device of the GPU tier (default: from the config)")
    r.add_argument("--keep-cache", action="store_true", help="use the configured disk path")
    r.set_defaults(func=replay_trace)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"kvtier: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
