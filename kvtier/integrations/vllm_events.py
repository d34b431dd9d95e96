"""kvtier's tiers in vLLM's KV events: what the scheduler's connector publishes.

With ``--kv-events-config`` vLLM publishes its GPU prefix cache as ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` events, and each step adds what the scheduler's
connector returns from ``take_events()``. ``TierEvents`` derives kvtier's part there,
in the engine core, from what the scheduler already learns each step: the workers'
reports (``ShardReport``: keys each shard's host pool gained and lost; with
``ConnectorCache.track_tiers``, spill values that landed in a tier or left it). Media,
localities and ownerships are ``kvtier.events.TIER_MEDIA``.

Contract.

- ``BlockStored`` (medium of the tier) when a block becomes held in a tier by every
  shard of the replica (tensor x pipeline ranks: each holds its part of the block's
  KV, and a load needs them all; ranks that hold the same KV, as MLA's, store one copy
  below, so there one value under their shared key suffices), ``BlockRemoved`` when it
  stops being so; one event per block and tier for the replica, never per rank. A
  spill value holds the blocks of its run; a block stays held while any value covering
  it is there.
- Blocks carry vLLM's own block hashes (as vLLM's GPU events publish them), the parent
  hash, the token ids and the block size, so they join vLLM's GPU events. Consecutive
  blocks of one chain stored in one step go in one ``BlockStored``.
- ``reset`` (vLLM's ``reset_prefix_cache(reset_connector=True)``): every block held
  is removed (kvtier's keys move to a new key space; vLLM's own ``AllBlocksCleared``
  covers the GPU pool).
- A tier with a TTL (Redis, ``tiers.redis.ttl``): a value is removed ``ttl`` seconds
  after it last landed. Reads refresh the expiry in Redis (any replica's), so the
  value may outlive that: the index then undercounts, never claims what is gone
  because of the TTL.
- Batched per step: nothing is published before ``take``. Bounded: a block's metadata
  (hash, tokens) is kept while a tier holds it, and for ``RECENT_BLOCKS`` blocks noted
  or let go most recently (a save that lands later, a host victim whose disk write
  has not landed yet).

Known limits: a value the store drops without telling (Redis ``maxmemory``, a
``kvtier clear`` from another process) is not removed; a value found in a tier that
this replica did not see land (written before a restart, or by another replica) is
not announced; it becomes a host block, announced, when a request loads it.

This module needs vLLM only in ``to_vllm``; ``TierEvents`` is plain Python.
"""

from __future__ import annotations

import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.connector import ShardReport, ShardSpec, shard_keys
from kvtier.events import medium_of

# Tier name of kvtier's host pool in events (the spill tiers go by their config names).
HOST = "cpu"
# Blocks whose metadata is kept though no tier holds them (noted, or let go, lately).
RECENT_BLOCKS = 1 << 16


@dataclass(frozen=True)
class BlockInfo:
    """What a ``BlockStored`` says of one block: vLLM's hash of it and of its parent
    (None: block 0), its tokens (compact: kept while a tier holds the block); ``key``
    and ``parent_key`` are kvtier's base keys."""

    key: bytes
    parent_key: bytes | None
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: array


@dataclass
class Stored:
    """``blocks`` (a chain: each one's parent is the one before) became held in ``tier``."""

    tier: str
    blocks: list[BlockInfo]


@dataclass
class Removed:
    """Blocks of vLLM hashes ``hashes`` are no longer held in ``tier``."""

    tier: str
    hashes: list[bytes]


