"""Moving chunks between the host pool and the spill tiers (disk, Redis).

A spill tier stores *chunks*: runs of consecutive blocks ``[s, e]`` of one chain
inside one aligned chunk ``[k*C, (k+1)*C)`` (``C`` = that tier's ``chunk_blocks``),
keyed by the hash of the run's last block ``e``; the value's header records ``s``.
Usually ``s = k*C``; a run starts later when the blocks before it were not in the
host pool when it was written (typically still on the GPU: the GPU evicts a chain
tail first, so a chunk's tail can reach the host, and leave it, before its head).
The head is written later as a run of its own, ending just before the tail.

Write path. Chunks are built from host slots by walking parent hashes back from a
run's last block, encoded (``ChunkCodec.encode_many``: each hook call's chunks
gathered into one buffer of values) while the slots are still valid, and written by
an I/O worker. Evicted slots are about to be reused, so their chunks are encoded in
the eviction hook; chunks that a publish completes are encoded on this manager's
encoder thread instead, their slots pinned until then, so that the caller's lock is
not held for a copy and a hash of every block its offloads bring in:

- ``write_back`` tiers: when the host pool evicts slots, the first ``write_back``
  tier in spill order receives each victim's run: the blocks from the victim back to
  its chunk's aligned start or to the first block the host pool does not hold (one
  value per chunk however many of its blocks go).
- ``write_through`` tiers: a chunk is written as soon as all its ``C`` blocks are in
  the host pool (so other instances sharing the tier see it early), and again offered
  when its blocks are evicted, as the runs above, unless it landed (or a load read
  it from the tier) less than ``LANDED_SECONDS`` before (so a write that failed during
  an outage, or a value the tier may have dropped since, gets another chance, while an
  eviction does not encode again what the tier has just stored or supplied; the size
  check below skips what is there). Blocks usually reach the host tail first, so a
  chunk whose tail arrived before its head is remembered under the hash it was
  missing and completed when that block arrives.
- cascade: a tier that evicts values to make room (LMDB) passes them to the next tier
  in spill order, when both use the same chunk size (a value cannot be re-chunked:
  it does not carry the hashes of its inner blocks).

Each hook call (an eviction, a publish) makes one write per tier, whatever the number
of chunks, and encodes each chunk once however many tiers of its size take it (a
publish's on the encoder thread).
Writes are queued to I/O workers with a bound on the bytes in flight; past it, a
write is dropped and counted (the tier is not keeping up). A tier never gets a chunk
it already holds. A chunk just completed in the host pool is seldom there: it is
written only where its key holds nothing (``put_many(only_new=True)``: SET NX, or a
check inside the write transaction), in the write's one round trip. Chunks offered on
eviction or passed down often are there: one batched size query (``sizes_many``)
first, and a value is sent only where the tier holds nothing, or less (a shorter run
ending at the same block, which the longer one replaces).

Read path. ``lookup`` asks each tier in order, with one batched size query, for the
chunks that continue the prefix the tiers above it hold: a value's size gives its
run's length, hence its start, so the lookup picks the fewest runs that cover the
prefix without a gap (greedily, the one reaching furthest). ``load`` (on an I/O
worker) reads them with one batched get per tier, checks every value
(``kvtier.chunk``) and that it holds what the lookup expected, and scatters the
blocks still missing into pinned host slots. A value that fails its checks is a
miss, is deleted, and is counted; one that changed since the lookup (rewritten as a
run that no longer reaches back far enough) is a miss too, and is kept.

In flight. A value queued for a tier is found by ``lookup`` and read by ``load`` from
memory until its write is over (where it is at least as long as the stored one, which
the lookup then counted on): the host slots it came from are free as soon as it
is encoded, so without this a prefix evicted a moment ago would be a miss everywhere
until the write lands. The values are the queued writes' own (bounded by the bytes in
flight); a write that fails takes its values out, and they are misses from then on.

Threads: ``lookup`` and ``load`` touch only the tiers, the codec, and host slots pinned
for them; they may run on any thread (loads run on the transfer engine's workers).
Writes run on this manager's own workers, so a write stuck on a hung tier never delays
a load; encodes run on its encoder thread, so a write stuck never keeps slots pinned.
``on_host_evict`` and ``on_host_publish`` run under the lock that guards the host pool
(the cache's), which the encoder takes to unpin slots. Counters are updated under
``self._lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import partial

from kvtier.block_pool import CachedBlocks
from kvtier.chunk import BadChunk, ChunkCodec, byte_rows
from kvtier.host_pool import HostPool
from kvtier.metrics import TierStats
from kvtier.threads import thread_pool
from kvtier.tiers.base import SpillTier

log = logging.getLogger(__name__)

HeldWrite = tuple[SpillTier, Executor, Callable[[], None]]  # a job, and where it runs
Chunk = tuple[bytes, int, list[int]]  # its key (last block's hash), first position, slots
Encoded = dict[tuple[bytes, int], memoryview]  # values one hook call made, by (key, start)


@dataclass(frozen=True)
class ChunkRef:
    """One stored chunk (a run inside an aligned chunk): its key, the chain position of
    its first block, its length."""

    key: bytes
    start: int
    num_blocks: int


@dataclass(frozen=True)
class SpillRun:
    """Blocks ``[first_block, first_block + num_blocks)`` of a prompt, held by one tier."""

    tier: str
    first_block: int
    num_blocks: int
    chunks: tuple[ChunkRef, ...]


@dataclass
class Outage:
    """A tier's health for the log: whether its last call failed, the failed calls since
    the last "down" line, when that line was logged (None: never), and whether its
    "back" line is still due."""

    down: bool = False
    failures: int = 0
    logged_at: float | None = None
    back_due: bool = False


OUTAGE_LOG_INTERVAL = 60.0  # seconds: at most one "down" line per tier in this time
# Seconds for which a block whose write-through chunk landed (or that a load read from
# the tier) is taken to be in that tier: evicted from the host pool within them, its
# chunk is not offered again.
LANDED_SECONDS = 60.0


@dataclass
class LoadResult:
    """What a load did: the leading blocks now in host slots, and what went wrong."""

    num_blocks: int = 0
    bad: list[tuple[str, bytes, str]] = field(default_factory=list)  # tier, key, reason
    errors: list[tuple[str, BaseException]] = field(default_factory=list)  # tier, what it raised
    blocks_read: dict[str, int] = field(default_factory=dict)
    read_seconds: dict[str, float] = field(default_factory=dict)  # per tier: its get_many
    check_seconds: dict[str, float] = field(default_factory=dict)  # ... checks and scatter
    short: Counter[str] = field(default_factory=Counter)  # per tier, blocks promised not loaded


def _cover(starts: Sequence[int | None], start: int, end: int, c: int) -> list[tuple[int, int]]:
    """Runs (first, last position) that cover positions ``[start, ...)`` without a gap;
    ``starts[j - start]`` is the first position of the run stored under position j
    (None: nothing stored there), as its value's size says.

    Greedy: at each step the run holding the next position that reaches furthest (it
    lies in that position's aligned chunk). Where the sizes say no stored run holds
    the next position but one in its chunk is stored, the furthest one is claimed
    anyway, from the chunk's start: a size can be a bad value's, which the load then
    reads, rejects and deletes (a good run that starts later is a miss there, kept).
    Stops where nothing in the next position's chunk is stored.
    """
    runs = []
    pos = start
    while pos < end:
        aligned = pos - pos % c
        furthest = None
        for j in range(min(aligned + c, end) - 1, pos - 1, -1):
            first = starts[j - start]
            if first is None:
                continue
            if first <= pos:
                runs.append((first, j))
                break
            if furthest is None:
                furthest = j
        else:
            if furthest is None:
                break
            runs.append((aligned, furthest))
        pos = runs[-1][1] + 1
    return runs


@dataclass(frozen=True)
class ValueShape:
    """What a stored value's size says: ``header_nbytes`` plus ``block_nbytes`` per block."""

    header_nbytes: int
    block_nbytes: int

    def run_start(self, last: int, size: int, c: int) -> int | None:
        """The first position of the run stored under position ``last`` as a value of
        ``size`` bytes (0: none, None returned). A size that is not a whole number of
        blocks, or more blocks than reach back to the chunk's start, is no value a codec
        of this shape wrote: it is taken to start at the chunk's start, so that the load
        reads it, rejects it and deletes it."""
        if not size:
            return None
        aligned = last - last % c
        n, rest = divmod(size - self.header_nbytes, self.block_nbytes)
        if rest or not 1 <= n <= last - aligned + 1:
            return aligned
        return last - n + 1


SizesHook = Callable[[SpillTier, Sequence[bytes], list[int]], None]


def find_runs(
    tiers: Sequence[SpillTier],
    shards: Sequence[Sequence[bytes]],
    start: int,
    shapes: Sequence[ValueShape],
    adjust: SizesHook | None = None,
    on_error: Callable[[str, BaseException], None] | None = None,
) -> tuple[list[list[SpillRun]], dict[str, tuple[int, int]]]:
    """The runs of stored chunks that extend a chain prefix of ``start`` blocks, tier by
    tier, as far as every shard's runs reach: a block counts only where all shards can
    load it. ``shards[s][j]`` is shard ``s``'s key of the block at position ``start + j``;
    ``shapes[s]`` the size of shard ``s``'s values (pipeline stages hold other layers).

    One batched size query per tier for all shards together (rule 5: one round trip per
    tier, whatever the number of shards). ``adjust`` may raise the sizes a tier answered
    (values still in flight); a tier that fails is skipped and reported to ``on_error``.
    Returns the runs per shard and, per tier asked, (blocks asked, blocks found).
    """
    out: list[list[SpillRun]] = [[] for _ in shards]
    looked: dict[str, tuple[int, int]] = {}
    first = start
    end = start + min((len(keys) for keys in shards), default=0)
    for tier in tiers:
        if start >= end:
            break
        c, n = tier.chunk_blocks, end - start
        ask = [key for keys in shards for key in keys[start - first : end - first]]
        try:
            sizes = tier.sizes_many(ask)
        except Exception as e:  # any failure of a tier is a miss, never the engine's
            if on_error is not None:
                on_error(tier.name, e)
            continue
        if adjust is not None:
            adjust(tier, ask, sizes)
        covers = []
        for s, shape in enumerate(shapes):
            own = sizes[s * n : (s + 1) * n]
            run_start = shape.run_start  # most keys of a chunk hold nothing: no call
            starts = [run_start(j, size, c) if size else None for j, size in enumerate(own, start)]
            covers.append(_cover(starts, start, end, c))
        stop = min((found[-1][1] + 1 if found else start) for found in covers)
        looked[tier.name] = (n, stop - start)
        if stop == start:
            continue
        for keys, found, runs in zip(shards, covers, out):
            chunks = tuple(
                ChunkRef(keys[last - first], lo, last - lo + 1) for lo, last in found if lo < stop
            )
            runs.append(SpillRun(tier.name, start, stop - start, chunks))
        start = stop
    return out, looked


def _blocks_by_tier(runs: Sequence[SpillRun]) -> Counter[str]:
    """The blocks of ``runs``, per tier."""
    out: Counter[str] = Counter()
    for run in runs:
        out[run.tier] += run.num_blocks
    return out


def hit_blocks(host_blocks: int, runs: Sequence[SpillRun]) -> dict[str, int]:
    """A hit's blocks by tier: ``host_blocks`` under ``cpu`` (when any), then ``runs``'."""
    return {**({"cpu": host_blocks} if host_blocks else {}), **_blocks_by_tier(runs)}


def truncate_runs(runs: Sequence[SpillRun], n: int) -> tuple[SpillRun, ...]:
    """The first ``n`` blocks of ``runs`` (chunks beyond them dropped)."""
    out = []
    for run in runs:
        if n <= 0:
            break
        if run.num_blocks <= n:
            out.append(run)
        else:
            chunks = tuple(c for c in run.chunks if c.start < run.first_block + n)
            out.append(SpillRun(run.tier, run.first_block, n, chunks))
        n -= run.num_blocks
    return tuple(out)


class SpillManager:
    """The spill tiers below one host pool, in spill order."""

    def __init__(
        self,
        tiers: Sequence[SpillTier],
        write_through: Sequence[str],
        host: HostPool,
        host_lock: AbstractContextManager[object],
        write_workers: int,
        max_pending_bytes: int,
    ) -> None:
        self.tiers = list(tiers)
        self.host = host
        self._host_lock = host_lock
        self.codec = ChunkCodec(host.layout)
        self.shape = ValueShape(self.codec.header_nbytes, self.codec.block_nbytes)
        self._rows = byte_rows(host.slab)
        # Writes get their own workers: a write stuck on a hung tier (up to its timeout)
        # must never delay a prefetch, which runs on the transfer engine's workers.
        self._writers = thread_pool(max(1, write_workers), "kvtier-spill")
        self._encoder = thread_pool(1, "kvtier-encode")
        self._stats = {t.name: TierStats() for t in self.tiers}
        self._outages = {t.name: Outage() for t in self.tiers}
        self._through = [t for t in self.tiers if t.name in write_through]
        back = [t for t in self.tiers if t.name not in write_through]
        self._back = back[0] if back else None
        # Blocks whose write-through chunk landed, or that a load read from the tier, per
        # write-through tier: hash -> when (``time.monotonic``), until the host pool
        # evicts them (see ``on_host_evict``).
        self._landed: dict[str, dict[bytes, float]] = {t.name: {} for t in self._through}
        # Incomplete write-through chunks: missing hash -> (tier, tail hash, tail position).
        self._waiting: dict[bytes, list[tuple[SpillTier, bytes, int]]] = {}
        self._max_pending = max_pending_bytes
        self._held: list[HeldWrite] | None = None
        for upper, lower in zip(self.tiers, self.tiers[1:]):
            if upper.chunk_blocks == lower.chunk_blocks:
                upper.on_evict = partial(self._cascade, lower)
            else:  # a value cannot be re-chunked: it does not hold its blocks' hashes
                log.info(
                    "kvtier: %s evictions are not passed to %s (chunk_blocks %d != %d)",
                    upper.name,
                    lower.name,
                    upper.chunk_blocks,
                    lower.chunk_blocks,
                )
        self._pending = 0
        self._writes: set[Future] = set()
        # Values queued for each tier and not yet written, by key (see "In flight").
        self._in_flight: dict[str, dict[bytes, memoryview]] = {t.name: {} for t in self.tiers}
        # What entered and left ``_in_flight`` since ``take_queued``: key -> size, 0 gone.
        self._queued_log: dict[str, dict[bytes, int]] = {t.name: {} for t in self.tiers}
        # Values that landed in each tier (key -> its blocks) or left it (key -> 0) since
        # ``take_tier_changes``; None until ``track_tiers`` (then, and only then, kept).
        self._tier_log: dict[str, dict[bytes, int]] | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when no write is queued

    # ------------------------------------------------------------------ read path
    def lookup(self, hashes: Sequence[bytes], start: int) -> list[SpillRun]:
        """Runs of stored chunks of the blocks ``hashes`` at chain positions ``start..``
        (extending a prefix of ``start`` blocks), tier by tier; a value still queued for
        its tier counts as stored (see "In flight")."""
        (runs,), looked = find_runs(
            self.tiers, [hashes], start, [self.shape], self._queued_sizes, self._count_error
        )
        with self._lock:
            for name, (asked, found) in looked.items():
                self._stats[name].hits += found
                self._stats[name].misses += asked - found
        for name in looked:
            self._count_ok(name)
        return runs

    def take_queued(self) -> dict[str, dict[bytes, int]]:
        """Per tier, the values that were queued for it (key -> size) or whose write
        ended (key -> 0) since the last call: what a lookup in another process, which
        cannot see this one's queue, needs to count them as stored (see "In flight")."""
        with self._lock:
            out = {name: log for name, log in self._queued_log.items() if log}
            self._queued_log = {t.name: {} for t in self.tiers}
            return out

    def track_tiers(self) -> None:
        """From now on, keep which values land in each tier and which leave it (evicted
        to make room, rejected on read), for ``take_tier_changes``."""
        with self._lock:
            self._tier_log = {t.name: {} for t in self.tiers}
        for tier in self.tiers:
            tier.on_drop = partial(self._log_dropped, tier.name)

    def take_tier_changes(self) -> dict[str, dict[bytes, int]]:
        """Per tier, the values that landed (key -> blocks of its run) or left it (key ->
        0) since the last call; {} unless ``track_tiers`` ran. A value the store drops on
        its own (Redis under ``maxmemory``, a TTL) is never seen."""
        if self._tier_log is None:  # not tracked: no lock taken (called every step)
            return {}
        with self._lock:
            if not self._tier_log:
                return {}
            out = {name: log for name, log in self._tier_log.items() if log}
            self._tier_log = {t.name: {} for t in self.tiers}
            return out

    def _log_tier(self, name: str, changes: dict[bytes, int]) -> None:
        """Journal values that landed in tier ``name`` (key -> blocks) or left it (0)."""
        if self._tier_log is None:  # not tracked (set once, by track_tiers)
            return
        with self._lock:
            self._tier_log[name].update(changes)

    def _log_dropped(self, name: str, keys: Sequence[bytes]) -> None:
        self._log_tier(name, dict.fromkeys(keys, 0))

    def _log_put(self, tier: SpillTier, items: list[tuple[bytes, memoryview, int]],
                 there: bool) -> None:  # fmt: skip
        """Journal write ``items`` (key, value, blocks) as in ``tier`` or not there."""
        if self._tier_log is not None:
            self._log_tier(tier.name, {key: n if there else 0 for key, _, n in items})

    def _queued_sizes(self, tier: SpillTier, keys: Sequence[bytes], sizes: list[int]) -> None:
        """Raise ``sizes`` to those of longer values still queued for ``tier``."""
        with self._lock:
            queued = self._in_flight[tier.name]
            if queued:
                for j, key in enumerate(keys):
                    value = queued.get(key)
                    if value is not None and len(value) > sizes[j]:
                        sizes[j] = len(value)

    def load(self, runs: Sequence[SpillRun], slots: Sequence[int]) -> LoadResult:
        """Read ``runs`` into ``slots`` (one per run block, in order, pinned by the caller).

        Stops at the first chunk that is missing, bad, or no longer reaches back to the
        blocks it was to supply: the result's ``num_blocks`` leading slots hold checked
        KV, the rest are garbage.
        """
        result = LoadResult()
        base = runs[0].first_block if runs else 0
        by_name = {t.name: t for t in self.tiers}
        for run in runs:
            tier = by_name[run.tier]
            ok = [False] * len(run.chunks)
            # Chunk i supplies blocks [lo, hi): from where the one before it ends (the
            # blocks before are there already), up to its own end or the run's.
            ends = [c.start + c.num_blocks for c in run.chunks]
            los = [run.first_block, *ends[:-1]]
            checking = [0.0]  # seconds in sink(), inside the tier's get_many

            def sink(
                i: int,
                value: memoryview,
                run: SpillRun = run,
                ok: list = ok,
                los: list = los,
                ends: list = ends,
                checking: list = checking,
            ) -> None:
                chunk = run.chunks[i]
                lo, hi = los[i], min(ends[i], run.first_block + run.num_blocks)
                start = time.perf_counter()
                try:
                    header, payload = self.codec.read_header(value, chunk.key)
                    first, n = header.first_position, header.num_blocks
                    if first + n != ends[i]:  # a value ends at its key's block
                        raise BadChunk(
                            "length",
                            f"chunk holds blocks {first}+{n}, expected blocks ending at "
                            f"{ends[i] - 1}",
                        )
                    if first > lo:  # rewritten since the lookup as a shorter run: a miss
                        return
                    # Copies blocks [lo, hi) (none when all are there already) and
                    # checks the whole payload.
                    dst = slots[lo - base : hi - base] if lo < hi else ()
                    self.codec.scatter(header, payload, self._rows, dst, lo - first)
                except BadChunk as e:
                    result.bad.append((run.tier, chunk.key, e.reason))
                    return
                finally:
                    checking[0] += time.perf_counter() - start
                ok[i] = True

            with self._lock:  # a queued value the lookup counted on (not a shorter one)
                queued = self._in_flight[run.tier]
                memory = {
                    i: value
                    for i, c in enumerate(run.chunks)
                    if (value := queued.get(c.key)) is not None
                    and len(value) >= self.codec.encoded_nbytes(c.num_blocks)
                }
            for i, value in memory.items():
                sink(i, value)
            stored = [i for i in range(len(run.chunks)) if i not in memory]
            try:
                start = time.perf_counter()
                if stored:
                    tier.get_many(
                        [run.chunks[i].key for i in stored],
                        lambda j, value, stored=stored, sink=sink: sink(stored[j], value),
                    )
                result.read_seconds[run.tier] = time.perf_counter() - start - checking[0]
                result.check_seconds[run.tier] = checking[0]
            except Exception as e:  # what loaded before the failure is still good
                result.errors.append((run.tier, e))
            good = next((i for i, v in enumerate(ok) if not v), len(ok))
            loaded = 0
            if good:
                last = run.chunks[good - 1]
                loaded = min(last.start + last.num_blocks - run.first_block, run.num_blocks)
            result.blocks_read[run.tier] = loaded
            result.num_blocks += loaded
            if good < len(ok):
                break
        short = _blocks_by_tier(runs)  # a run after one that fell short loads nothing
        short.subtract(result.blocks_read)
        result.short = +short
        return result

    def settle_load(self, result: LoadResult) -> None:
        """Count a finished load and delete the bad values it met (in the background)."""
        with self._lock:
            nbytes = self.host.layout.block_nbytes
            for name, n in result.blocks_read.items():
                self._stats[name].count_out(n, n * nbytes, result.read_seconds.get(name))
            for name, _, _ in result.bad:
                self._stats[name].rejected += 1
            for name, n in result.short.items():
                self._stats[name].short_loads += n
        for name, error in result.errors:
            self._count_error(name, error)
        for name in result.read_seconds.keys() - {name for name, _ in result.errors}:
            self._count_ok(name)
        by_name = {t.name: t for t in self.tiers}
        for name, key, reason in result.bad:
            log.warning("kvtier: rejected %s value %s (%s); deleting it", name, key.hex(), reason)
            tier = by_name[name]
            self._background(tier, self._writers, partial(tier.delete_many, [key]))
            self._log_dropped(name, [key])

    def on_loaded(self, runs: Sequence[SpillRun], hashes: Sequence[bytes], first: int) -> None:
        """Blocks ``hashes`` (chain positions ``first..``, as many as loaded) were read
        from ``runs``: each is in its run's tier as surely as a chunk that just landed
        there, so a write-through tier is not offered it again when the host pool evicts
        it (a load staged after a load would otherwise re-encode what it just read)."""
        through = {t.name: t for t in self._through}
        with self._lock:
            for run in runs:
                if run.tier in through:
                    lo = run.first_block - first
                    self._record_landed(through[run.tier], [hashes[lo : lo + run.num_blocks]])

    def count_unstaged(self, promised: Sequence[SpillRun], staged: Sequence[SpillRun]) -> None:
        """Count the blocks of ``promised`` runs that ``staged`` (cut to the host slots
        free for a load) leaves out as short loads of their tiers."""
        short = _blocks_by_tier(promised)
        short.subtract(_blocks_by_tier(staged))
        with self._lock:
            for name, n in (+short).items():
                self._stats[name].short_loads += n

    # ------------------------------------------------------------------ write path
    def on_host_evict(self, victims: CachedBlocks) -> None:
        """Host eviction hook: spill the victims' chunks before their slots are reused,
        one batch per tier; tiers of the same chunk size share each encoded value."""
        encoded: Encoded = {}
        if self._back:
            self._encode_and_put(self._back, self._evicted_chunks(self._back, victims), encoded)
        self._put_unlanded(victims, encoded)

    def on_host_publish(self, blocks: CachedBlocks) -> None:
        """Write-through: write every chunk that these newly cached blocks complete, one
        batch per tier, encoded on the encoder thread once for the tiers that take the
        same chunks (tiers of one chunk size)."""
        if not self._through:
            return
        retry = [w for h in blocks.hashes for w in self._waiting.pop(h, ())]
        # by the chunks' (key, start): the tiers taking them, and the chunks
        groups: dict[tuple[tuple[bytes, int], ...], tuple[list[SpillTier], list[Chunk]]] = {}
        for tier in self._through:
            c = tier.chunk_blocks
            tails = [(h, p) for h, p in zip(blocks.hashes, blocks.positions) if p % c == c - 1]
            tails += [(tail, p) for t, tail, p in retry if t is tier]
            chunks: dict[bytes, Chunk] = {}  # by key: a chunk completed twice goes once
            for tail, p in tails:
                chunk = self._complete_chunk(tier, tail, p)
                if chunk is not None:
                    chunks[tail] = chunk
            found = list(chunks.values())
            same = tuple((key, start) for key, start, _ in found)
            groups.setdefault(same, ([], found))[0].append(tier)
        for tiers, found in groups.values():
            self._encode_later(tiers, found)

    def write_tail(self, last: bytes, position: int) -> None:
        """Write-through: write the partial chunk that ends a chain at ``last`` (chain
        position ``position``, in the host pool), which no later block of the chain will
        complete (its request is over): without it, an engine started again, or another
        one sharing the tier, would miss the chain's last blocks until the host pool
        evicted them. Not for a tier in which ``last`` ends a full chunk (written as it
        completed) or has landed already. Under the host pool's lock."""
        if not self._through or self.host.lookup_each([last])[0] is None:
            return
        with self._lock:
            landed = {t.name for t in self._through if last in self._landed[t.name]}
        groups: dict[tuple[int, int], tuple[list[SpillTier], list[Chunk]]] = {}
        for tier in self._through:
            c = tier.chunk_blocks
            if position % c == c - 1 or tier.name in landed:
                continue
            slots = self._host_run(last, position % c + 1)
            start = position - len(slots) + 1
            groups.setdefault((start, len(slots)), ([], [(last, start, slots)]))[0].append(tier)
        for tiers, chunks in groups.values():
            self._encode_later(tiers, chunks)

    def write_unlanded(self) -> None:
        """Write-through: write what the host pool holds and no write-through tier has
        taken (chains' partial last chunks, writes that failed), as its eviction would:
        the engine is stopping, its host pool goes with it, and an engine started again
        is to find everything this one computed. Under the host pool's lock."""
        if self._through:
            self._put_unlanded(self.host.cached_blocks(self.host.eviction_order()), {})

    def counters(self) -> dict[str, TierStats]:
        """A snapshot of each spill tier's counters (asks no store anything)."""
        with self._lock:
            self._take_evictions()
            return {t.name: self._stats[t.name].snapshot() for t in self.tiers}

    def counts(self) -> dict[str, tuple[int, ...]]:
        """Each spill tier's counters alone (``TierStats.counts``), for every engine step."""
        with self._lock:
            self._take_evictions()
            return {t.name: self._stats[t.name].counts() for t in self.tiers}

    def _take_evictions(self) -> None:
        """Copy the evictions each tier counts itself into its stats (under the lock)."""
        for tier in self.tiers:
            self._stats[tier.name].evictions = tier.evictions

    def stats(self) -> dict[str, TierStats]:
        """``counters``, and what each tier holds (asked of the store outside the lock;
        None when it cannot answer)."""
        out = self.counters()
        for tier in self.tiers:
            try:
                out[tier.name].usage = tier.usage()
            except Exception as e:  # a dead store has no usage to report, nothing more
                log.debug("kvtier: %s tier usage unavailable: %s", tier.name, e)
        return out

    def close(self) -> None:
        """Finish queued writes and close every tier."""
        self.flush()
        self._encoder.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        self.codec.close()
        for tier in self.tiers:
            tier.close()

    @contextmanager
    def holding_writes(self) -> Iterator[list[HeldWrite]]:
        """Hold back the writes made inside (the caller holds its lock) and yield them;
        the caller starts them with ``start_writes``, e.g. once a load that the writes
        could evict from its tier has read what it needs."""
        held: list[HeldWrite] = []
        self._held = held
        try:
            yield held
        finally:
            self._held = None

    def encode_held(self, held: list[HeldWrite]) -> None:
        """Run the write-through encodes held in ``held`` now, on the caller's thread (it
        holds the host pool's lock), so that their slots are unpinned at once: a load
        needs them to stage into. Their writes stay held."""
        jobs, held[:] = held[:], []
        for tier, pool, job in jobs:
            if pool is self._encoder:
                held.extend(self._encode_pinned(*job.args))  # ``_encode_later``'s job
            else:
                held.append((tier, pool, job))

    def start_writes(self, held: list[HeldWrite]) -> None:
        """Queue writes that ``holding_writes`` held back (any thread)."""
        while held:
            self._background(*held.pop())

    def flush(self) -> None:
        """Wait for every queued write, and for the writes they queue (cascades)."""
        with self._idle:
            self._idle.wait_for(lambda: not self._writes)

    # ------------------------------------------------------------------ internals
    def _complete_chunk(self, tier: SpillTier, tail: bytes, position: int) -> Chunk | None:
        """The full chunk ending at ``tail``; None, remembering it, while a block is missing."""
        c = tier.chunk_blocks
        slots, missing = self.host.walk_back(tail, c)
        if missing is not None:
            waiting = self._waiting.setdefault(missing, [])
            if (tier, tail, position) not in waiting:
                waiting.append((tier, tail, position))
            if len(self._waiting) > self.host.num_blocks:  # forget the oldest
                self._waiting.pop(next(iter(self._waiting)))
            return None
        return tail, position - c + 1, slots

    def _put_unlanded(self, blocks: CachedBlocks, encoded: Encoded) -> None:
        """Encode now (under the caller's lock) and queue to each write-through tier the
        chunks of ``blocks`` that did not land in it (``_not_landed``)."""
        for tier in self._through:
            unwritten = self._not_landed(tier, blocks)
            self._encode_and_put(tier, self._evicted_chunks(tier, unwritten), encoded)

    def _evicted_chunks(self, tier: SpillTier, victims: CachedBlocks) -> list[Chunk]:
        """The runs of ``tier``'s chunk size that hold the victims: each from a chunk's
        last victim back to the chunk's aligned start, or to the first block the host
        pool does not hold (the run's head, written when it is evicted in turn)."""
        c = tier.chunk_blocks
        covered: set[int] = set()
        chunks = []
        order = sorted(range(len(victims)), key=lambda i: -victims.positions[i])
        for i in order:
            slot = victims.block_ids[i]
            if slot in covered:
                continue
            p = victims.positions[i]
            slots = self._host_run(victims.hashes[i], p % c + 1)
            covered.update(slots)
            chunks.append((victims.hashes[i], p - len(slots) + 1, slots))
        return chunks

    def _host_run(self, last: bytes, count: int) -> list[int]:
        """Slots of the longest run of at most ``count`` chain blocks ending at ``last``
        (which the host pool holds) that the host pool holds, oldest first."""
        slots, missing = self.host.walk_back(last, count)
        if missing is None:
            return slots
        run: list[int] = []
        h = last
        while len(run) < count and (slot := self.host.lookup_each([h])[0]) is not None:
            run.append(slot)
            h = self.host.cached_blocks([slot]).parents[0]
        return run[::-1]

    def _encode_and_put(self, tier: SpillTier, chunks: list[Chunk], encoded: Encoded) -> None:
        """Encode ``chunks`` (while their slots are valid: under the caller's lock) and queue
        them to ``tier`` as one write; a value already in ``encoded`` is reused."""
        nbytes = self._reserve_chunks(tier, chunks)
        if nbytes:
            todo = [chunk for chunk in chunks if (chunk[0], chunk[1]) not in encoded]
            if todo:
                values = self.codec.encode_many(self._rows, todo)
                encoded.update(((key, start), v) for (key, start, _), v in zip(todo, values))
            items = [(key, encoded[key, start], len(slots)) for key, start, slots in chunks]
            self._track(tier, items)
            self._queue(tier, self._writers, partial(self._put, tier, items, nbytes, fresh=False))

    def _encode_later(self, tiers: list[SpillTier], chunks: list[Chunk]) -> None:
        """Pin the slots of ``chunks`` (under the caller's lock) and queue, on the encoder
        thread, their encode (once: every tier of ``tiers`` takes these same chunks) and
        then their write to each tier that has room in the write queue."""
        reserved = [(tier, n) for tier in tiers if (n := self._reserve_chunks(tier, chunks))]
        if reserved:
            slots = [slot for _, _, chunk_slots in chunks for slot in chunk_slots]
            self.host.touch(slots)  # no eviction reuses them before they are encoded
            job = partial(self._encode_then_write, reserved, chunks, slots)
            self._queue(reserved[0][0], self._encoder, job)

    def _encode_then_write(
        self, reserved: list[tuple[SpillTier, int]], chunks: list[Chunk], slots: list[int]
    ) -> None:
        """On the encoder thread: ``_encode_pinned``, then queue the writes."""
        for write in self._encode_pinned(reserved, chunks, slots):
            self._background(*write)

    def _encode_pinned(
        self, reserved: list[tuple[SpillTier, int]], chunks: list[Chunk], slots: list[int]
    ) -> list[HeldWrite]:
        """Encode the chunks whose ``slots`` ``_encode_later`` pinned, make them visible in
        flight in each tier of ``reserved`` (a tier, the bytes reserved for its write),
        and unpin the slots: each tier's write (of chunks just completed: ``fresh``). A
        failure is a lost write-through, counted against every tier, never the caller's
        error: it gives back the bytes and returns no write."""
        blocks: dict[bytes, list[bytes]] = {}
        try:
            values = self.codec.encode_many(self._rows, chunks)
            items = [(key, v, len(s)) for (key, _, s), v in zip(chunks, values)]
            for tier, _ in reserved:
                self._track(tier, items)  # before the slots can go: never out of sight
        except BaseException as e:
            with self._lock:
                self._pending -= sum(nbytes for _, nbytes in reserved)
            if not isinstance(e, Exception):
                raise
            for tier, _ in reserved:
                self._count_error(tier.name, e)
            return []
        finally:
            with self._host_lock:  # only write-through tiers' chunks come here
                for key, _, chunk_slots in chunks:
                    blocks[key] = self.host.cached_blocks(chunk_slots).hashes
                self.host.free(slots)
        return [
            (tier, self._writers, partial(self._put, tier, items, n, fresh=True, blocks=blocks))
            for tier, n in reserved
        ]

    def _reserve_chunks(self, tier: SpillTier, chunks: list[Chunk]) -> int:
        """``_reserve`` the bytes of ``chunks``' values; 0 when there are none or no room."""
        nbytes = sum(self.codec.encoded_nbytes(len(slots)) for _, _, slots in chunks)
        if not chunks or not self._reserve(tier, nbytes, sum(len(s) for _, _, s in chunks)):
            return 0
        return nbytes

    def _queue(self, tier: SpillTier, pool: Executor, job: Callable[[], None]) -> None:
        """Run ``job`` on ``pool``, or hold it back inside ``holding_writes``."""
        if self._held is not None:
            self._held.append((tier, pool, job))
        else:
            self._background(tier, pool, job)

    def _cascade(self, tier: SpillTier, evicted: list[tuple[bytes, bytes]]) -> None:
        """The tier above ``tier`` evicted these chunk values: pass them down as they are
        (same chunk size; ``tier`` checks them when it reads them, like any value)."""
        header, bn = self.codec.header_nbytes, self.codec.block_nbytes
        items = [(key, value, (len(value) - header) // bn) for key, value in evicted]
        nbytes = sum(len(value) for _, value in evicted)
        if self._reserve(tier, nbytes, sum(n for _, _, n in items)):
            self._track(tier, items)
            self._background(
                tier, self._writers, partial(self._put, tier, items, nbytes, fresh=False)
            )

    def _reserve(self, tier: SpillTier, nbytes: int, blocks: int) -> bool:
        """Count ``nbytes`` as queued for a write; False (and the blocks dropped) when the
        queue is full, i.e. the tier is not keeping up. A write larger than the whole
        bound is taken when nothing else is queued: else it could never be written."""
        with self._lock:
            if self._pending and self._pending + nbytes > self._max_pending:
                self._stats[tier.name].dropped += blocks
                return False
            self._pending += nbytes
            return True

    def _put(
        self,
        tier: SpillTier,
        items: list[tuple[bytes, memoryview, int]],
        nbytes: int,
        fresh: bool,
        blocks: dict[bytes, list[bytes]] | None = None,
    ) -> None:
        """Store the chunks the tier does not hold yet. On an I/O worker. ``blocks`` gives
        the block hashes of write-through chunks, recorded as landed once they are.

        Chunks just completed in the host pool (``fresh``) are seldom in the tier: they
        are written only where the key holds nothing (``put_many(only_new=True)``), which
        saves the size query's round trip; a shorter run held under the key stays until
        the chunk is evicted and offered again. Other chunks (evicted, or passed down)
        often are in the tier already: their sizes are asked first, and only those the
        tier lacks or holds shorter (a run ending at the same block that starts later:
        the longer one replaces it) are sent.
        """
        try:
            todo = items
            if not fresh:
                held = tier.sizes_many([key for key, _, _ in items])
                todo = [item for item, size in zip(items, held) if size < len(item[1])]
                if self._tier_log is not None:  # what the tier holds already is there too
                    there = [item for item, size in zip(items, held) if size >= len(item[1])]
                    self._log_put(tier, there, True)
                if not todo:
                    return
            start = time.perf_counter()
            self._log_put(tier, todo, True)  # first: the evictions the write makes come after
            try:
                stored = tier.put_many([(key, value) for key, value, _ in todo], only_new=fresh)
            except BaseException:
                self._log_put(tier, todo, False)
                raise
            seconds = time.perf_counter() - start
            if stored < len(todo):  # held already (fresh), or too large for the tier: which?
                # A value as long as ours is counted as written, whoever wrote it.
                landed = tier.sizes_many([key for key, _, _ in todo])
                skipped = [item for item, size in zip(todo, landed) if size < len(item[1])]
                todo = [item for item, size in zip(todo, landed) if size >= len(item[1])]
                self._log_put(tier, skipped, False)  # a shorter run there goes unannounced
                with self._lock:
                    self._stats[tier.name].dropped += sum(n for _, _, n in skipped)
            with self._lock:
                self._stats[tier.name].count_in(
                    sum(n for _, _, n in todo), sum(len(v) for _, v, _ in todo), seconds
                )
                if blocks:
                    self._record_landed(tier, [blocks[key] for key, _, _ in todo])
            self._count_ok(tier.name)
        finally:
            with self._lock:
                self._pending -= nbytes
                queued = self._in_flight[tier.name]
                journal = self._queued_log[tier.name]
                for key, value, _ in items:
                    if queued.get(key) is value:  # not since replaced by a newer write
                        del queued[key]
                        journal[key] = 0

    def _record_landed(self, tier: SpillTier, chunks: list[list[bytes]]) -> None:
        """Record the blocks of ``chunks`` as in write-through ``tier`` now (landed, or
        read from it; under ``_lock``); beyond twice the host pool's blocks, the oldest
        records go."""
        landed, now = self._landed[tier.name], time.monotonic()
        for hashes in chunks:
            for h in hashes:
                landed.pop(h, None)  # a refreshed record becomes the newest, not just fresh
                landed[h] = now
        for _ in range(len(landed) - 2 * self.host.num_blocks):
            del landed[next(iter(landed))]

    def _not_landed(self, tier: SpillTier, victims: CachedBlocks) -> CachedBlocks:
        """The victims whose write-through chunk did not land in ``tier`` within the last
        ``LANDED_SECONDS``; the others' records go with them (the host pool lets them go).
        Those the tier holds are not offered again: their slots' KV is not encoded twice
        (a write that failed, or a value the tier may have dropped since, is)."""
        landed = self._landed[tier.name]
        if not landed:
            return victims
        since = time.monotonic() - LANDED_SECONDS
        with self._lock:
            keep = [i for i, h in enumerate(victims.hashes) if landed.pop(h, since - 1) < since]
        if len(keep) == len(victims.hashes):
            return victims
        b = victims
        return CachedBlocks(
            [b.block_ids[i] for i in keep],
            [b.hashes[i] for i in keep],
            [b.positions[i] for i in keep],
            [b.parents[i] for i in keep],
        )

    def _track(self, tier: SpillTier, items: list[tuple[bytes, memoryview, int]]) -> None:
        """Make queued values visible to lookups and loads until ``_put`` is over."""
        with self._lock:
            queued = self._in_flight[tier.name]
            journal = self._queued_log[tier.name]
            for key, value, _ in items:
                if len(value) >= len(queued.get(key, b"")):  # the longer run wins
                    queued[key] = value
                    journal[key] = len(value)

    def _background(self, tier: SpillTier, pool: Executor, job: Callable[[], None]) -> None:
        """Run ``job`` on ``pool``; ``flush`` waits for it, and a failure counts against
        ``tier``."""
        future = pool.submit(job)
        with self._lock:
            self._writes.add(future)
        future.add_done_callback(lambda f, t=tier: self._write_done(t, f))

    def _write_done(self, tier: SpillTier, future: Future) -> None:
        error = future.exception()
        if error is not None:
            self._count_error(tier.name, error)
        with self._lock:  # last, so that flush() returns only once the write is counted
            self._writes.discard(future)
            if not self._writes:
                self._idle.notify_all()

    def _count_error(self, name: str, error: BaseException) -> None:
        """Count a failed call of tier ``name``. A tier going down logs one warning with
        the cause, unless one was logged less than ``OUTAGE_LOG_INTERVAL`` ago (a tier
        that flaps); every other failure only counts."""
        now = time.monotonic()
        with self._lock:
            self._stats[name].errors += 1
            outage = self._outages[name]
            outage.failures += 1
            report = not outage.down and (
                outage.logged_at is None or now - outage.logged_at >= OUTAGE_LOG_INTERVAL
            )
            outage.down = True
            if report:
                outage.logged_at, outage.failures, outage.back_due = now, 1, True
        if report:
            log.warning("kvtier: %s tier is down: %s", name, error)

    def _count_ok(self, name: str) -> None:
        """Tier ``name`` answered a call: if it was down, log one warning that it is
        back, with the failed calls since the last "down" line."""
        outage = self._outages[name]
        if not outage.down:  # the common case, no lock
            return
        with self._lock:
            report, outage.down, outage.back_due = outage.back_due, False, False
            failures, since = outage.failures, outage.logged_at or 0.0
        if report:
            log.warning(
                "kvtier: %s tier is back; %d failed calls since it went down %.1f s ago",
                name,
                failures,
                time.monotonic() - since,
            )
