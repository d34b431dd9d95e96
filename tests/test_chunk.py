"""Tests for kvtier.chunk: bit-exact round trips and every way a value is rejected."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.chunk import (
    FORMAT_VERSION,
    MAGIC,
    REASONS,
    BadChunk,
    ChunkCodec,
    ChunkHeader,
    byte_rows,
    chunk_bounds,
)
from kvtier.layout import KVLayout

KEY = bytes(range(16))
OTHER_KEY = bytes(range(1, 17))
SMALL = KVLayout(1, 2, 2, 1, 4, torch.float16)  # 32 B blocks, for fuzzing
ROWS = [5, 0, 3, 6]  # non-contiguous, unordered


def random_slab(layout: KVLayout, num_slots: int = 8, seed: int = 0) -> torch.Tensor:
    """A slab ``[num_slots, *block_shape]`` of random bits (every bit pattern, NaNs too)."""
    gen = np.random.default_rng(seed)
    raw = gen.integers(0, 256, size=num_slots * layout.block_nbytes, dtype=np.uint8)
    return torch.from_numpy(raw).view(layout.dtype).reshape(num_slots, *layout.block_shape)


def valid_value(codec: ChunkCodec, pos: int = 8, rows: list[int] = ROWS) -> bytes:
    slab = random_slab(codec.layout)
    return bytes(codec.encode(KEY, pos, byte_rows(slab), rows))


def good_fields(codec: ChunkCodec, payload: bytes, pos: int = 8) -> dict[str, Any]:
    return {
        "v": FORMAT_VERSION,
        "fp": codec.fingerprint,
        "key": KEY,
        "n": len(payload) // codec.block_nbytes,
        "pos": pos,
        "len": len(payload),
        "sum": xxhash.xxh3_64_intdigest(payload, pos),
    }


def forge(header: Any, payload: bytes = b"") -> bytes:
    """A value with a hand-made header (packed minimally by msgpack)."""
    packed = msgpack.packb(header, use_bin_type=True)
    return MAGIC + struct.pack("<I", len(packed)) + packed + payload


def reason_of(codec: ChunkCodec, value: bytes, key: bytes = KEY) -> str:
    with pytest.raises(BadChunk) as info:
        codec.decode(value, key)
    assert info.value.reason in REASONS
    return info.value.reason


# --- round trips ------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout",
    [
        KVLayout(2, 2, 4, 2, 8, torch.float16),
        KVLayout(2, 2, 4, 2, 8, torch.bfloat16),
        KVLayout(2, 2, 4, 2, 8, torch.float32),
        KVLayout(3, 1, 4, 1, 16, torch.bfloat16),  # MLA: kv_factor 1
    ],
    ids=["float16", "bfloat16", "float32", "kv_factor1"],
)
def test_round_trip_is_bit_exact(layout: KVLayout):
    codec = ChunkCodec(layout)
    slab = random_slab(layout)
    value = codec.encode(KEY, 12, byte_rows(slab), ROWS)
    header, blocks = codec.decode(value, KEY)
    assert header == ChunkHeader(
        FORMAT_VERSION,
        layout.fingerprint,
        KEY,
        len(ROWS),
        12,
        len(ROWS) * layout.block_nbytes,
        header.checksum,
    )
    assert blocks.shape == (len(ROWS), layout.block_nbytes)
    assert np.array_equal(blocks, byte_rows(slab)[ROWS])
    restored = torch.from_numpy(blocks.copy()).view(layout.dtype).reshape(-1, *layout.block_shape)
    assert torch.equal(restored.view(torch.uint8), slab[ROWS].view(torch.uint8))
    finite = ~torch.isnan(slab[ROWS].float())
    assert torch.equal(restored.float()[finite], slab[ROWS].float()[finite])


def test_decode_of_read_only_memoryview_is_zero_copy():
    codec = ChunkCodec(SMALL)
    value = valid_value(codec)
    view = memoryview(value)
    assert view.readonly
    _, blocks = codec.decode(view, KEY)
    assert not blocks.flags.writeable
    assert np.shares_memory(blocks, np.frombuffer(value, dtype=np.uint8))


def test_scatter_copies_the_blocks_from_skip_into_the_given_rows():
    codec = ChunkCodec(SMALL)
    src = random_slab(SMALL)
    value = codec.encode(KEY, 8, byte_rows(src), ROWS)
    header, payload = codec.read_header(value, KEY)
    dst = byte_rows(torch.zeros_like(src))
    codec.scatter(header, payload, dst, [7, 1], 2)
    assert np.array_equal(dst[[7, 1]], byte_rows(src)[ROWS[2:]])
    assert not dst[[0, 2, 3, 4, 5, 6]].any()


@pytest.mark.parametrize("block", [0, 3], ids=["a copied block", "a block not copied"])
def test_scatter_checks_the_whole_payload(block: int):
    codec = ChunkCodec(SMALL)
    value = bytearray(codec.encode(KEY, 8, byte_rows(random_slab(SMALL)), ROWS))
    value[codec.header_nbytes + block * codec.block_nbytes] ^= 1
    header, payload = codec.read_header(value, KEY)
    dst = byte_rows(torch.zeros_like(random_slab(SMALL)))
    with pytest.raises(BadChunk) as info:
        codec.scatter(header, payload, dst, [0, 1], 0)
    assert info.value.reason == "checksum"


def test_read_header_leaves_the_checksum_to_scatter():
    codec = ChunkCodec(SMALL)
    value = bytearray(valid_value(codec))
    value[-1] ^= 1
    header, payload = codec.read_header(value, KEY)
    assert header.num_blocks == len(ROWS) and len(payload) == header.payload_nbytes


def test_encoded_length_matches_encoded_nbytes():
    codec = ChunkCodec(KVLayout(2, 2, 4, 2, 8, torch.bfloat16))
    slab = byte_rows(random_slab(codec.layout, num_slots=40))
    for n in (1, 2, 7, 32):
        for pos in (0, 1, 2**40):
            value = codec.encode(KEY, pos, slab, list(range(n))[::-1])
            assert len(value) == codec.encoded_nbytes(n)


def test_encoded_header_is_a_plain_msgpack_map():
    codec = ChunkCodec(SMALL)
    value = valid_value(codec, pos=3)
    (hlen,) = struct.unpack_from("<I", value, 4)
    header = msgpack.unpackb(value[8 : 8 + hlen], raw=False)
    assert header == good_fields(codec, value[8 + hlen :], pos=3)


def test_encode_rejects_out_of_range_rows():
    codec = ChunkCodec(SMALL)
    slab = byte_rows(random_slab(SMALL))
    with pytest.raises(ValueError):
        codec.encode(KEY, 0, slab, [0, 8])
    with pytest.raises(ValueError):
        codec.encode(KEY, 0, slab, [-1])


def test_encode_many_values_decode_to_each_chunks_blocks():
    codec = ChunkCodec(SMALL)
    slab = byte_rows(random_slab(SMALL))
    chunks = [(KEY, 8, ROWS), (OTHER_KEY, 0, [7]), (bytes(16), 2**40, [1, 2, 1])]
    for (key, pos, rows), value in zip(chunks, codec.encode_many(slab, chunks)):
        header, blocks = codec.decode(value, key)
        assert (header.first_position, header.num_blocks) == (pos, len(rows))
        assert np.array_equal(blocks, slab[rows])


def test_encode_many_values_are_consecutive_views_of_one_buffer():
    codec = ChunkCodec(SMALL)
    slab = byte_rows(random_slab(SMALL))
    values = codec.encode_many(slab, [(KEY, 0, [0, 1]), (OTHER_KEY, 2, [2])])
    first, second = (np.frombuffer(v, np.uint8) for v in values)
    assert values[0].obj is values[1].obj
    assert second.ctypes.data == first.ctypes.data + len(first)


def test_encode_many_rejects_a_bad_chunk_among_good_ones():
    codec = ChunkCodec(SMALL)
    slab = byte_rows(random_slab(SMALL))
    with pytest.raises(ValueError, match=r"rows must be in \[0, 8\), got 0\.\.8"):
        codec.encode_many(slab, [(KEY, 0, [0, 1]), (OTHER_KEY, 2, [0, 8])])


def test_byte_rows_is_a_zero_copy_view_for_bfloat16():
    slab = random_slab(KVLayout(2, 2, 4, 2, 8, torch.bfloat16), num_slots=3)
    rows = byte_rows(slab)
    assert rows.shape == (3, slab[0].numel() * 2) and rows.dtype == np.uint8
    rows[1, :] = 0
    assert torch.all(slab[1] == 0)


def test_chunk_bounds_are_aligned():
    assert chunk_bounds(0, 16) == (0, 16)
    assert chunk_bounds(15, 16) == (0, 16)
    assert chunk_bounds(16, 16) == (16, 32)
    assert chunk_bounds(7, 1) == (7, 8)


# --- rejections -------------------------------------------------------------------


def test_empty_value_is_rejected():
    assert reason_of(ChunkCodec(SMALL), b"") == "empty"


def test_truncated_header_is_rejected():
    codec = ChunkCodec(SMALL)
    value = valid_value(codec)
    for cut in (2, 6, 20, codec.header_nbytes - 1):
        assert reason_of(codec, value[:cut]) == "truncated"


def test_truncated_payload_is_rejected():
    codec = ChunkCodec(SMALL)
    value = valid_value(codec)
    assert reason_of(codec, value[:-1]) == "truncated"
    assert reason_of(codec, value[: codec.header_nbytes]) == "truncated"


def test_trailing_bytes_are_rejected():
    codec = ChunkCodec(SMALL)
    assert reason_of(codec, valid_value(codec) + b"\0") == "length"


def test_flipped_payload_byte_fails_the_checksum():
    codec = ChunkCodec(SMALL)
    value = bytearray(valid_value(codec))
    value[-10] ^= 0x01
    assert reason_of(codec, bytes(value)) == "checksum"


def test_changed_position_fails_the_checksum():
    codec = ChunkCodec(SMALL)
    value = valid_value(codec, pos=8)
    payload = value[codec.header_nbytes :]
    fields = good_fields(codec, payload, pos=8) | {"pos": 9}
    assert reason_of(codec, forge(fields, payload)) == "checksum"


def test_other_format_version_is_rejected():
    codec = ChunkCodec(SMALL)
    payload = valid_value(codec)[codec.header_nbytes :]
    fields = good_fields(codec, payload) | {"v": 2}
    assert reason_of(codec, forge(fields, payload)) == "version"


def test_other_layouts_fingerprint_is_rejected():
    other = ChunkCodec(KVLayout(1, 2, 2, 1, 4, torch.bfloat16))  # same block size, other dtype
    assert other.block_nbytes == SMALL.block_nbytes
    assert reason_of(other, valid_value(ChunkCodec(SMALL))) == "layout"


def test_wrong_key_is_rejected():
    codec = ChunkCodec(SMALL)
    assert reason_of(codec, valid_value(codec), key=OTHER_KEY) == "key"


def test_value_without_magic_is_rejected():
    codec = ChunkCodec(SMALL)
    value = valid_value(codec)
    assert reason_of(codec, b"XXXX" + value[4:]) == "magic"
    assert reason_of(codec, b"\x80\x01") == "magic"
    assert reason_of(codec, msgpack.packb({"v": 1})) == "magic"


def test_non_msgpack_header_after_magic_is_rejected():
    codec = ChunkCodec(SMALL)
    junk = bytes(np.random.default_rng(1).integers(0, 256, 64, dtype=np.uint8))
    assert reason_of(codec, MAGIC + struct.pack("<I", 1) + b"\xc1" + junk) == "header"
    assert reason_of(codec, MAGIC + struct.pack("<I", 64) + junk) == "header"
    assert reason_of(codec, MAGIC + junk) in ("header", "truncated")


def test_header_length_out_of_range_is_rejected():
    codec = ChunkCodec(SMALL)
    assert reason_of(codec, MAGIC + struct.pack("<I", 0) + b"\x80") == "header"
    assert reason_of(codec, MAGIC + struct.pack("<I", 2**32 - 1) + b"\x80") == "header"


def test_header_that_is_not_a_map_is_rejected():
    codec = ChunkCodec(SMALL)
    assert reason_of(codec, forge([1, 2, 3])) == "header"


def test_absurd_len_field_is_rejected():
    codec = ChunkCodec(SMALL)
    payload = valid_value(codec)[codec.header_nbytes :]
    fields = good_fields(codec, payload) | {"len": 2**62}
    assert reason_of(codec, forge(fields, payload)) == "length"


def test_len_field_not_matching_block_count_is_rejected():
    codec = ChunkCodec(SMALL)
    payload = valid_value(codec)[codec.header_nbytes :]
    fields = good_fields(codec, payload) | {"n": 3}
    assert reason_of(codec, forge(fields, payload)) == "length"


def test_zero_blocks_is_rejected():
    codec = ChunkCodec(SMALL)
    fields = good_fields(codec, b"") | {"n": 0}
    assert reason_of(codec, forge(fields)) == "header"


def test_extra_header_key_is_rejected():
    codec = ChunkCodec(SMALL)
    payload = valid_value(codec)[codec.header_nbytes :]
    fields = good_fields(codec, payload) | {"extra": 1}
    assert reason_of(codec, forge(fields, payload)) == "header"


@pytest.mark.parametrize("missing", ["fp", "key", "n", "pos", "len", "sum"])
def test_missing_header_key_is_rejected(missing: str):
    codec = ChunkCodec(SMALL)
    payload = valid_value(codec)[codec.header_nbytes :]
    fields = good_fields(codec, payload)
    del fields[missing]
    assert reason_of(codec, forge(fields, payload)) == "header"


@pytest.mark.parametrize(
    "field, bad",
    [("v", True), ("fp", "x" * 16), ("key", b"short"), ("n", 1.0), ("pos", -1), ("sum", -5)],
)
def test_wrong_header_types_are_rejected(field: str, bad: Any):
    codec = ChunkCodec(SMALL)
    payload = valid_value(codec)[codec.header_nbytes :]
    fields = good_fields(codec, payload) | {field: bad}
    assert reason_of(codec, forge(fields, payload)) == "header"


def test_forged_but_well_formed_header_is_accepted():
    codec = ChunkCodec(SMALL)
    payload = valid_value(codec)[codec.header_nbytes :]
    header, blocks = codec.decode(forge(good_fields(codec, payload), payload), KEY)
    assert header.num_blocks == len(ROWS) and blocks.tobytes() == payload


# --- fuzzing ----------------------------------------------------------------------

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_STRUCTURED = settings(FUZZ, max_examples=100)  # generating msgpack objects is slower
FUZZ_CODEC = ChunkCodec(SMALL)
FUZZ_VALUE = valid_value(FUZZ_CODEC, rows=[2, 1])
FUZZ_HEADER, _ = FUZZ_CODEC.decode(FUZZ_VALUE, KEY)
FUZZ_PAYLOAD = FUZZ_VALUE[FUZZ_CODEC.header_nbytes :]


def decode_or_bad_chunk(value: bytes) -> tuple[ChunkHeader, np.ndarray] | None:
    try:
        return FUZZ_CODEC.decode(value, KEY)
    except BadChunk as e:
        assert e.reason in REASONS
        return None


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_decode_to_data(value: bytes):
    assert decode_or_bad_chunk(value) is None


@FUZZ
@given(st.integers(0, 1100), st.binary(max_size=1100))
def test_arbitrary_header_behind_magic_never_decodes_to_data(hlen: int, rest: bytes):
    assert decode_or_bad_chunk(MAGIC + struct.pack("<I", hlen) + rest) is None


@FUZZ
@given(st.data())
def test_mutated_or_truncated_value_is_rejected_or_decodes_unchanged(data: st.DataObject):
    # A mutation may survive only if it changes nothing decoded: the identity, or an
    # encoding alias such as uint64 -> int64 for the same non-negative int.
    value = bytearray(FUZZ_VALUE)
    if data.draw(st.booleans(), label="truncate"):
        value = value[: data.draw(st.integers(0, len(value) - 1), label="cut")]
    else:
        at = data.draw(st.integers(0, len(value) - 1), label="at")
        value[at] = data.draw(st.integers(0, 255), label="byte")
    decoded = decode_or_bad_chunk(bytes(value))
    if decoded is not None:
        assert decoded[0] == FUZZ_HEADER
        assert decoded[1].tobytes() == FUZZ_PAYLOAD


MSGPACK_LEAF = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=20)
)
MSGPACK_OBJECT = st.recursive(
    MSGPACK_LEAF,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=4) | st.binary(max_size=4), inner, max_size=8)
    ),
    max_leaves=20,
)


@FUZZ_STRUCTURED
@given(MSGPACK_OBJECT, st.binary(max_size=100))
def test_arbitrary_msgpack_header_never_decodes_to_data(header: Any, payload: bytes):
    assert decode_or_bad_chunk(forge(header, payload)) is None


@FUZZ_STRUCTURED
@given(
    st.dictionaries(
        st.sampled_from(["v", "fp", "key", "n", "pos", "len", "sum", "x"]), MSGPACK_LEAF
    )
)
def test_header_with_arbitrary_field_values_is_rejected_or_decodes_unchanged(
    overrides: dict[str, Any],
):
    fields = good_fields(FUZZ_CODEC, FUZZ_PAYLOAD, pos=FUZZ_HEADER.first_position) | overrides
    decoded = decode_or_bad_chunk(forge(fields, FUZZ_PAYLOAD))
    if decoded is not None:
        assert decoded[0] == FUZZ_HEADER
        assert decoded[1].tobytes() == FUZZ_PAYLOAD


def test_every_single_byte_mutation_is_rejected_or_decodes_unchanged():
    for at in range(len(FUZZ_VALUE)):
        for byte in range(256):
            value = bytearray(FUZZ_VALUE)
            value[at] = byte
            decoded = decode_or_bad_chunk(bytes(value))
            if decoded is not None:
                assert decoded[0] == FUZZ_HEADER
                assert decoded[1].tobytes() == FUZZ_PAYLOAD
