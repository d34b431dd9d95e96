"""The disk tier: chunk values in one LMDB environment, with their eviction order in LMDB.

On-disk schema
--------------
One LMDB environment (a directory holding ``data.mdb`` and ``lock.mdb``) with named
sub-databases. Integers are 8-byte big-endian, so byte order is numeric order.

=========  ==============================  ===========================================
database   key                             value
=========  ==============================  ===========================================
``data``   chunk key (16 bytes, as given)  the chunk value (opaque bytes, may be empty)
``sizes``  chunk key                       the length of its ``data`` value
``meta``   ``b"version"``                  schema version (8 bytes, now 3)
           ``b"nbytes"``                   total bytes of all values in ``data``
           ``b"seq"``                      the next sequence number
``records`` record name (text)             a record (``SpillTier.put_record``)
=========  ==============================  ===========================================

and the eviction order's (``lmdb_order``): ``atime`` (key -> sequence number of its
last use), ``lru`` and ``protected`` (sequence number + key: the queues, first entry
oldest) and the reuse policy's ghost lists. Every key in ``data`` has exactly one
``atime`` entry and one queue entry, and ``meta[nbytes]`` is the sum of the lengths of
the ``data`` values. Every method keeps these invariants inside a single transaction,
so they hold in every committed state; the number of entries is ``data``'s B-tree
count (no separate counter). Version 1 (before ``protected`` and the ghosts) is read
as version 2. ``records`` is outside all of that (``clear`` keeps it);
a store without it (written before it existed) gets an empty one on open, with no
change of version.

``sizes`` exists because py-lmdb touches every page of a value it returns (it faults
them in outside the GIL): asking for a value just to learn its length reads the whole
value, from disk when it is not cached. So lookups (``sizes_many``,
``contains_many``), overwrites and evictions read lengths from ``sizes``, and only
``get_many`` (and an eviction whose values are taken) reads values. Every value has
its ``sizes`` entry, written and deleted in the same transaction as the value, so a
lookup is one B-tree search per key, found or not. Version 2 had no ``sizes``: opening
a version 1 or 2 store measures its values once, in its first transaction, and makes
it version 3; so does opening a version 3 store with fewer ``sizes`` entries than
values (earlier releases adopted version 2 values unmeasured).

Eviction protocol
-----------------
The order is the policy the tier was opened with (``eviction``: ``kvtier.eviction``;
opening a store another policy ordered adopts it). A use (a put, or a read that found
the key) takes the next sequence number from ``meta[seq]`` and requeues the key as the
newest of its queue (under ``reuse``, the queue its use count from ``uses`` picks).
``put_many`` runs in one write transaction: for each value it first removes an
overwritten value's bytes from the total (and its queue entry), then, while ``nbytes +
len(value) > capacity``, deletes the order's victim together with its ``data`` entry,
then writes the value. A value longer than ``capacity`` is skipped (not stored,
nothing evicted). Within one batch a later value may evict an earlier one;
``put_many`` counts both as stored. ``get_many`` reads in one read transaction (values
are handed to the sink zero-copy, straight out of the memory map) and records the
keys it found as used in memory: the next write transaction of this tier (a put, a
delete, or at the latest one of its own once ``MAX_PENDING_USES`` keys wait, or at
``close``) bumps them first, in the order they were read. So a read never waits for
LMDB's writer lock nor pays for a commit, and this process's own evictions see every
read; another process's evictions see them once written. Opening a store with a
smaller ``capacity`` than it holds evicts down to the new capacity at once.

The memory map grows on demand: it starts at ``min(1.25 * capacity + 16 MiB, 64 MiB)``
(or the ``map_size`` argument, or the size the store already has) and doubles on
``MapFullError`` up to ``1.5 * capacity + 64 MiB`` (room for B-tree pages, the
order's indexes and pages LMDB cannot reuse while readers hold old
snapshots); the failed batch is then retried. A store fuller than that raises
``TierError``.

Durability
----------
The environment is opened with ``sync=False, metasync=False``: commits are not
fsynced (``close()`` and ``flush()`` do that). LMDB never overwrites live pages (a
copy-on-write B-tree whose root is switched by the meta page as the last write of a
commit), so a crashed *process* leaves exactly the last committed state. After an
*OS* crash or power loss the most recent commits may be lost; the store stays
consistent as long as the file system keeps the order of writes (LMDB's documented
condition for ``MDB_NOSYNC``). That trade is right for a cache.

Threads and processes
---------------------
One ``lmdb.Environment`` per tier, shared by all threads; each call opens its own
transaction in the calling thread (never shared, never kept across calls). Read
transactions run in parallel; write transactions are serialized by LMDB's writer lock,
which also serializes writers in other processes (``lock=True``), so several processes
on one machine may use the same directory at once, and the accounting in ``meta`` stays
exact because it is only changed inside write transactions.

``env.set_mapsize`` needs every transaction of this process to be closed, so calls take
a shared lock around their transaction and a resize takes it exclusively (a small
readers-writer lock that prefers the resizer). A resize happens on ``MapFullError``
(grow this process's map) or ``MapResizedError`` (another process grew the store beyond
this process's map: adopt its size with ``set_mapsize(0)``); the batch is retried.

LMDB forbids opening one environment twice in one process (closing either copy drops
the other's file locks), so a second ``LMDBTier`` on an open path raises ``TierError``.
Do not use a tier across ``fork()``; open it in the child.

Every other ``lmdb.Error`` (a directory that cannot be written, a full disk, a corrupt
file) is raised as ``TierError`` with the LMDB error chained.

A full file system
------------------
LMDB cannot commit anything, not even an eviction, once its file can neither grow nor
reuse a page (a page freed by a commit is reused two commits later at the earliest).
So the tier keeps a reserve: before a write, if the file system's free space is below
the batch plus ``FS_SLACK`` (at most 1/8 of the file system) and ``data.mdb`` has grown
since the last time, ``capacity`` drops to 90% of the bytes the store holds and the
excess is evicted in transactions of their own, whose pages the write and later ones
reuse inside ``data.mdb``. The first drop logs a warning; capacity does not grow back
until the tier is reopened. A write that still fails is a ``TierError`` like any other.
Opening a store whose capacity exceeds what the file system can give it logs one
warning.

A damaged store
---------------
LMDB reads pages straight out of its memory map, so a ``data.mdb`` shorter than the
pages its meta page says are in use (a partial copy, a restore cut short) would kill
the process with ``SIGBUS`` on the first read of a missing page. On open the tier
checks that the file holds every page up to ``last_pgno``; a store that fails this, or
that LMDB itself reports as corrupt or not an LMDB file, is moved aside (its files
renamed with a ``.damaged-<unix time>`` suffix) with one warning, and the tier starts
empty in the same directory.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar

import lmdb

from kvtier.config import DiskTierConfig, EvictionPolicy
from kvtier.tiers.base import Buffer, SpillTier, TierError, TierUsage, ValueSink
from kvtier.tiers.lmdb_order import ORDERS, OrderState

__all__ = ["LMDBTier"]

log = logging.getLogger(__name__)

MiB = 1 << 20
SCHEMA_VERSION = 3
INITIAL_MAP_CAP = 64 * MiB  # the map starts at most this big ...
MAP_SLACK = 64 * MiB  # ... and grows to at most capacity * MAP_GROWTH_LIMIT + MAP_SLACK
MAP_GROWTH_LIMIT = 1.5
MAX_READERS = 512  # reader slots for all processes together (one per open read txn)
# How every store is opened (see "Durability" and "Threads and processes" above); the
# benchmarks open their raw-lmdb ceiling with the same options.
ENV_OPTIONS: dict[str, object] = {
    "subdir": True,
    "readonly": False,
    "lock": True,
    "writemap": False,
    "metasync": False,
    "sync": False,
    # Values are whole chunks, read whole: the kernel's read-around turns reading a value
    # that is not in the page cache into a few large reads instead of one per page.
    "readahead": True,
    "max_dbs": 16,
    "max_readers": MAX_READERS,
    "max_spare_txns": 8,
}
MAX_RESIZE_RETRIES = 64  # map resizes one call may go through before it gives up
KEYS_PAGE = 1024  # keys() reads this many keys per read transaction
MAX_PENDING_USES = 4096  # reads recorded as uses by the next write at the latest
FS_SLACK = 16 * MiB  # free space (at most 1/8 of the file system) a write keeps in reserve
FULL_DISK_SHRINK = 0.9  # on a nearly full disk, capacity drops to this share of what is held

_VERSION, _NBYTES, _SEQ = b"version", b"nbytes", b"seq"
T = TypeVar("T")


def _u64(n: int) -> bytes:
    return n.to_bytes(8, "big")


def _int(b: Buffer | None) -> int:
    return 0 if b is None else int.from_bytes(b, "big")


def _missing_pages(env: lmdb.Environment, data_file: Path) -> str | None:
    """Why ``data_file`` cannot hold every page ``env`` says is in use; None if it can."""
    size = data_file.stat().st_size
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    if size < needed:
        return f"data.mdb has {size} bytes, its pages in use need {needed}"
    return None


class _SharedExclusiveLock:
    """Many holders of ``shared()`` or one of ``exclusive()``; a waiting exclusive
    holder stops new shared holders, so a resize is never starved. Not re-entrant."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if not self._shared:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


