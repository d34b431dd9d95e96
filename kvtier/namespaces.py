"""Namespace records: what each key namespace of a spill store holds, kept in the store.

An engine's values in the spill tiers carry no readable trace of what wrote them (a
key is a chained hash; a value names only its layout's fingerprint), and in connector
mode the layout comes from the engine, not from the config. So each connector worker
(``kvtier.connector.ConnectorCache``), when it opens its spill tiers, writes into every
one of them a record of its namespace and shard: the engine's model name, the shard
(rank) and the layout of its blocks. ``kvtier stats``, ``inspect`` and ``clear``
(``kvtier.admin``) read them to list a store's namespaces and to check its chunks
against the layouts that wrote them.

A record is stored with ``SpillTier.put_record`` under the name ``<namespace>/<shard>``
(so every shard writes its own and concurrent workers never read-modify-write one
record); a later opening overwrites it. The value is a msgpack map, never pickled::

    {"v": 1, "ns": str, "engine": str, "shard": str,
     "layout": [num_layers, kv_factor, block_size, num_kv_heads, head_dim, dtype name],
     "fp": 16-byte layout fingerprint, "opened": unix time of the opening}

``decode`` checks all of it (the fingerprint against the layout, the name against the
namespace and shard) and raises ``BadRecord`` naming what is wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack

from kvtier.layout import DTYPES, KVLayout, dtype_name
from kvtier.tiers.base import SpillTier, TierError

log = logging.getLogger(__name__)

RECORD_VERSION: Final = 1
_KEYS: Final = frozenset(("v", "ns", "engine", "shard", "layout", "fp", "opened"))


class BadRecord(ValueError):
    """A stored record that is not a namespace record this kvtier reads; says why."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"bad namespace record {name!r}: {problem}")


@dataclass(frozen=True)
class NamespaceRecord:
    """One shard of an engine that opened a store: its key ``namespace`` (16 hex
    digits), ``engine`` (the model name it serves, e.g. ``vllm:<model>``), ``shard``
    (its rank), the ``layout`` of its blocks, and when it ``opened`` the store."""

    namespace: str
    engine: str
    shard: str
    layout: KVLayout
    opened: float

    @property
    def name(self) -> str:
        """The name the record is stored under."""
        return f"{self.namespace}/{self.shard}"

    def encode(self) -> bytes:
        """The stored value (module docstring)."""
        layout = self.layout
        dims = [layout.num_layers, layout.kv_factor, layout.block_size]
        dims += [layout.num_kv_heads, layout.head_dim, dtype_name(layout.dtype)]
        fields = {"v": RECORD_VERSION, "ns": self.namespace, "engine": self.engine}
        fields |= {"shard": self.shard, "layout": dims, "fp": layout.fingerprint}
        return msgpack.packb({**fields, "opened": self.opened}, use_bin_type=True)

    @classmethod
    def decode(cls, name: str, value: bytes) -> NamespaceRecord:
        """The record stored as ``value`` under ``name``; ``BadRecord`` if it is not one."""
        try:
            fields = msgpack.unpackb(value, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise BadRecord(name, f"not msgpack ({e})") from None
        if not isinstance(fields, dict) or set(fields) != _KEYS:
            raise BadRecord(name, f"expected a map of {sorted(_KEYS)}")
        if fields["v"] != RECORD_VERSION:
            raise BadRecord(name, f"version {fields['v']!r}, this kvtier reads {RECORD_VERSION}")
        texts = [fields[k] for k in ("ns", "engine", "shard")]
        if not all(isinstance(t, str) for t in texts) or not isinstance(fields["opened"], float):
            raise BadRecord(name, "ns, engine and shard must be text and opened a time")
        try:
            *dims, dtype = fields["layout"]
            layout = KVLayout(*dims, DTYPES[dtype])
        except (ValueError, TypeError, KeyError) as e:
            raise BadRecord(name, f"its layout {fields['layout']!r} is not one ({e})") from None
        if fields["fp"] != layout.fingerprint:
            raise BadRecord(name, "its layout fingerprint does not match its layout")
        record = cls(*texts, layout, fields["opened"])
        if record.name != name:
            raise BadRecord(name, f"it describes {record.name!r}")
        return record

    def as_json(self) -> dict[str, Any]:
        """The record as JSON types (the layout by its fields and its fingerprint in hex)."""
        layout = self.layout
        return {
            "namespace": self.namespace,
            "engine": self.engine,
            "shard": self.shard,
            "layout": {
                "num_layers": layout.num_layers,
                "kv_factor": layout.kv_factor,
                "block_size": layout.block_size,
                "num_kv_heads": layout.num_kv_heads,
                "head_dim": layout.head_dim,
                "dtype": dtype_name(layout.dtype),
            },
            "fingerprint": layout.fingerprint.hex(),
            "opened": self.opened,
        }


def record_namespace(tiers: Sequence[SpillTier], record: NamespaceRecord) -> None:
    """Write ``record`` into every tier of ``tiers``; a tier that cannot take it is
    logged, never raised (the values it stores are still good, only less visible)."""
    value = record.encode()
    for tier in tiers:
        try:
            tier.put_record(record.name, value)
        except TierError as e:
            log.warning("kvtier: %s tier: cannot record %s: %s", tier.name, record.name, e)


def read_records(tier: SpillTier) -> list[NamespaceRecord]:
    """Every namespace record ``tier``'s store holds, by name; a bad one is logged and
    left out. ``TierError`` when the store cannot be read."""
    records = []
    for name, value in sorted(tier.records().items()):
        try:
            records.append(NamespaceRecord.decode(name, value))
        except BadRecord as e:
            log.warning("kvtier: %s tier: %s", tier.name, e)
    return records
