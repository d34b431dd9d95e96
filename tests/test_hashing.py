import hashlib
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash

from kvtier.hashing import (
    HASH_NBYTES,
    BlockHasher,
    ExtraKeys,
    MultiModalInput,
    namespace_root,
)
from kvtier.layout import KVLayout

LAYOUT = KVLayout(2, 2, 4, 2, 8, torch.float16)
ROOT = namespace_root("model-a", LAYOUT.fingerprint)


def hasher(algorithm: str = "xxh3_128", root: bytes = ROOT) -> BlockHasher:
    return BlockHasher(root, block_size=4, algorithm=algorithm)


def test_only_full_blocks_are_hashed():
    assert len(hasher().hash_blocks(list(range(11)))) == 2


def test_hashes_are_16_bytes_for_both_algorithms():
    for algorithm in ("xxh3_128", "sha256"):
        hashes = hasher(algorithm).hash_blocks(list(range(8)))
        assert all(len(h) == HASH_NBYTES for h in hashes)


def test_algorithms_give_different_keys():
    assert hasher("xxh3_128").hash_blocks([1, 2, 3, 4]) != hasher("sha256").hash_blocks(
        [1, 2, 3, 4]
    )


def test_unknown_algorithm_is_rejected():
    with pytest.raises(ValueError, match="unknown hash algorithm 'md5'"):
        BlockHasher(ROOT, 4, "md5")


def test_shared_prefix_shares_hashes_and_divergence_changes_every_later_hash():
    a = hasher().hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    b = hasher().hash_blocks([1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12])
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]


def test_a_hash_names_its_whole_prefix_not_just_its_block():
    a = hasher().hash_blocks([1, 1, 1, 1, 9, 9, 9, 9])
    b = hasher().hash_blocks([2, 2, 2, 2, 9, 9, 9, 9])
    assert a[1] != b[1]


def test_extending_a_chain_equals_hashing_the_whole_prompt():
    tokens = list(range(100, 130))
    whole = hasher().hash_blocks(tokens)
    head = hasher().hash_blocks(tokens[:12])
    tail = hasher().hash_blocks(tokens[12:], parent=head[-1], first_block=3)
    assert head + tail == whole


def test_extension_needs_a_parent():
    with pytest.raises(ValueError, match="parent is required"):
        hasher().hash_blocks([1, 2, 3, 4], first_block=2)


def test_list_numpy_and_tensor_tokens_hash_alike():
    tokens = list(range(7, 39))
    expected = hasher().hash_blocks(tokens)
    assert hasher().hash_blocks(np.array(tokens, dtype=np.int64)) == expected
    assert hasher().hash_blocks(torch.tensor(tokens)) == expected
    assert hasher().hash_blocks(tuple(tokens)) == expected
    assert hasher().hash_blocks(range(7, 39)) == expected


def test_token_ids_of_every_int_size_and_int_subclass_hash_as_their_uint32_value():
    class Token(int):
        pass

    # 0 and ids of 2**30 and up are not one-digit ints; bools and subclasses not exact ints.
    tokens = [0, 1, 2**30 - 1, 2**30, 2**31, 2**32 - 1, True, Token(5)]
    expected = hasher().hash_blocks(np.array([int(t) for t in tokens], np.uint32))
    assert hasher().hash_blocks(tokens) == expected


@pytest.mark.parametrize("bad", [[-1, 0, 0, 0], [2**32, 0, 0, 0]])
def test_out_of_range_token_ids_are_rejected(bad):
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*32\)"):
        hasher().hash_blocks(bad)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*32\)"):
        hasher().hash_blocks(np.array(bad, dtype=np.int64))


def test_token_ids_beyond_64_bits_are_rejected():
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*32\)"):
        hasher().hash_blocks([2**70, 0, 0, 0])


def test_a_token_id_that_is_not_an_int_is_rejected_by_position():
    with pytest.raises(TypeError, match="token id 2 is float, not an int"):
        hasher().hash_blocks([1, 2, 3.0, 4])


def test_model_layout_and_salt_each_give_a_disjoint_namespace():
    other_layout = KVLayout(2, 2, 4, 2, 8, torch.bfloat16)
    roots = {
        ROOT,
        namespace_root("model-b", LAYOUT.fingerprint),
        namespace_root("model-a", other_layout.fingerprint),
        namespace_root("model-a", LAYOUT.fingerprint, salt="tenant-1"),
        namespace_root("model-a", LAYOUT.fingerprint, algorithm="sha256"),
    }
    assert len(roots) == 5
    tokens = [5, 6, 7, 8]
    assert len({hasher(root=r).hash_blocks(tokens)[0] for r in roots}) == 5


