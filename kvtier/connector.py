"""Connector mode: kvtier's host pool and spill tiers below KV blocks an engine owns.

In native mode ``TieredCache`` owns the GPU block pool. An engine with its own block
manager (vLLM) keeps its GPU blocks and its own chained block hashes; kvtier supplies
everything below: the (pinned) host pool, the spill tiers, chunking and the copy
engine. An engine's scheduler and its workers are usually separate processes (one
worker per tensor- or pipeline-parallel rank), so connector mode has two halves:

- ``ConnectorIndex`` (the scheduler's process) answers "how many blocks past the
  engine's own hit can be loaded?" without any worker's memory: from an index of what
  every worker's host pool holds, kept from the workers' reports (``apply``), and from
  the spill tiers themselves (LMDB and Redis are shared between processes).
- ``ConnectorCache`` (each worker's process) owns the host pool, the copies and the
  spill writes of its *shard* (its rank's KV heads and layers), and carries out the
  loads, saves and stages (reads of a waiting request's spill hit into the host pool,
  ahead of its load) the scheduler hands it each step. It reports which keys its host
  pool gained and lost, and the spill writes it has queued (``take_report``), for
  the index.

Keys. The engine hashes its blocks; kvtier never re-hashes tokens here, so whatever
the engine mixes into its hashes (cache salt, LoRA, multimodal inputs) carries through.
The scheduler turns each engine hash into a *base key* ``H(root || engine hash)``,
where the root names the model, the config's salt and how often the cache was reset.
Each shard stores a block under its own key ``H(shard root || base key)``: the shard
root names the worker's KV tensor layout (``EngineKV.describe``) and its rank in the
tensor- and pipeline-parallel world, so ranks, TP sizes and layouts never share a
value, and bytes are only ever read back into the layout that wrote them. Ranks that
hold the same KV (an MLA latent is whole on every tensor-parallel rank) are one
shard's replicas: they share its root, so one copy of a block is stored below,
written by the first of them and read by each; each keeps its own host pool. Workers
tell the scheduler their shard once at start-up (``ShardSpec``), and record it (its
namespace, model name and layout) in each spill tier they open, for ``kvtier stats``,
``inspect`` and ``clear`` (``kvtier.namespaces``).

Promises. A hit counts only blocks that every shard can load. The index can be stale
(a block evicted after the last report): a worker then reports the blocks it could not
load, and the engine recomputes them. Never wrong KV, never an exception: a load that
does not happen is a load error, a save that does not happen a later miss.

Ordering (worker). A load is never reported done while any part of it is
outstanding. A save copies out of the engine's blocks before the engine may reuse
them: on CPU the copy runs inline; on CUDA it runs on the offload stream and the
engine's current stream waits on its event (no host sync), so any later kernel that
overwrites those blocks runs after the copy. Host slots are published only once
their copy has completed, and pinned while a copy reads them.

Threads. Every public method of ``ConnectorCache`` takes ``self._lock``; loads' spill
reads run on the transfer engine's workers, stages' on the stager (one thread: one
stage at a time), spill writes on the spill manager's. A stage's read waits until no
load is submitted and not over (``STAGE_YIELD`` at most): a load's request is running,
a stage's is still queued. Never the other way round: a load never queues behind a
stage, which on a shared worker would wait for that very load.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from kvtier.block_pool import CachedBlocks
from kvtier.config import KVTierConfig
from kvtier.eviction import use_counts_for
from kvtier.hashing import HASH_NBYTES, get_digest, namespace_root
from kvtier.host_tiers import HostTiers
from kvtier.layout import KVLayout
from kvtier.metrics import CacheStats
from kvtier.namespaces import NamespaceRecord, record_namespace
from kvtier.spill import (
    LoadResult,
    SpillRun,
    ValueShape,
    find_runs,
    hit_blocks,
    truncate_runs,
)
from kvtier.threads import thread_pool
from kvtier.tiers import open_spill_tiers
from kvtier.tiers.base import SpillTier
from kvtier.trace import LoadTimes, Trace
from kvtier.transfer import Transfer, copy_blocks

log = logging.getLogger(__name__)

STAGE_YIELD = 0.25  # seconds a stage's read waits at most for the loads being read


@dataclass(frozen=True)
class StatePiece:
    """Piece ``index`` of the state after a chain position that engine blocks ``ids``
    hold (``EngineKV``: one id per state group, then one per block of each sliding
    window): the recurrent state's (Mamba, linear attention) bytes or a window's KV,
    packed into one host slot (``EngineKV.num_pieces`` pieces per state)."""

    ids: tuple[int, ...]
    index: int


# An engine block of a kvtier block: its id, or one id per group where the engine's
# layers are in groups with block tables of their own (``EngineKV``); or a piece of a
# recurrent state.
BlockIds = int | tuple[int, ...] | StatePiece


@dataclass(frozen=True)
class LayerGroup:
    """Layers of the engine's KV that share a block table: ``kind`` names what their
    blocks hold (part of the namespace), ``layers`` counts them; ``windowed``: its table
    holds the null block where a block fell out of a sliding window."""

    kind: str
    layers: int
    windowed: bool = False


class EngineKV:
    """The engine's KV: one tensor per layer, ``[num_blocks, ...]`` with blocks on dim 0.

    The layers may be in ``groups`` (in layer order) that each have a block table of
    their own, as vLLM's KV cache groups do (full attention, a sliding window): a kvtier
    block is one chain position in every group, and its engine block is one id per
    group (``BlockIds``; a plain int without groups). In a windowed group an id equal to
    ``null_block`` holds no KV (the block fell out of the window): a load skips that
    group's layers there, and a save is never handed one.

    A model with recurrent state beside its attention (vLLM's Mamba groups) has
    ``states`` too: one tensor per state layer, ``[num_blocks, ...]``, a block holding
    the layer's state after some chain position; ``state_groups[i]`` is the index of
    state layer i's block in a ``StatePiece``'s ids. The state layers' bytes are packed,
    whole layers in order, into pieces of at most one host slot each. A model whose
    sliding-window layers are kept as a state (only the window before chosen positions,
    not every position) has ``windows``: (a window layer's tensor, like ``layers``, the
    index in a ``StatePiece``'s ids of its block there), one per layer and block of the
    window, packed ``len(layers)`` to a piece after the state's bytes. A state is stored
    as ``num_pieces`` kvtier blocks after its position (``state_keys``); a piece's id
    equal to ``null_block`` is neither saved nor loaded (a window reaching before the
    chain, or into blocks the engine holds itself).

    Copies move a batch of blocks per layer (``copy_blocks`` coalesces runs) between
    these tensors and the host slab, viewed as ``[slots, layers, *layer block shape]``
    (a piece: as bytes).
    """

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        groups: Sequence[LayerGroup] = (),
        null_block: int | None = None,
        states: Sequence[torch.Tensor] = (),
        state_groups: Sequence[int] = (),
        windows: Sequence[tuple[torch.Tensor, int]] = (),
    ) -> None:
        if not layers:
            raise ValueError("EngineKV needs at least one layer tensor")
        first = layers[0]
        for i, t in enumerate([*layers, *(w for w, _ in windows)]):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(
                    f"KV layer {i} is {tuple(t.shape)} {t.dtype} on {t.device}; expected "
                    f"{tuple(first.shape)} {first.dtype} on {first.device} like layer 0"
                )
        if groups and sum(g.layers for g in groups) != len(layers):
            raise ValueError(f"groups {list(groups)} do not hold the {len(layers)} layers")
        if len(state_groups) != len(states):
            raise ValueError(f"{len(states)} state layers but {len(state_groups)} group indexes")
        self.layers = list(layers)
        self.groups = list(groups)
        # Each layer's group (all 0 without groups: one table of plain ids).
        self._group_of = [g for g, group in enumerate(self.groups) for _ in range(group.layers)]
        self._group_of = self._group_of or [0] * len(self.layers)
        self._null_block = null_block
        self.device = first.device
        self.dtype = first.dtype
        self.block_shape = tuple(first.shape[1:])
        self.block_numel = int(np.prod(self.block_shape))
        # Each state layer's blocks as rows of bytes (a view: ValueError if it is none).
        self._state_rows = [t.view(len(t), -1).view(torch.uint8) for t in states]
        self._state_groups = list(state_groups)
        self._pieces = _pack(
            [r.shape[1] for r in self._state_rows], len(self.layers) * self.block_nbytes
        )
        n = len(self.layers)
        self._windows = [list(windows[k : k + n]) for k in range(0, len(windows), n)]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one layer's block."""
        return self.block_numel * self.layers[0].element_size()

    @property
    def num_pieces(self) -> int:
        """Host slots that one state takes (0: the engine has none)."""
        return len(self._pieces) + len(self._windows)

    def describe(self) -> str:
        """The element order of one block (part of the namespace root)."""
        dims = "x".join(str(d) for d in self.block_shape)
        text = f"{len(self.layers)} layers of [{dims}] {self.dtype} on {self.device.type}"
        if len(self.groups) > 1:
            text += " in groups " + ", ".join(f"{g.kind} x{g.layers}" for g in self.groups)
        if self._pieces:
            sizes = "+".join(str(r.shape[1]) for r in self._state_rows)
            text += f", state of {sizes} B (groups {self._state_groups}) in {len(self._pieces)}"
        if self._windows:
            ids = [g for piece in self._windows for _, g in piece]
            text += f", windows of {len(ids)} layer blocks (ids {ids}) in {len(self._windows)}"
        return text

    def host_view(self, slab: torch.Tensor) -> torch.Tensor:
        """``slab`` as ``[slots, layers, *block_shape]`` (same bytes)."""
        return slab.view(len(slab), len(self.layers), *self.block_shape)

    def copy_to(self, host: torch.Tensor, block_ids: Sequence[BlockIds], slots: list[int]) -> None:
        """``host[slots[i], l] = layer_l[block_ids[i]]`` for every layer l (its group's id);
        a state piece's layers into its slot's bytes."""
        (ids, to), pieces = self._split(block_ids, slots)
        per_group = self._per_group(ids, to)
        for i, layer in enumerate(self.layers):
            ids, to = per_group[self._group_of[i]]
            copy_blocks(layer, ids, host[:, i], to, non_blocking=True)
        for rows, ids, region, to in self._piece_copies(host, pieces):
            copy_blocks(rows, ids, region, to, non_blocking=True)

    def copy_from(
        self, host: torch.Tensor, slots: list[int], block_ids: Sequence[BlockIds]
    ) -> None:
        """``layer_l[block_ids[i]] = host[slots[i], l]`` for every layer l (its group's id,
        unless that is the null block); a state piece's layers from its slot's bytes."""
        (ids, src), pieces = self._split(block_ids, slots)
        per_group = self._per_group(ids, src)
        for i, layer in enumerate(self.layers):
            ids, src = per_group[self._group_of[i]]
            copy_blocks(host[:, i], src, layer, ids, non_blocking=True)
        for rows, ids, region, src in self._piece_copies(host, pieces):
            copy_blocks(region, src, rows, ids, non_blocking=True)

    @staticmethod
    def _split(
        block_ids: Sequence[BlockIds], slots: list[int]
    ) -> tuple[tuple[list[BlockIds], list[int]], list[tuple[StatePiece, int]]]:
        """(chain positions' ids and slots), (state pieces with their slots)."""
        pieces = [(b, s) for b, s in zip(block_ids, slots) if isinstance(b, StatePiece)]
        if not pieces:
            return (list(block_ids), slots), []
        kept = [(b, s) for b, s in zip(block_ids, slots) if not isinstance(b, StatePiece)]
        return ([b for b, _ in kept], [s for _, s in kept]), pieces

    def _piece_copies(
        self, host: torch.Tensor, pieces: list[tuple[StatePiece, int]]
    ) -> Iterable[tuple[torch.Tensor, list[int], torch.Tensor, list[int]]]:
        """Per state layer and window layer block of the pieces: (its engine tensor,
        engine ids, the host region that holds it, slots), the null block left out."""
        if not pieces:
            return
        host_bytes = host.view(len(host), -1).view(torch.uint8)
        rows, of = self._state_rows, self._state_groups
        states = [
            [(rows[k], of[k], host_bytes[:, o : o + rows[k].shape[1]]) for k, o in members]
            for members in self._pieces
        ]
        windows = [[(t, g, host[:, i]) for i, (t, g) in enumerate(m)] for m in self._windows]
        for index, members in enumerate(states + windows):
            mine = [(p.ids, s) for p, s in pieces if p.index == index]
            for tensor, g, region in members if mine else ():
                pairs = [(ids[g], s) for ids, s in mine if ids[g] != self._null_block]
                yield tensor, [i for i, _ in pairs], region, [s for _, s in pairs]

    def _per_group(
        self, block_ids: Sequence[BlockIds], slots: list[int]
    ) -> list[tuple[list[int], list[int]]]:
        """Each group's engine ids of ``block_ids`` and their ``slots``, the null block's
        left out."""
        if not self.groups:
            return [(list(block_ids), slots)]
        out = []
        for g, group in enumerate(self.groups):
            null = self._null_block if group.windowed else None
            pairs = [(ids[g], s) for ids, s in zip(block_ids, slots) if ids[g] != null]
            out.append(([i for i, _ in pairs], [s for _, s in pairs]))
        return out


def _pack(sizes: Sequence[int], capacity: int) -> list[list[tuple[int, int]]]:
    """Layers of ``sizes`` bytes, in order, as pieces of at most ``capacity`` bytes: per
    piece, (layer, byte offset) of each layer in it. ``ValueError`` for a layer larger
    than a piece."""
    pieces: list[list[tuple[int, int]]] = []
    used = capacity
    for layer, size in enumerate(sizes):
        if size > capacity:
            raise ValueError(f"a state layer of {size} B does not fit a host slot of {capacity} B")
        if used + size > capacity:
            pieces.append([])
            used = 0
        pieces[-1].append((layer, used))
        used += size
    return pieces


def engine_blocks(layer: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``layer`` with one engine block per index of dim 0.

    An attention kernel that takes smaller blocks than the engine's block manager sees
    ``ratio = len(layer) / num_blocks`` kernel blocks per engine block on dim 0, engine
    block ``b`` being kernel blocks ``b * ratio`` to ``b * ratio + ratio - 1``; they are
    grouped here as ``[num_blocks, ratio, *kernel block]`` (same bytes, a view), so that
    copies move whole engine blocks. ``ValueError`` when dim 0 is no multiple of
    ``num_blocks``."""
    ratio, rest = divmod(layer.shape[0], num_blocks)
    if rest or not ratio:
        raise ValueError(
            f"a KV tensor of shape {list(layer.shape)} does not hold {num_blocks} blocks on "
            f"dim 0, nor a whole number of kernel blocks per block"
        )
    return layer if ratio == 1 else layer.unflatten(0, (num_blocks, ratio))


def engine_layout(
    kv: EngineKV, block_size: int, num_kv_heads: int, head_dim: int, kv_factor: int
) -> KVLayout:
    """The ``KVLayout`` of the engine's blocks: ``kv_factor`` (2 for K and V, 1 for MLA's
    one latent) x ``block_size`` tokens x ``num_kv_heads`` x ``head_dim`` per layer;
    ``ValueError`` when the tensors' blocks do not hold exactly that many elements."""
    expected = kv_factor * block_size * num_kv_heads * head_dim
    if kv.block_numel != expected:
        what = "K and V" if kv_factor == 2 else "one MLA latent"
        raise ValueError(
            f"a KV block of shape {list(kv.block_shape)} does not hold {block_size} tokens x "
            f"{num_kv_heads} KV heads x {head_dim} for {what}"
        )
    return KVLayout(len(kv.layers), kv_factor, block_size, num_kv_heads, head_dim, kv.dtype)


# Spill tiers a ConnectorCache of this process has open, by namespace.
_open_in_process: dict[str, list[SpillTier]] = {}


def spill_namespace(config: KVTierConfig, name: str) -> str:
    """The namespace of an engine's values in shared spill tiers (Redis key prefix):
    the same in the scheduler and every worker of engines serving model ``name``."""
    h = config.hashing
    return namespace_root(f"connector:{name}", b"", h.salt, h.algorithm).hex()[:16]


def shard_keys(root: bytes, base_keys: Sequence[bytes], algorithm: str) -> list[bytes]:
    """Each base key as the shard whose root is ``root`` stores it (module docstring)."""
    digest = get_digest(algorithm)
    return [digest(root + k)[:HASH_NBYTES] for k in base_keys]


def state_keys(base_key: bytes, pieces: int, algorithm: str) -> list[bytes]:
    """The base keys of the ``pieces`` pieces of the recurrent state after the chain
    position of ``base_key``: blocks that continue its chain as a branch of their own
    (``EngineKV``), so that a hit which ends there loads them after its last block."""
    digest = get_digest(algorithm)
    return [digest(base_key + b"state" + bytes([j]))[:HASH_NBYTES] for j in range(pieces)]


@dataclass(frozen=True)
class ShardSpec:
    """What a worker tells the scheduler at start-up: its shard's name (rank), the root
    of its keys, the size of its stored values (to read a run's length off a size), and
    the host slots one recurrent state takes (``EngineKV.num_pieces``)."""

    name: str
    root: bytes
    shape: ValueShape
    pieces: int = 0


@dataclass
class ShardReport:
    """What one shard's worker tells the index after a step: keys its host pool gained
    (True) or lost (False), per spill tier the values it queued (key -> size) or whose
    write ended (key -> 0), which the tiers do not show until they land, and the
    requests whose stage is over (its blocks, if any, among ``held``); and, once
    ``ConnectorCache.track_tiers`` ran, per spill tier the values that landed (key ->
    blocks of its run) or left it (key -> 0), for KV events.

    ``origin`` names the cache that made it (one per worker process) and ``seq`` counts
    its reports: an engine may deliver a report late (vLLM replays a failed worker's
    output beside the next one) or twice, and the index applies each origin's reports
    once and in order (``after``, ``merged``)."""

    held: dict[bytes, bool] = field(default_factory=dict)
    queued: dict[str, dict[bytes, int]] = field(default_factory=dict)
    staged: list[str] = field(default_factory=list)
    stored: dict[str, dict[bytes, int]] = field(default_factory=dict)
    origin: int = 0
    seq: int = 0

    def __bool__(self) -> bool:
        return bool(self.held or self.queued or self.staged or self.stored)

    def after(self, other: ShardReport) -> bool:
        """Whether this report comes after ``other`` (one of another origin always does:
        the worker started anew)."""
        return self.origin != other.origin or self.seq > other.seq

    def merged(self, other: ShardReport) -> ShardReport:
        """This report and ``other`` (of the same shard) as one, each key as the later of
        the two has it; the same report twice is itself."""
        if (other.origin, other.seq) == (self.origin, self.seq):
            return self
        older, newer = (other, self) if self.after(other) else (self, other)
        return ShardReport(
            {**older.held, **newer.held},
            _merged_tiers(older.queued, newer.queued),
            [*older.staged, *(r for r in newer.staged if r not in older.staged)],
            _merged_tiers(older.stored, newer.stored),
            newer.origin,
            newer.seq,
        )


def _merged_tiers(
    older: dict[str, dict[bytes, int]], newer: dict[str, dict[bytes, int]]
) -> dict[str, dict[bytes, int]]:
    out = {tier: dict(values) for tier, values in older.items()}
    for tier, values in newer.items():
        out.setdefault(tier, {}).update(values)
    return out


@dataclass
class StageCounts:
    """Blocks a shard staged ahead of their request's load: read into the host pool,
    then loaded by a request, or evicted before any load used them."""

    staged: int = 0
    used: int = 0
    evicted_unused: int = 0


@dataclass(frozen=True)
class ConnectorHit:
    """Blocks ``[start, start + num_blocks)`` of a chain below the engine: the first
    ``host_blocks`` in every shard's host pool (as last reported), then spill runs,
    ``spill[shard]`` being that shard's runs (all of the same length). The last
    ``pieces`` blocks are the pieces of the recurrent state after the chain position
    before them (``state_keys``), the others chain positions."""

    start: int
    host_blocks: int = 0
    spill: dict[str, tuple[SpillRun, ...]] = field(default_factory=dict)
    pieces: int = 0

    @property
    def spill_blocks(self) -> int:
        runs = next(iter(self.spill.values()), ())
        return sum(run.num_blocks for run in runs)

    @property
    def num_blocks(self) -> int:
        return self.host_blocks + self.spill_blocks

    @property
    def num_positions(self) -> int:
        """Chain positions of the hit (its blocks but a state's pieces)."""
        return self.num_blocks - self.pieces

    def blocks_per_tier(self) -> dict[str, int]:
        """Hit blocks by tier name (``cpu``, then each spill tier that holds some)."""
        return hit_blocks(self.host_blocks, next(iter(self.spill.values()), ()))

    def truncated(self, n: int) -> ConnectorHit:
        """The first ``n`` blocks of this hit."""
        host = min(n, self.host_blocks)
        spill = {shard: truncate_runs(runs, n - host) for shard, runs in self.spill.items()}
        return ConnectorHit(self.start, host, spill if n > host else {})


class ConnectorIndex:
    """The scheduler's half (module docstring): base keys, and lookups against the
    workers' host pools (as reported) and the spill tiers. Not thread-safe: the engine's
    scheduler calls it from one thread."""

    def __init__(self, config: KVTierConfig, name: str) -> None:
        self._hashing = config.hashing
        self._name = name
        self._resets = 0
        self.root = self._base_root()
        self.shards: list[ShardSpec] = []
        self._held: dict[str, set[bytes]] = {}  # shard name -> keys its host pool holds
        self._queued: dict[str, dict[bytes, int]] = {}  # tier -> values queued for it: size
        namespace = spill_namespace(config, name)
        # A worker in this process has the tiers open already (vLLM registers the KV
        # caches before it builds the scheduler), and LMDB allows one opening per
        # process: read through the worker's.
        self._owns_tiers = namespace not in _open_in_process
        failed: list[str] = []
        if self._owns_tiers:
            self.tiers, failed = open_spill_tiers(config, namespace)
        else:
            self.tiers = _open_in_process[namespace]
        self.tier_errors = dict.fromkeys(failed, 1)

    def set_shards(self, shards: Sequence[ShardSpec]) -> None:
        """The engine's shards, as its workers reported them; lookups miss until then."""
        self.shards = list(shards)
        self._held = {s.name: self._held.get(s.name, set()) for s in self.shards}

    def keys(self, engine_hashes: Sequence[bytes]) -> list[bytes]:
        """The base key of each engine block hash."""
        digest, root = get_digest(self._hashing.algorithm), self.root
        return [digest(root + bytes(h))[:HASH_NBYTES] for h in engine_hashes]

    def state_keys(self, base_key: bytes) -> list[bytes]:
        """The base keys of the pieces of the recurrent state after ``base_key``'s block
        (none for a model without; ``state_keys``)."""
        pieces = max((s.pieces for s in self.shards), default=0)
        return state_keys(base_key, pieces, self._hashing.algorithm)

    def lookup(self, keys: Sequence[bytes], start: int) -> ConnectorHit:
        """The longest run of ``keys[start:]`` (base keys) that every shard can load:
        first what all their host pools hold, then what the spill tiers hold for all of
        them (one size query per tier for all shards). Pins nothing."""
        if not self.shards or start >= len(keys):
            return ConnectorHit(start)
        per_shard = [shard_keys(s.root, keys[start:], self._hashing.algorithm) for s in self.shards]
        host = self._host_run(per_shard)
        if not self.tiers or start + host == len(keys):
            return ConnectorHit(start, host)
        below = [ks[host:] for ks in per_shard]
        shapes = [s.shape for s in self.shards]
        spill, _ = find_runs(
            self.tiers, below, start + host, shapes, self._queued_sizes, self._error
        )
        if not spill[0]:
            return ConnectorHit(start, host)
        return ConnectorHit(start, host, {s.name: tuple(r) for s, r in zip(self.shards, spill)})

    def holds(self, keys: Sequence[bytes]) -> bool:
        """Whether every shard's host pool holds all of ``keys`` (base keys), as last
        reported."""
        if not keys:
            return True
        per_shard = [shard_keys(s.root, keys, self._hashing.algorithm) for s in self.shards]
        return bool(self.shards) and self._host_run(per_shard) == len(keys)

    def holds_each(self, keys: Sequence[bytes]) -> list[bool]:
        """Per base key, whether every shard can load its block from its host pool (as
        last reported) or from a spill value stored under its key (the value a chain
        that ends at that block is stored under): one size query per tier for all."""
        alg, n = self._hashing.algorithm, len(keys)
        per_shard = [shard_keys(s.root, keys, alg) for s in self.shards]
        held = [[k in self._held[s.name] for k in ks] for s, ks in zip(self.shards, per_shard)]
        ask = [k for ks in per_shard for k in ks]
        for tier in self.tiers if ask else ():
            try:
                sizes = tier.sizes_many(ask)
            except Exception as e:  # a tier that fails is a miss
                self._error(tier.name, e)
                continue
            self._queued_sizes(tier, ask, sizes)
            for s, shard in enumerate(held):
                shard[:] = [h or size > 0 for h, size in zip(shard, sizes[s * n : (s + 1) * n])]
        return [bool(self.shards) and all(shard[j] for shard in held) for j in range(n)]

    def _host_run(self, per_shard: list[list[bytes]]) -> int:
        """How many leading keys every shard's host pool holds (each shard's keys)."""
        held = [self._held[s.name] for s in self.shards]
        n, size = 0, len(per_shard[0])
        while n < size and all(ks[n] in h for h, ks in zip(held, per_shard)):
            n += 1
        return n

    def apply(self, reports: dict[str, ShardReport]) -> None:
        """Take the workers' reports of a step (by shard)."""
        for name, report in reports.items():
            keys = self._held.setdefault(name, set())
            for key, present in report.held.items():
                if present:
                    keys.add(key)
                else:
                    keys.discard(key)
            for tier, sizes in report.queued.items():
                queued = self._queued.setdefault(tier, {})
                for key, size in sizes.items():
                    if size:
                        queued[key] = size
                    else:
                        queued.pop(key, None)

    def reset(self) -> None:
        """Move to a new key space (the engine's weights changed): nothing stored before
        is found again, and the index starts empty."""
        self._resets += 1
        self.root = self._base_root()
        for keys in self._held.values():
            keys.clear()
        self._queued.clear()

    def close(self) -> None:
        if self._owns_tiers:
            for tier in self.tiers:
                tier.close()

    def _base_root(self) -> bytes:
        h = self._hashing
        name = f"{self._name}#reset{self._resets}" if self._resets else self._name
        return namespace_root(name, b"", h.salt, h.algorithm)

    def _queued_sizes(self, tier: SpillTier, keys: Sequence[bytes], sizes: list[int]) -> None:
        """Count values a worker has queued for ``tier`` as stored (they are read from
        the worker's queue until they land)."""
        queued = self._queued.get(tier.name)
        if queued:
            for j, key in enumerate(keys):
                sizes[j] = max(sizes[j], queued.get(key, 0))

    def _error(self, tier: str, error: BaseException) -> None:
        log.debug("kvtier: %s tier lookup failed: %s", tier, error)
        self.tier_errors[tier] = self.tier_errors.get(tier, 0) + 1


@dataclass
class _Load:
    """A pinned hit being copied into engine blocks ``blocks`` (in chain order):
    ``host_slots`` hold the first blocks, ``spill_slots`` stage the spill runs. A
    *stage* is a load with no engine blocks: it only reads its runs into host slots."""

    keys: list[bytes]  # keys of the loaded blocks, in order
    parent: bytes  # key of the block before keys[0] (the root for block 0)
    start: int  # chain position of keys[0]
    blocks: list[BlockIds]
    host_slots: list[int]
    spill_slots: list[int]
    runs: tuple[SpillRun, ...]
    unpinned: list[BlockIds]  # engine blocks that could not be pinned: failed from the start
    times: LoadTimes = field(default_factory=LoadTimes)  # for the trace
    started: float = 0.0
    valid: int = 0  # leading blocks loaded and checked
    result: LoadResult | None = None
    transfer: Transfer | None = None
    error: BaseException | None = None
    cancelled: bool = False  # a stage no longer ahead of its request: not read if not begun
    reading: bool = False  # a stage's read has begun: its slots are the read's until it ends
    inline: bool = False  # a host-only load copied by ``load`` itself, not on a worker
    finished: threading.Event = field(default_factory=threading.Event)

    @property
    def slots(self) -> list[int]:
        return self.host_slots + self.spill_slots

    def failed_blocks(self) -> list[BlockIds]:
        """Engine blocks that hold no valid KV once the load is over."""
        return self.blocks[self.valid :] + self.unpinned


@dataclass
class _Save:
    """Engine blocks being copied into host slots; published when the copy is done."""

    transfer: Transfer
    slots: CachedBlocks


class ConnectorCache:
    """A worker's half (module docstring): the host pool and spill tiers of one shard
    below the engine's KV blocks.

    ``name`` names what the engine serves (its model): engines of the same name share
    values in the spill tiers. ``shard`` names this worker's rank; ``keys_of`` (by
    default ``shard``), with the KV tensor layout, makes the root of this shard's keys:
    ranks that hold the same KV (replicas) share it, so that one copy of each block is
    stored below, written by the one of them whose ``spill_writes`` is True; the others
    read it, and their host pools spill nothing.
    """

    def __init__(
        self,
        config: KVTierConfig,
        kv: EngineKV,
        layout: KVLayout,
        name: str,
        shard: str,
        keys_of: str | None = None,
        spill_writes: bool = True,
    ) -> None:
        if layout.block_numel != len(kv.layers) * kv.block_numel or layout.dtype != kv.dtype:
            raise ValueError(f"layout {layout.describe()} does not match the engine's KV")
        h = config.hashing
        self._algorithm = h.algorithm
        self.kv = kv
        self.layout = layout
        self.shard = shard
        self.root = namespace_root(
            f"{name}|{kv.describe()}|{keys_of or shard}", layout.fingerprint, h.salt, h.algorithm
        )

        self._cuda = kv.device.type == "cuda"
        self._lock = threading.RLock()
        self._namespace = spill_namespace(config, name)
        # The blocks each request loads or saves here count as its uses (the engine's
        # own GPU hits are not seen here).
        self.uses = use_counts_for(config, layout, 0)
        self.below = HostTiers(
            config, layout, kv.device, self._lock, self._namespace, uses=self.uses
        )
        self.host, self.spill, self.transfer = (
            self.below.host,
            self.below.spill,
            self.below.transfer,
        )
        # The spill manager this shard writes through (None: no spill tier, or a replica
        # whose copy below another one writes).
        self._spill_out = self.spill if spill_writes else None
        _open_in_process[self._namespace] = self.spill.tiers if self.spill else []
        record = NamespaceRecord(self._namespace, name, shard, layout, time.time())
        record_namespace(_open_in_process[self._namespace], record)
        self.host.on_evict = self._on_host_evict
        self._host_view = kv.host_view(self.host.slab)
        self._stats = CacheStats(self.below.tier_stats())
        self._loads: dict[str, _Load] = {}
        self._stages: dict[str, _Load] = {}  # by request: reading ahead of its load
        self._stages_over: list[str] = []  # requests whose stage is over, to report
        # Keys stages published for requests that still wait, no load used yet: what
        # counts against the stage share (``stage``).
        self._staged_unused: set[bytes] = set()
        self._staged_for: dict[str, list[bytes]] = {}  # request -> keys its stage published
        self._stage_budget = int(config.tiers.cpu.stage_share * self.host.num_blocks)
        self.stage_counts = StageCounts()
        self._stager = thread_pool(1, "kvtier-stage")
        # Spill loads submitted and not over: a stage reads only when there are none
        # (``STAGE_YIELD`` at most), for their requests run now and a stage's still waits.
        self._loads_reading = 0
        self._no_loads_reading = threading.Condition()
        self._stage_yielding = False  # the stager waits in ``_read_stage`` (``stage_yielding``)
        self._saves: list[_Save] = []
        self._detached = False  # the engine's KV is unmapped (``detach``)
        self._closed = False
        self._changes: dict[bytes, bool] = {}  # keys the host pool gained or lost
        self._origin = random.getrandbits(63)  # of its reports (``ShardReport``)
        self._reports = 0
        self.trace = Trace(config.metrics.trace_path)

    @property
    def spec(self) -> ShardSpec:
        """This shard, as the scheduler's index needs it."""
        shape = self.spill.shape if self.spill else ValueShape(0, self.layout.block_nbytes)
        return ShardSpec(self.shard, self.root, shape, self.kv.num_pieces)

    def keys(self, base_keys: Sequence[bytes]) -> list[bytes]:
        """This shard's key of each base key."""
        return shard_keys(self.root, base_keys, self._algorithm)

    def take_report(self) -> ShardReport:
        """What the index needs to know of this shard since the last call."""
        with self._lock:
            self._poll_saves()
            self._settle_stages()
            held, self._changes = self._changes, {}
            staged, self._stages_over = self._stages_over, []
            self._reports += 1
        if not self.spill:
            return ShardReport(held, {}, staged, origin=self._origin, seq=self._reports)
        queued, stored = self.spill.take_queued(), self.spill.take_tier_changes()
        return ShardReport(held, queued, staged, stored, self._origin, self._reports)

    def track_tiers(self) -> None:
        """Report, from now on, which values land in the spill tiers and which leave them
        (``ShardReport.stored``): only KV events need it."""
        if self.spill:
            self.spill.track_tiers()

    # ------------------------------------------------------------------ loads
    def pin(
        self,
        req_id: str,
        keys: Sequence[bytes],
        parent: bytes,
        hit: ConnectorHit,
        blocks: list[BlockIds],
    ) -> int:
        """Pin ``hit`` for loading into engine ``blocks`` (one per hit block); ``keys``
        are this shard's keys of the hit's blocks, ``parent`` that of the block before
        (the root for block 0). Host blocks evicted since the index saw them are read
        from the spill tiers if they hold them. Returns how many leading blocks it
        pinned; the rest (not held below either, no staging slots free even with those
        of the stages not yet reading, ``_make_room``) the load reports failed."""
        if len(blocks) != hit.num_blocks or len(keys) != hit.num_blocks:
            raise ValueError(
                f"{len(blocks)} engine blocks and {len(keys)} keys for a hit of "
                f"{hit.num_blocks} blocks"
            )
        with self._lock:
            if req_id in self._loads:
                raise ValueError(f"request {req_id!r} already has a load pinned")
            if self._detached:
                raise RuntimeError("the engine's KV is unmapped (asleep): no load until attach")
            if self.uses is not None:
                self.uses.record(keys)
            host_slots = self.host.lookup(keys[: hit.host_blocks])
            self.host.touch(host_slots)
            if self._staged_unused:
                used = self._staged_unused.intersection(keys[: len(host_slots)])
                self._staged_unused -= used
                self.stage_counts.used += len(used)
            runs = hit.spill.get(self.shard, ())
            if len(host_slots) < hit.host_blocks:
                # Evicted since the index saw them (its reports lag the pool by a step):
                # the rest of the hit is read from the spill tiers, as far as they hold it.
                held = len(host_slots)
                runs = tuple(self.spill.lookup(keys[held:], hit.start + held)) if self.spill else ()
            self._make_room(sum(run.num_blocks for run in runs))
            staging, runs = self.below.stage(runs)
            n = len(host_slots) + len(staging)
            self._loads[req_id] = _Load(
                keys=list(keys[:n]),
                parent=parent,
                start=hit.start,
                blocks=blocks[:n],
                host_slots=host_slots,
                spill_slots=staging,
                runs=runs,
                unpinned=blocks[n:],
            )
            return n

    def abandon(self, req_id: str) -> None:
        """Forget the pinned load of ``req_id`` if it has not started (its slots are
        unpinned); a started one runs to its end and ``finished_loads`` reports it."""
        with self._lock:
            p = self._loads.get(req_id)
            if p is not None and not p.started:
                del self._loads[req_id]
                self.host.free(p.slots)

    def stage(self, req_id: str, keys: Sequence[bytes], parent: bytes, hit: ConnectorHit) -> int:
        """Read this shard's spill runs of ``hit`` (``keys`` its blocks' keys, ``parent``
        the key before them) into host slots ahead of the request's load, on the
        stager, with no engine blocks; once read they are host-pool blocks like any other
        (``take_report`` tells the index). Blocks staged for requests that still wait
        (until ``unstage``) and not yet loaded take at most ``stage_share`` of the pool;
        allocating slots evicts only unpinned blocks.
        Returns how many blocks it stages; ``take_report`` names the request once the
        stage is over, whatever it read."""
        with self._lock:
            budget = self._stage_budget - len(self._staged_unused)
            budget -= sum(len(p.spill_slots) for p in self._stages.values())
            runs = truncate_runs(hit.spill.get(self.shard, ()), budget)
            if req_id in self._stages or not runs:
                self._stages_over.append(req_id)
                return 0
            try:
                slots, runs = self.below.stage(runs)
            except BaseException:
                self._stages_over.append(req_id)
                raise
            n = len(slots)
            p = _Load(list(keys[:n]), parent, hit.start, [], [], slots, runs, [])
            p.started = time.perf_counter()
            self._stages[req_id] = p
        self._stager.submit(self._read_stage, p)
        return n

    def keep(self, keys: Sequence[bytes]) -> None:
        """Queue the host blocks of ``keys`` (a chain's, from its first block) that this
        pool holds and no one pins as the newest, the first block last: a waiting
        request's host hit outlives the evictions of the blocks stages and saves bring
        in after it."""
        with self._lock:
            self.host.requeue([s for s in self.host.lookup_each(keys) if s is not None])

    def unstage(self, req_id: str) -> None:
        """The request of a stage no longer waits (it was scheduled, or went away): its
        runs are not read if the read has not begun (a read under way ends and publishes
        what it read), and the blocks its stage published no longer count against the
        stage share, loaded or not: they are host-pool blocks like any other."""
        with self._lock:
            p = self._stages.get(req_id)
            if p is not None:
                self._cancel_stage(p)
            self._staged_unused.difference_update(self._staged_for.pop(req_id, ()))

    def _cancel_stage(self, p: _Load) -> None:
        """Cancel stage ``p`` (under the lock): if its read has not begun, it reads
        nothing, its slots are unpinned now and it is over (reported in the next step)."""
        p.cancelled = True
        if not p.reading:
            self.host.free(p.spill_slots)
            p.spill_slots, p.runs = [], ()
            p.finished.set()

    def _make_room(self, needed: int) -> None:
        """Unpin the slots of stages whose read has not begun, latest first, until
        ``needed`` slots are unpinned or none is left (under the lock): a load is wanted
        now and a stage only ahead of time, so a load never fails for the slots of a
        stage that could still give them back. The stage's request is looked up again."""
        for p in reversed(self._stages.values()):
            if needed <= self.host.num_free:
                return
            if not p.cancelled:
                self._cancel_stage(p)

    @property
    def staging(self) -> bool:
        """Whether a stage is under way."""
        return bool(self._stages)

    @property
    def stage_yielding(self) -> bool:
        """Whether the stager is inside its wait for the loads being read to be over
        (``STAGE_YIELD`` at most), its stage's read not started; a stage waits only while
        some load is being read. For tests and diagnostics."""
        with self._no_loads_reading:  # the stager holds it except inside the wait
            return self._stage_yielding

    @property
    def loading(self) -> bool:
        """Whether a load or a stage is under way: ``finished_loads`` has none to settle
        when not (loads and stages come and go only in the caller's calls)."""
        return bool(self._loads or self._stages)

    @property
    def pinned_slots(self) -> int:
        """Host slots that loads, stages and saves in flight hold (none at rest)."""
        return self.host.num_blocks - self.host.num_free

    def load(self, req_id: str, asynchronous: bool = False) -> None:
        """Start the pinned load of ``req_id``. A host-only load is copied here (queued
        on the load stream after the engine's current work on CUDA, so the engine's next
        kernels see it) unless ``asynchronous``: the engine computes meanwhile and
        uses the blocks only once ``finished_loads`` has reported them. Spill reads
        always run on an I/O worker; a load that is not ``asynchronous`` and has some is
        in place once ``wait_loads`` of its request returns (the engine computes with it
        in this step). Never raises for a failure: ``finished_loads`` reports it."""
        with self._lock:
            p = self._loads[req_id]
            p.started = time.perf_counter()
            if not p.runs and not asynchronous:
                p.inline = True
                self._copy_up(p, p.host_slots, after=None)
                if self._cuda:
                    p.transfer.order_current_stream()
                else:
                    p.times.copied = time.time()
                    p.finished.set()
                return
            after = self.transfer.mark()
        self._count_loads_reading(+1)
        try:
            self.transfer.submit(self._read_load, p, after)
        except BaseException:
            self._count_loads_reading(-1)
            raise

    def finished_loads(self) -> list[tuple[str, list[BlockIds]]]:
        """Loads that are over, each with the engine blocks that did not load (recompute
        them); unpins their slots and publishes what came from the spill tiers."""
        with self._lock:
            done = [
                (r, p)
                for r, p in self._loads.items()
                if p.started and (p.transfer.done() if p.inline else p.finished.is_set())
            ]
            out = []
            for req_id, p in done:
                del self._loads[req_id]
                self._settle(req_id, p)
                out.append((req_id, p.failed_blocks()))
            self._settle_stages()
            return out

    # ------------------------------------------------------------------ saves
    def save(
        self, blocks: list[BlockIds], keys: Sequence[bytes], parent: bytes, start: int
    ) -> None:
        """Copy engine ``blocks`` (chain positions ``start..``, this shard's keys ``keys``,
        the first one's parent ``parent``) into host slots, unless already there (then
        they are only queued again, as the newest). Call after the engine has queued the
        writes of their KV; the engine may reuse the blocks as soon as this returns.

        A batch larger than the free slots goes in pieces: each piece is published
        (once its copy is done) before the next one evicts, so on CPU a chain longer
        than the host pool passes through it into the spill tiers.
        """
        with self._lock:
            self._poll_saves()
            if self._detached:  # nothing to copy from: a later miss
                self._stats["cpu"].dropped += len(blocks)
                return
            if self.uses is not None:
                self.uses.record(keys)
            host = self.host
            present = host.lookup_each(keys)
            host.requeue([s for s in present if s is not None])
            parents = [parent, *keys[:-1]]
            todo = [i for i, s in enumerate(present) if s is None]
            while todo and host.num_free:
                piece, todo = todo[: host.num_free], todo[host.num_free :]
                self._save_piece(
                    [blocks[i] for i in piece],
                    CachedBlocks(
                        [],  # slots: filled in by _save_piece
                        [keys[i] for i in piece],
                        [start + i for i in piece],
                        [parents[i] for i in piece],
                    ),
                )
            self._stats["cpu"].dropped += len(todo)

    def write_tail(self, key: bytes, position: int) -> None:
        """The chain whose last block is ``key`` (chain position ``position``) is over (its
        request finished): its last chunk, short of a whole one, goes to the write-through
        tiers now (``SpillManager.write_tail``), if the host pool holds it."""
        with self._lock:
            self._poll_saves()
            if self._spill_out:
                self._spill_out.write_tail(key, position)

    def reset(self) -> None:
        """Drop what the host pool holds (the engine's weights changed; its keys moved to
        a new key space anyway), unless a load, a copy or a write-through encode holds
        some: then they age out. The spill tiers are shared and keep their values."""
        with self._lock:
            if self.host.reset():  # no eviction hook: staged blocks are gone unused
                self._staged_unused.clear()
                self._staged_for.clear()

    def detach(self) -> None:
        """The engine is about to unmap its KV tensors (vLLM's sleep): returns once no
        copy of a load or save in flight can touch them any more, and until ``attach``
        none starts (a load's blocks fail, a save is dropped). Loads and stages read on;
        what they read stays in the host pool, as does everything below it."""
        with self._lock:
            self._detached = True
            loading = list(self._loads)
            inline = [p.transfer for p in self._loads.values() if p.started and p.inline]
        self.wait_loads(req_ids=loading)  # those on a worker
        for transfer in inline:
            transfer.join()
        self._join_saves()

    def attach(self) -> None:
        """The engine's KV tensors are mapped again (vLLM's wake-up; the same tensors,
        their contents lost): loads and saves copy again."""
        with self._lock:
            self._detached = False

    # ------------------------------------------------------------------ misc
    def counters(self) -> CacheStats:
        """A snapshot of the host pool's and each spill tier's counters (cheap: asks no
        store anything)."""
        with self._lock:
            self._poll_saves()
            snapshot = self._stats.snapshot()
        if self.spill:
            snapshot.tiers.update(self.spill.counters())
        return snapshot

    def counts(self) -> dict[str, tuple[int, ...]]:
        """``counters`` without the latency histograms (``TierStats.counts``): cheap
        enough for every engine step."""
        with self._lock:
            self._poll_saves()
            out = {name: s.counts() for name, s in self._stats.tiers.items()}
        if self.spill:
            out.update(self.spill.counts())
        return out

    def stats(self) -> CacheStats:
        """``counters``, with what each spill tier holds (asked of the store)."""
        snapshot = self.counters()
        if self.spill:
            snapshot.tiers.update(self.spill.stats())
        return snapshot

    def flush(self) -> None:
        """Wait for every copy and spill write in flight (tests, shutdown)."""
        self._join_saves()
        self.below.flush()

    def wait_loads(
        self,
        timeout: float | None = None,
        req_ids: Iterable[str] | None = None,
        copies: bool = False,
    ) -> None:
        """Wait until every started load and stage that runs on a worker (only the loads
        of ``req_ids`` when given) is over, or ``timeout`` seconds have passed;
        ``finished_loads`` then reports those over (the others are copies that ``load``
        itself ran or queued, waited for too with ``copies``: a host sync on CUDA)."""
        with self._lock:
            if req_ids is None:
                loads = [*self._loads.values(), *self._stages.values()]
            else:
                loads = [self._loads[r] for r in req_ids if r in self._loads]
            reading = [p for p in loads if p.started and not p.inline]
            queued = [p.transfer for p in loads if p.inline] if copies else []
        for transfer in queued:
            transfer.join()
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in reading:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0 or not p.finished.wait(left):
                return

    def close(self) -> None:
        """Finish loads, copies and writes in flight, write to the write-through tiers
        what they have not taken (``SpillManager.write_unlanded``), then close the tiers.
        Once: a later call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.wait_loads()
        self.finished_loads()
        self._stager.shutdown()
        self.flush()  # every save published, every write queued so far landed
        with self._lock:
            if self._spill_out:
                self._spill_out.write_unlanded()
        self.below.flush()
        _open_in_process.pop(self._namespace, None)
        self.below.close()
        self.trace.close()

    # ------------------------------------------------------------------ internals
    def _copy(
        self, fn, stream: torch.cuda.Stream | None, n: int, after: torch.cuda.Event | None = None
    ) -> Transfer:
        """Run ``fn`` (a batch of copies of ``n`` blocks): inline on CPU, on ``stream``
        after ``after`` (else the current stream's work) on CUDA. Failures are kept in
        the handle, never raised."""
        nbytes = n * self.layout.block_nbytes
        if stream is None:
            start = time.perf_counter()
            try:
                fn()
            except Exception as e:
                return Transfer(nbytes, error=e)
            return Transfer(nbytes, seconds=time.perf_counter() - start)
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            events[0].record(stream)
            try:
                fn()
            except Exception as e:
                return Transfer(nbytes, error=e)
            finally:
                events[1].record(stream)
        return Transfer(nbytes, events=events)

    def _copy_up(self, p: _Load, slots: list[int], after: torch.cuda.Event | None) -> None:
        blocks = p.blocks[: len(slots)]
        p.transfer = self._copy(
            lambda: self.kv.copy_from(self._host_view, slots, blocks),
            self.transfer.load_stream if self._cuda else None,
            len(slots),
            after,
        )

    def _run_load(self, p: _Load, after: torch.cuda.Event | None) -> None:
        """On an I/O worker: read the spill runs into the staging slots, copy every
        loaded block up (a load), and wait for the copy. ``p.valid`` is set only at the
        end."""
        p.times.run = time.time()
        try:
            valid = len(p.host_slots)
            if p.runs:
                p.result = self.spill.load(p.runs, p.spill_slots)
                p.times.read = time.time()
                valid += p.result.num_blocks
            if p.blocks:  # a stage only reads
                self._copy_up(p, p.slots[:valid], after)
                error = p.transfer.join()
                if error is not None:
                    raise error
                p.times.copied = time.time()
            p.valid = valid
        except Exception as e:  # settled as a failed load, never raised
            p.error = e
        finally:
            p.finished.set()

    def _read_load(self, p: _Load, after: torch.cuda.Event | None) -> None:
        try:
            self._run_load(p, after)
        finally:
            self._count_loads_reading(-1)

    def _read_stage(self, p: _Load) -> None:
        if not p.cancelled:  # one cancelled while queued holds up the stages behind it no more
            with self._no_loads_reading:
                self._stage_yielding = True
                try:
                    self._no_loads_reading.wait_for(lambda: not self._loads_reading, STAGE_YIELD)
                finally:
                    self._stage_yielding = False
        with self._lock:  # from here on, the stage's slots are its read's
            p.reading = not p.cancelled
        if p.reading:  # else it is over already (``_cancel_stage``)
            self._run_load(p, None)

    def _count_loads_reading(self, change: int) -> None:
        with self._no_loads_reading:
            self._loads_reading += change
            if not self._loads_reading:
                self._no_loads_reading.notify_all()

    def _settle(self, req_id: str, p: _Load) -> None:
        """Count a finished load, publish what it read from the spill tiers, unpin."""
        stats = self._stats["cpu"]
        if p.inline:  # the copy is the whole load
            error = p.transfer.join()
            if error is None:
                p.valid = len(p.host_slots)
            else:
                p.error = error
        if p.error is not None:
            log.warning("kvtier: load of %d blocks failed: %s", len(p.blocks), p.error)
            stats.errors += 1
            p.valid = 0
        if p.result is not None:
            self.spill.settle_load(p.result)
        n_host = len(p.host_slots)
        loaded = max(0, min(p.valid, n_host + (p.result.num_blocks if p.result else 0)) - n_host)
        if loaded:  # blocks read from the spill tiers are host-cached now too
            keys = p.keys[n_host : n_host + loaded]
            parent = p.keys[n_host - 1] if n_host else p.parent
            self.below.publish_loaded(
                p.spill_slots[:loaded], keys, p.start + n_host, parent, p.runs
            )
            self._changes.update(dict.fromkeys(keys, True))
            if not p.blocks:  # a stage
                self.stage_counts.staged += loaded
                if not p.cancelled:  # for a request that still waits
                    self._staged_unused.update(keys)
                    self._staged_for[req_id] = keys
        self.host.free(p.slots)
        from_host = min(p.valid, n_host)
        if from_host:
            stats.count_out(from_host, from_host * self.layout.block_nbytes)
        if p.blocks:
            self._stats.prefetch_latency.observe(time.perf_counter() - p.started)
        if self.trace:
            blocks = hit_blocks(len(p.host_slots), p.runs)
            reads = p.result.read_seconds if p.result else {}
            event = "load" if p.blocks else "stage"
            self.trace.load(req_id, self.shard, blocks, p.valid, p.times, reads, event)

    def _settle_stages(self) -> None:
        """Settle the stages that are over (their blocks published, their slots
        unpinned), for ``take_report`` to name."""
        for req_id, p in list(self._stages.items()):
            if p.finished.is_set():
                del self._stages[req_id]
                self._settle(req_id, p)
                self._stages_over.append(req_id)

    def _save_piece(self, src: list[BlockIds], chain: CachedBlocks) -> None:
        """Copy engine blocks ``src`` into newly allocated slots that will hold ``chain``."""
        n = len(src)
        evictions = self.host.stats().evictions
        slots = self.host.allocate(n)  # evicted slots are spilled by the hook, first
        self._stats["cpu"].evictions += self.host.stats().evictions - evictions
        transfer = self._copy(
            lambda: self.kv.copy_to(self._host_view, src, slots),
            self.transfer.offload_stream if self._cuda else None,
            n,
        )
        transfer.order_current_stream()  # the engine reuses the blocks after the copy
        save = _Save(transfer, replace(chain, block_ids=slots))
        if transfer.done():
            self._finish_save(save)
        else:
            self._saves.append(save)

    def _join_saves(self) -> None:
        """Wait for the copies of every save in flight, and publish them."""
        with self._lock:
            for s in self._saves:
                s.transfer.join()
            self._poll_saves()

    def _poll_saves(self) -> None:
        if self._saves:
            pending = []
            for s in self._saves:
                if s.transfer.done():
                    self._finish_save(s)
                else:
                    pending.append(s)
            self._saves = pending

    def _finish_save(self, s: _Save) -> None:
        slots = s.slots.block_ids
        stats = self._stats["cpu"]
        if s.transfer.error is None:
            b = s.slots
            self.host.publish(slots, b.hashes, b.positions, b.parents)
            self._changes.update(dict.fromkeys(b.hashes, True))
            stats.count_in(len(slots), s.transfer.nbytes, s.transfer.seconds)
        else:
            log.warning("kvtier: save to the host pool failed: %s", s.transfer.error)
            stats.errors += 1
        self.host.free(slots)  # in chain order: the tail is queued first, evicted first
        if s.transfer.error is None and self._spill_out:
            self._spill_out.on_host_publish(s.slots)

    def _on_host_evict(self, victims: CachedBlocks) -> None:
        """Host eviction hook: the index learns the victims are gone; the spill tiers
        take their chunks before the slots are reused."""
        self._changes.update(dict.fromkeys(victims.hashes, False))
        if self._staged_unused:
            unused = self._staged_unused.intersection(victims.hashes)
            self._staged_unused -= unused
            self.stage_counts.evicted_unused += len(unused)
        if self._spill_out:
            self._spill_out.on_host_evict(victims)