class TierEvents:
    """The scheduler's derivation of kvtier's KV events (module docstring). Not
    thread-safe: vLLM's scheduler calls it from one thread."""

    def __init__(
        self,
        algorithm: str,
        ttl: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._algorithm = algorithm
        self._ttl = dict(ttl or {})  # tier -> seconds a value lives after it lands
        self._clock = clock
        # Values of tiers with a TTL, oldest landing first: (tier, shard, key) -> when.
        self._landed: OrderedDict[tuple[str, int, bytes], float] = OrderedDict()
        self.shards: list[ShardSpec] = []
        self._shard_index: dict[str, int] = {}
        self._blocks: dict[bytes, BlockInfo] = {}  # base key -> metadata
        self._keys: dict[bytes, tuple[bytes, ...]] = {}  # base key -> its key in each shard
        self._base: dict[bytes, bytes] = {}  # shard key -> base key
        # tier -> shard key -> values holding that shard's part; the host pool's by
        # (shard, shard key) -> 1: replicas' host pools hold the same keys, each a copy
        self._cover: dict[str, Counter[bytes | tuple[int, bytes]]] = {}
        self._holders: dict[str, Counter[bytes]] = {}  # tier -> base key -> shards holding it
        self._roots = 0  # distinct roots of the shards' keys: copies of a block below
        self._values: dict[str, dict[bytes, tuple[bytes, ...]]] = {}  # value key -> its blocks
        self._refs: Counter[bytes] = Counter()  # base key -> (tier, shard) parts held
        self._recent: OrderedDict[bytes, None] = OrderedDict()
        self._changes: list[tuple[bool, str, BlockInfo]] = []  # (stored?, tier, block)

    @classmethod
    def from_config(cls, config: KVTierConfig) -> TierEvents:
        """For the connector of ``config``: its hash algorithm, its Redis TTL."""
        redis = config.tiers.redis
        ttl = {"redis": redis.ttl} if redis is not None and redis.ttl else {}
        return cls(config.hashing.algorithm, ttl)

    def set_shards(self, shards: Sequence[ShardSpec]) -> None:
        """The replica's shards (the workers' handshake); reports of others are ignored.
        The same shards again (vLLM repeats the handshake after a wake-up) change
        nothing; other shards hold none of the blocks held so far: they are removed."""
        if list(shards) == self.shards:
            return
        self.reset()
        self.shards = list(shards)
        self._roots = len({s.root for s in self.shards})
        self._shard_index = {s.name: i for i, s in enumerate(self.shards)}

    def note(self, request: Any, keys: Sequence[bytes], start: int, end: int,
             block_size: int) -> None:  # fmt: skip
        """Blocks ``start..end`` of vLLM ``request`` (its ``block_hashes`` and
        ``all_token_ids``; ``keys`` its base keys from block 0) may enter kvtier's tiers
        (a save, a load or a stage is handed to the workers): keep what their events
        need."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        new = [i for i in range(start, end) if keys[i] not in self._blocks]
        for i in new:
            self._blocks[keys[i]] = BlockInfo(
                keys[i],
                keys[i - 1] if i else None,
                bytes(hashes[i]),
                bytes(hashes[i - 1]) if i else None,
                array("i", tokens[i * block_size : (i + 1) * block_size]),
            )
        per_shard = [
            shard_keys(s.root, [keys[i] for i in new], self._algorithm) for s in self.shards
        ]
        for j, i in enumerate(new):
            own = tuple(ks[j] for ks in per_shard)
            self._keys[keys[i]] = own
            self._base.update(dict.fromkeys(own, keys[i]))
        for i in range(start, end):
            if keys[i] not in self._refs:
                self._let_go(keys[i])

    def apply(self, reports: dict[str, ShardReport]) -> None:
        """Take the workers' reports of a step (by shard name)."""
        for name, report in reports.items():
            shard = self._shard_index.get(name)
            if shard is None:
                continue
            host = self._cover.setdefault(HOST, Counter())
            for key, present in report.held.items():
                if present != ((shard, key) in host) and key in self._base:
                    self._cover_keys(HOST, [key], 1 if present else -1, shard)
            for tier, values in report.stored.items():
                for key, n in values.items():
                    self._value(tier, shard, key, n)

    def reset(self) -> None:
        """Every block held is removed; all state goes (kvtier moved to new keys)."""
        for tier, holders in self._holders.items():
            for base, n in holders.items():
                if n == self._needed(tier):
                    self._changes.append((False, tier, self._blocks[base]))
        self._forget_all()

    def take(self) -> list[Stored | Removed]:
        """This step's events, in order: runs of one tier's stored chain blocks, or of
        one tier's removals, each one event. Values past their tier's TTL go first."""
        self._expire()
        out: list[Stored | Removed] = []
        for stored, tier, block in self._changes:
            last = out[-1] if out else None
            if stored:
                if (
                    isinstance(last, Stored)
                    and last.tier == tier
                    and (last.blocks[-1].key == block.parent_key)
                ):
                    last.blocks.append(block)
                else:
                    out.append(Stored(tier, [block]))
            elif isinstance(last, Removed) and last.tier == tier:
                last.hashes.append(block.block_hash)
            else:
                out.append(Removed(tier, [block.block_hash]))
        self._changes = []
        return out

    # ------------------------------------------------------------------ internals
    def _value(self, tier: str, shard: int, key: bytes, blocks: int) -> None:
        """Shard ``shard``'s value under ``key`` in ``tier`` now holds the run of
        ``blocks`` blocks ending at ``key``'s block (0: none)."""
        values = self._values.setdefault(tier, {})
        old = values.pop(key, ())
        run: list[bytes] = []
        base = self._base.get(key)
        while blocks and base is not None and len(run) < blocks and base in self._keys:
            run.append(self._keys[base][shard])
            base = self._blocks[base].parent_key
        run.reverse()  # chain order, so that the run is one event
        if run:
            values[key] = tuple(run)
        if tier in self._ttl:
            self._landed.pop((tier, shard, key), None)
            if run:
                self._landed[(tier, shard, key)] = self._clock()
        self._cover_keys(tier, run, 1)  # before the old run goes: no block flaps
        self._cover_keys(tier, old, -1)

    def _expire(self) -> None:
        """Values that landed longer than their tier's TTL ago leave the index."""
        now = self._clock()
        while self._landed:
            (tier, shard, key), landed = next(iter(self._landed.items()))
            if now - landed < self._ttl[tier]:
                return
            self._value(tier, shard, key, 0)

    def _cover_keys(
        self, tier: str, keys: Sequence[bytes], step: int, shard: int | None = None
    ) -> None:
        """One more (``step`` 1) or one fewer (-1) value of ``tier`` holds each of
        these shard keys (the host pool: ``shard``'s); a shard key held by none, or
        newly by one, changes its block's holders."""
        cover = self._cover.setdefault(tier, Counter())
        for key in keys:
            part = key if shard is None else (shard, key)
            before = cover[part]
            cover[part] = before + step
            if cover[part] <= 0:
                del cover[part]
            if (before == 0) != (cover[part] == 0):
                self._hold(tier, self._base[key], step)

    def _hold(self, tier: str, base: bytes, step: int) -> None:
        """One shard more (1) or fewer (-1) holds block ``base`` in ``tier``; the
        every-shard rule turns that into a stored or removed event."""
        holders = self._holders.setdefault(tier, Counter())
        before = holders[base]
        holders[base] = before + step
        if not holders[base]:
            del holders[base]
        needed = self._needed(tier)
        if holders[base] == needed:
            self._changes.append((True, tier, self._blocks[base]))
        elif before == needed:
            self._changes.append((False, tier, self._blocks[base]))
        self._refs[base] += step
        if self._refs[base] <= 0:
            del self._refs[base]
            self._let_go(base)

    def _needed(self, tier: str) -> int:
        """Holders that make a block held in ``tier``: every shard's host pool; below,
        a value under each distinct root (replicas share one copy)."""
        return len(self.shards) if tier == HOST else self._roots

    def _let_go(self, base: bytes) -> None:
        """``base`` is held nowhere: keep its metadata among the recent ones a while."""
        self._recent[base] = None
        self._recent.move_to_end(base)
        while len(self._recent) > RECENT_BLOCKS:
            old, _ = self._recent.popitem(last=False)
            if old not in self._refs:
                del self._blocks[old]
                for key in self._keys.pop(old):
                    self._base.pop(key, None)  # replicas' keys are alike

    def _forget_all(self) -> None:
        for state in (self._blocks, self._keys, self._base, self._cover, self._holders,
                      self._values, self._refs, self._recent, self._landed):  # fmt: skip
            state.clear()


def events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config`` with
    ``enable_kv_cache_events``); without them kvtier does no event work at all."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)


def to_vllm(events: Sequence[Stored | Removed], block_size: int) -> list[Any]:
    """``events`` as vLLM's ``BlockStored`` / ``BlockRemoved``, hashes converted as vLLM
    converts its GPU events' (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as convert

    out: list[Any] = []
    for event in events:
        medium = medium_of(event.tier)
        where = {"medium": medium.medium, "locality": medium.locality,
                 "ownership": medium.ownership, "group_idx": 0}  # fmt: skip
        if isinstance(event, Removed):
            out.append(BlockRemoved(block_hashes=[convert(h) for h in event.hashes], **where))
            continue
        first = event.blocks[0]
        out.append(
            BlockStored(
                block_hashes=[convert(b.block_hash) for b in event.blocks],
                parent_block_hash=(
                    None if first.parent_hash is None else convert(first.parent_hash)
                ),
                token_ids=[t for b in event.blocks for t in b.token_ids],
                block_size=block_size,
                lora_id=None,
                lora_name=None,
                **where,
            )
        )
    return out
