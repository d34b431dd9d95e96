"""Chunk values: the format every spill tier (LMDB, Redis) stores, and its checks.

A chunk is a run of blocks ``[s, s+n)`` of one chain inside one aligned chunk
``[k*C, (k+1)*C)`` (``C`` the tier's ``chunk_blocks``; usually ``s = k*C``, see
``kvtier.spill``), stored under the 16-byte chained hash of its last block. Its value
is one contiguous buffer::

    MAGIC (4 bytes, b"KVT\\x01") | uint32 LE header length H (1 <= H <= 1024)
    | msgpack header (H bytes) | payload (n * layout.block_nbytes bytes)

The header is a msgpack map with exactly the keys ``v`` (format version), ``fp``
(16-byte layout fingerprint), ``key`` (16-byte chunk key), ``n`` (blocks), ``pos``
(chain position of the first block), ``len`` (payload bytes) and ``sum`` (the
``xxh3_64`` int digest of the payload, seeded with ``pos`` so that the one header
field not checked against the caller's expectations or the value's length is
covered too). Values are never pickled.

The encoder always writes the same fixed-width header (ints as msgpack uint64), so
``encoded_nbytes(n)`` is exact; the decoder accepts any well-formed msgpack header
(it reads that fixed form with one ``struct`` unpack, anything else with msgpack,
with the same checks and the same outcome).
Decoding validates, in order: empty, truncated / magic, header, version, layout,
key, length, checksum; the first failure raises ``BadChunk`` with its reason code.
``decode`` does all of it; a load calls ``read_header`` (all but the checksum) and
then ``scatter``, which copies the blocks it needs into host slots on a copier thread
while it checks the checksum of the whole payload.
Nothing else is ever raised for a bad value, and nothing in a value is trusted
before it has been checked.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, get_args

import msgpack
import numpy as np
import torch
import xxhash

from kvtier._core import Copier
from kvtier.layout import KVLayout

FORMAT_VERSION: Final = 1
MAGIC: Final = b"KVT\x01"
KEY_NBYTES: Final = 16
MAX_HEADER_NBYTES: Final = 1024

_PREFIX = struct.Struct("<4sI")  # magic, header length
_HEADER_KEYS: Final = frozenset(("v", "fp", "key", "n", "pos", "len", "sum"))
_U64_MAX: Final = (1 << 64) - 1

Reason = Literal[
    "empty", "truncated", "magic", "header", "version", "layout", "key", "length", "checksum"
]
REASONS: Final[frozenset[str]] = frozenset(get_args(Reason))


class BadChunk(ValueError):
    """A value that is not a valid chunk for this layout and key.

    ``reason`` is one of ``REASONS``; the message says what was expected and found.
    """

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(f"bad chunk ({reason}): {message}")
        self.reason: Reason = reason


@dataclass(frozen=True)
class ChunkHeader:
    """The decoded, validated header of a chunk value."""

    version: int
    layout_fingerprint: bytes
    key: bytes
    num_blocks: int
    first_position: int
    payload_nbytes: int
    checksum: int


def _verify(header: ChunkHeader, actual: int) -> None:
    """BadChunk ("checksum") unless ``actual`` is the payload digest the header records."""
    if actual != header.checksum:
        raise BadChunk(
            "checksum", f"expected xxh3_64 {header.checksum:#018x}, found {actual:#018x}"
        )


def chunk_bounds(position: int, chunk_blocks: int) -> tuple[int, int]:
    """``(start, end)``: the aligned chunk ``[start, end)`` that holds chain ``position``."""
    if position < 0:
        raise ValueError(f"chain position must be >= 0, got {position}")
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
    start = position - position % chunk_blocks
    return start, start + chunk_blocks


def byte_rows(t: torch.Tensor) -> np.ndarray:
    """Zero-copy ``[N, bytes per row]`` uint8 numpy view of a CPU tensor ``[N, ...]``.

    Works for every dtype, bfloat16 and float8 included (the bytes are reinterpreted,
    never converted). The tensor must be on the CPU and contiguous; the view shares
    its memory (writes through it change the tensor).
    """
    if t.device.type != "cpu":
        raise ValueError(f"byte_rows needs a CPU tensor, got one on {t.device}")
    if t.dim() < 1:
        raise ValueError("byte_rows needs a tensor with a leading row dimension")
    if not t.is_contiguous():
        raise ValueError("byte_rows needs a contiguous tensor (a view must not copy)")
    return t.detach().view(torch.uint8).reshape(t.shape[0], -1).numpy()


def _fixed_header_template(fingerprint: bytes) -> tuple[bytes, int, tuple[int, ...]]:
    """Magic, H and a msgpack header with fixed-width fields, zeroed where they vary.

    Returns ``(template, key_offset, int_offsets)``: the 16-byte key goes at
    ``key_offset``; the big-endian uint64 values of n, pos, len and sum at
    ``int_offsets`` (all offsets from the value's start).
    """
    parts: list[bytes] = [b"\x87"]  # fixmap, 7 entries
    parts.append(b"\xa1v" + bytes((FORMAT_VERSION,)))  # positive fixint
    parts.append(b"\xa2fp\xc4\x10" + fingerprint)
    parts.append(b"\xa3key\xc4\x10")
    key_off = sum(map(len, parts))
    parts.append(bytes(KEY_NBYTES))
    int_offs = []
    for name in (b"n", b"pos", b"len", b"sum"):
        parts.append(bytes((0xA0 | len(name),)) + name + b"\xcf")  # fixstr, uint64
        int_offs.append(sum(map(len, parts)))
        parts.append(bytes(8))
    head = b"".join(parts)
    prefix = _PREFIX.pack(MAGIC, len(head))
    return prefix + head, len(prefix) + key_off, tuple(len(prefix) + o for o in int_offs)


def _fixed_header_struct(fingerprint: bytes) -> tuple[struct.Struct, tuple[bytes, ...]]:
    """The fixed-width header as one ``struct``: constant segments between the fields.

    Returns ``(fmt, segments)``: ``fmt`` packs / unpacks ``(seg0, key, seg1, n, seg2,
    pos, seg3, len, seg4, sum)`` (the ``segments`` are ``seg0..seg4``: magic, header
    length, map and field names, fingerprint); ``fmt.size`` is the header's length.
    """
    template, key_off, (o_n, o_pos, o_len, o_sum) = _fixed_header_template(fingerprint)
    assert o_sum + 8 == len(template)
    bounds = [(0, key_off), (key_off + KEY_NBYTES, o_n), (o_n + 8, o_pos)]
    bounds += [(o_pos + 8, o_len), (o_len + 8, o_sum)]
    segments = tuple(template[a:b] for a, b in bounds)
    lens = [len(seg) for seg in segments]
    fmt = struct.Struct(f">{lens[0]}s{KEY_NBYTES}s{lens[1]}sQ{lens[2]}sQ{lens[3]}sQ{lens[4]}sQ")
    assert fmt.size == len(template)
    return fmt, segments


class ChunkCodec:
    """Encodes and decodes chunk values for one layout.

    ``encode`` gathers slab rows straight into the value; ``scatter`` copies a value's
    blocks into slab rows. Both copy on the codec's copier thread (``kvtier._core.Copier``)
    while the calling thread computes the checksum over the same bytes: two cores on
    one value (one core doing both reached ~0.6-0.75 of a plain copy, measured with
    ``benchmarks/bench_tiers.py``). ``decode`` validates a value and returns a
    zero-copy view of its blocks. All are thread-safe (the copier takes jobs from any
    thread; the codec holds no other mutable state). ``close`` stops the copier.
    """

    __slots__ = ("layout", "block_nbytes", "fingerprint", "_header", "_segments", "_copier")

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.block_nbytes: int = layout.block_nbytes
        self.fingerprint: bytes = layout.fingerprint
        self._header, self._segments = _fixed_header_struct(self.fingerprint)
        self._copier = Copier(name="kvtier-codec")

    def close(self) -> None:
        """Stop the copier thread (``encode`` and ``scatter`` raise RuntimeError after)."""
        self._copier.close()

    @property
    def header_nbytes(self) -> int:
        """Bytes in front of the payload of every value this codec encodes."""
        return self._header.size

    def encoded_nbytes(self, n: int) -> int:
        """Exact length of the value ``encode`` writes for ``n`` blocks."""
        return self._header.size + n * self.block_nbytes

    def encode(
        self,
        key: bytes,
        first_position: int,
        src: np.ndarray,
        rows: Sequence[int] | np.ndarray,
    ) -> memoryview:
        """The value holding blocks ``src[rows]``, in that order, from chain ``first_position``.

        ``src`` is a 2-D uint8 array ``[num_slots, block_nbytes]`` (see ``byte_rows``);
        ``rows`` are 1 or more row indices in ``[0, num_slots)``, in chain order. The
        rows are gathered straight into the returned (writable, contiguous) buffer, on
        the copier while this thread hashes them, with plain stores: the tier write
        reads the value next, from the CPU cache (measured against streaming stores,
        medians of 8 ``bench_tiers --quick`` runs each: ``encode chunk 8/32`` 1.16x /
        1.22x, ``lmdb put chunk 8/32`` 1.06x / 1.05x).
        Raises ValueError / TypeError for bad arguments (a caller bug, not bad data).
        """
        return self.encode_many(src, [(key, first_position, rows)])[0]

    def encode_many(
        self, src: np.ndarray, chunks: Sequence[tuple[bytes, int, Sequence[int] | np.ndarray]]
    ) -> list[memoryview]:
        """``encode(key, first_position, src, rows)`` of each ``(key, first_position, rows)``
        in ``chunks``, as one batch: the values are consecutive views of one buffer, and
        every copy is queued before this thread hashes the first row, so the copier and
        this thread never wait for each other between values (measured here, 8 MiB of
        chunks of 8 or 32 blocks: 8-19% faster than one ``encode`` per value with the
        slab out of the CPU cache, 15-29% in it). Every chunk is checked before anything
        is copied.
        """
        self._check_rows_array(src, "src")
        bn, hlen = self.block_nbytes, self._header.size
        row_lists = []
        for key, first_position, rows in chunks:
            if len(key) != KEY_NBYTES:
                raise ValueError(f"chunk key must be {KEY_NBYTES} bytes, got {len(key)}")
            if not 0 <= first_position <= _U64_MAX:
                raise ValueError(f"first_position must be in [0, 2**64), got {first_position}")
            rows = rows.tolist() if isinstance(rows, np.ndarray) else list(rows)
            if not rows:
                raise ValueError("rows must be a non-empty sequence")
            lo, hi = min(rows), max(rows)
            if lo < 0 or hi >= src.shape[0]:
                raise ValueError(f"rows must be in [0, {src.shape[0]}), got {lo}..{hi}")
            row_lists.append(rows)
        # Not zero-filled: every byte is written below (headers by pack_into, payloads
        # by the copier).
        buf = np.empty(sum(self.encoded_nbytes(len(rows)) for rows in row_lists), np.uint8)
        out = memoryview(buf)
        values, jobs, offset = [], [], 0
        for rows in row_lists:
            end = offset + self.encoded_nbytes(len(rows))
            jobs.append(
                self._copier.submit(
                    src, rows, buf[offset + hlen : end], range(len(rows)), bn, cached=True
                )
            )
            values.append(out[offset:end])
            offset = end
        checksums = []
        for (_, first_position, _), rows in zip(chunks, row_lists):
            digest = xxhash.xxh3_64(seed=first_position)
            for r in rows:  # the payload's bytes, read from the slab alongside the copier
                digest.update(src[r])
            checksums.append(digest.intdigest())
        for job in jobs:
            job.wait()
        seg0, seg1, seg2, seg3, seg4 = self._segments
        pack_into = self._header.pack_into
        for (key, first_position, _), rows, value, checksum in zip(
            chunks, row_lists, values, checksums
        ):
            n = len(rows)
            key = key if type(key) is bytes else bytes(key)
            pack_into(
                value, 0, seg0, key, seg1, n, seg2, first_position, seg3, n * bn, seg4, checksum
            )
        return values

    def decode(
        self, value: bytes | bytearray | memoryview, key: bytes
    ) -> tuple[ChunkHeader, np.ndarray]:
        """Validate ``value`` as the chunk stored under ``key``; return its header and blocks.

        The blocks are a zero-copy ``[n, block_nbytes]`` uint8 view of the value
        (read-only when the buffer is, e.g. ``bytes`` or an LMDB memoryview; valid
        as long as the buffer is). The payload checksum is verified before
        returning. Raises ``BadChunk`` (and nothing else) for any bad value.
        """
        header, payload = self.read_header(value, key)
        _verify(header, xxhash.xxh3_64_intdigest(payload, header.first_position))
        # = np.frombuffer(payload).reshape(n, bn), in one call: a zero-copy view,
        # read-only when the value is, keeping its buffer alive.
        return header, np.ndarray((header.num_blocks, self.block_nbytes), np.uint8, payload)

    def scatter(
        self,
        header: ChunkHeader,
        payload: memoryview,
        dst: np.ndarray,
        dst_rows: Sequence[int],
        skip: int,
    ) -> None:
        """Copy blocks ``skip, skip + 1, ...`` of a payload ``read_header`` returned into
        rows ``dst_rows`` of ``dst`` (``[num_slots, block_nbytes]`` uint8, see
        ``byte_rows``) and verify the payload's checksum, on two cores: the copy runs on
        the copier (this thread takes the pieces left when it is done hashing).
        Raises ``BadChunk`` ("checksum") when the checksum does not match, after the
        copy: the rows written then hold garbage. Bad arguments raise before anything
        is copied.
        """
        self._check_rows_array(dst, "dst")
        src_rows = range(skip, skip + len(dst_rows))
        job = self._copier.submit(payload, src_rows, dst, dst_rows, self.block_nbytes)
        actual = xxhash.xxh3_64_intdigest(payload, header.first_position)  # GIL released
        job.wait()
        _verify(header, actual)

    def read_header(
        self, value: bytes | bytearray | memoryview, key: bytes
    ) -> tuple[ChunkHeader, memoryview]:
        """Every check of ``decode`` but the payload checksum: the validated header and
        the payload bytes (a view of ``value``, not yet verified: ``scatter`` or
        ``decode`` verifies it). Raises ``BadChunk`` (and nothing else) for a bad value.
        """
        mv = memoryview(value)
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
        size = mv.nbytes
        fast = self._read_fixed_header(mv, size, key)
        if fast is not None:
            return fast
        if size == 0:
            raise BadChunk("empty", "expected a chunk value, found 0 bytes")
        prefix_n = _PREFIX.size
        if size < prefix_n:
            head = bytes(mv[:4])
            if head == MAGIC[: len(head)]:
                raise BadChunk("truncated", f"expected >= {prefix_n} bytes, found {size}")
            raise BadChunk("magic", f"expected magic {MAGIC!r}, found {head!r}")
        magic, hlen = _PREFIX.unpack_from(mv)
        if magic != MAGIC:
            raise BadChunk("magic", f"expected magic {MAGIC!r}, found {magic!r}")
        if not 1 <= hlen <= MAX_HEADER_NBYTES:
            raise BadChunk("header", f"expected header length 1..{MAX_HEADER_NBYTES}, found {hlen}")
        start = prefix_n + hlen
        if size < start:
            raise BadChunk(
                "truncated", f"expected >= {start} bytes for a {hlen}-byte header, found {size}"
            )
        try:
            h = msgpack.unpackb(
                mv[prefix_n:start],
                raw=False,
                strict_map_key=True,
                max_bin_len=64,
                max_str_len=64,
                max_array_len=16,
                max_map_len=16,
                max_ext_len=0,
            )
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise BadChunk(
                "header", f"expected a msgpack map, found undecodable bytes ({e})"
            ) from e
        if type(h) is not dict:
            raise BadChunk("header", f"expected a msgpack map, found {type(h).__name__}")
        version = h.get("v")
        if type(version) is not int:
            raise BadChunk("header", f"expected an int format version 'v', found {version!r}")
        if version != FORMAT_VERSION:
            raise BadChunk("version", f"expected format {FORMAT_VERSION}, found {version}")
        if h.keys() != _HEADER_KEYS:
            raise BadChunk(
                "header",
                f"expected keys {sorted(_HEADER_KEYS)}, found {sorted(map(str, h.keys()))}",
            )
        fp, hkey, n, pos, length, checksum = (
            h["fp"],
            h["key"],
            h["n"],
            h["pos"],
            h["len"],
            h["sum"],
        )
        if type(fp) is not bytes or len(fp) != 16:
            raise BadChunk("header", f"expected 16-byte bin 'fp', found {fp!r}")
        if type(hkey) is not bytes or len(hkey) != KEY_NBYTES:
            raise BadChunk("header", f"expected {KEY_NBYTES}-byte bin 'key', found {hkey!r}")
        if type(n) is not int or n < 1:
            raise BadChunk("header", f"expected int 'n' >= 1, found {n!r}")
        if type(pos) is not int or pos < 0:
            raise BadChunk("header", f"expected int 'pos' >= 0, found {pos!r}")
        if type(length) is not int or length < 0:
            raise BadChunk("header", f"expected int 'len' >= 0, found {length!r}")
        if type(checksum) is not int or checksum < 0:
            raise BadChunk("header", f"expected uint64 'sum', found {checksum!r}")
        if fp != self.fingerprint:
            raise BadChunk(
                "layout",
                f"expected layout {self.fingerprint.hex()} ({self.layout.describe()}), "
                f"found {fp.hex()}",
            )
        if hkey != key:
            raise BadChunk("key", f"expected key {bytes(key).hex()}, found {hkey.hex()}")
        bn = self.block_nbytes
        if length != n * bn:
            raise BadChunk(
                "length", f"expected len = {n} blocks x {bn} B = {n * bn}, found {length}"
            )
        present = size - start
        if present < length:
            raise BadChunk("truncated", f"expected {length} payload bytes, found {present}")
        if present > length:
            raise BadChunk("length", f"expected {length} payload bytes, found {present}")
        header = ChunkHeader(version, fp, hkey, n, pos, length, checksum)
        return header, mv[start:]

    def _check_rows_array(self, a: np.ndarray, name: str) -> None:
        """TypeError naming ``name`` unless ``a`` is a ``byte_rows`` array of this layout's
        blocks (uint8 ``[num_slots, block_nbytes]``)."""
        bn = self.block_nbytes
        if a.dtype != np.uint8 or a.ndim != 2 or a.shape[1] != bn:
            raise TypeError(
                f"{name} must be a uint8 array [num_slots, {bn}], got {a.dtype} {a.shape}"
            )

    def peek(self, value: bytes | bytearray | memoryview) -> ChunkHeader | None:
        """The header of a value in this codec's fixed form, checking nothing else (not
        the key, the length or the checksum): for showing what a bad value claims to
        be. None for any other value (another layout, a foreign or truncated header)."""
        mv = memoryview(value)
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
        if mv.nbytes < self._header.size:
            return None
        seg0, key, seg1, n, seg2, pos, seg3, length, seg4, checksum = self._header.unpack_from(mv)
        if (seg0, seg1, seg2, seg3, seg4) != self._segments:
            return None
        return ChunkHeader(FORMAT_VERSION, self.fingerprint, key, n, pos, length, checksum)

    def _read_fixed_header(
        self, mv: memoryview, size: int, key: bytes | bytearray | memoryview
    ) -> tuple[ChunkHeader, memoryview] | None:
        """``read_header`` for a value whose header is the fixed-width one ``encode`` writes.

        Reads the header with one ``struct`` unpack instead of msgpack. Returns None
        (``read_header`` then runs its general checks, which name the failure) unless
        the header is byte for byte this codec's fixed form (so the magic, length,
        version, keys and layout fingerprint are right) and the key, block count and
        lengths match: everything ``read_header`` checks.
        """
        fmt = self._header
        start = fmt.size
        if size < start:
            return None
        seg0, hkey, seg1, n, seg2, pos, seg3, length, seg4, checksum = fmt.unpack_from(mv)
        if (
            (seg0, seg1, seg2, seg3, seg4) != self._segments
            or hkey != key
            or n < 1
            or length != n * self.block_nbytes
            or size - start != length
        ):
            return None
        header = ChunkHeader(FORMAT_VERSION, self.fingerprint, hkey, n, pos, length, checksum)
        return header, mv[start:]
