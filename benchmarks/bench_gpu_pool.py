"""Per-block cost of kvtier's GPU-pool bookkeeping, at two pool sizes.

Cases (µs per block, lower is better), for prompts of 4k, 32k and 128k tokens
(block size 16: 256, 2048 and 8192 blocks) and pools of 10k and 1M blocks:

- ``hash``: ``BlockHasher.hash_blocks`` of a whole prompt, given as a numpy uint32
  array and as a Python list. Ceiling: one raw ``xxh3_128_digest`` call per block
  over pre-built (16-byte parent + 64 token bytes). Pool-independent.
- ``lookup``: ``GPUBlockPool.lookup`` of a prompt whose blocks are all cached, with
  freshly made hash objects (as a new request's are). Ceiling: a raw ``dict.get``
  loop over the same keys in a plain dict of the pool's size.
- ``allocate``: ``GPUBlockPool.allocate(n)`` from a pool full of cached free blocks,
  so every block is an eviction (hook set to a no-op); ``allocate ... empty``: from an
  empty pool.
- ``free``: ``GPUBlockPool.free`` of a request's published blocks.
- ``append``: decode after the prompt: ``BlockManager.allocate(req, 1)`` +
  ``commit(req, tokens)`` once per token for 64 blocks (16 calls per block).
  Informational, no target.
- ``cycle``: a cold request without hashing: lookup (miss), allocate (evicting),
  publish with precomputed hashes, free.
- ``record``: with ``--eviction reuse`` only: ``UseCounts.record`` of a prompt's hashes
  (what a request adds to the use counts, once). Informational, no target.
- ``scaling OP PROMPT 1M/10k``: the 1M-block figure over the 10k-block one; the
  bookkeeping should cost the same per block whatever the pool size (<= 1.5x).

``--eviction reuse`` runs the pool cases with the reuse policy (``kvtier.eviction``): each
pool ranks by use counts of twice its size in which every other filling request's
blocks were used twice, so both of its queues hold blocks.

The KV layout is one byte per token so that a 1M-block pool fits anywhere: this
measures bookkeeping, not memory traffic. Each repetition rebuilds the state it
consumes (refills the pool, republishes blocks) outside the timed region. Pools are
filled as a stream of requests and then churned once (every block evicted and reused),
so they and the process heap are in a server's steady state. Hashing is measured
before any pool exists. Cases run in rounds, each round taking a few samples of every
case with the 10k and 1M pools side by side, so that a machine whose speed drifts
(shared cores) skews no comparison.

    python benchmarks/bench_gpu_pool.py [--quick] [--eviction reuse] [--out FILE.json]
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from _report import Result, measure_samples, report_cpu_run, standard_args, summarize
from kvtier._core import UseCounts

from kvtier.block_manager import BlockManager
from kvtier.gpu_pool import GPUBlockPool
from kvtier.hashing import HASH_NBYTES, BlockHasher, get_digest, namespace_root
from kvtier.layout import KVLayout
from kvtier.progress import progress

BENCHMARK = "bench_gpu_pool"
BLOCK_SIZE = 16
LAYOUT = KVLayout(1, 1, BLOCK_SIZE, 1, 1, torch.uint8)  # 16 B/block: bookkeeping only
PROMPTS = {"4k": 4 * 1024, "32k": 32 * 1024, "128k": 128 * 1024}  # tokens
POOLS = {"10k": 10_000, "1M": 1_000_000}  # blocks
DECODE_BLOCKS = 64  # blocks appended token by token in the ``append`` case
FILL_REQUEST = 2048  # blocks per request when filling a pool (a 32k-token prompt)
VOCAB = 128_000
UNIT = "µs/block"
METRIC = "time per block"
HASH_CEILING = "raw xxh3_128 over parent+tokens per block"
LOOKUP_CEILING = "raw dict.get loop over the same keys, dict of the pool's size"

TARGETS = {  # µs/block, on the value
    "hash": 0.25,
    "lookup": 0.3,
    "allocate": 0.25,
    "allocate empty": 0.25,
    "free": 0.15,
    "append": None,
    "cycle": 0.6,
    "record": None,
}
SCALING_TARGET = 1.5  # pool 1M over pool 10k, per block
POOL_OPS = ("lookup", "allocate", "allocate empty", "free", "append", "cycle")
REUSE_OPS = ("record",)

Fn = Callable[[Any], Any]


def _nothing() -> None:
    pass


def _no_op_hook(_: object) -> None:
    """The eviction hook: receives the victims, does nothing with them."""


def publish_chain(
    pool: GPUBlockPool, ids: list[int], hashes: list[bytes], first: int, parent: bytes
) -> int:
    """Publish ``hashes`` as blocks ``first...`` of one chain, as ``BlockManager.publish`` does."""
    return pool.publish(ids, hashes, range(first, first + len(ids)), [parent, *hashes[:-1]])


def _split(buf: bytes) -> list[bytes]:
    return [buf[i : i + HASH_NBYTES] for i in range(0, len(buf), HASH_NBYTES)]


@dataclass
class Case:
    """One timed operation: ``fn(setup())`` per repetition, per-block figures."""

    name: str
    op: str  # key of TARGETS, or "" for a ceiling
    prompt: str
    pool: str | None
    num_blocks: int  # what one call's time is divided by
    fn: Fn
    setup: Callable[[], Any]
    prepare: Callable[[], None] = _nothing  # before each round's samples, untimed
    finish: Callable[[], None] = _nothing  # after them, untimed
    ceiling: str | None = None  # name of the case that is this one's ceiling
    ceiling_what: str | None = None
    metric: str = METRIC
    samples: list[float] = field(default_factory=list)

    def per_block(self) -> tuple[float, float, float]:
        med, lo, hi = summarize(self.samples)
        return med * 1e6 / self.num_blocks, lo * 1e6 / self.num_blocks, hi * 1e6 / self.num_blocks


class Bench:
    """The pools, the inputs and the cases of one run."""

    def __init__(self, quick: bool, eviction: str) -> None:
        # rounds x samples per round; 4k prompts (cheap, noisier) take 4x the samples.
        self.rounds, self.per_round = (3, 3) if quick else (10, 5)
        self.eviction = eviction
        self.uses: dict[int, UseCounts] = {}  # reuse: each pool's, by id(pool)
        self.rng = np.random.default_rng(20240601)
        self.root = namespace_root("bench-model", LAYOUT.fingerprint)
        self.hasher = BlockHasher(self.root, BLOCK_SIZE)
        self.prompts = {
            name: self.rng.integers(0, VOCAB, n, dtype=np.uint32) for name, n in PROMPTS.items()
        }
        self.cases: list[Case] = []
        self._req_ids = itertools.count()

    # ------------------------------------------------------------- helpers
    def fresh_hashes(self, n: int) -> list[bytes]:
        """``n`` new random 16-byte hash objects (their str-hash not yet computed)."""
        return _split(self.rng.bytes(HASH_NBYTES * n))

    def republish_and_free(self, pool: GPUBlockPool, ids: list[int]) -> None:
        """Give in-use unhashed ``ids`` new hashes and free them: they become cached free."""
        publish_chain(pool, ids, self.fresh_hashes(len(ids)), 0, self.root)
        pool.free(ids)

    def pool(self, num_blocks: int) -> GPUBlockPool:
        """An empty pool evicting by the run's policy (reuse: with use counts of its own)."""
        if self.eviction == "lru":
            return GPUBlockPool(num_blocks, LAYOUT, "cpu", on_evict=_no_op_hook)
        uses = UseCounts(2 * num_blocks)
        pool = GPUBlockPool(num_blocks, LAYOUT, "cpu", _no_op_hook, "reuse", uses)
        self.uses[id(pool)] = uses
        return pool

    def fill(self, pool: GPUBlockPool) -> None:
        """Make every free block of the pool a cached free block.

        Filled as a stream of finished requests of ``FILL_REQUEST`` blocks (allocate,
        publish, free), so that the eviction order and the cache map's insertion order
        look like a server's, not like one giant request's. Under reuse every other
        request's blocks count two uses.
        """
        uses = self.uses.get(id(pool))
        for i in itertools.count():
            if pool.num_free <= pool.num_cached:
                return
            ids = pool.allocate(min(FILL_REQUEST, pool.num_free - pool.num_cached))
            hashes = self.fresh_hashes(len(ids))
            if uses is not None and i % 2:
                uses.record(hashes)
                uses.record(hashes)
            publish_chain(pool, ids, hashes, 0, self.root)
            pool.free(ids)

    def churn(self, pool: GPUBlockPool) -> None:
        """Reuse every block of a full pool once, as a stream of cold requests.

        Brings the pool (and the process heap, where hash objects live) from "just
        filled" to the steady state of a server that has been evicting for a while.
        """
        for _ in range(-(-pool.num_blocks // FILL_REQUEST)):
            self.republish_and_free(pool, pool.allocate(FILL_REQUEST))

    @staticmethod
    def check_full(pool: GPUBlockPool) -> None:
        assert pool.num_free == pool.num_cached == pool.num_blocks, "pool not full of cached"

    def add(self, case: Case) -> None:
        self.cases.append(case)

    # ------------------------------------------------------------- cases
    def add_hash(self, prompt: str) -> None:
        tokens = self.prompts[prompt]
        nb = len(tokens) // BLOCK_SIZE
        hashes = self.hasher.hash_blocks(tokens)
        data = tokens.tobytes()
        step = 4 * BLOCK_SIZE
        parents = [self.root, *hashes[:-1]]
        blobs = [parents[i] + data[i * step : (i + 1) * step] for i in range(nb)]
        digest = get_digest("xxh3_128")
        assert list(map(digest, blobs)) == hashes
        as_list = tokens.tolist()
        assert self.hasher.hash_blocks(as_list) == hashes
        raw = f"raw hash {prompt}"
        self.add(Case(raw, "", prompt, None, nb, lambda b: list(map(digest, b)), lambda: blobs))
        for kind, arg in (("array", tokens), ("list", as_list)):
            self.add(
                Case(
                    f"hash {prompt} tokens {kind}",
                    "hash",
                    prompt,
                    None,
                    nb,
                    self.hasher.hash_blocks,
                    lambda arg=arg: arg,
                    ceiling=raw,
                    ceiling_what=HASH_CEILING,
                )
            )

    def add_allocate_empty(self, pool: GPUBlockPool, prompt: str, pool_name: str) -> None:
        nb = PROMPTS[prompt] // BLOCK_SIZE
        held: list[list[int]] = []

        def setup() -> int:
            while held:
                pool.free(held.pop())  # unhashed: back to the empty stack
            assert pool.num_free == pool.num_blocks and pool.num_cached == 0
            return nb

        self.add(
            Case(
                f"allocate {prompt} tokens pool {pool_name} empty",
                "allocate empty",
                prompt,
                pool_name,
                nb,
                lambda n: held.append(pool.allocate(n)),
                setup,
                finish=setup,
            )
        )

    def add_lookup(self, pool: GPUBlockPool, prompt: str, pool_name: str) -> None:
        tokens = self.prompts[prompt]
        nb = len(tokens) // BLOCK_SIZE
        hashes = self.hasher.hash_blocks(tokens)
        joined = b"".join(hashes)

        def copies() -> list[bytes]:
            return _split(joined)  # new objects, as a new request's hashes are

        def prepare() -> None:
            """(Re)publish the prompt if other cases evicted (a tail of) it, as a request would."""
            hit = pool.lookup(hashes)
            k = len(hit)
            if k < nb:
                pool.touch(hit)  # pin the surviving prefix while the rest is allocated
                ids = pool.allocate(nb - k)
                publish_chain(pool, ids, hashes[k:], k, hashes[k - 1] if k else self.root)
                pool.free(hit + ids)
            self.check_full(pool)
            assert len(pool.lookup(copies())) == nb

        # Ceiling: a plain dict of the pool's size holding the same keys, inserted first
        # (so they have the shortest probe sequences: the best a dict can do).
        raw_map = dict(zip(hashes, range(nb)))
        raw_map.update(dict.fromkeys(self.fresh_hashes(pool.num_blocks - nb), 0))

        def raw_lookup(keys: list[bytes]) -> None:
            get = raw_map.get
            out = []
            for h in keys:
                b = get(h)
                if b is None:
                    break
                out.append(b)

        raw = f"raw lookup {prompt} {pool_name}"
        self.add(Case(raw, "", prompt, pool_name, nb, raw_lookup, copies))
        self.add(
            Case(
                f"lookup {prompt} tokens pool {pool_name}",
                "lookup",
                prompt,
                pool_name,
                nb,
                pool.lookup,
                copies,
                prepare=prepare,
                ceiling=raw,
                ceiling_what=LOOKUP_CEILING,
            )
        )

    def add_allocate(self, pool: GPUBlockPool, prompt: str, pool_name: str) -> None:
        nb = PROMPTS[prompt] // BLOCK_SIZE
        held: list[list[int]] = []

        def setup() -> int:
            while held:
                self.republish_and_free(pool, held.pop())
            self.check_full(pool)
            return nb

        self.add(
            Case(
                f"allocate {prompt} tokens pool {pool_name}",
                "allocate",
                prompt,
                pool_name,
                nb,
                lambda n: held.append(pool.allocate(n)),
                setup,
                finish=setup,
            )
        )

    def add_free(self, pool: GPUBlockPool, prompt: str, pool_name: str) -> None:
        nb = PROMPTS[prompt] // BLOCK_SIZE

        def setup() -> list[int]:
            self.check_full(pool)
            ids = pool.allocate(nb)
            publish_chain(pool, ids, self.fresh_hashes(nb), 0, self.root)
            return ids

        self.add(
            Case(
                f"free {prompt} tokens pool {pool_name}",
                "free",
                prompt,
                pool_name,
                nb,
                pool.free,
                setup,
                finish=lambda: self.check_full(pool),
            )
        )

    def add_cycle(self, pool: GPUBlockPool, prompt: str, pool_name: str) -> None:
        nb = PROMPTS[prompt] // BLOCK_SIZE
        root = self.root
        hits: list[int] = []

        def cycle(hashes: list[bytes]) -> None:
            hit = pool.lookup(hashes)
            k = len(hit)
            ids = pool.allocate(len(hashes) - k)
            publish_chain(pool, ids, hashes[k:], k, hashes[k - 1] if k else root)
            pool.free(ids)
            hits.append(k)

        def setup() -> list[bytes]:
            self.check_full(pool)
            return self.fresh_hashes(nb)

        def finish() -> None:
            assert not any(hits), "a cold request hit"
            self.check_full(pool)

        self.add(
            Case(
                f"cycle {prompt} tokens pool {pool_name}",
                "cycle",
                prompt,
                pool_name,
                nb,
                cycle,
                setup,
                finish=finish,
            )
        )

    def add_record(self, pool: GPUBlockPool, prompt: str, pool_name: str) -> None:
        nb = PROMPTS[prompt] // BLOCK_SIZE
        self.add(
            Case(
                f"record {prompt} tokens pool {pool_name}",
                "record",
                prompt,
                pool_name,
                nb,
                self.uses[id(pool)].record,
                lambda: self.fresh_hashes(nb),
            )
        )

    def add_append(self, pool: GPUBlockPool, prompt: str, pool_name: str) -> None:
        manager = BlockManager(pool, self.hasher)
        num_prompt = PROMPTS[prompt]
        live: list[object] = []

        def release() -> None:
            while live:
                req = live.pop()
                published = manager.request(req).num_published
                assert published == num_prompt // BLOCK_SIZE + DECODE_BLOCKS
                manager.free(req)
            self.check_full(pool)

        def setup() -> tuple[object, list[int], list[int]]:
            release()
            req = next(self._req_ids)
            tokens = self.rng.integers(0, VOCAB, num_prompt).tolist()
            manager.allocate(req, num_prompt)
            manager.commit(req, tokens)
            live.append(req)
            decode = self.rng.integers(0, VOCAB, DECODE_BLOCKS * BLOCK_SIZE).tolist()
            return req, tokens, decode

        def append(arg: tuple[object, list[int], list[int]]) -> None:
            req, tokens, decode = arg
            allocate, commit, push = manager.allocate, manager.commit, tokens.append
            for tok in decode:
                push(tok)
                allocate(req, 1)
                commit(req, tokens)

        self.add(
            Case(
                f"append {prompt} tokens pool {pool_name}",
                "append",
                prompt,
                pool_name,
                DECODE_BLOCKS,
                append,
                setup,
                finish=release,
                metric=f"{METRIC}, decoding {DECODE_BLOCKS} blocks one token at a time",
            )
        )

    def run(self) -> None:
        """Hashing first (it needs no pool), then the pools' cases."""
        for prompt in PROMPTS:
            self.add_hash(prompt)
        self.run_rounds(self.cases, "hash")
        hashing = len(self.cases)
        self.add_pool_cases()
        self.run_rounds(self.cases[hashing:], "pools")

    def add_pool_cases(self) -> None:
        """Create the pools and their cases; 10k and 1M variants of a case sit side by side."""
        empty, full = {}, {}
        for name, n in POOLS.items():
            empty[name], full[name] = self.pool(n), self.pool(n)
            self.fill(full[name])
            self.churn(full[name])
            self.check_full(full[name])
        cases = [
            self.add_lookup,
            self.add_allocate,
            self.add_allocate_empty,
            self.add_free,
            self.add_append,
            self.add_cycle,
        ]
        if self.eviction == "reuse":
            cases.append(self.add_record)
        for prompt in PROMPTS:
            for add in cases:
                for name in POOLS:
                    pools = empty if add == self.add_allocate_empty else full
                    add(pools[name], prompt, name)

    def run_rounds(self, cases: list[Case], what: str) -> None:
        steps = [(r, c) for r in range(self.rounds) for c in cases]
        for _, case in progress(steps, desc=f"{BENCHMARK} {what}"):
            repeats = self.per_round * (4 if PROMPTS[case.prompt] <= 4096 else 1)
            case.prepare()
            case.samples += measure_samples(case.fn, repeats, warmup=1, setup=case.setup)
            case.finish()

    # ------------------------------------------------------------- results
    def results(self) -> list[Result]:
        by_name = {c.name: c for c in self.cases}
        rows: list[Result] = []
        for case in self.cases:
            if not case.op:
                continue  # a ceiling: reported in its case's row
            value, lo, hi = case.per_block()
            target = TARGETS[case.op]
            ceiling = by_name[case.ceiling].per_block()[0] if case.ceiling else None
            rows.append(
                Result(
                    case=case.name,
                    metric=case.metric,
                    unit=UNIT,
                    value=value,
                    min=lo,
                    max=hi,
                    ceiling=ceiling,
                    ceiling_what=case.ceiling_what,
                    target=target,
                    target_kind="value" if target is not None else None,
                    higher_is_better=False,
                )
            )
        ops, pools, prompts = ["hash", *POOL_OPS, *REUSE_OPS], [None, *POOLS], list(PROMPTS)
        order = {  # table order: operation, pool, prompt (cases were built prompt first)
            c.name: (ops.index(c.op), pools.index(c.pool), prompts.index(c.prompt))
            for c in self.cases
            if c.op
        }
        rows.sort(key=lambda r: order[r.case])
        return rows + self.scaling()

    def scaling(self) -> list[Result]:
        """1M-block over 10k-block per-block cost, per operation and prompt size."""
        small, large = POOLS
        per = {(c.op, c.prompt, c.pool): c.per_block() for c in self.cases if c.op and c.pool}
        rows = []
        for op in (*POOL_OPS, *REUSE_OPS) if self.eviction == "reuse" else POOL_OPS:
            for prompt in PROMPTS:
                a, b = per[(op, prompt, small)], per[(op, prompt, large)]
                rows.append(
                    Result(
                        case=f"scaling {op} {prompt} tokens {large}/{small}",
                        metric=f"{METRIC}, pool {large} over pool {small}",
                        unit="ratio",
                        value=b[0] / a[0],
                        min=b[1] / a[2],  # the widest the two ranges allow
                        max=b[2] / a[1],
                        target=SCALING_TARGET,
                        target_kind="value",
                        higher_is_better=False,
                    )
                )
        return rows


def main() -> int:
    parser = standard_args(__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--eviction", choices=["lru", "reuse"], default="lru", help="the pools' policy"
    )
    args = parser.parse_args()
    bench = Bench(args.quick, args.eviction)
    load_before = os.getloadavg()[0]
    bench.run()
    details = (
        f"--eviction {args.eviction}; {bench.rounds} rounds x {bench.per_round} samples "
        f"(x4 for 4k prompts), each after 1 warm-up"
    )
    report_cpu_run(BENCHMARK, args.quick, details, bench.results(), args.out, load_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