# Directories (by device and inode) with an open LMDBTier in this process.
_open_stores: set[tuple[int, int]] = set()
_open_stores_lock = threading.Lock()


class LMDBTier(SpillTier):
    """A disk spill tier: an LMDB store of at most ``capacity`` value bytes, evicted in
    the order of the ``eviction`` policy (``kvtier.eviction``; the config's default is
    ``reuse``, which needs the owner to set ``uses``).

    ``map_size`` overrides the initial memory-map size (bytes; it grows on demand).
    Raises ``TierError`` if the store cannot be opened, ``ValueError`` for bad arguments.
    """

    def __init__(
        self,
        path: str | Path,
        capacity: int,
        chunk_blocks: int,
        name: str = "disk",
        *,
        map_size: int | None = None,
        eviction: EvictionPolicy = "lru",
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity: expected a positive number of bytes, got {capacity!r}")
        if isinstance(chunk_blocks, bool) or not isinstance(chunk_blocks, int) or chunk_blocks < 1:
            raise ValueError(f"chunk_blocks: expected a positive int, got {chunk_blocks!r}")
        if eviction not in ORDERS:
            raise ValueError(f"eviction: expected one of {', '.join(ORDERS)}, got {eviction!r}")
        self.name = name
        self.eviction = eviction
        self.chunk_blocks = chunk_blocks
        self.path = Path(path)
        self.capacity = capacity
        self.max_map_size = int(capacity * MAP_GROWTH_LIMIT) + MAP_SLACK
        initial = map_size or min(int(capacity * 1.25) + MAP_SLACK // 4, INITIAL_MAP_CAP)
        self._lock = _SharedExclusiveLock()
        self._stats_lock = threading.Lock()
        self._evictions = 0
        self._env: lmdb.Environment | None = None
        # Keys get_many found, not yet recorded as used (see "Eviction protocol").
        self._uses: list[bytes] = []
        self._uses_lock = threading.Lock()
        self._fitted_size = 0  # size of data.mdb when capacity was last lowered to the disk
        self._shrink_lock = threading.Lock()

        try:
            self.path.mkdir(parents=True, exist_ok=True)
            st = os.stat(self.path)
        except OSError as e:
            raise TierError(f"{name}: cannot create the LMDB directory {self.path}: {e}") from e
        self._store_id = (st.st_dev, st.st_ino)
        with _open_stores_lock:
            if self._store_id in _open_stores:
                raise TierError(
                    f"{name}: the LMDB store {self.path} is already open in this process"
                )
            _open_stores.add(self._store_id)
        try:
            self._env = self._open_env(initial)
            self._env.reader_check()  # free reader slots of processes that died
            self._init_schema()
        except BaseException as e:
            self._release()
            if isinstance(e, TierError):
                raise
            if isinstance(e, (lmdb.Error, OSError)):
                raise TierError(f"{name}: cannot open the LMDB store {self.path}: {e}") from e
            raise

    @classmethod
    def from_config(cls, cfg: DiskTierConfig) -> LMDBTier:
        """The tier described by a ``tiers.disk`` config section."""
        return cls(
            cfg.resolved_path, cfg.capacity, cfg.chunk_blocks, name="disk", eviction=cfg.eviction
        )

    # --- opening and closing -------------------------------------------------------

    def _open_env(self, map_size: int) -> lmdb.Environment:
        """The environment at ``self.path``, a damaged one moved aside first (see "A
        damaged store")."""
        try:
            env = lmdb.open(str(self.path), map_size=map_size, **ENV_OPTIONS)
        except (lmdb.CorruptedError, lmdb.InvalidError) as e:
            damage = f"LMDB cannot read it: {e}"
        else:
            damage = _missing_pages(env, self.path / "data.mdb")
            if damage is None:
                return env
            env.close()
        suffix = f".damaged-{int(time.time())}"
        moved = []
        for file in sorted(self.path.glob("*.mdb")):
            file.rename(file.with_name(file.name + suffix))
            moved.append(file.name)
        log.warning(
            "kvtier: %s: the LMDB store in %s is damaged (%s); moved %s aside (suffix %s) "
            "and starting empty",
            self.name,
            self.path,
            damage,
            " and ".join(moved),
            suffix,
        )
        return lmdb.open(str(self.path), map_size=map_size, **ENV_OPTIONS)

    def _init_schema(self) -> None:
        env = self._env
        assert env is not None

        def init(txn: lmdb.Transaction) -> None:
            with txn.cursor() as cur:
                fresh = not cur.first()  # nothing in the main database: a new store
            self._data = env.open_db(b"data", txn=txn)
            self._sizes = env.open_db(b"sizes", txn=txn)
            self._meta = env.open_db(b"meta", txn=txn)
            self._records = env.open_db(b"records", txn=txn)
            version = txn.get(_VERSION, db=self._meta)
            if version is None:
                if not fresh:
                    raise TierError(f"{self.name}: {self.path} is an LMDB store but not kvtier's")
                txn.put(_NBYTES, _u64(0), db=self._meta)
                txn.put(_SEQ, _u64(0), db=self._meta)
            elif not 1 <= _int(version) <= SCHEMA_VERSION:
                raise TierError(
                    f"{self.name}: {self.path} has kvtier LMDB schema version {_int(version)}, "
                    f"this kvtier reads versions 1 to {SCHEMA_VERSION}"
                )
            # Version 1 is version 2 with every key in lru and no ghosts; version 2 is 3
            # without ``sizes`` entries.
            if txn.stat(self._sizes)["entries"] < txn.stat(self._data)["entries"]:
                self._measure_unsized(txn)
            txn.put(_VERSION, _u64(SCHEMA_VERSION), db=self._meta)
            self._order = ORDERS[self.eviction](env, txn, self._data, self._meta)
            self._order.adopt(txn)

        self._run(init, write=True)
        if self.usage().nbytes > self.capacity:  # reopened with a smaller capacity
            self._evict_to_fit(0)
        data_nbytes = (self.path / "data.mdb").stat().st_size
        free = shutil.disk_usage(self.path).free
        if self.capacity > data_nbytes + free:
            log.warning(
                "kvtier: %s: capacity %d B exceeds what the file system of %s can hold for "
                "it (%d B: %d B in data.mdb, %d B free); the tier shrinks if the disk fills",
                self.name,
                self.capacity,
                self.path,
                data_nbytes + free,
                data_nbytes,
                free,
            )

    def _evict_to_fit(self, room: int) -> None:
        """Evict, in a transaction of its own, until ``room`` more bytes fit within
        ``capacity``; the values evicted go to ``on_evict``. (A later transaction can
        reuse the pages this one frees; the one that frees them cannot.)"""
        keep = self.on_evict is not None

        def shrink(txn: lmdb.Transaction) -> list[tuple[bytes, bytes]]:
            evicted: list[tuple[bytes, bytes]] = []
            total = self._evict(txn, _int(txn.get(_NBYTES, db=self._meta)), room, evicted, keep)
            txn.put(_NBYTES, _u64(total), db=self._meta)
            return evicted

        self._evicted(self._run(shrink, write=True))

    def _fit_file_system(self, room: int) -> None:
        """Before a write of ``room`` bytes: lower ``capacity`` if the file system is
        nearly full and ``data.mdb`` grew since it was last lowered (see "A full file
        system")."""
        try:
            disk = shutil.disk_usage(self.path)
            size = (self.path / "data.mdb").stat().st_size
        except OSError:
            return
        if disk.free >= room + min(FS_SLACK, disk.total // 8) or size <= self._fitted_size:
            return
        with self._shrink_lock:
            if size <= self._fitted_size:
                return  # another write lowered it meanwhile
            lowered = max(1, int(min(self.capacity, self.usage().nbytes) * FULL_DISK_SHRINK))
            (log.debug if self._fitted_size else log.warning)(
                "kvtier: %s: the file system of %s is nearly full (%d B free); capacity "
                "lowered from %d B to %d B",
                self.name,
                self.path,
                disk.free,
                self.capacity,
                lowered,
            )
            self.capacity, self._fitted_size = lowered, size
        # Twice: LMDB reuses a page two commits after it was freed. On a disk already
        # full either may fail; the write after them tells.
        for _ in range(2):
            with suppress(TierError):
                self._evict_to_fit(room)

    def _release(self) -> None:
        if self._env is not None:
            env, self._env = self._env, None
            env.close()
        with _open_stores_lock:
            _open_stores.discard(self._store_id)

    def flush(self) -> None:
        """Force committed writes to disk (fsync); ``close()`` does this too."""
        with self._lock.shared():
            env = self._check_open()
            try:
                env.sync(True)
            except lmdb.Error as e:
                raise TierError(f"{self.name}: LMDB sync failed: {e}") from e

    def close(self) -> None:
        """Record pending uses, flush and close the environment; safe to call more than once."""
        if self._env is not None and self._uses:
            with suppress(TierError):  # uses only order evictions: they may be lost
                self._write_uses()
        with self._lock.exclusive():
            if self._env is None:
                return
            try:
                self._env.sync(True)
            except lmdb.Error:
                pass  # a cache: losing unsynced commits is allowed, closing must not fail
            finally:
                self._release()

    def __enter__(self) -> LMDBTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._env is None else "open"
        return f"LMDBTier({str(self.path)!r}, capacity={self.capacity}, {state})"

    # --- transactions, map resizing ------------------------------------------------

    def _check_open(self) -> lmdb.Environment:
        if self._env is None:
            raise TierError(f"{self.name}: the LMDB tier is closed")
        return self._env

    def _run(self, fn: Callable[[lmdb.Transaction], T], *, write: bool) -> T:
        """``fn(txn)`` in one transaction (``buffers=True``), committed if ``write``; a
        write transaction first records the uses ``get_many`` left pending.

        A full map is grown and a map another process grew is adopted, then ``fn``
        runs again in a new transaction; other LMDB errors become ``TierError``.
        """
        uses = self._take_uses() if write else []  # written by whichever attempt commits
        for _ in range(MAX_RESIZE_RETRIES):
            with self._lock.shared():
                env = self._check_open()
                try:
                    with env.begin(write=write, buffers=True) as txn:
                        if uses:
                            self._bump(txn, uses)
                        return fn(txn)
                except lmdb.MapFullError:
                    grow = True
                except lmdb.MapResizedError:
                    grow = False
                except lmdb.Error as e:
                    raise self._error(e) from e
                seen = env.info()["map_size"]  # only changes under the exclusive lock
            self._resize(grow, seen)
        raise TierError(f"{self.name}: LMDB map size kept changing; gave up after retries")

    def _resize(self, grow: bool, seen: int) -> None:
        with self._lock.exclusive():
            env = self._check_open()
            try:
                if env.info()["map_size"] != seen:
                    return  # another thread resized meanwhile: just retry
                # Adopt the store's size first: another process may have grown it.
                env.set_mapsize(0)
                size = env.info()["map_size"]
                if grow and size <= seen:
                    if seen >= self.max_map_size:
                        raise TierError(
                            f"{self.name}: LMDB map is full at its limit of {self.max_map_size} B "
                            f"(capacity {self.capacity} B)"
                        )
                    env.set_mapsize(min(max(seen, size) * 2, self.max_map_size))
            except lmdb.Error as e:
                raise self._error(e) from e

    def _error(self, e: lmdb.Error) -> TierError:
        return TierError(f"{self.name}: LMDB error on {self.path}: {e}")

    # --- accounting helpers (inside a write txn) -------------------------------------

    def _write_uses(self) -> None:
        """A write transaction of its own, for the uses ``get_many`` left pending (every
        write transaction records them first)."""
        self._run(lambda txn: None, write=True)

    def _take_uses(self) -> list[bytes]:
        """The keys read since the last write transaction, in read order; none left."""
        with self._uses_lock:
            uses, self._uses = self._uses, []
        return uses

    def _bump(self, txn: lmdb.Transaction, keys: list[bytes]) -> None:
        """Make ``keys`` the newest of their queues, in order; a key deleted since it was
        read stays deleted."""
        keys = list(reversed(dict.fromkeys(reversed(keys))))  # each once, at its last use
        touch, meta = self._order.touch, self._meta
        seq = _int(txn.get(_SEQ, db=meta))
        for key, uses in zip(keys, self._uses_of(keys)):
            seq += touch(txn, key, seq, uses)
        txn.put(_SEQ, _u64(seq), db=meta)

    def _uses_of(self, keys: Sequence[bytes]) -> Sequence[int]:
        """The use counts of ``keys`` where the eviction order ranks by them, else 1s."""
        if self.uses is None or not self._order.ranks_by_uses:
            return [1] * len(keys)
        return self.uses(keys)

    def _measure_unsized(self, txn: lmdb.Transaction) -> None:
        """Give every value without a ``sizes`` entry one (values a version 2 store
        held; reads each of them once)."""
        sizes = self._sizes
        with txn.cursor(db=self._data) as cur:
            for key in cur.iternext(keys=True, values=False):  # the values stay unread
                if txn.get(key, db=sizes) is None:
                    txn.put(key, _u64(len(cur.value())), db=sizes)

    def _size(self, txn: lmdb.Transaction, key: bytes) -> int:
        """The length of ``key``'s value (-1: absent), from ``sizes`` (module docstring)."""
        size = txn.get(key, db=self._sizes)
        return -1 if size is None else _int(size)

    def _sizes_of(self, txn: lmdb.Transaction, keys: Sequence[bytes], absent: int) -> list[int]:
        """The length of each of ``keys``' values (``absent`` where there is none): the
        lookups' path, one cursor on ``sizes`` for all (a ``get`` per key would parse
        its ``db`` argument every time, which costs more than the B-tree search)."""
        with txn.cursor(db=self._sizes) as cur:
            found, size = cur.set_key, cur.value
            return [_int(size()) if found(k) else absent for k in keys]

    def _remove(self, txn: lmdb.Transaction, key: bytes) -> int:
        """Delete ``key`` from all databases; returns its value's length (-1: absent)."""
        size = self._size(txn, key)
        if size < 0:
            return -1
        self._delete_value(txn, key)
        self._order.unplace(txn, key)
        return size

    def _delete_value(self, txn: lmdb.Transaction, key: bytes) -> None:
        """Delete ``key``'s value and its length (its order entries are the caller's)."""
        txn.delete(key, db=self._data)
        txn.delete(key, db=self._sizes)

    def _evict(
        self,
        txn: lmdb.Transaction,
        total: int,
        room: int,
        evicted: list[tuple[bytes, bytes]],
        keep_values: bool,
    ) -> int:
        """Evict the eviction order's victims until ``room`` more bytes fit beside
        ``total`` bytes.

        Returns the new total; appends ``(key, value)`` to ``evicted`` for each value
        that went (the value copied out when ``keep_values``, else ``b""``). The caller
        writes the total to ``meta`` and reports the evictions once it has committed.
        """
        while total + room > self.capacity:
            key = self._order.victim(txn)
            if key is None:
                break
            size = self._size(txn, key)
            if size >= 0:
                total -= size
                evicted.append((key, bytes(txn.get(key, db=self._data)) if keep_values else b""))
                self._delete_value(txn, key)
        return total

    def _evicted(self, evicted: list[tuple[bytes, bytes]]) -> None:
        """Count and report the values a committed batch evicted (``on_drop`` gets their
        keys, ``on_evict`` the pairs)."""
        if not evicted:
            return
        with self._stats_lock:
            self._evictions += len(evicted)
        if self.on_drop is not None:
            self.on_drop([key for key, _ in evicted])
        if self.on_evict is not None:
            self.on_evict(evicted)

    def order_state(self) -> OrderState:
        """The eviction order's queues, ghost lists and delta (for tests and inspection)."""
        return self._run(self._order.state, write=False)

    @property
    def evictions(self) -> int:
        """Values this process evicted to make room since the tier was opened."""
        return self._evictions

    @property
    def map_size(self) -> int:
        """The current size of this process's memory map of the store, in bytes."""
        with self._lock.shared():
            return self._check_open().info()["map_size"]

    # --- SpillTier -----------------------------------------------------------------

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            self._check_open()
            return []
        return [n >= 0 for n in self._run(lambda txn: self._sizes_of(txn, keys, -1), write=False)]

    def sizes_many(self, keys: Sequence[bytes]) -> list[int]:
        if not keys:
            self._check_open()
            return []
        return self._run(lambda txn: self._sizes_of(txn, keys, 0), write=False)

    def get_many(self, keys: Sequence[bytes], sink: ValueSink) -> list[bool]:
        if not keys:
            self._check_open()
            return []
        data = self._data

        def read(txn: lmdb.Transaction) -> list[bool]:
            found = [False] * len(keys)
            for i, key in enumerate(keys):
                value = txn.get(key, db=data)
                if value is not None:
                    sink(i, value)  # a memoryview into the map, valid during this txn
                    found[i] = True
            return found

        found = self._run(read, write=False)
        hits = [bytes(k) for k, f in zip(keys, found) if f]
        with self._uses_lock:
            self._uses.extend(hits)
            overdue = len(self._uses) >= MAX_PENDING_USES
        if overdue:
            self._write_uses()
        return found

    def put_many(self, items: Sequence[tuple[bytes, Buffer]], only_new: bool = False) -> int:
        if not items:
            self._check_open()
            return 0
        data, sizes, meta = self._data, self._sizes, self._meta

        keep = self.on_evict is not None  # evicted values are copied out only if taken
        order = self._order
        keys = [bytes(key) for key, _ in items]
        uses = self._uses_of(keys)

        def put(txn: lmdb.Transaction) -> tuple[int, list[tuple[bytes, bytes]]]:
            capacity = self.capacity
            total = _int(txn.get(_NBYTES, db=meta))
            seq = _int(txn.get(_SEQ, db=meta))
            stored = 0
            evicted: list[tuple[bytes, bytes]] = []
            for key, (_, value), n in zip(keys, items, uses):
                size = memoryview(value).nbytes
                if size > capacity:
                    continue
                old = self._size(txn, key)
                if old >= 0:
                    if only_new:
                        continue
                    total -= old
                    order.unplace(txn, key)  # keep it out of the eviction below
                else:
                    order.returned(txn, key)
                if total + size > capacity:
                    total = self._evict(txn, total, size, evicted, keep)
                txn.put(key, value, db=data)
                txn.put(key, _u64(size), db=sizes)
                order.place(txn, key, seq, n)
                seq += 1
                total += size
                stored += 1
            txn.put(_NBYTES, _u64(total), db=meta)
            txn.put(_SEQ, _u64(seq), db=meta)
            return stored, evicted

        self._fit_file_system(sum(memoryview(v).nbytes for _, v in items))
        stored, evicted = self._run(put, write=True)
        self._evicted(evicted)
        return stored

    def delete_many(self, keys: Sequence[bytes]) -> int:
        if not keys:
            self._check_open()
            return 0

        def delete(txn: lmdb.Transaction) -> int:
            total = _int(txn.get(_NBYTES, db=self._meta))
            removed = 0
            for key in keys:
                size = self._remove(txn, bytes(key))
                if size >= 0:
                    total -= size
                    removed += 1
            txn.put(_NBYTES, _u64(total), db=self._meta)
            return removed

        return self._run(delete, write=True)

    def keys(self) -> Iterator[bytes]:
        """Every key, in key order; read in pages, so no transaction stays open between
        items (keys written or deleted while iterating may or may not show up)."""
        after: bytes | None = None
        while True:

            def page(txn: lmdb.Transaction, after: bytes | None = after) -> list[bytes]:
                out: list[bytes] = []
                with txn.cursor(db=self._data) as cur:
                    ok = cur.first() if after is None else cur.set_range(after)
                    while ok and len(out) < KEYS_PAGE:
                        key = bytes(cur.key())
                        if key != after:
                            out.append(key)
                        ok = cur.next()
                return out

            keys = self._run(page, write=False)
            if not keys:
                return
            yield from keys
            after = keys[-1]

    def clear(self) -> int:
        def clear(txn: lmdb.Transaction) -> int:
            n = txn.stat(self._data)["entries"]
            txn.drop(self._data, delete=False)
            txn.drop(self._sizes, delete=False)
            self._order.clear(txn)
            txn.put(_NBYTES, _u64(0), db=self._meta)
            return n

        return self._run(clear, write=True)

    def usage(self) -> TierUsage:
        def usage(txn: lmdb.Transaction) -> TierUsage:
            entries = txn.stat(self._data)["entries"]
            return TierUsage(entries, _int(txn.get(_NBYTES, db=self._meta)), self.capacity)

        return self._run(usage, write=False)

    def put_record(self, name: str, value: bytes) -> None:
        self._run(lambda txn: txn.put(name.encode(), value, db=self._records), write=True)

    def records(self) -> dict[str, bytes]:
        def read(txn: lmdb.Transaction) -> dict[str, bytes]:
            with txn.cursor(db=self._records) as cur:
                return {bytes(k).decode(errors="replace"): bytes(v) for k, v in cur}

        return self._run(read, write=False)
