"""Offline views of the spill tiers a config names: what they hold, their chunks, and
clearing them (``kvtier stats``, ``inspect``, ``clear``), per key namespace.

Namespaces. A config with a layout section has one namespace, its own
(``kvtier.tiers.spill_namespace``), whose chunks are checked against that layout. A
config without one (connector mode, e.g. ``configs/vllm.yaml``: the engine supplies the
layout) works on the namespaces recorded in the store: every connector worker records
its namespace, model name, shard and layout in each spill tier it opens
(``kvtier.namespaces``), and each chunk is checked against the recorded layout its
header names. Redis keeps each namespace's values under keys of their own, so it is
reported, inspected and cleared per namespace; the disk store keeps every namespace's
values under keys that do not say which, so it is reported, inspected and cleared as a
whole. Records are not values: ``clear`` keeps them.

Only the spill tiers are opened (no GPU or host pool is built): a disk store that does
not exist yet is reported empty and is not created. Chunk values are read with the
tier's ordinary batched ``get_many`` (which counts as a use for its eviction order) and
checked by ``kvtier.chunk``; nothing is ever unpickled.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from itertools import islice
from typing import Any

from kvtier.chunk import BadChunk, ChunkCodec
from kvtier.config import ConfigError, KVTierConfig
from kvtier.layout import KVLayout
from kvtier.namespaces import NamespaceRecord, read_records
from kvtier.tiers import open_spill_tier, spill_namespace
from kvtier.tiers.base import SpillTier, TierError, TierUsage

READ_PAGE = 32  # chunk values read per batch by ``list_chunks``


class UnknownNamespace(LookupError):
    """A namespace asked for that no tier records; the message lists those they do."""


@dataclass(frozen=True)
class Namespace:
    """A key namespace of the spill tiers and the layouts of its values: the config's own
    (no ``records``) when it has a layout section, else one that connector workers
    recorded in a store (``records``: one per shard, as that store keeps them)."""

    name: str
    layouts: tuple[KVLayout, ...]
    records: tuple[NamespaceRecord, ...] = ()


@dataclass(frozen=True)
class TierReport:
    """What one configured spill tier holds in ``namespace`` (None: the whole store, every
    namespace's values), or why it could not say; ``records``: what the namespaces it
    counts are, as recorded."""

    tier: str
    where: str  # the disk path, or the Redis server and key pattern (no credentials)
    usage: TierUsage | None
    error: str | None = None
    namespace: str | None = None
    records: tuple[NamespaceRecord, ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The report as JSON types."""
        return {
            "tier": self.tier,
            "namespace": self.namespace,
            "where": self.where,
            "usage": asdict(self.usage) if self.usage else None,
            "error": self.error,
            "records": [r.as_json() for r in self.records],
        }


@dataclass(frozen=True)
class ChunkInfo:
    """One stored value: its key, what its header says, and whether it is a valid chunk.

    ``num_blocks`` and ``first_position`` are None when the header cannot be read;
    ``problem`` is None for a valid chunk, else the ``BadChunk`` message (with its reason).
    """

    key: str  # hex
    nbytes: int
    num_blocks: int | None
    first_position: int | None
    problem: str | None


def configured_tiers(config: KVTierConfig, names: Sequence[str] | None = None) -> list[str]:
    """``names`` (default: every configured spill tier, in spill order), checked to be
    configured; ``ConfigError`` naming the first that is not."""
    configured = list(config.tiers.spill_order)
    for name in names or ():
        if name not in configured:
            raise ConfigError(
                f"tiers.{name}",
                None,
                f"no {name} tier is configured (configured spill tiers: "
                f"{', '.join(configured) or 'none'})",
            )
    return list(names) if names else configured


def own_namespace(config: KVTierConfig) -> Namespace | None:
    """The config's own namespace, with its layout; None without a layout section."""
    if config.layout is None:
        return None
    return Namespace(spill_namespace(config, config.layout), (config.layout,))


def where(config: KVTierConfig, name: str, namespace: str | None = None) -> str:
    """Where tier ``name`` keeps the values of ``namespace`` (default: the config's own,
    else every namespace), for people (credentials left out)."""
    if name == "disk":
        return str(config.tiers.disk.resolved_path)
    cfg = config.tiers.redis
    url = re.sub(r"//[^/@]*@", "//", cfg.url)
    own = own_namespace(config)
    return f"{url} keys {cfg.key_prefix}:{namespace or (own.name if own else '*')}:*"


@contextmanager
def open_tier(
    config: KVTierConfig, name: str, namespace: str | None = None
) -> Iterator[SpillTier | None]:
    """Tier ``name`` of ``config``, closed on exit; None for a disk store not created yet.

    ``namespace`` is the Redis key namespace its walks (``keys``, ``usage``, ``clear``)
    cover: by default the config's own, and none for a config without a layout section
    (the store's records, which every namespace shares, read the same). ``TierError``
    when it cannot be opened.
    """
    if name == "disk" and not config.tiers.disk.resolved_path.exists():
        yield None
        return
    if namespace is None:
        own = own_namespace(config)
        namespace = own.name if own else ""
    tier = open_spill_tier(config, name, namespace)
    try:
        yield tier
    finally:
        tier.close()


def store_namespaces(config: KVTierConfig, tier: SpillTier | None) -> list[Namespace]:
    """The namespaces whose values ``tier``'s store holds, by name: the config's own when
    it has a layout section, else those recorded in the store (none in a store not
    created yet). ``TierError`` when its records cannot be read."""
    own = own_namespace(config)
    if own is not None:
        return [own]
    grouped: dict[str, list[NamespaceRecord]] = {}
    for record in read_records(tier) if tier is not None else ():
        grouped.setdefault(record.namespace, []).append(record)
    return [
        Namespace(name, tuple(dict.fromkeys(r.layout for r in records)), tuple(records))
        for name, records in sorted(grouped.items())
    ]


def tier_namespaces(config: KVTierConfig, name: str) -> list[Namespace]:
    """``store_namespaces`` of tier ``name`` (``TierError`` when it cannot be read)."""
    with open_tier(config, name) as tier:
        return store_namespaces(config, tier)


def check_namespace(
    wanted: str | None, known: Iterable[Namespace], unread: Mapping[str, str] | None = None
) -> None:
    """``UnknownNamespace`` unless ``wanted`` (None: every namespace) is among ``known``;
    the message lists those, and the tiers (``unread``: why) whose records could not be
    read."""
    names = sorted({ns.name for ns in known})
    if wanted is None or wanted in names:
        return
    failed = "".join(f"; {tier} could not be read: {why}" for tier, why in (unread or {}).items())
    raise UnknownNamespace(
        f"namespace {wanted} is not recorded in the store (recorded: "
        f"{', '.join(names) or 'none'}{failed})"
    )


def reports(
    config: KVTierConfig, names: Sequence[str], namespace: str | None = None
) -> list[TierReport]:
    """What tiers ``names`` hold, in ``namespace`` (None: all): the disk store as one
    report, Redis one per namespace it records (the config's own, or ``namespace``),
    with those namespaces' records. A tier that cannot be reached is reported, not
    raised; ``UnknownNamespace`` when no tier that answered records ``namespace``."""
    found: dict[str, list[Namespace]] = {}
    unread: dict[str, str] = {}
    for name in names:
        try:
            found[name] = tier_namespaces(config, name)
        except (TierError, ConfigError) as e:
            unread[name] = str(e)
    check_namespace(namespace, (ns for nss in found.values() for ns in nss), unread)
    out: list[TierReport] = []
    for name in names:
        if name in unread:
            out.append(TierReport(name, where(config, name, namespace), None, unread[name]))
            continue
        shown = [ns for ns in found[name] if namespace in (None, ns.name)]
        if name == "disk":
            out.append(_report(config, name, None, shown))
            continue
        targets = [namespace] if namespace else [ns.name for ns in shown]
        out += [_report(config, name, t, [ns for ns in shown if ns.name == t]) for t in targets]
        if not targets:
            out.append(TierReport(name, where(config, name), TierUsage(0, 0, None)))
    return out


def _report(
    config: KVTierConfig, name: str, namespace: str | None, shown: Sequence[Namespace]
) -> TierReport:
    """What tier ``name`` holds in ``namespace`` (None: the whole store); ``shown``: the
    namespaces it counts."""
    at = where(config, name, namespace)
    records = tuple(r for ns in shown for r in ns.records)
    try:
        with open_tier(config, name, namespace) as tier:
            usage = tier.usage() if tier else TierUsage(0, 0, config.tiers.disk.capacity)
    except (TierError, ConfigError) as e:
        return TierReport(name, at, None, str(e), namespace, records)
    return TierReport(name, at, usage, None, namespace, records)


@contextmanager
def codecs_for(layouts: Iterable[KVLayout]) -> Iterator[list[ChunkCodec]]:
    """A codec per distinct layout of ``layouts``, closed on exit; ``ConfigError`` naming
    ``layout`` when there is none (a config without a layout section, and a store that
    records none)."""
    distinct = list(dict.fromkeys(layouts))
    if not distinct:
        raise ConfigError(
            "layout",
            None,
            "a layout section, or namespace records in the store (a connector writes "
            "them when it opens it): chunks are checked against a layout",
        )
    codecs = [ChunkCodec(layout) for layout in distinct]
    try:
        yield codecs
    finally:
        for codec in codecs:
            codec.close()


def list_chunks(tier: SpillTier, codecs: Sequence[ChunkCodec], limit: int) -> Iterator[ChunkInfo]:
    """The first ``limit`` values of ``tier`` (in the tier's key order), each checked as
    a chunk of the layout of ``codecs`` its header names. Values are read ``READ_PAGE``
    at a time."""
    keys = islice(tier.keys(), limit)
    while page := list(islice(keys, READ_PAGE)):
        yield from _read_page(tier, codecs, page)


def _read_page(tier: SpillTier, codecs: Sequence[ChunkCodec], keys: list[bytes]) -> list[ChunkInfo]:
    found: dict[int, ChunkInfo] = {}

    def sink(i: int, value: memoryview) -> None:
        found[i] = describe(codecs, keys[i], value)

    tier.get_many(keys, sink)
    # A key deleted (or expired) between listing and reading is simply not shown.
    return [found[i] for i in sorted(found)]


def describe(codecs: Sequence[ChunkCodec], key: bytes, value: memoryview) -> ChunkInfo:
    """A value stored under ``key``, checked in full by the codec of ``codecs`` whose
    layout its header names (else by the first, which names what is wrong)."""
    codec = next((c for c in codecs if c.peek(value) is not None), codecs[0])
    try:
        header, _ = codec.decode(value, key)
        problem = None
    except BadChunk as e:
        header, problem = codec.peek(value), str(e)
    return ChunkInfo(
        key.hex(),
        value.nbytes,
        header.num_blocks if header else None,
        header.first_position if header else None,
        problem,
    )
