"""The LMDB tier's eviction orders (kvtier.tiers.lmdb_order): reuse's victims, delta and
ghost lists, kept in the store; switching policies and the version 1 schema."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
from tier_contract import make_key, read_all

from kvtier.eviction import REUSE_DELTA0, REUSE_STEP
from kvtier.tiers.lmdb import ENV_OPTIONS, LMDBTier

VALUE = b"v" * 1000  # four fit in the tiers below


class Uses:
    """A use-count hint: keys listed twice in ``twice`` count 2, the rest 1."""

    def __init__(self) -> None:
        self.twice: set[bytes] = set()

    def __call__(self, keys: list[bytes]) -> list[int]:
        return [2 if k in self.twice else 1 for k in keys]


@pytest.fixture
def reuse_tier(tmp_path: Path) -> Iterator[tuple[LMDBTier, Uses]]:
    tier = LMDBTier(tmp_path / "s", capacity=4000, chunk_blocks=1, eviction="reuse")
    tier.uses = Uses()
    yield tier, tier.uses
    tier.close()


def keys(n: int) -> list[bytes]:
    return [make_key("k", i) for i in range(n)]


def held(tier: LMDBTier, ks: list[bytes]) -> list[int]:
    return [i for i, found in enumerate(tier.contains_many(ks)) if found]


def test_reuse_evicts_a_key_one_request_used_before_an_older_key_two_used(reuse_tier) -> None:
    tier, uses = reuse_tier
    k = keys(5)
    uses.twice.add(k[0])
    tier.put_many([(key, VALUE) for key in k[:4]])  # k0 protected and the oldest
    tier.put_many([(k[4], VALUE)])
    assert held(tier, k) == [0, 2, 3, 4]
    assert tier.order_state().queued == (3, 1)


def test_reuse_evicts_a_protected_key_once_older_than_probation_by_delta(reuse_tier) -> None:
    tier, uses = reuse_tier
    k = keys(5)
    uses.twice.add(k[0])
    tier.put_many([(key, VALUE) for key in k[:4]])  # seq 0..3; delta = 4 x 4 keys = 16
    for _ in range(5):  # k1..k3 rewritten: their seqs reach 16..18
        tier.put_many([(key, VALUE) for key in k[1:4]])
    tier.put_many([(k[4], VALUE)])  # probation's oldest (16) - 16 <= 0: still probation
    assert held(tier, k) == [0, 2, 3, 4]
    tier.put_many([(k[1], VALUE)])  # back from probation: delta 12; k2 at 17: 17 - 12 > 0
    assert held(tier, k) == [1, 2, 3, 4]


def test_a_read_requeues_a_key_by_its_use_count(reuse_tier) -> None:
    tier, uses = reuse_tier
    k = keys(2)
    tier.put_many([(key, VALUE) for key in k])
    uses.twice.add(k[0])
    read_all(tier, [k[0]])
    tier.delete_many([make_key("absent")])  # a write: the read is recorded first
    assert tier.order_state().queued == (1, 1)


def test_a_key_stored_again_after_eviction_from_probation_lowers_delta(reuse_tier) -> None:
    tier, _ = reuse_tier
    k = keys(5)
    tier.put_many([(key, VALUE) for key in k])  # k0 leaves probation
    assert tier.order_state().ghosts == (1, 0)
    tier.put_many([(k[0], VALUE)])  # back (k1 goes): 4 keys held when it came back
    state = tier.order_state()
    assert state.delta == REUSE_DELTA0 - REUSE_STEP / 4
    assert state.ghosts == (1, 0)  # k0 out of the list, k1 in


def test_a_key_stored_again_after_eviction_from_protected_raises_delta(reuse_tier) -> None:
    tier, uses = reuse_tier
    k = keys(5)
    uses.twice.update(k)
    tier.put_many([(key, VALUE) for key in k])
    assert tier.order_state().ghosts == (0, 1)
    tier.put_many([(k[0], VALUE)])
    assert tier.order_state().delta == REUSE_DELTA0 + REUSE_STEP / 4


def test_each_ghost_list_holds_at_most_as_many_keys_as_the_tier(reuse_tier) -> None:
    tier, _ = reuse_tier
    for key in keys(20):
        tier.put_many([(key, VALUE)])
    assert tier.order_state().ghosts == (4, 0)


def test_without_use_counts_reuse_orders_every_key_as_used_once(tmp_path: Path) -> None:
    with LMDBTier(tmp_path / "s", capacity=4000, chunk_blocks=1, eviction="reuse") as tier:
        k = keys(5)
        tier.put_many([(key, VALUE) for key in k[:4]])
        read_all(tier, [k[0]])
        tier.put_many([(k[4], VALUE)])
        assert held(tier, k) == [0, 2, 3, 4]  # as LRU
        assert tier.order_state().queued == (4, 0)


def test_clear_forgets_the_queues_and_the_ghosts(reuse_tier) -> None:
    tier, _ = reuse_tier
    tier.put_many([(key, VALUE) for key in keys(6)])
    tier.clear()
    assert tier.order_state() == type(tier.order_state())((0, 0), (0, 0), REUSE_DELTA0)


# --- switching policies, the version 1 schema ------------------------------------------------


def test_a_store_reuse_ordered_is_evicted_in_use_order_when_reopened_with_lru(
    tmp_path: Path,
) -> None:
    k = keys(5)
    with LMDBTier(tmp_path / "s", capacity=4000, chunk_blocks=1, eviction="reuse") as tier:
        tier.uses = lambda ks: [2 if key == k[1] else 1 for key in ks]
        tier.put_many([(key, VALUE) for key in k[:4]])  # k1 protected, k0 the oldest
    with LMDBTier(tmp_path / "s", capacity=4000, chunk_blocks=1, eviction="lru") as tier:
        assert tier.order_state().queued == (4, 0)
        tier.put_many([(k[4], VALUE)])
        assert held(tier, k) == [1, 2, 3, 4]


def test_a_version_1_store_is_read_and_ordered_as_before(tmp_path: Path) -> None:
    k = keys(5)
    env = lmdb.open(str(tmp_path / "s"), map_size=1 << 24, **ENV_OPTIONS)
    with env.begin(write=True) as txn:  # what kvtier's version 1 wrote
        data, atime, lru, meta = (
            env.open_db(n, txn=txn) for n in (b"data", b"atime", b"lru", b"meta")
        )
        for seq, key in enumerate(k[:4]):
            txn.put(key, VALUE, db=data)
            txn.put(key, seq.to_bytes(8, "big"), db=atime)
            txn.put(seq.to_bytes(8, "big") + key, b"", db=lru)
        for name, n in ((b"version", 1), (b"nbytes", 4000), (b"seq", 4)):
            txn.put(name, n.to_bytes(8, "big"), db=meta)
    env.close()
    with LMDBTier(tmp_path / "s", capacity=4000, chunk_blocks=1, eviction="reuse") as tier:
        assert tier.usage().entries == 4
        tier.put_many([(k[4], VALUE)])
        assert held(tier, k) == [1, 2, 3, 4]


def test_an_unknown_eviction_policy_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="eviction"):
        LMDBTier(tmp_path / "s", capacity=4000, chunk_blocks=1, eviction="lfu")
