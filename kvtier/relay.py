"""``Relay``: the loads of a replicated shard, passed from the rank that holds it.

Where every rank of a tensor-parallel group holds the same KV (an MLA latent is whole on
each), one copy below is enough: the group's first rank, the *holder*, keeps the shard's
host pool and reads its spill tiers; the other ranks keep nothing below their KV and
receive every load from the holder over the group, straight into their KV blocks. The
host pool, the bytes written and the bytes read below are then one copy's, not one per
rank.

A relay moves a batch of loads at once: one broadcast of how many leading blocks of each
the holder loaded, then the blocks in pieces of at most ``piece_bytes``, each gathered
from the holder's KV, announced (whether the gather succeeded: else no rank writes the
piece, and its loads fail on every rank), broadcast and scattered into each other
rank's KV. A rank that has nowhere to put a load's blocks (it never heard of the load)
still takes part, and drops them; one that cannot scatter a piece fails its loads there
and goes on with the relay.

Threads. Every rank of the group must run the same relays in the same order: they run
on the engine's own thread, in the order its step's instructions (the same on every
rank) name them, so they never interleave with the engine's collectives on the group.
A relay raises only where a collective fails, which fails the engine's group as well;
what the holder could fail at is announced before the broadcast it concerns.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from kvtier.connector import BlockIds, EngineKV

log = logging.getLogger(__name__)

PIECE_BYTES = 16 << 20  # at most this much KV in one broadcast (its buffer on the device)


class Relay:
    """One rank's end of its group's relays. ``data`` is the group on the KV's device
    (NCCL on CUDA), ``control`` the same ranks on the CPU (gloo); the holder is rank 0
    of both. ``attached``: whether the engine's KV is mapped (False while it sleeps:
    the holder sends no block, the others write none)."""

    def __init__(
        self,
        kv: EngineKV,
        data: dist.ProcessGroup,
        control: dist.ProcessGroup,
        holder: bool,
        piece_bytes: int = PIECE_BYTES,
    ) -> None:
        self.kv = kv
        self.holder = holder
        self.attached = True
        self._data, self._control = data, control
        self._piece_blocks = max(1, piece_bytes // (len(kv.layers) * kv.block_nbytes))
        # The pieces' buffer, kept from relay to relay: a fresh one costs more than the
        # copies on the CPU (its pages are faulted in anew), and on CUDA the caching
        # allocator would keep its memory anyway.
        self._buffer = torch.empty(
            0, len(kv.layers), *kv.block_shape, dtype=kv.dtype, device=kv.device
        )
        self.blocks = 0  # blocks relayed (sent by the holder, received by the others)

    def run(self, loads: Sequence[Sequence[BlockIds] | None], valid: Sequence[int]) -> list[int]:
        """Relay ``loads`` (each one's engine blocks in chain order; None where this rank
        has none): on the holder ``valid[i]`` is how many leading blocks of load i it
        loaded (the others pass anything). Returns, per load, how many leading blocks
        hold the holder's KV on this rank now; the rest are not loaded."""
        counts = torch.zeros(len(loads), dtype=torch.int64)
        if self.holder and self.attached:
            for i, blocks in enumerate(loads):
                counts[i] = min(valid[i], len(blocks)) if blocks is not None else 0
        self._broadcast(self._control, counts)
        sent = counts.tolist()
        targets = [
            blocks if blocks is not None and self.attached and len(blocks) >= n else None
            for blocks, n in zip(loads, sent)
        ]
        ok = [True] * len(loads)
        flat = [(i, j) for i, n in enumerate(sent) for j in range(n)]
        for start in range(0, len(flat), self._piece_blocks):
            piece = flat[start : start + self._piece_blocks]
            if not self._relay_piece(piece, loads, targets):
                for i, _ in piece:
                    ok[i] = False
        self.blocks += len(flat)
        return [n if okay and t is not None else 0 for n, okay, t in zip(sent, ok, targets)]

    def _relay_piece(
        self,
        piece: list[tuple[int, int]],
        loads: Sequence[Sequence[BlockIds] | None],
        targets: list[Sequence[BlockIds] | None],
    ) -> bool:
        """Relay the blocks ``piece`` names ((load, block) pairs): whether they are in
        place on this rank. Where the holder cannot gather them no rank writes any;
        where this rank cannot scatter them its loads fail here, and the relay goes on
        (the other ranks are in it)."""
        kv = self.kv
        if len(self._buffer) < len(piece):
            self._buffer = self._buffer.new_empty(len(piece), *self._buffer.shape[1:])
        buffer = self._buffer[: len(piece)]
        slots = list(range(len(piece)))
        gathered = torch.ones(1, dtype=torch.uint8)
        if self.holder:
            try:
                kv.copy_to(buffer, [loads[i][j] for i, j in piece], slots)
            except Exception as e:  # never raised: the loads fail on every rank
                log.warning("kvtier: relay of %d blocks failed: %s", len(piece), e)
                gathered[0] = 0
        self._broadcast(self._control, gathered)
        if not gathered[0]:
            return False
        self._broadcast(self._data, buffer.view(-1).view(torch.uint8))
        mine = [(s, targets[i][j]) for s, (i, j) in enumerate(piece) if targets[i] is not None]
        if mine and not self.holder:
            try:
                kv.copy_from(buffer, [s for s, _ in mine], [b for _, b in mine])
            except Exception as e:  # never raised: the loads fail on this rank
                log.warning("kvtier: relay of %d blocks failed here: %s", len(mine), e)
                return False
        return True

    @staticmethod
    def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([tensor], opts).wait()
