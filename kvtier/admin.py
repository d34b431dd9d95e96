"""Offline views of the spill tiers a config names: what they hold, their chunks, and
clearing them (``kvtier stats``, ``inspect``, ``clear``).

Only the spill tiers are opened (no GPU or host pool is built): a disk store that does
not exist yet is reported empty and is not created. Chunk values are read with the
tier's ordinary batched ``get_many`` (which counts as a use for its eviction order) and
checked by ``kvtier.chunk``; nothing is ever unpickled.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice

from kvtier.chunk import BadChunk, ChunkCodec
from kvtier.config import ConfigError, KVTierConfig
from kvtier.layout import KVLayout
from kvtier.tiers import open_spill_tier, spill_namespace
from kvtier.tiers.base import SpillTier, TierError, TierUsage

READ_PAGE = 32  # chunk values read per batch by ``list_chunks``


@dataclass(frozen=True)
class TierReport:
    """What one configured spill tier holds, or why it could not say."""

    tier: str
    where: str  # the disk path, or the Redis server and key pattern (no credentials)
    usage: TierUsage | None
    error: str | None = None


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


def where(config: KVTierConfig, name: str) -> str:
    """Where tier ``name`` keeps its values, for people (credentials left out)."""
    if name == "disk":
        return str(config.tiers.disk.resolved_path)
    cfg = config.tiers.redis
    url = re.sub(r"//[^/@]*@", "//", cfg.url)
    namespace = spill_namespace(config, config.layout) if config.layout else "?"
    return f"{url} keys {cfg.key_prefix}:{namespace}:*"


@contextmanager
def open_tier(config: KVTierConfig, name: str) -> Iterator[SpillTier | None]:
    """Tier ``name`` of ``config``, closed on exit; None for a disk store not created yet.

    ``TierError`` when it cannot be opened; ``ConfigError`` for a Redis tier without a
    layout section (its key namespace derives from the layout).
    """
    if name == "disk" and not config.tiers.disk.resolved_path.exists():
        yield None
        return
    tier = open_spill_tier(config, name, spill_namespace(config, require_layout(config)))
    try:
        yield tier
    finally:
        tier.close()


def report(config: KVTierConfig, name: str) -> TierReport:
    """What tier ``name`` holds; a tier that cannot be reached is reported, not raised."""
    try:
        with open_tier(config, name) as tier:
            usage = tier.usage() if tier else TierUsage(0, 0, config.tiers.disk.capacity)
    except (TierError, ConfigError) as e:
        return TierReport(name, where(config, name), None, str(e))
    return TierReport(name, where(config, name), usage)


def list_chunks(tier: SpillTier, codec: ChunkCodec, limit: int) -> Iterator[ChunkInfo]:
    """The first ``limit`` values of ``tier`` (in the tier's key order), each checked as
    a chunk of ``codec``'s layout. Values are read ``READ_PAGE`` at a time."""
    keys = islice(tier.keys(), limit)
    while page := list(islice(keys, READ_PAGE)):
        yield from _read_page(tier, codec, page)


def _read_page(tier: SpillTier, codec: ChunkCodec, keys: list[bytes]) -> list[ChunkInfo]:
    found: dict[int, ChunkInfo] = {}

    def sink(i: int, value: memoryview) -> None:
        found[i] = describe(codec, keys[i], value)

    tier.get_many(keys, sink)
    # A key deleted (or expired) between listing and reading is simply not shown.
    return [found[i] for i in sorted(found)]


def describe(codec: ChunkCodec, key: bytes, value: memoryview) -> ChunkInfo:
    """A value stored under ``key``, checked in full by ``codec``."""
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


def require_layout(config: KVTierConfig) -> KVLayout:
    """The config's layout; ``ConfigError`` naming ``layout`` when it has none."""
    if config.layout is None:
        raise ConfigError(
            "layout",
            None,
            "a layout section: chunk checks and the Redis key namespace derive from it",
        )
    return config.layout
