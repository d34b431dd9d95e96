"""The ``kvtier`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvtier.block_manager import BlockManager
from kvtier.config import ConfigError, KVTierConfig, default_config, load_config
from kvtier.gpu_pool import GPUBlockPool
from kvtier.hashing import BlockHasher, namespace_root
from kvtier.progress import progress
from kvtier.workloads import multi_turn_chat


def _load(path: str | None) -> KVTierConfig:
    config = default_config() if path is None else load_config(path)
    if config.layout is None:
        raise ConfigError("layout", None, "a layout section (the demo has no model to derive it)")
    return config


def demo(args: argparse.Namespace) -> int:
    """Serve a synthetic multi-turn chat through the GPU block manager; print hit rates."""
    config = _load(args.config)
    layout = config.layout
    assert layout is not None
    pool = GPUBlockPool(config.tiers.gpu.resolve_num_blocks(layout), layout, device="cpu")
    root = namespace_root(
        config.model, layout.fingerprint, config.hashing.salt, config.hashing.algorithm
    )
    manager = BlockManager(pool, BlockHasher(root, layout.block_size, config.hashing.algorithm))
    requests = list(multi_turn_chat(args.conversations, args.turns))
    print(
        f"kvtier demo: {len(requests)} requests, GPU pool of {pool.num_blocks} blocks "
        f"({layout.describe()})"
    )
    rows = []
    for req in progress(requests, desc="serving"):
        hit = manager.lookup(req.req_id, req.prompt)
        hit_tokens = len(hit) * layout.block_size
        if manager.allocate(req.req_id, len(req.prompt) + len(req.reply) - hit_tokens, hit) is None:
            print(f"{req.req_id}: pool exhausted, request skipped", file=sys.stderr)
            manager.free(req.req_id)
            continue
        manager.commit(req.req_id, req.prompt + req.reply)
        manager.free(req.req_id)
        rows.append((req.req_id, len(req.prompt), hit_tokens))
    print(f"{'request':>10} {'prompt':>8} {'hit':>8} {'hit rate':>9}")
    for req_id, prompt, hit in rows:
        print(f"{req_id:>10} {prompt:>8} {hit:>8} {hit / prompt:>8.1%}")
    total = sum(r[1] for r in rows)
    hits = sum(r[2] for r in rows)
    stats = pool.stats()
    print(
        f"overall: {hits}/{total} prompt tokens hit ({hits / max(total, 1):.1%}); "
        f"{stats.evictions} blocks evicted; {stats.num_cached} cached"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="serve a synthetic multi-turn chat and print hit rates")
    p.add_argument("--config", help="YAML config (default: the embedded default)")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.set_defaults(func=demo)
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
