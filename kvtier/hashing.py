"""Chained block hashes: a block's 16-byte hash names its whole prefix.

    root  = H("kvtier-root-v1" || tagged(model) || tagged(layout fingerprint) || tagged(salt))
    h[i]  = H(h[i-1] || tokens of block i as little-endian uint32 || extras(i)),  h[-1] = root

Only full blocks are hashed. ``extras(i)`` is empty for a plain block; otherwise it is
a sequence of *tagged, length-prefixed* items (one tag byte, a uint32 length, the
payload): the LoRA name (tag ``L``) and the multimodal inputs overlapping block i
(tag ``M``: content hash and signed offset from the block's first token). Because
every item carries its domain tag and length, the encoding is injective: a LoRA name
can never produce the bytes of a multimodal item, and neither can reach the root's
fields (tags ``N``/``F``/``S``), whatever their content.

Two digests are offered:

- ``xxh3_128`` (default): ~30 ns per block. Not collision-resistant against crafted
  input: a tenant who can choose prompts could in principle construct a prompt whose
  block hash equals another's. Use it where tenants trust each other.
- ``sha256`` (truncated to 16 bytes): several times slower per block, but no
  practical collision can be crafted. Use it when prompts from mutually untrusted
  tenants share a cache (and give each tenant its own salt as well).

Everything is deterministic across processes and machines: no Python ``hash()``,
no random seeds. The chain loop runs in the compiled core (``kvtier._core``, with
xxh3_128 inlined from the vendored ``xxhash.h``); its digests are the bytes of
``xxhash.xxh3_128_digest`` and ``hashlib.sha256`` over the same input.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from kvtier._core import chain_hashes, pack_tokens

HASH_NBYTES = 16
ALGORITHMS = ("xxh3_128", "sha256")

Digest = Callable[[bytes], bytes]


def _sha256_16(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:HASH_NBYTES]


_DIGESTS: dict[str, Digest] = {"xxh3_128": xxhash.xxh3_128_digest, "sha256": _sha256_16}


def get_digest(algorithm: str) -> Digest:
    """The 16-byte digest function named ``algorithm`` (one of ``ALGORITHMS``)."""
    try:
        return _DIGESTS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown hash algorithm {algorithm!r}; expected one of {ALGORITHMS}"
        ) from None


def _tagged(tag: bytes, payload: bytes) -> bytes:
    """One domain-tagged, length-prefixed item: tag (1 byte) || uint32 length || payload."""
    return tag + struct.pack("<I", len(payload)) + payload


def namespace_root(
    model: str, layout_fingerprint: bytes, salt: str = "", algorithm: str = "xxh3_128"
) -> bytes:
    """The hash every chain starts from: different model, layout or salt => disjoint keys."""
    data = (
        b"kvtier-root-v1"
        + _tagged(b"N", model.encode())
        + _tagged(b"F", layout_fingerprint)
        + _tagged(b"S", salt.encode())
    )
    return get_digest(algorithm)(data)


@dataclass(frozen=True)
class MultiModalInput:
    """A non-text input occupying prompt positions ``[offset, offset + length)``.

    ``content_hash`` identifies the input's content (e.g. a hash of the image bytes);
    blocks that overlap the input include it, so the same placeholder tokens with a
    different image never share KV.
    """

    content_hash: bytes
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"multimodal input needs offset >= 0 and length > 0, got {self}")


@dataclass(frozen=True)
class ExtraKeys:
    """What changes a block's KV besides its tokens: a LoRA adapter, multimodal inputs."""

    lora: str | None = None
    mm_inputs: tuple[MultiModalInput, ...] = field(default=())

    def block_suffix(self, block_index: int, block_size: int) -> bytes:
        """The tagged extras of block ``block_index``; empty when it has none."""
        parts = [] if self.lora is None else [_tagged(b"L", self.lora.encode())]
        start, end = block_index * block_size, (block_index + 1) * block_size
        for mm in self.mm_inputs:
            if mm.offset < end and mm.offset + mm.length > start:
                parts.append(_tagged(b"M", mm.content_hash + struct.pack("<q", mm.offset - start)))
        return b"".join(parts)


TokenIds = Sequence[int] | np.ndarray | torch.Tensor


def token_bytes(token_ids: TokenIds) -> bytes:
    """Token ids as little-endian uint32 bytes; rejects ids outside [0, 2**32)."""
    if type(token_ids) is list:  # the common case, before torch's costly isinstance
        return pack_tokens(token_ids)
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    if isinstance(token_ids, np.ndarray):
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= 2**32):
            raise ValueError("token ids must be in [0, 2**32)")
        return np.ascontiguousarray(token_ids, dtype="<u4").tobytes()
    return pack_tokens(token_ids)


class BlockHasher:
    """Hashes the full blocks of token runs into chains under one namespace root.

    ``hash_blocks`` is the single entry point: it hashes a whole prompt in one call,
    and extends an existing chain (decode) when given the chain's last hash and the
    index of the first new block. The returned hashes are always for full blocks only.
    """

    def __init__(self, root: bytes, block_size: int, algorithm: str = "xxh3_128") -> None:
        if len(root) != HASH_NBYTES:
            raise ValueError(f"root must be {HASH_NBYTES} bytes, got {len(root)}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.root = root
        self.block_size = block_size
        self.algorithm = algorithm
        digest = get_digest(algorithm)
        # The compiled chain inlines xxh3_128 (None); any other digest it calls per block.
        self._chain_digest = None if algorithm == "xxh3_128" else digest

    def hash_blocks(
        self,
        token_ids: TokenIds,
        parent: bytes | None = None,
        first_block: int = 0,
        extra: ExtraKeys | None = None,
    ) -> list[bytes]:
        """Hashes of the full blocks in ``token_ids``.

        ``token_ids`` starts at block ``first_block`` of its prompt; ``parent`` is the
        hash of block ``first_block - 1`` (``None`` means the root, for block 0).
        A trailing partial block is ignored.
        """
        if parent is None:
            if first_block != 0:
                raise ValueError("parent is required when first_block > 0")
            parent = self.root
        data = token_bytes(token_ids)
        if extra is None or (extra.lora is None and not extra.mm_inputs):
            suffixes: bytes | list[bytes] = b""
        elif not extra.mm_inputs:  # a LoRA alone: the same suffix on every block
            suffixes = extra.block_suffix(0, self.block_size)
        else:
            n = len(data) // (4 * self.block_size)
            suffixes = [extra.block_suffix(first_block + i, self.block_size) for i in range(n)]
        return chain_hashes(data, parent, 4 * self.block_size, suffixes, self._chain_digest)
