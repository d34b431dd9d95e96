"""Replaying a published request trace through a real ``TieredCache``.

A trace line names a request's prompt by the chained ids of its 512-token blocks
(Mooncake's format: ``timestamp``, ``input_length``, ``output_length``, ``hash_ids``;
equal ids at position i mean equal prefixes up to and including block i). Each id
maps to a fixed pseudo-random run of 512 tokens (seeded by the id), so a prompt is
real token ids that kvtier hashes itself, and bytes really move through every tier
(the KV written is not a model's: this measures the cache, not a model).

The *ceiling* is the block hit rate of an unbounded cache under kvtier's rules: a
request can hit the full blocks an earlier request committed, never the block that
holds its own last token.

Latencies are not measured here: the cache's own ``stats()`` histograms (lookup,
prefetch, per-tier batches) cover the replay.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from kvtier.cache import TieredCache
from kvtier.config import KVTierConfig

TRACE_BLOCK = 512  # tokens per trace block


@dataclass(frozen=True)
class TraceRequest:
    """One line of a trace."""

    timestamp_ms: int
    input_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of a JSONL trace; ValueError naming the bad line."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                req = TraceRequest(
                    int(obj["timestamp"]), int(obj["input_length"]), tuple(obj["hash_ids"])
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a trace request ({e})") from None
            if req.input_length > len(req.hash_ids) * TRACE_BLOCK or req.input_length <= 0:
                raise ValueError(
                    f"{path}:{lineno}: input_length {req.input_length} does not fit "
                    f"{len(req.hash_ids)} blocks of {TRACE_BLOCK} tokens"
                )
            out.append(req)
    return out


class TraceTokens:
    """Deterministic tokens for trace block ids (memoised: ids repeat a lot)."""

    def __init__(self, vocab_size: int = 32000) -> None:
        self.vocab_size = vocab_size
        self._runs: dict[int, np.ndarray] = {}

    def block(self, hash_id: int) -> np.ndarray:
        run = self._runs.get(hash_id)
        if run is None:
            rng = np.random.default_rng(hash_id)
            run = self._runs[hash_id] = rng.integers(
                0, self.vocab_size, TRACE_BLOCK, dtype=np.uint32
            )
        return run

    def prompt(self, req: TraceRequest) -> np.ndarray:
        return np.concatenate([self.block(h) for h in req.hash_ids])[: req.input_length]


def distinct_blocks(requests: Iterable[TraceRequest]) -> int:
    """Trace blocks (of 512 tokens) that the requests name, each counted once."""
    return len({h for req in requests for h in req.hash_ids})


def sized_to_shares(
    config: KVTierConfig, requests: Sequence[TraceRequest], shares: Sequence[float]
) -> KVTierConfig:
    """``config`` with its GPU pool, host pool and, given a third share, disk tier holding
    ``shares`` percent of the trace's distinct blocks, each rounded down to whole trace
    blocks (the disk's capacity counts value bytes: chunk headers take a little of it);
    with two shares there is no disk tier. ValueError for a share that holds no trace
    block, or a tier the config lacks."""
    layout = config.layout
    if layout is None or TRACE_BLOCK % layout.block_size:
        raise ValueError("sizing tiers by shares needs a layout whose block_size divides 512")
    if len(shares) not in (2, 3):
        raise ValueError(f"expected 2 or 3 shares (GPU, host[, disk]), got {len(shares)}")
    distinct = distinct_blocks(requests)
    trace_blocks = [int(distinct * share / 100) for share in shares]
    for name, share, n in zip(("GPU", "host", "disk"), shares, trace_blocks):
        if n < 1:
            raise ValueError(f"the {name} share {share}% holds no block of {distinct} distinct")
    gpu, host, *disk = (n * (TRACE_BLOCK // layout.block_size) for n in trace_blocks)
    tiers = config.tiers
    if tiers.cpu is None or (disk and tiers.disk is None):
        raise ValueError("sizing tiers by shares needs a tiers.cpu (and for 3, tiers.disk) section")
    nbytes = layout.block_nbytes
    return replace(
        config,
        tiers=replace(
            tiers,
            gpu=replace(tiers.gpu, num_blocks=gpu, capacity=None),
            cpu=replace(tiers.cpu, capacity=host * nbytes),
            disk=replace(tiers.disk, capacity=disk[0] * nbytes) if disk else None,
            spill_order=(),
        ),
    )


def ceiling_hits(requests: Iterable[TraceRequest], block_size: int) -> list[int]:
    """Per request, the cache blocks an unbounded cache would hit (kvtier's rules)."""
    if TRACE_BLOCK % block_size:
        raise ValueError(f"block_size {block_size} must divide {TRACE_BLOCK}")
    committed: dict[int, int] = {}  # trace block id -> full cache blocks ever committed
    out = []
    for req in requests:
        out.append(prefix_hit(committed, req, block_size))
        for _, h, n in full_blocks(req, block_size):
            committed[h] = max(committed.get(h, 0), n)
    return out


def prefix_hit(committed: Mapping[int, int], req: TraceRequest, block_size: int) -> int:
    """Cache blocks ``req`` hits when ``committed`` gives the full cache blocks held of
    each trace block: the leading ones, never the block of its last token."""
    hit = 0
    for h in req.hash_ids:
        have = committed.get(h, 0)
        hit += have
        if have < TRACE_BLOCK // block_size:
            break
    return min(hit, (req.input_length - 1) // block_size)


def full_blocks(req: TraceRequest, block_size: int) -> Iterator[tuple[int, int, int]]:
    """(position, trace block id, full cache blocks) of each trace block ``req`` commits."""
    per_trace_block = TRACE_BLOCK // block_size
    full = req.input_length // block_size
    for t, h in enumerate(req.hash_ids):
        n = min(per_trace_block, full - t * per_trace_block)
        if n <= 0:
            break
        yield t, h, n


def next_uses(requests: Sequence[TraceRequest]) -> list[list[int]]:
    """For each request and each of its trace blocks, the index of the next request
    naming that block; ``len(requests)`` for a block never named again."""
    never = len(requests)
    out: list[list[int]] = [[] for _ in requests]
    seen: dict[int, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        ids = requests[i].hash_ids
        out[i] = [seen.get(h, never) for h in ids]
        for h in ids:
            seen[h] = i
    return out


def optimal_hits(requests: list[TraceRequest], capacity: int, block_size: int) -> int:
    """Cache blocks hit by the offline optimum: one cache of ``capacity`` cache blocks
    that, when full, evicts the trace block whose next use is farthest (Belady).

    It works in whole trace blocks (``TRACE_BLOCK // block_size`` cache blocks each)
    and counts hits as ``ceiling_hits`` does; with unbounded capacity it equals the
    ceiling. Every request's blocks are cached after it is served; the optimum may
    evict them at once (that is, not admit them).
    """
    per_trace_block = TRACE_BLOCK // block_size
    slots = capacity // per_trace_block
    next_use = next_uses(requests)
    committed: dict[int, int] = {}  # cached trace block -> full cache blocks it holds
    due: dict[int, int] = {}  # cached trace block -> its next use
    farthest: list[tuple[int, int]] = []  # (-next use, trace block), stale entries skipped
    hits = 0
    for i, req in enumerate(requests):
        hits += prefix_hit(committed, req, block_size)
        for t, h, n in full_blocks(req, block_size):
            committed[h] = max(committed.get(h, 0), n)
            due[h] = next_use[i][t]
            heapq.heappush(farthest, (-due[h], h))
        while len(due) > slots:
            neg, h = heapq.heappop(farthest)
            if due.get(h) == -neg:
                del due[h], committed[h]
    return hits


@dataclass(frozen=True)
class ReplaySample:
    """One served request: when it arrived, its prompt's blocks, the blocks it hit in
    each tier, and the blocks an unbounded cache would have hit."""

    timestamp_ms: int
    prompt_blocks: int
    hit_blocks: dict[str, int]
    ceiling_blocks: int


@dataclass(frozen=True)
class HitRateWindows:
    """Hit rates per time window of ``width_s`` seconds: ``start_s[i]`` (seconds into the
    trace) opens window ``i``; ``per_tier[t][i]`` and ``ceiling[i]`` are shares of the
    prompt blocks of the requests that arrived in it. Windows no request arrived in are
    left out."""

    width_s: float
    start_s: list[float]
    per_tier: dict[str, list[float]]
    ceiling: list[float]


@dataclass
class ReplayResult:
    """What a replay measured; block counts are cache blocks."""

    requests: int = 0
    prompt_blocks: int = 0
    hit_blocks: dict[str, int] = field(default_factory=dict)  # per tier
    ceiling_blocks: int = 0
    skipped: int = 0  # requests the GPU pool could not hold
    served: list[int] = field(default_factory=list)  # indices of the served requests
    samples: list[ReplaySample] = field(default_factory=list)  # per served request

    @property
    def hit_rate(self) -> float:
        return sum(self.hit_blocks.values()) / max(self.prompt_blocks, 1)

    @property
    def ceiling(self) -> float:
        return self.ceiling_blocks / max(self.prompt_blocks, 1)

    def windows(self, count: int) -> HitRateWindows:
        """Hit rates in ``count`` equal time windows spanning the replayed requests."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        tiers = list(self.hit_blocks)
        if not self.samples:
            return HitRateWindows(0.0, [], {t: [] for t in tiers}, [])
        t0, t1 = self.samples[0].timestamp_ms, self.samples[-1].timestamp_ms
        width = max(t1 - t0, 1) / count
        prompt = [0] * count
        hits = {t: [0] * count for t in tiers}
        ceiling = [0] * count
        for s in self.samples:
            i = min(int((s.timestamp_ms - t0) / width), count - 1)
            prompt[i] += s.prompt_blocks
            ceiling[i] += s.ceiling_blocks
            for t, n in s.hit_blocks.items():
                hits[t][i] += n
        used = [i for i in range(count) if prompt[i]]
        return HitRateWindows(
            width / 1000,
            [i * width / 1000 for i in used],
            {t: [hits[t][i] / prompt[i] for i in used] for t in tiers},
            [ceiling[i] / prompt[i] for i in used],
        )


def replay(
    cache: TieredCache,
    requests: list[TraceRequest],
    progress_bar: Callable[[list[TraceRequest]], Iterable[TraceRequest]] | None = None,
) -> ReplayResult:
    """Serve every request in order (lookup, allocate, wait, commit, free).

    A request the GPU pool cannot hold is skipped and counted (and left out of the
    hit rate and of the ceiling).
    """
    bs = cache.block_size
    tokens = TraceTokens()
    ceiling = ceiling_hits(requests, bs)
    result = ReplayResult()
    items = progress_bar(requests) if progress_bar else requests
    for i, req in enumerate(items):
        prompt = tokens.prompt(req)
        rid = f"r{i}"
        hit = cache.lookup(rid, prompt)
        table = cache.allocate(rid, len(prompt) - hit.num_tokens, hit)
        if table is None:
            cache.free(rid)
            result.skipped += 1
            continue
        valid = cache.wait(rid)
        cache.commit(rid, prompt)
        cache.free(rid)
        loaded = valid // bs
        hit_blocks = {}
        for tier, n in hit.tokens_per_tier().items():  # in hierarchy order
            hit_blocks[tier] = min(n // bs, loaded)
            loaded -= hit_blocks[tier]
            result.hit_blocks[tier] = result.hit_blocks.get(tier, 0) + hit_blocks[tier]
        sample = ReplaySample(req.timestamp_ms, req.input_length // bs, hit_blocks, ceiling[i])
        result.samples.append(sample)
        result.served.append(i)
        result.requests += 1
        result.prompt_blocks += sample.prompt_blocks
        result.ceiling_blocks += sample.ceiling_blocks
    return result
