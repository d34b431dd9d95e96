"""Chunk put/get throughput of kvtier's LMDB and Redis tiers against raw lmdb / redis-py.

Every batch is one 4k-token prompt: 256 blocks of ``LAYOUT`` (32 KiB per block, 8 MiB
per batch), cut into chunks of 1, 8 and 32 blocks (256, 32 and 8 values of 32 KiB,
256 KiB and 1 MiB). Throughput is value bytes (header included) per second, GB = 1e9.

Cases, for each tier (``lmdb``, ``redis``) and chunk size C:

- ``TIER put chunk C``: what the cache does when it spills a batch: ``ChunkCodec.encode``
  of every chunk from (scattered) host-slab rows, then, as the spill manager's I/O
  worker does, the write: for ``lmdb`` (write-back: chunks offered on eviction)
  ``sizes_many`` of the keys and ``put_many`` of the absent ones (all); for ``redis``
  (write-through: chunks just completed) ``put_many(only_new=True)``.
  Ceiling: the same value bytes written raw: one lmdb write transaction of ``txn.put``
  (an environment opened with the tier's flags: ``sync=False, metasync=False,
  writemap=False``), or one redis-py ``pipeline(transaction=False)`` of SET.
  Target: >= 0.7 of the ceiling for chunks of 8+ blocks (informational for chunk 1).
  ``... vs raw on a write worker``: the same samples against the same raw write run
  on a worker thread, as the cache's writes are (one ``ThreadPoolExecutor`` worker, the
  caller waiting for it), sampled alongside: how much of the gap is the thread rather
  than kvtier (informational). On a small machine that also runs the Redis server, the
  scheduler often puts a freshly woken worker on the server's core. Measured on a
  2-core VM, chunk 32, medians of 40 puts of 8 MiB: with the benchmark pinned to one
  core and the server to the other (``taskset``), the write worker's ``put_many`` took
  within 6% of the raw pipeline's ``execute`` (3.39-3.51 vs 3.31-3.35 ms); unpinned,
  18-19% longer. What is left of the gap when pinned is the checksum (encode
  2.06-2.22 ms vs the raw gather's 1.55-1.58), the hook, and the hand-offs to the
  encoder, to the write worker and back (~0.55 ms together). The sharing costs any
  thread, raw or not: with the server pinned to core 1 and the main thread to core 0,
  the raw put of chunk 32 (gather and pipeline) took 2.75-3.24 ms from a worker
  pinned to core 0 and 4.17-7.50 ms from one pinned to core 1 (medians of 60, three
  runs). Full runs with the server on core 1 and the benchmark on core 0 (so LMDB
  loses its second core): ``redis put chunk 32`` 0.745-0.839, ``chunk 8`` 0.795-0.810;
  unpinned, the same day, 0.654-0.716 and 0.688-0.742.
  ``... put_many only``: the tier call alone, values encoded beforehand (informational).
  ``... hook``: µs of each timed put spent in the host pool's hook, holding the cache's
  lock (informational): an eviction's encode, or a write-through's pinning of slots
  for the encoder thread.
- ``TIER get chunk C``: ``SpillManager.load`` of the batch (the run its ``lookup``
  returns) into 256 scattered host-slab slots: one ``tier.get_many`` whose sink checks
  every value (header, and the xxh3 checksum while the codec's copier scatters its
  blocks into the slots: two cores). Ceiling: the same values read raw (an lmdb read
  transaction of ``get`` with ``buffers=True``, or a redis-py pipeline of GET) and
  their blocks copied, unchecked, into the same slots (a numpy scatter per value, as
  the decode ceiling does). Target as for put. ``... get_many only``: the tier call
  alone, its sink copying each value's blocks into the same slots as the raw reader
  does (informational). As all three write the same bytes into the same slots, the
  load's own result is checked after each batch of samples by one more load, untimed,
  into cleared slots.
  Why the same slots: the raw reader used to copy each value whole into an 8 MiB
  staging buffer of its own, which ``get_many only`` wrote again just before every raw
  sample, so the raw copy always found its destination in the CPU cache, where the
  load never finds its slots (it writes them with streaming stores, which bypass the
  cache), and a copy into a cached buffer is no limit a load into slots can reach.
  Raw still runs right after ``get_many only``, which leaves the slots in the cache:
  the ceiling keeps that advantage (and ``get_many only``, which runs right after the
  load, reads below 1.0 for it).
- ``TIER lookup chunk C 4k tokens``: ``SpillManager.lookup`` of the prompt's 256 block
  hashes (all stored), in µs; ceiling: the raw existence check of the same 256 keys
  (one lmdb read transaction of ``get``, one pipeline of EXISTS). ``redis lookup chunk
  C 4k tokens round trips``: ``RedisTier.round_trips`` per lookup (the most any timed
  lookup took); target <= 1.
- ``encode chunk C`` / ``decode chunk C``: the codec alone, no tier: encode every
  chunk of the batch from slab rows with one ``encode_many``, keeping the values
  until the batch is done, as the put path does (ceiling: ``np.take`` of the same
  rows into new arrays, kept likewise), and check + scatter every value as the load
  sink does (``read_header``, ``scatter``; ceiling: the same payloads scattered into
  the same slab rows with numpy, unchecked). Both run on two cores (the codec's
  copier copies while the calling thread hashes); every ceiling runs on one.

Puts write keys the store does not hold (each repetition first deletes them, untimed),
into stores that hold the get batches of every chunk size. Gets read stored values
again and again (hot: the LMDB map lives in the page cache). The LMDB environments live
in a fresh temporary directory (in /dev/shm when there is one), deleted at the end;
Redis keys carry a unique prefix and are deleted at the end. The Redis tier runs with
the config's default ttl (SET ... PX, GETEX ... PX), the raw pipeline without.

Memory: unless ``--malloc-default`` is given, glibc is told to keep freed memory for
reuse (``mallopt`` trim threshold 1 GiB, mmap threshold 32 MiB). Otherwise whether a
call's fresh 8 MiB (encoded values, LMDB's dirty pages, redis-py's reply buffers)
costs 2048 page faults depends on what sits at the top of the heap, which flips between
otherwise equal cases; on a VM a fault can cost several µs (the output measures it),
more than the copy it precedes. The output also gives each main case's median page
faults per call, and its ceiling's; with a Redis server on this machine, also the
server's during each Redis case: it faults in fresh pages when its allocator has no
freed ones at hand, and which case that hits, kvtier's or raw, varies from run to
run (a put of 8 MiB that faults them all in ran ~1.5x as long).

Cases run in rounds, each round taking a few samples of every case with kvtier and
raw cases side by side, so machine noise (shared cores, the Redis server on the same
machine) hits both alike. Figures are medians; min and max are over all samples.

    python benchmarks/bench_tiers.py [--quick] [--out FILE.json] [--redis-url URL]
                                     [--malloc-default]
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import redis
import torch
from _report import (
    Result,
    machine_info,
    measure_samples,
    print_table,
    standard_args,
    summarize,
    write_json,
)

from kvtier.chunk import ChunkCodec, byte_rows
from kvtier.config import RedisTierConfig
from kvtier.host_pool import HostPool
from kvtier.layout import KVLayout
from kvtier.progress import progress
from kvtier.spill import ChunkRef, SpillManager, SpillRun
from kvtier.tiers.base import Buffer, SpillTier
from kvtier.tiers.lmdb import ENV_OPTIONS, LMDBTier
from kvtier.tiers.redis import RedisTier

BENCHMARK = "bench_tiers"
LAYOUT_ARGS = dict(num_layers=4, kv_factor=2, block_size=16, num_kv_heads=2, head_dim=64)
DTYPE = torch.float16
PROMPT_TOKENS = 4096
CHUNKS = (1, 8, 32)  # blocks per chunk
TARGET_RATIO = 0.7  # of the raw ceiling, for chunks of TARGET_MIN_CHUNK+ blocks
TARGET_MIN_CHUNK = 8
ROUND_TRIP_TARGET = 1
LMDB_CAPACITY = 1 << 30  # never reached: nothing is evicted
LMDB_MAP_SIZE = 256 << 20  # big enough that no map resize happens while timing
GB = 1e9

PUT_CEILING = {
    "lmdb": "raw lmdb: one write txn of txn.put of each value gathered from the same slab "
    "rows (np.take) as it is put",
    "redis": "raw redis-py pipeline(transaction=False) of SET of the values gathered from "
    "the same slab rows (np.take)",
}
PUT_PREBUILT_CEILING = {
    "lmdb": "raw lmdb: one write txn of txn.put of the same values, prebuilt",
    "redis": "raw redis-py pipeline(transaction=False) of SET of the same values, prebuilt",
}
GET_CEILING = {
    "lmdb": "raw lmdb: one read txn of get(buffers=True) + numpy scatter of each value's "
    "blocks into the same slab slots",
    "redis": "raw redis-py pipeline of GET + numpy scatter of each value's blocks into the "
    "same slab slots",
}
LOOKUP_CEILING = {
    "lmdb": "raw lmdb: one read txn of get of the same 256 keys",
    "redis": "raw redis-py pipeline of EXISTS of the same 256 keys",
}
ENCODE_CEILING = "np.take of the same slab rows into new arrays (kept until the batch is done)"
DECODE_CEILING = "numpy scatter of the same payloads into the same slab rows, unchecked"


LAYOUT = KVLayout(dtype=DTYPE, **LAYOUT_ARGS)
BLOCKS = PROMPT_TOKENS // LAYOUT.block_size  # blocks per batch (one prompt)


@dataclass
class Case:
    """One timed operation; ``kind`` says how its samples become a figure."""

    name: str
    fn: Callable[[Any], Any]
    setup: Callable[[], Any]
    kind: str  # "throughput" (nbytes per call), "time" (µs per call), "raw"
    nbytes: int = 0
    ceiling: str | None = None  # name of the raw case that is this case's ceiling
    ceiling_what: str | None = None
    target: float | None = None
    samples: list[float] = field(default_factory=list)
    check: Callable[[], None] = lambda: None  # runs after each batch of samples
    faults: list[int] = field(default_factory=list)  # minor page faults of each call
    server: Callable[[], int] | None = None  # the Redis server's page faults so far
    server_faults: list[int] = field(default_factory=list)  # ... during each call
    # A raw case sampled in the group of the cases before it, alternating with them.
    joins_group: bool = False
    worker_ceiling: str | None = None  # the raw case run on a worker thread, if any
    hook: Callable[[], float] | None = None  # seconds the last call spent in the spill hook
    hook_samples: list[float] = field(default_factory=list)  # ... of each timed call

    def timed(self, arg: Any) -> None:
        """``fn(arg)``, counting the page faults it takes (a fresh page costs µs), and the
        Redis server's (when ``server`` can count them)."""
        server = self.server() if self.server else 0
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.fn(arg)
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        if self.server:
            self.server_faults.append(self.server() - server)


