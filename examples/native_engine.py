"""A minimal engine loop on kvtier's native API: the reference for embedding kvtier.

kvtier owns the block pool (``cache.kv``, ``[num_blocks, layers, 2, block_size, heads,
head_dim]``); the engine asks what is cached, waits for what is being loaded, computes
KV for the rest into the blocks it was given, commits, decodes, and frees:

    hit   = cache.lookup(req_id, prompt)                      # tokens per tier
    table = cache.allocate(req_id, len(prompt) - hit.num_tokens, hit)
    valid = cache.wait(req_id)                                # KV of prompt[:valid] is in place
    ... write KV of prompt[valid:] into cache.kv[table] ...
    cache.commit(req_id, prompt)                              # publish the full blocks
    ... per decoded token: cache.allocate(req_id, 1); write its KV; cache.commit(...) ...
    cache.free(req_id)

The "model" here is a toy whose KV at a position depends on every token before it
(as a transformer's does), so a wrong block from any tier would show. Every request's
KV is checked against a from-scratch recompute.

    python examples/native_engine.py [--config configs/default.yaml] [--requests 40]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from dataclasses import replace

import torch

from kvtier.cache import TieredCache
from kvtier.config import load_config
from kvtier.layout import KVLayout


class ToyModel:
    """KV of token ``t`` = a fixed integer projection of the sum of the embeddings of
    tokens ``0..t``: prefix-dependent like a transformer's, computed on integers (exact in
    float64) so that a recompute is exact however the work is split."""

    def __init__(self, layout: KVLayout, vocab: int = 1000, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.layout = layout
        self.vocab = vocab
        self.embed = torch.randint(-50, 50, (vocab, 16), generator=g, dtype=torch.float64)
        width = layout.num_layers * layout.kv_factor * layout.num_kv_heads * layout.head_dim
        self.proj = torch.randint(-50, 50, (16, width), generator=g, dtype=torch.float64)

    def kv(self, tokens: list[int], start: int) -> torch.Tensor:
        """KV of ``tokens[start:]``: ``[n, layers, kv_factor, heads, head_dim]``."""
        lay = self.layout
        prefix_sums = self.embed[torch.tensor(tokens)].cumsum(0)
        out = (prefix_sums[start:] @ self.proj % 4099).to(lay.dtype)  # exact in any float
        return out.view(-1, lay.num_layers, lay.kv_factor, lay.num_kv_heads, lay.head_dim)


def _slots(cache: TieredCache, table: list[int], first: int, n: int):
    """(block, offset) index tensors of positions ``first .. first + n - 1``."""
    pos = torch.arange(first, first + n)
    blocks = torch.tensor(table)[pos // cache.block_size]
    return blocks.to(cache.kv.device), (pos % cache.block_size).to(cache.kv.device)


def write_kv(cache: TieredCache, table: list[int], first: int, kv: torch.Tensor) -> None:
    """Write per-token KV for positions ``first, first + 1, ...`` into the block table."""
    blocks, offsets = _slots(cache, table, first, kv.shape[0])
    cache.kv[blocks, :, :, offsets] = kv.to(cache.kv.device)


def read_kv(cache: TieredCache, table: list[int], n: int) -> torch.Tensor:
    """The KV of the first ``n`` positions, in the model's per-token shape."""
    blocks, offsets = _slots(cache, table, 0, n)
    return cache.kv[blocks, :, :, offsets].cpu()


def serve(cache: TieredCache, model: ToyModel, req_id: str, prompt: list[int], decode: int):
    """One request: prefill through the cache, then ``decode`` steps; returns
    (tokens served by each tier, all tokens)."""
    hit = cache.lookup(req_id, prompt)
    table = cache.allocate(req_id, len(prompt) - hit.num_tokens, hit)
    if table is None:
        cache.free(req_id)
        raise RuntimeError(f"{req_id}: no room in the GPU pool")
    try:
        valid = cache.wait(req_id)  # a failed load only makes this smaller
        write_kv(cache, table, valid, model.kv(prompt, valid))
        cache.commit(req_id, prompt)
        tokens = list(prompt)
        for _ in range(decode):  # a decode step: one more slot, its KV, commit
            tokens.append(random.randrange(model.vocab))
            if cache.allocate(req_id, 1) is None:
                raise RuntimeError(f"{req_id}: no room in the GPU pool to decode")
            table = cache.block_ids(req_id)
            write_kv(cache, table, len(tokens) - 1, model.kv(tokens, len(tokens) - 1))
            cache.commit(req_id, tokens)
        if not torch.equal(read_kv(cache, table, len(tokens)), model.kv(tokens, 0)):
            raise AssertionError(f"{req_id}: KV differs from a recompute")
        return hit.tokens_per_tier(), tokens
    finally:
        cache.free(req_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--user-tokens", type=int, default=256, help="new tokens per turn")
    args = parser.parse_args(argv)
    random.seed(0)
    config = load_config(args.config)
    with tempfile.TemporaryDirectory() as scratch:
        if config.tiers.disk is not None:  # start cold: a fresh disk tier
            disk = replace(config.tiers.disk, path=f"{scratch}/lmdb")
            config = replace(config, tiers=replace(config.tiers, disk=disk))
        with TieredCache(config) as cache:
            model = ToyModel(cache.layout)
            system = [random.randrange(1000) for _ in range(5 * cache.block_size)]
            chats: dict[int, list[int]] = {}
            served = {tier: 0 for tier in cache.stats().tiers}
            for i in range(args.requests):
                chat = i % 4  # four conversations sharing a system prompt, interleaved
                user = [random.randrange(1000) for _ in range(args.user_tokens)]
                prompt = chats.get(chat, system) + user
                per_tier, chats[chat] = serve(cache, model, f"r{i}", prompt, decode=6)
                for tier, n in per_tier.items():
                    served[tier] = served.get(tier, 0) + n
            print(f"{args.requests} requests, every one's KV equal to a recompute")
            print(
                "tokens served from each tier: " + ", ".join(f"{t} {n}" for t, n in served.items())
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
