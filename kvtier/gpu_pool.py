"""The device block pool: ``BlockPool`` bookkeeping over a block-major KV tensor.

``kv[b]`` is block ``b``'s KV across all layers (``layout.block_shape``), so a batch
of blocks is a set of rows that one gather moves. The eviction hook (see
``BlockPool``) runs before a cached block's row is handed out again, which is where
the host tier copies it out.
"""

from __future__ import annotations

import torch

from kvtier._core import UseCounts
from kvtier.block_pool import BlockPool, EvictionHook
from kvtier.config import EvictionPolicy
from kvtier.layout import KVLayout


class GPUBlockPool(BlockPool):
    """``num_blocks`` KV blocks on ``device`` with prefix caching; ``eviction`` and
    ``uses`` as for ``BlockPool``."""

    def __init__(
        self,
        num_blocks: int,
        layout: KVLayout,
        device: torch.device | str = "cpu",
        on_evict: EvictionHook | None = None,
        eviction: EvictionPolicy = "lru",
        uses: UseCounts | None = None,
    ) -> None:
        super().__init__(num_blocks, on_evict, eviction, uses)
        self.layout = layout
        self.device = torch.device(device)
        # Block-major: one block is one contiguous run of layout.block_nbytes bytes.
        self.kv = torch.zeros((num_blocks, *layout.block_shape), dtype=layout.dtype, device=device)