@dataclass
class Prompt:
    """One batch: a prompt's 256 blocks cut into chunks of ``c`` blocks."""

    c: int
    hashes: list[bytes]
    chunks: list[ChunkRef]
    keys: list[bytes]
    slots: list[list[int]]  # host-slab rows of each chunk's blocks (encode's source)
    values: list[memoryview]  # the encoded chunks
    nbytes: int


class Bench:
    def __init__(self, quick: bool, redis_url: str) -> None:
        self.quick = quick
        self.rounds, self.per_round = (3, 3) if quick else (10, 6)
        self.rng = np.random.default_rng(20240611)
        self.codec = ChunkCodec(LAYOUT)
        # Slab rows [0, BLOCKS): the spill source; [BLOCKS, 2 * BLOCKS): load's targets.
        # Every slot is allocated (in use), so nothing evicts or reuses them.
        self.host = HostPool(2 * BLOCKS, LAYOUT, pin_memory=False)
        self.host.allocate(2 * BLOCKS)
        self.rows = byte_rows(self.host.slab)
        self.rows[:BLOCKS] = self.rng.integers(0, 256, self.rows[:BLOCKS].shape, dtype=np.uint8)
        self.dst = [int(s) for s in BLOCKS + self.rng.permutation(BLOCKS)]
        # The chain every put case spills: published in scattered slots of [0, BLOCKS),
        # as a host pool holds a prompt's blocks. Each chunk size has its own stores.
        self.put_hashes = [self.rng.bytes(16) for _ in range(BLOCKS)]
        self.put_slots = [int(s) for s in self.rng.permutation(BLOCKS)]
        parents = [self.rng.bytes(16), *self.put_hashes[:-1]]
        self.host.publish(self.put_slots, self.put_hashes, range(BLOCKS), parents)
        self.cases: list[Case] = []
        self.round_trips: dict[int, list[int]] = {}
        self.tag = f"kvtier-bench-{uuid.uuid4().hex[:12]}"
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{self.tag}-", dir=_tmp_base()))
        self.lmdb_tiers: list[LMDBTier] = []
        self.raw_envs: list[lmdb.Environment] = []
        self.redis_tiers: list[RedisTier] = []
        self.redis_url = redis_url
        self.raw_redis: redis.Redis | None = None
        self.raw_redis_keys: list[bytes] = []
        self.redis_error: str | None = None
        self.server_stat: int | None = None  # fd of the local Redis server's /proc stat
        self.raw_writer = ThreadPoolExecutor(1, thread_name_prefix="raw-writer")

    # ------------------------------------------------------------- data
    def prompt(self, c: int, published: bool = False) -> Prompt:
        """A prompt in chunks of ``c``, its blocks in scattered slab slots: the chain
        published in the host pool (``published``, what the put cases spill), or one
        with fresh hashes."""
        if published:
            hashes, src = self.put_hashes, self.put_slots
        else:
            hashes = [self.rng.bytes(16) for _ in range(BLOCKS)]
            src = [int(s) for s in self.rng.permutation(BLOCKS)]
        chunks = [ChunkRef(hashes[k + c - 1], k, c) for k in range(0, BLOCKS, c)]
        slots = [src[ch.start : ch.start + c] for ch in chunks]
        values = [self.codec.encode(ch.key, ch.start, self.rows, s) for ch, s in zip(chunks, slots)]
        nbytes = sum(len(v) for v in values)
        return Prompt(c, hashes, chunks, [ch.key for ch in chunks], slots, values, nbytes)

    def manager(self, tier: SpillTier, write_through: bool) -> SpillManager:
        """The cache's spill manager over ``tier`` alone, with one write worker."""
        through = [tier.name] if write_through else []
        return SpillManager(
            [tier], through, self.host, threading.Lock(), write_workers=1, max_pending_bytes=1 << 30
        )

    def gather(self, p: Prompt) -> Callable[[int], np.ndarray]:
        """``gather(i)``: value i of ``p`` built raw from the slab: its header bytes
        copied, its blocks gathered from their slots with one ``np.take`` (lmdb and
        redis-py take one buffer per value, so scattered rows must be gathered)."""
        hlen, bn, rows = self.codec.header_nbytes, LAYOUT.block_nbytes, self.rows
        headers = [np.frombuffer(v[:hlen], dtype=np.uint8) for v in p.values]
        idx = [np.asarray(s, dtype=np.intp) for s in p.slots]

        def gather(i: int) -> np.ndarray:
            buf = np.empty(hlen + len(idx[i]) * bn, dtype=np.uint8)
            buf[:hlen] = headers[i]
            np.take(rows, idx[i], axis=0, out=buf[hlen:].reshape(-1, bn), mode="clip")
            return buf

        return gather

    def deliver(self, p: Prompt) -> Callable[[int, Buffer], None]:
        """``deliver(i, value)``: the raw reader's copy of value i of ``p`` into the load's
        slots, its blocks where a load of ``p`` puts them (header skipped, unchecked)."""
        hlen, bn, rows = self.codec.header_nbytes, LAYOUT.block_nbytes, self.rows
        targets = [np.asarray(self.dst[ch.start : ch.start + p.c], np.intp) for ch in p.chunks]

        def deliver(i: int, value: Buffer) -> None:
            rows[targets[i]] = np.frombuffer(value, np.uint8, offset=hlen).reshape(-1, bn)

        return deliver

    def check_loaded(self, p: Prompt) -> None:
        """The load targets hold exactly the prompt's blocks."""
        src = [s for slots in p.slots for s in slots]
        assert np.array_equal(self.rows[self.dst], self.rows[src]), "loaded blocks differ"

    def open_lmdb(self, c: int) -> tuple[LMDBTier, lmdb.Environment, Any]:
        tier = LMDBTier(self.tmp / f"tier-{c}", LMDB_CAPACITY, c, map_size=LMDB_MAP_SIZE)
        self.lmdb_tiers.append(tier)
        env = lmdb.open(str(self.tmp / f"raw-{c}"), map_size=LMDB_MAP_SIZE, **ENV_OPTIONS)
        self.raw_envs.append(env)
        return tier, env, env.open_db(b"data")

    def open_redis(self, c: int) -> RedisTier | None:
        if self.redis_error is not None:
            return None
        if self.raw_redis is None:
            client = redis.Redis.from_url(self.redis_url, socket_timeout=5)
            try:
                client.ping()
            except (redis.RedisError, OSError) as e:
                self.redis_error = f"{type(e).__name__}: {e}"
                print(f"{BENCHMARK}: no Redis at {self.redis_url} ({e}); "
                      "skipping the Redis cases", file=sys.stderr)  # fmt: skip
                return None
            self.raw_redis = client
            self.server_stat = _open_server_stat(client)
        cfg = RedisTierConfig(url=self.redis_url, chunk_blocks=c, key_prefix=self.tag)
        tier = RedisTier.from_config(cfg, namespace=f"c{c}")
        self.redis_tiers.append(tier)
        return tier

    def raw_redis_key(self, key: bytes) -> bytes:
        """A raw key as long as the tier's, under this run's prefix."""
        k = f"{self.tag}:raw:".encode() + key.hex().encode()
        self.raw_redis_keys.append(k)
        return k

    # ------------------------------------------------------------- cases
    def add(self, case: Case) -> None:
        self.cases.append(case)

    def add_codec(self, c: int) -> None:
        p = self.prompt(c)
        codec, rows, hlen = self.codec, self.rows, self.codec.header_nbytes
        bn = LAYOUT.block_nbytes
        idx = [np.asarray(s, dtype=np.intp) for s in p.slots]

        # Both keep the whole batch alive until they return, as the put path does.
        def raw_encode(_: object) -> None:
            _ = [np.take(rows, i, axis=0) for i in idx]

        chunks = [(ch.key, ch.start, s) for ch, s in zip(p.chunks, p.slots)]

        def encode(_: object) -> None:
            _ = codec.encode_many(rows, chunks)

        values = [bytes(v) for v in p.values]  # what a Redis read hands the sink
        targets = [np.asarray(self.dst[ch.start : ch.start + c]) for ch in p.chunks]
        payloads = [np.frombuffer(v, np.uint8, offset=hlen).reshape(c, bn) for v in values]

        def raw_decode(_: object) -> None:
            for t, pl in zip(targets, payloads):
                rows[t] = pl

        slots = [self.dst[ch.start : ch.start + c] for ch in p.chunks]

        def decode(_: object) -> None:
            for ch, v, s in zip(p.chunks, values, slots):
                header, payload = codec.read_header(v, ch.key)
                if (header.first_position, header.num_blocks) != (ch.start, ch.num_blocks):
                    raise AssertionError("wrong chunk")
                codec.scatter(header, payload, rows, s, 0)

        def check() -> None:
            self.check_loaded(p)

        none = _none
        self.add(Case(f"raw encode chunk {c}", raw_encode, none, "raw", p.nbytes))
        self.add(
            Case(f"encode chunk {c}", encode, none, "throughput", p.nbytes,
                 f"raw encode chunk {c}", ENCODE_CEILING)
        )  # fmt: skip
        self.add(Case(f"raw decode chunk {c}", raw_decode, none, "raw", p.nbytes))
        self.add(
            Case(f"decode chunk {c}", decode, none, "throughput", p.nbytes,
                 f"raw decode chunk {c}", DECODE_CEILING, check=check)
        )  # fmt: skip

    def add_lmdb(self, c: int) -> None:
        tier, env, db = self.open_lmdb(c)
        put, get = self.prompt(c, published=True), self.prompt(c)
        # The get batch, stored in both stores.
        assert tier.put_many(list(zip(get.keys, get.values))) == len(get.keys)
        with env.begin(write=True, db=db) as txn:
            for k, v in zip(get.keys, get.values):
                txn.put(k, bytes(v))

        def delete_put_keys() -> None:
            tier.delete_many(put.keys)

        def raw_delete_put_keys() -> None:
            with env.begin(write=True, db=db) as txn:
                for k in put.keys:
                    txn.delete(k)

        gather = self.gather(put)

        def raw_put(_: object) -> None:
            with env.begin(write=True, db=db) as txn:
                for i, k in enumerate(put.keys):
                    txn.put(k, gather(i))

        prebuilt = [(k, bytes(v)) for k, v in zip(put.keys, put.values)]

        def raw_put_prebuilt(_: object) -> None:
            with env.begin(write=True, db=db) as txn:
                for k, v in prebuilt:
                    txn.put(k, v)

        deliver = self.deliver(get)

        def raw_get(_: object) -> None:
            with env.begin(db=db, buffers=True) as txn:
                for i, k in enumerate(get.keys):
                    deliver(i, txn.get(k))

        def raw_lookup(_: object) -> None:
            with env.begin(db=db, buffers=True) as txn:
                _ = [txn.get(h) is not None for h in get.hashes]

        self.add_tier_cases("lmdb", tier, put, get, raw_put, raw_put_prebuilt,
                            raw_delete_put_keys, delete_put_keys, raw_get, raw_lookup)  # fmt: skip

    def add_redis(self, c: int) -> None:
        tier = self.open_redis(c)
        if tier is None:
            return
        r = self.raw_redis
        assert r is not None
        put, get = self.prompt(c, published=True), self.prompt(c)
        assert tier.put_many(list(zip(get.keys, get.values))) == len(get.keys)
        raw_get_keys = [self.raw_redis_key(k) for k in get.keys]
        raw_put_keys = [self.raw_redis_key(k) for k in put.keys]
        raw_lookup_keys = [self.raw_redis_key(h) for h in get.hashes]
        pipe = r.pipeline(transaction=False)
        for k, v in zip(raw_get_keys, get.values):
            pipe.set(k, bytes(v))
        pipe.execute()

        tier_put_keys = [tier.redis_key(k) for k in put.keys]

        # Both delete with a synchronous DEL: the tier's UNLINK would leave the values to
        # Redis's lazy-free thread, which would then free them during the next sample.
        def delete_put_keys() -> None:
            r.delete(*tier_put_keys)

        def raw_delete_put_keys() -> None:
            r.delete(*raw_put_keys)

        gather = self.gather(put)

        def raw_put(_: object) -> None:
            pipe = r.pipeline(transaction=False)
            for i, k in enumerate(raw_put_keys):
                pipe.set(k, memoryview(gather(i)))
            pipe.execute()

        prebuilt = [(k, bytes(v)) for k, v in zip(raw_put_keys, put.values)]

        def raw_put_prebuilt(_: object) -> None:
            pipe = r.pipeline(transaction=False)
            for k, v in prebuilt:
                pipe.set(k, v)
            pipe.execute()

        deliver = self.deliver(get)

        def raw_get(_: object) -> None:
            pipe = r.pipeline(transaction=False)
            for k in raw_get_keys:
                pipe.get(k)
            for i, v in enumerate(pipe.execute()):
                deliver(i, v)

        def raw_lookup(_: object) -> None:
            pipe = r.pipeline(transaction=False)
            for k in raw_lookup_keys:
                pipe.exists(k)
            pipe.execute()

        self.add_tier_cases("redis", tier, put, get, raw_put, raw_put_prebuilt,
                            raw_delete_put_keys, delete_put_keys, raw_get, raw_lookup)  # fmt: skip
        if self.server_stat is not None:
            for case in self.cases:
                if case.name.startswith(("redis ", "raw redis ")):
                    case.server = self.server_faults_so_far

    def server_faults_so_far(self) -> int:
        """The local Redis server's minor page faults so far (``/proc/PID/stat``)."""
        assert self.server_stat is not None
        stat = os.pread(self.server_stat, 4096, 0)
        return int(stat.rsplit(b")", 1)[1].split()[7])  # minflt: the stat's 10th field

    def add_tier_cases(
        self,
        name: str,
        tier: SpillTier,
        put: Prompt,
        get: Prompt,
        raw_put: Callable[[Any], None],
        raw_put_prebuilt: Callable[[Any], None],
        raw_setup: Callable[[], None],
        setup: Callable[[], None],
        raw_get: Callable[[Any], None],
        raw_lookup: Callable[[Any], None],
    ) -> None:
        c = put.c
        # Redis is write-through by default (chunks go out as soon as they are complete in
        # the host pool), LMDB write-back (chunks go out when the host pool evicts them).
        write_through = name == "redis"
        manager = self.manager(tier, write_through)
        chain = self.host.cached_blocks(self.put_slots)  # in chain order
        tail_first = self.host.cached_blocks(self.put_slots[::-1])  # eviction order
        stored_only: list[int] = []
        encoded = list(zip(put.keys, put.values))

        hook = [0.0]  # seconds the last put spent in the hook

        def put_full(_: object) -> None:
            # What the cache runs: the host pool's hook (under the cache's lock) pins the
            # chunks' slots for the encoder thread (write-through) or encodes them (evicted
            # slots) and queues them; a write worker stores those the tier lacks. Done when
            # the worker is.
            start = time.perf_counter()
            if write_through:
                manager.on_host_publish(chain)
            else:
                manager.on_host_evict(tail_first)
            hook[0] = time.perf_counter() - start
            manager.flush()

        def check_put() -> None:
            """The last sample stored every chunk, bit-exact, and nothing failed."""
            stats = manager.stats()[tier.name]
            assert stats.errors == stats.dropped == 0, f"{name} put: {stats}"
            stored: list[bytes] = [b""] * len(put.keys)
            tier.get_many(put.keys, lambda i, v: stored.__setitem__(i, bytes(v)))
            assert stored == [bytes(v) for v in put.values], f"{name} put: values differ"

        def put_only(_: object) -> None:
            stored_only.append(tier.put_many(encoded))

        run = SpillRun(tier.name, 0, BLOCKS, tuple(get.chunks))
        assert manager.lookup(get.hashes, 0) == [run], "lookup does not find the stored batch"
        loaded: list[int] = []
        loaded_only: list[int] = []

        def load(_: object) -> None:
            result = manager.load([run], self.dst)
            loaded.append(result.num_blocks if not (result.bad or result.errors) else -1)

        def check_load() -> None:
            _expect(loaded, BLOCKS, "blocks loaded")()
            # The raw reader and get_many only write the same blocks into the same slots:
            # check one more load of its own, into cleared slots.
            self.rows[self.dst] = 0
            result = manager.load([run], self.dst)
            assert result.num_blocks == BLOCKS and not (result.bad or result.errors), result
            self.check_loaded(get)

        deliver = self.deliver(get)

        def get_only(_: object) -> None:
            loaded_only.append(BLOCKS if all(tier.get_many(get.keys, deliver)) else -1)

        trips = self.round_trips.setdefault(c, []) if name == "redis" else None

        found: list[bool] = []

        def lookup(_: object) -> None:
            before = getattr(tier, "round_trips", 0)
            runs = manager.lookup(get.hashes, 0)
            if trips is not None:
                trips.append(tier.round_trips - before)
            found.append(runs == [run])

        target = TARGET_RATIO if c >= TARGET_MIN_CHUNK else None
        n = put.nbytes
        add, thr = self.add, "throughput"
        raw = f"raw {name} put chunk {c}"
        on_worker = f"{raw} on a write worker"
        add(Case(raw, raw_put, raw_setup, "raw", n))
        add(Case(f"{name} put chunk {c}", put_full, setup, thr, n, raw, PUT_CEILING[name],
                 target, check=check_put, worker_ceiling=on_worker,
                 hook=lambda: hook[0]))  # fmt: skip

        def raw_put_on_worker(arg: object) -> None:
            self.raw_writer.submit(raw_put, arg).result()

        add(Case(on_worker, raw_put_on_worker, raw_setup, "raw", n, joins_group=True))
        raw = f"raw {name} put chunk {c} prebuilt values"
        add(Case(raw, raw_put_prebuilt, raw_setup, "raw", n))
        stored_all = _expect(stored_only, len(put.keys), "stored")
        add(Case(f"{name} put chunk {c} put_many only", put_only, setup, thr, n, raw,
                 PUT_PREBUILT_CEILING[name], check=stored_all))  # fmt: skip
        raw = f"raw {name} get chunk {c}"
        n = get.nbytes
        add(Case(raw, raw_get, _none, "raw", n))
        add(Case(f"{name} get chunk {c}", load, _none, thr, n, raw, GET_CEILING[name], target,
                 check=check_load))  # fmt: skip
        add(Case(f"{name} get chunk {c} get_many only", get_only, _none, thr, n, raw,
                 GET_CEILING[name], check=_expect(loaded_only, BLOCKS, "blocks read")))  # fmt: skip
        raw = f"raw {name} lookup chunk {c}"
        add(Case(raw, raw_lookup, _none, "raw"))
        add(Case(f"{name} lookup chunk {c} 4k tokens", lookup, _none, "time", 0, raw,
                 LOOKUP_CEILING[name], check=_expect(found, True, "lookup found it")))  # fmt: skip

    # ------------------------------------------------------------- running
    def run(self) -> None:
        for c in CHUNKS:
            self.add_codec(c)
            self.add_lmdb(c)
            self.add_redis(c)
        groups: list[list[Case]] = []  # a raw case and the kvtier cases it is the ceiling of
        for case in self.cases:
            if (case.kind == "raw" and not case.joins_group) or not groups:
                groups.append([])
            groups[-1].append(case)
        steps = [(r, g) for r in range(self.rounds) for g in groups]
        for _, group in progress(steps, desc=BENCHMARK):
            # Samples alternate between the cases of a group: raw, kvtier, raw, kvtier...
            for i in range(self.per_round):
                for case in group:
                    case.samples += measure_samples(
                        case.timed, 1, warmup=0 if i else 1, setup=case.setup
                    )
                    if case.hook:  # of the timed call, the last one
                        case.hook_samples.append(case.hook())
            for case in group:
                case.check()

    def close(self) -> None:
        """Close every store and delete everything this run wrote."""
        self.raw_writer.shutdown()
        for tier in self.lmdb_tiers:
            tier.close()
        for env in self.raw_envs:
            env.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        for tier in self.redis_tiers:
            try:
                tier.clear()
            finally:
                tier.close()
        if self.raw_redis is not None:
            keys = list(dict.fromkeys(self.raw_redis_keys))
            for i in range(0, len(keys), 1000):
                self.raw_redis.delete(*keys[i : i + 1000])
            leftover = list(self.raw_redis.scan_iter(match=f"{self.tag}*", count=1000))
            if leftover:
                self.raw_redis.delete(*leftover)
            self.raw_redis.close()
        if self.server_stat is not None:
            os.close(self.server_stat)

    # ------------------------------------------------------------- results
    def results(self) -> list[Result]:
        by_name = {c.name: c for c in self.cases}
        rows: list[Result] = []
        for case in self.cases:
            if case.kind == "raw":
                continue
            ceiling = by_name[case.ceiling] if case.ceiling else None
            if case.kind == "throughput":
                value, lo, hi = _throughput(case)
                row = Result(
                    case=case.name,
                    metric="throughput, value bytes per second",
                    unit="GB/s",
                    value=value,
                    min=lo,
                    max=hi,
                    ceiling=_throughput(ceiling)[0] if ceiling else None,
                    ceiling_what=case.ceiling_what,
                    target=case.target,
                )
                rows.append(row)
                if case.worker_ceiling:  # the same samples, informational
                    rows.append(
                        replace(
                            row,
                            case=f"{case.name} vs raw on a write worker",
                            ceiling=_throughput(by_name[case.worker_ceiling])[0],
                            ceiling_what=f"{case.ceiling_what}, run on a worker thread",
                            target=None,
                        )
                    )
            else:
                row = _micros(
                    case.name,
                    "time per lookup of a 4k-token prompt (256 block hashes)",
                    case.samples,
                )
                rows.append(
                    replace(
                        row,
                        ceiling=summarize(ceiling.samples)[0] * 1e6 if ceiling else None,
                        ceiling_what=case.ceiling_what,
                    )
                )
            if case.hook_samples:
                rows.append(
                    _micros(
                        f"{case.name} hook",
                        "time the spill hook holds the caller (the cache's lock) per put",
                        case.hook_samples,
                    )
                )
        for c, trips in self.round_trips.items():
            if trips:
                rows.append(
                    Result(
                        case=f"redis lookup chunk {c} 4k tokens round trips",
                        metric="RedisTier.round_trips per lookup of a 4k-token prompt (worst)",
                        unit="round trips",
                        value=max(trips),
                        min=min(trips),
                        max=max(trips),
                        target=ROUND_TRIP_TARGET,
                        target_kind="value",
                        higher_is_better=False,
                    )
                )
        return sorted(rows, key=lambda r: _case_order(r.case))

    def fault_lines(self) -> list[str]:
        """Median minor page faults per call of the main put/get cases and their ceilings
        (and of the Redis server during them, where it could be counted)."""
        by_name = {c.name: c for c in self.cases}
        lines = []
        main = [c for c in self.cases if c.kind == "throughput" and len(c.name.split()) == 4]
        for case in sorted(main, key=lambda c: _case_order(c.name)):
            if case.ceiling:
                raw = by_name[case.ceiling]
                line = f"{case.name}: {_median_faults(case.faults, raw.faults)}"
                if case.server_faults:
                    server = _median_faults(case.server_faults, raw.server_faults)
                    line += f"; Redis server {server}"
                lines.append(line)
        return lines