def test_roots_and_hashes_are_identical_in_another_process():
    code = (
        "import torch;from kvtier.layout import KVLayout;"
        "from kvtier.hashing import BlockHasher, namespace_root;"
        "L=KVLayout(2,2,4,2,8,torch.float16);r=namespace_root('model-a',L.fingerprint);"
        "print(r.hex(), *(h.hex() for h in BlockHasher(r,4).hash_blocks(list(range(12)))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    ).stdout.split()
    assert out == [ROOT.hex(), *(h.hex() for h in hasher().hash_blocks(list(range(12))))]


def test_lora_changes_every_block():
    tokens = list(range(8))
    plain = hasher().hash_blocks(tokens)
    lora = hasher().hash_blocks(tokens, extra=ExtraKeys(lora="adapter"))
    assert all(a != b for a, b in zip(plain, lora))


def test_lora_name_never_collides_with_a_salt_of_the_same_text():
    salted = BlockHasher(namespace_root("model-a", LAYOUT.fingerprint, salt="x"), 4)
    with_lora = hasher().hash_blocks([1, 2, 3, 4], extra=ExtraKeys(lora="x"))
    assert salted.hash_blocks([1, 2, 3, 4]) != with_lora


def test_lora_name_that_spells_a_multimodal_item_does_not_collide_with_it():
    # The bytes a naive encoding would give an image item at offset 0 of block 0.
    image = MultiModalInput(content_hash=b"\x01" * 16, offset=0, length=4)
    mm = hasher().hash_blocks([1, 2, 3, 4], extra=ExtraKeys(mm_inputs=(image,)))
    forged = ExtraKeys(lora=(b"\x01" * 16 + b"\x00" * 8).decode("latin-1"))
    assert hasher().hash_blocks([1, 2, 3, 4], extra=forged) != mm


def test_multimodal_input_changes_only_the_blocks_it_overlaps():
    tokens = list(range(12))
    image = MultiModalInput(content_hash=b"img-1", offset=5, length=2)
    other = MultiModalInput(content_hash=b"img-2", offset=5, length=2)
    a = hasher().hash_blocks(tokens, extra=ExtraKeys(mm_inputs=(image,)))
    b = hasher().hash_blocks(tokens, extra=ExtraKeys(mm_inputs=(other,)))
    plain = hasher().hash_blocks(tokens)
    assert a[0] == plain[0] == b[0]
    assert a[1] != b[1]  # block 1 holds the image
    assert a[2] != b[2]  # and the chain carries it on


def test_multimodal_extension_equals_whole_prompt_hashing():
    tokens = list(range(16))
    extra = ExtraKeys(mm_inputs=(MultiModalInput(b"img", offset=9, length=3),))
    whole = hasher().hash_blocks(tokens, extra=extra)
    head = hasher().hash_blocks(tokens[:8], extra=extra)
    assert head + hasher().hash_blocks(tokens[8:], head[-1], 2, extra) == whole


def _reference_chain(digest, root, tokens, suffix_of):
    """The documented formula, block by block in Python: the compiled chain must match it."""
    out, parent = [], root
    for i in range(len(tokens) // 4):
        block = struct.pack("<4I", *tokens[4 * i : 4 * i + 4])
        parent = digest(parent + block + suffix_of(i))
        out.append(parent)
    return out


EXTRAS = {
    "plain": None,
    "lora": ExtraKeys(lora="adapter-7"),
    "multimodal": ExtraKeys(
        lora="adapter-7", mm_inputs=(MultiModalInput(b"\x05" * 16, offset=3, length=6),)
    ),
}


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
@pytest.mark.parametrize("extra", EXTRAS.values(), ids=EXTRAS.keys())
def test_hashes_are_bit_identical_to_the_digest_over_parent_tokens_and_extras(algorithm, extra):
    digests = {
        "xxh3_128": xxhash.xxh3_128_digest,
        "sha256": lambda b: hashlib.sha256(b).digest()[:16],
    }
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 2**32, 41, dtype=np.uint64)]
    extra_keys = extra or ExtraKeys()
    expected = _reference_chain(
        digests[algorithm], ROOT, tokens, lambda i: extra_keys.block_suffix(i, 4)
    )
    assert hasher(algorithm).hash_blocks(tokens, extra=extra) == expected


def test_a_parent_that_is_not_16_bytes_is_rejected():
    with pytest.raises(ValueError, match="parent must be 16 bytes"):
        hasher().hash_blocks([1, 2, 3, 4], parent=b"short", first_block=1)
