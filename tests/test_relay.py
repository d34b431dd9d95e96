"""``Relay``: a replicated shard's loads passed from the holder to the other ranks of its
group, here two ranks in threads over gloo groups (as vLLM's CPU build has them). The
round trip itself runs on every device in ``test_devices``."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from kvtier.connector import EngineKV
from kvtier.relay import Relay

BLOCKS, LAYERS, BLOCK_SHAPE = 8, 3, (1, 4, 16)  # an MLA-like latent block per layer
BLOCK_NBYTES = LAYERS * 4 * 16 * 2  # of all layers, bf16


def make_kv(random: bool, device: str = "cpu") -> EngineKV:
    """An engine's KV on ``device``: random blocks, or zeros."""
    shape = (BLOCKS, *BLOCK_SHAPE)
    make = torch.randn if random else torch.zeros
    return EngineKV([make(shape).to(device, torch.bfloat16) for _ in range(LAYERS)])


def blocks_of(kv: EngineKV, ids: list[int]) -> list[torch.Tensor]:
    return [layer[ids] for layer in kv.layers]


def relay(
    kvs: tuple[EngineKV, EngineKV],
    loads: tuple[Sequence, Sequence],
    valid: Sequence[int],
    attached: tuple[bool, bool] = (True, True),
    piece_bytes: int = 1 << 20,
) -> tuple[list[int], list[int], list[int]]:
    """``Relay.run`` on the holder (rank 0) and another rank at once: each rank's
    ``loads``, the holder's ``valid``; returns what each returned and the blocks each
    relay counted."""
    store = dist.HashStore()

    def rank(r: int) -> tuple[list[int], int]:
        groups = [
            dist.ProcessGroupGloo(dist.PrefixStore(name, store), r, 2, timedelta(seconds=30))
            for name in ("data", "control")
        ]
        end = Relay(kvs[r], *groups, holder=r == 0, piece_bytes=piece_bytes)
        end.attached = attached[r]
        return end.run(loads[r], valid), end.blocks

    with ThreadPoolExecutor(2) as pool:
        (holder, sent), (other, received) = pool.map(rank, range(2))
    return holder, other, [sent, received]


def test_blocks_past_what_the_holder_loaded_are_neither_sent_nor_written():
    holder, other = make_kv(True), make_kv(False)
    holder_got, other_got, counted = relay((holder, other), ([[0, 1, 2]], [[4, 5, 6]]), [1])
    assert (holder_got, other_got, counted) == ([1], [1], [1, 1])
    assert torch.equal(blocks_of(other, [4])[0], blocks_of(holder, [0])[0])
    assert not any(t.any() for t in blocks_of(other, [5, 6]))


def test_a_relay_larger_than_a_piece_goes_in_pieces():
    holder, other = make_kv(True), make_kv(False)
    loads = ([list(range(7))], [list(range(7))])
    assert relay((holder, other), loads, [7], piece_bytes=2 * BLOCK_NBYTES)[1] == [7]
    for got, want in zip(blocks_of(other, list(range(7))), blocks_of(holder, list(range(7)))):
        assert torch.equal(got, want)


def test_a_load_the_other_rank_never_heard_of_is_received_and_dropped():
    holder, other = make_kv(True), make_kv(False)
    holder_got, other_got, _ = relay((holder, other), ([[0], [1]], [None, [2]]), [1, 1])
    assert (holder_got, other_got) == ([1, 1], [0, 1])
    assert torch.equal(blocks_of(other, [2])[0], blocks_of(holder, [1])[0])
    assert not any(t[[0, 1]].any() for t in other.layers)


def test_a_sleeping_holder_sends_nothing_and_a_sleeping_rank_writes_nothing():
    holder, other = make_kv(True), make_kv(False)
    loads = ([[0]], [[1]])
    assert relay((holder, other), loads, [1], attached=(False, True))[:2] == ([0], [0])
    assert relay((holder, other), loads, [1], attached=(True, False))[:2] == ([1], [0])
    assert not any(t.any() for t in other.layers)


def test_a_piece_the_holder_cannot_gather_fails_its_loads_on_every_rank_and_is_not_written():
    holder, other = make_kv(True), make_kv(False)
    loads = ([[0], [BLOCKS + 5], [2]], [[1], [2], [3]])  # the holder has no block 13
    got = relay((holder, other), loads, [1, 1, 1], piece_bytes=2 * BLOCK_NBYTES)[:2]
    assert got == ([0, 0, 1], [0, 0, 1])
    assert not any(t[[1, 2]].any() for t in other.layers)
    assert torch.equal(blocks_of(other, [3])[0], blocks_of(holder, [2])[0])


def test_a_piece_a_rank_cannot_scatter_fails_its_loads_there_and_the_relay_goes_on():
    holder, other = make_kv(True), make_kv(False)
    loads = ([[0], [1], [2]], [[1], [BLOCKS + 5], [3]])  # that rank has no block 13
    got = relay((holder, other), loads, [1, 1, 1], piece_bytes=2 * BLOCK_NBYTES)[:2]
    assert got == ([1, 1, 1], [0, 0, 1])
    assert torch.equal(blocks_of(other, [3])[0], blocks_of(holder, [2])[0])
