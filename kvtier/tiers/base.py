"""The interface every spill tier implements: a batched store of chunk values.

A spill tier maps 16-byte chunk keys (the chained hash of a chunk's last block) to
opaque values (``kvtier.chunk`` encodes and checks them; a tier never interprets
them). Every method works on a batch: one LMDB transaction, one Redis pipeline.

Errors: a method that cannot reach its store raises ``TierError`` (with the cause
chained). The cache catches it, counts it, and treats the batch as missed or dropped;
nothing a tier raises reaches the engine. A tier never pickles anything.

Threads: a tier may be called from several I/O worker threads at once and must be
safe for that (LMDB: one environment, a transaction per call; Redis: a connection
pool).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

Buffer = bytes | bytearray | memoryview

# Called once per present key, with the index of the key in the request and its value.
# The buffer is valid only during the call (it may point into a memory map, or into a
# buffer that the next value is read into).
ValueSink = Callable[[int, memoryview], None]

# Receives the (key, value) pairs a tier evicted to make room, after they are gone.
EvictionSink = Callable[[list[tuple[bytes, bytes]]], None]

# How many requests used each key's block (``kvtier.eviction``), for a tier whose
# eviction policy ranks by it.
UseHint = Callable[[Sequence[bytes]], list[int]]


class TierError(RuntimeError):
    """The tier's store could not be reached or failed; the batch did not happen."""


@dataclass(frozen=True)
class TierUsage:
    """What a tier holds now: values, their total bytes, and its capacity (None: unbounded)."""

    entries: int
    nbytes: int
    capacity: int | None


class SpillTier(ABC):
    """A batched key -> value store for chunks, with its own chunk size."""

    name: str  # "disk", "redis": the config section it was built from
    chunk_blocks: int  # blocks per chunk written to this tier
    # Set by the owner to pass evicted values on (to the next tier). Called on the thread
    # whose put caused the eviction, after its batch has committed. A tier whose store
    # evicts on its own (Redis under maxmemory) never calls it.
    on_evict: EvictionSink | None = None
    # Set by the owner to learn the keys of the values this tier evicted to make room
    # (after the batch has committed), without their values. Redis never calls it.
    on_drop: Callable[[list[bytes]], None] | None = None
    # Set by the owner to the use counts of the cache's blocks; a tier whose eviction
    # policy ranks by them (LMDB under ``reuse``) asks it for the keys it writes and
    # reads. Without it every key counts as used once.
    uses: UseHint | None = None

    @property
    def evictions(self) -> int:
        """Values this tier evicted to make room (0 where the store evicts on its own)."""
        return 0

    @abstractmethod
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are present, in one batch (one round trip / one transaction)."""

    @abstractmethod
    def sizes_many(self, keys: Sequence[bytes]) -> list[int]:
        """The byte length of each key's value, 0 where it is absent, in one batch (one
        round trip / one transaction); not a use. An empty value also reads 0 (Redis
        cannot tell it from an absent key in one command; no chunk value is empty)."""

    @abstractmethod
    def get_many(self, keys: Sequence[bytes], sink: ValueSink) -> list[bool]:
        """Call ``sink(i, value)`` for every present ``keys[i]``; returns which were present.

        Reads are one batch; reading counts as a use for the tier's eviction order.
        """

    @abstractmethod
    def put_many(self, items: Sequence[tuple[bytes, Buffer]], only_new: bool = False) -> int:
        """Store (or overwrite) the values, one batch; returns how many were stored.

        A full tier makes room by evicting its least recently used values; a value it
        cannot hold at all is skipped (not stored, not an error). With ``only_new``, a
        key that holds a value keeps it and is not counted (checked and written as one
        step per key, so of two writers of a key exactly one stores it).
        """

    @abstractmethod
    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Remove the keys that are present; returns how many were removed."""

    @abstractmethod
    def keys(self) -> Iterator[bytes]:
        """Every key this tier holds in its namespace (for inspection; may be slow)."""

    @abstractmethod
    def clear(self) -> int:
        """Delete every value in this tier's namespace; returns how many."""

    @abstractmethod
    def usage(self) -> TierUsage:
        """What the tier holds now."""

    @abstractmethod
    def put_record(self, name: str, value: bytes) -> None:
        """Store a small record under ``name`` beside the values, replacing one of that
        name. A record is no value: ``keys``, ``usage``, the eviction order and expiry
        never see it, and ``clear`` keeps it. Records say what the store's namespaces
        are (``kvtier.namespaces``)."""

    @abstractmethod
    def records(self) -> dict[str, bytes]:
        """Every record of the store by name, whichever namespace wrote it."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and handles; the tier is unusable afterwards."""
