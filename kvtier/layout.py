"""The shape and dtype of one block's KV, and the fingerprint that names it.

Every tier stores blocks as raw bytes, so the layout is what gives those bytes a
meaning. Two caches with different layouts must never share a block: the layout
fingerprint is part of every namespace root and every spill-tier value header.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import xxhash

# Names accepted in configs, mapped to torch dtypes. Only dtypes whose bytes can be
# stored and restored exactly (no implicit conversion) are listed.
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The config name of a supported torch dtype; raises ValueError for others."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; expected one of {sorted(DTYPES)}")


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one block's KV across all layers.

    A block is stored contiguously as ``[num_layers, kv_factor, block_size,
    num_kv_heads, head_dim]`` elements of ``dtype`` (``kv_factor`` is 2 for
    separate K and V, 1 for MLA's joint latent). The block-major order is what
    lets a batch of blocks move with one gather and land as one contiguous run.
    """

    num_layers: int
    kv_factor: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.kv_factor not in (1, 2):
            raise ValueError(f"KVLayout.kv_factor must be 1 or 2, got {self.kv_factor!r}")
        dtype_name(self.dtype)  # validates

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: (layers, kv_factor, block_size, kv_heads, head_dim)."""
        return (self.num_layers, self.kv_factor, self.block_size, self.num_kv_heads, self.head_dim)

    @cached_property
    def block_numel(self) -> int:
        """Number of elements in one block."""
        n = 1
        for dim in self.block_shape:
            n *= dim
        return n

    @cached_property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @cached_property
    def block_nbytes(self) -> int:
        """Bytes of one block of KV across all layers."""
        return self.block_numel * self.itemsize

    @cached_property
    def fingerprint(self) -> bytes:
        """16 bytes that are equal exactly when two layouts are equal, in any process."""
        text = "kvtier-layout-v1:" + ":".join(
            str(v) for v in (*self.block_shape, dtype_name(self.dtype))
        )
        return xxhash.xxh3_128_digest(text.encode())

    def describe(self) -> str:
        """One line for logs and CLI output."""
        return (
            f"{self.num_layers} layers x {self.kv_factor} x {self.block_size} tokens x "
            f"{self.num_kv_heads} heads x {self.head_dim} {dtype_name(self.dtype)} "
            f"= {self.block_nbytes} B/block"
        )
