"""The LMDB tier's eviction order, kept in the store itself (policies: ``kvtier.eviction``).

Every method works inside the caller's transaction, so an order changes in the same
commit as the values it orders. Numbers are 8-byte big-endian (byte order is numeric
order); ``seq`` is the tier's use counter (``meta[seq]``), one per use of a key.

=================  ==========================  ======================================
database           key                         value
=================  ==========================  ======================================
``atime``          key                         seq of its last use
``lru``            seq + key                   ``b""``: ``lru``: every stored key;
                                               ``reuse``: the keys in probation
``protected``      seq + key                   ``b""``: ``reuse``: keys used by two or
                                               more requests
``ghosts``         key                         list (1 byte: 0 probation, 1 protected)
                                               + seq: ``reuse``: keys evicted lately
``ghost_order``    list + seq + key            ``b""``: the same, oldest first per list
``meta``           ``b"delta"``                ``reuse``: delta as a multiple of the
                                               keys held (8-byte float)
                   ``b"ghosts0"``, ``ghosts1`` entries in each ghost list
=================  ==========================  ======================================

A stored key has exactly one ``atime`` entry and one entry in ``lru`` or
``protected``. Under ``lru`` ``protected`` and the ghost lists are empty (opening a
store with ``lru`` that ``reuse`` wrote moves every key into ``lru``, in order).
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass

import lmdb

from kvtier.eviction import REUSE_DELTA0, REUSE_DELTA_MAX, REUSE_STEP

_SEQ_LEN = 8
_DELTA = b"delta"
_GHOSTS = (b"ghosts0", b"ghosts1")
_DB_NAMES = (b"atime", b"lru", b"protected", b"ghosts", b"ghost_order")


def _u64(n: int) -> bytes:
    return n.to_bytes(8, "big")


def _int(b: bytes | memoryview | None) -> int:
    return 0 if b is None else int.from_bytes(b, "big")


@dataclass(frozen=True)
class OrderState:
    """An order at one moment (for tests and inspection): keys queued in probation (all
    keys under ``lru``) and in protected, hashes in each ghost list, and delta as a
    multiple of the keys held (None under ``lru``)."""

    queued: tuple[int, int]
    ghosts: tuple[int, int]
    delta: float | None


class EvictionOrder(ABC):
    """The order in which an LMDB tier evicts its keys; one per open tier."""

    ranks_by_uses = False  # whether place/touch look at ``uses``

    def __init__(
        self, env: lmdb.Environment, txn: lmdb.Transaction, data: object, meta: object
    ) -> None:
        """Open (creating) the order's databases in ``txn``; ``data`` and ``meta`` are the
        tier's."""
        self._data, self._meta = data, meta
        self._atime, self._lru, self._protected, self._ghosts, self._ghost_order = (
            env.open_db(name, txn=txn) for name in _DB_NAMES
        )

    @abstractmethod
    def adopt(self, txn: lmdb.Transaction) -> None:
        """Bring a store another policy ordered under this one (at open)."""

    @abstractmethod
    def _queue(self, uses: int) -> object:
        """The order database a key used by ``uses`` requests queues in."""

    @abstractmethod
    def returned(self, txn: lmdb.Transaction, key: bytes) -> None:
        """Note that ``key``, not stored, is being stored (again)."""

    @abstractmethod
    def victim(self, txn: lmdb.Transaction) -> bytes | None:
        """Dequeue and return the key to evict next (None: none queued); the caller
        deletes its value."""

    def place(self, txn: lmdb.Transaction, key: bytes, seq: int, uses: int) -> None:
        """Queue a key just written (queued before or not) as the newest of its queue,
        used at ``seq`` by ``uses`` requests."""
        self._requeue(txn, key, seq, uses, queued_only=False)

    def touch(self, txn: lmdb.Transaction, key: bytes, seq: int, uses: int) -> bool:
        """As ``place`` for a queued key; False, changing nothing, for one that is not
        (deleted since it was read)."""
        return self._requeue(txn, key, seq, uses, queued_only=True)

    def unplace(self, txn: lmdb.Transaction, key: bytes) -> bool:
        """Take a key out of the order; False if it was not queued."""
        stamp = txn.pop(key, db=self._atime)
        if stamp is None:
            return False
        return self._dequeue(txn, bytes(stamp) + key)

    def state(self, txn: lmdb.Transaction) -> OrderState:
        """What the order holds now."""
        queued = (txn.stat(self._lru)["entries"], txn.stat(self._protected)["entries"])
        return OrderState(queued, (0, 0), None)

    def clear(self, txn: lmdb.Transaction) -> None:
        """Forget every key and ghost."""
        for db in (self._atime, self._lru, self._protected):
            txn.drop(db, delete=False)
        self._forget_ghosts(txn)

    def _forget_ghosts(self, txn: lmdb.Transaction) -> None:
        for db in (self._ghosts, self._ghost_order):
            txn.drop(db, delete=False)
        for name in (_DELTA, *_GHOSTS):
            txn.delete(name, db=self._meta)

    def _requeue(
        self, txn: lmdb.Transaction, key: bytes, seq: int, uses: int, queued_only: bool
    ) -> bool:
        stamp = _u64(seq)
        old = txn.replace(key, stamp, db=self._atime)  # a copy of the old stamp
        if old is None and queued_only:
            txn.delete(key, db=self._atime)
            return False
        if old is not None:
            self._dequeue(txn, old + key)
        txn.put(stamp + key, b"", db=self._queue(uses))
        return True

    def _dequeue(self, txn: lmdb.Transaction, entry: bytes) -> bool:
        """Delete an order entry (seq + key) from whichever queue holds it."""
        return txn.delete(entry, db=self._lru) or txn.delete(entry, db=self._protected)

    @staticmethod
    def _first(txn: lmdb.Transaction, db: object) -> bytes | None:
        """The oldest entry (seq + key) of an order database, or None."""
        with txn.cursor(db=db) as cur:
            return bytes(cur.key()) if cur.first() else None