def _case_order(name: str) -> tuple[int, int, int, int]:
    """Table order: tier (then the codec), operation, chunk size, main case first."""
    words = name.split()
    group = ("lmdb", "redis", "encode", "decode").index(words[0])
    op = next((i for i, w in enumerate(("put", "get", "lookup")) if w in words), 0)
    c = int(words[words.index("chunk") + 1])
    rest = " ".join(words[words.index("chunk") + 2 :])
    variant = (
        "",
        "vs raw on a write worker",
        "put_many only",
        "hook",
        "get_many only",
        "4k tokens",
    )
    return group, op, c, variant.index(rest) if rest in variant else len(variant)


def _micros(case: str, metric: str, samples: list[float]) -> Result:
    """A row of ``samples`` (seconds) in µs: their median, min and max; lower is better."""
    med, lo, hi = (x * 1e6 for x in summarize(samples))
    return Result(
        case=case, metric=metric, unit="µs", value=med, min=lo, max=hi, higher_is_better=False
    )


def _median_faults(faults: list[int], raw: list[int]) -> str:
    return f"{statistics.median(faults):.0f} (raw {statistics.median(raw):.0f})"


def _open_server_stat(client: redis.Redis) -> int | None:
    """A descriptor of the Redis server's ``/proc/PID/stat`` when the server runs on this
    machine (the pid it reports is a process named redis-...); None otherwise."""
    try:
        pid = int(client.info("server")["process_id"])
        with open(f"/proc/{pid}/comm") as comm:
            if not comm.read().startswith("redis"):
                return None
        return os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except (redis.RedisError, KeyError, ValueError, OSError):
        return None


def _throughput(case: Case) -> tuple[float, float, float]:
    med, lo, hi = summarize(case.samples)
    return case.nbytes / med / GB, case.nbytes / hi / GB, case.nbytes / lo / GB


def _expect(results: list[Any], expected: object, what: str) -> Callable[[], None]:
    """A check that every call since the last check returned ``expected`` (and one did)."""

    def check() -> None:
        bad = [r for r in results if r != expected]
        assert results and not bad, f"{what}: expected {expected!r}, got {bad or 'no calls'}"
        results.clear()

    return check


def _none() -> None:
    return None


def fault_cost_us(nbytes: int = 16 << 20) -> float:
    """µs per minor page fault: first touches of a fresh anonymous mapping."""
    page = mmap.PAGESIZE
    with mmap.mmap(-1, nbytes) as m:
        a = np.frombuffer(m, dtype=np.uint8)
        t0 = time.perf_counter()
        a[::page] = 1
        t1 = time.perf_counter()
        del a
    return (t1 - t0) / (nbytes // page) * 1e6


def keep_freed_memory() -> str:
    """Make glibc keep freed memory for reuse instead of handing it back to the kernel.

    By default glibc returns the top of the heap to the kernel once more than 128 KiB
    (or twice the largest freed mmap chunk) is free there, and serves big blocks with
    fresh mmaps, so whether a call pays a page fault per 4 KiB of the values it
    allocates (8 MiB: 2048 faults) depends on which object happens to sit at the top
    of the heap: it flips between otherwise equal cases. Raising both thresholds gives
    every case the steady state of a long-running server, where freed memory is reused.
    Returns what was set, for the output.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "unchanged (no glibc mallopt)"
    m_trim_threshold, m_mmap_threshold = -1, -3
    trim, mmap_max = 1 << 30, 32 << 20  # 32 MiB: glibc's largest mmap threshold
    if mallopt(m_trim_threshold, trim) != 1 or mallopt(m_mmap_threshold, mmap_max) != 1:
        return "unchanged (mallopt failed)"
    return "trim threshold 1 GiB, mmap threshold 32 MiB (freed memory is reused)"


def _tmp_base() -> str | None:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def main() -> int:
    parser = standard_args(__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/0",
        help="the Redis server to use (keys get a unique prefix and are deleted afterwards)",
    )
    parser.add_argument(
        "--malloc-default",
        action="store_true",
        help="keep glibc's default trim/mmap thresholds (see the module docstring)",
    )
    args = parser.parse_args()
    malloc = "glibc defaults" if args.malloc_default else keep_freed_memory()
    bench = Bench(args.quick, args.redis_url)
    load_before = os.getloadavg()[0]
    fault_us = fault_cost_us()
    try:
        bench.run()
    finally:
        bench.close()
    results = bench.results()
    machine = machine_info("cpu")
    tmp = str(bench.tmp.parent)
    print(
        f"{BENCHMARK}{' --quick' if args.quick else ''}: {machine['cpu']}, "
        f"{machine['cores']} cores, torch {machine['torch']}, lmdb {lmdb.__version__}, "
        f"redis-py {redis.__version__}; {bench.rounds} rounds x {bench.per_round} samples, "
        f"each after 1 warm-up; load average {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after"
    )
    print(
        f"layout: {LAYOUT.describe()} = {LAYOUT.block_nbytes // 1024} KiB/block; batch = "
        f"{BLOCKS} blocks ({PROMPT_TOKENS} tokens, {BLOCKS * LAYOUT.block_nbytes >> 20} MiB) "
        f"in chunks of {', '.join(map(str, CHUNKS))}; LMDB in {tmp}"
        f"{' (tmpfs)' if tmp == '/dev/shm' else ''}; Redis at {args.redis_url}"
        + (f" UNAVAILABLE ({bench.redis_error})" if bench.redis_error else "")
        + f"; malloc: {malloc}"
    )
    print_table(results)
    print(
        f"minor page faults per call (median; a first touch of a page costs {fault_us:.1f} µs "
        f"here, {4096 / fault_us / 1e3:.2f} GB/s):"
    )
    for line in bench.fault_lines():
        print(f"  {line}")
    if args.out:
        write_json(args.out, BENCHMARK, results, machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