class LRUOrder(EvictionOrder):
    """``lru``: the victim is the key used longest ago."""

    def adopt(self, txn: lmdb.Transaction) -> None:
        with txn.cursor(db=self._protected) as cur:
            entries = [bytes(k) for k, _ in cur]
        for entry in entries:  # seq + key: they land in order among the others
            txn.put(entry, b"", db=self._lru)
        txn.drop(self._protected, delete=False)
        self._forget_ghosts(txn)

    def _queue(self, uses: int) -> object:
        return self._lru

    def returned(self, txn: lmdb.Transaction, key: bytes) -> None:
        pass

    def victim(self, txn: lmdb.Transaction) -> bytes | None:
        entry = self._first(txn, self._lru)
        if entry is None:
            return None
        key = entry[_SEQ_LEN:]
        txn.delete(entry, db=self._lru)
        txn.delete(key, db=self._atime)
        return key


class ReuseOrder(EvictionOrder):
    """``reuse``: probation (``lru``) and ``protected`` queues, the victim the older of
    their oldest with probation's aged by delta; evicted keys are remembered per queue
    (at most as many as the keys held) and move delta when they come back."""

    ranks_by_uses = True

    def adopt(self, txn: lmdb.Transaction) -> None:
        pass  # an LRU-ordered store is one whose keys are all in probation

    def _queue(self, uses: int) -> object:
        return self._protected if uses >= 2 else self._lru

    def returned(self, txn: lmdb.Transaction, key: bytes) -> None:
        ghost = txn.pop(key, db=self._ghosts)
        if ghost is None:
            return
        ghost = bytes(ghost)
        txn.delete(ghost + key, db=self._ghost_order)
        mine = ghost[0]
        counts = self._ghost_counts(txn)
        counts[mine] -= 1
        self._put_ghost_count(txn, mine, counts[mine])
        share = max(1.0, counts[1 - mine] / max(1, counts[mine]))
        step = REUSE_STEP * share / self._held(txn)
        delta = self._delta(txn) + (-step if mine == 0 else step)
        txn.put(_DELTA, struct.pack(">d", min(max(delta, 0.0), REUSE_DELTA_MAX)), db=self._meta)

    def victim(self, txn: lmdb.Transaction) -> bytes | None:
        probation, protected = self._first(txn, self._lru), self._first(txn, self._protected)
        if probation is None and protected is None:
            return None
        held = self._held(txn)
        aged = self._delta(txn) * held
        take_probation = protected is None or (
            probation is not None
            and _int(probation[:_SEQ_LEN]) - aged <= _int(protected[:_SEQ_LEN])
        )
        entry, db, mine = (
            (probation, self._lru, 0) if take_probation else (protected, self._protected, 1)
        )
        stamp, key = entry[:_SEQ_LEN], entry[_SEQ_LEN:]
        txn.delete(entry, db=db)
        txn.delete(key, db=self._atime)
        self._remember(txn, key, mine, stamp, held)
        return key

    def _remember(
        self, txn: lmdb.Transaction, key: bytes, mine: int, stamp: bytes, held: int
    ) -> None:
        """Put an evicted key at the end of ghost list ``mine``, dropping its oldest
        beyond ``held`` entries."""
        counts = self._ghost_counts(txn)
        tag = bytes((mine,))
        with txn.cursor(db=self._ghost_order) as cur:
            while counts[mine] >= held and cur.set_range(tag) and cur.key()[:1] == tag:
                old = bytes(cur.key())
                cur.delete()
                txn.delete(old[1 + _SEQ_LEN :], db=self._ghosts)
                counts[mine] -= 1
        txn.put(key, tag + stamp, db=self._ghosts)
        txn.put(tag + stamp + key, b"", db=self._ghost_order)
        self._put_ghost_count(txn, mine, counts[mine] + 1)

    def state(self, txn: lmdb.Transaction) -> OrderState:
        queued = super().state(txn).queued
        return OrderState(queued, tuple(self._ghost_counts(txn)), self._delta(txn))

    def _held(self, txn: lmdb.Transaction) -> int:
        """Keys stored (at least 1): the tier's capacity in keys once it is full."""
        return max(1, txn.stat(self._data)["entries"])

    def _delta(self, txn: lmdb.Transaction) -> float:
        raw = txn.get(_DELTA, db=self._meta)
        return REUSE_DELTA0 if raw is None else struct.unpack(">d", raw)[0]

    def _ghost_counts(self, txn: lmdb.Transaction) -> list[int]:
        return [_int(txn.get(name, db=self._meta)) for name in _GHOSTS]

    def _put_ghost_count(self, txn: lmdb.Transaction, mine: int, n: int) -> None:
        txn.put(_GHOSTS[mine], _u64(n), db=self._meta)


ORDERS: dict[str, type[EvictionOrder]] = {"lru": LRUOrder, "reuse": ReuseOrder}
