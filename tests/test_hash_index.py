"""kvtier._core.HashIndex: the 16-byte block hash -> block id map behind every pool."""

import random

import numpy as np
import pytest
from kvtier._core import HashIndex


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def filled(capacity: int, n: int) -> HashIndex:
    index = HashIndex(capacity)
    assert index.insert([key(i) for i in range(n)], np.arange(n, dtype=np.int64) * 10) == []
    return index


def test_prefix_returns_the_ids_of_the_longest_leading_run_held():
    index = filled(8, 3)
    assert index.prefix([key(0), key(1), key(7), key(2)]) == [0, 10]
    assert index.prefix([key(7), key(0)]) == []
    assert index.prefix([]) == []


def test_find_gives_each_keys_id_or_none():
    index = filled(8, 3)
    assert index.find([key(2), key(9), key(0)]) == [20, None, 0]
    assert index.get(key(1)) == 10 and index.get(key(9)) is None


def test_insert_keeps_the_first_writer_and_reports_the_positions_already_held():
    index = filled(8, 2)
    assert index.insert([key(5), key(1), key(6)], ids(50, 99, 60)) == [1]
    assert index.find([key(1), key(5), key(6)]) == [10, 50, 60]
    assert len(index) == 4


def test_a_key_given_twice_in_one_insert_keeps_its_first_id():
    index = HashIndex(4)
    assert index.insert([key(3), key(3)], ids(1, 2)) == [1]
    assert index.items() == [(key(3), 1)]


def test_remove_drops_the_keys():
    index = filled(8, 4)
    index.remove([key(1), key(3)])
    assert sorted(index.items()) == [(key(0), 0), (key(2), 20)]


def test_removing_an_absent_key_raises_and_changes_nothing():
    index = filled(8, 4)
    before = sorted(index.items())
    with pytest.raises(KeyError):
        index.remove([key(0), key(1), key(9)])
    with pytest.raises(KeyError):
        index.remove([key(2), key(2)])
    assert sorted(index.items()) == before


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (b"short", ValueError, "must be 16 bytes, got 5 bytes"),
        ("x" * 16, TypeError, "must be 16 bytes, got str"),
        (7, TypeError, "must be 16 bytes, got int"),
    ],
)
def test_a_key_that_is_not_16_bytes_is_rejected_by_every_method(bad, error, message):
    index = filled(8, 2)
    for call in (
        lambda: index.get(bad),
        lambda: index.find([key(0), bad]),
        lambda: index.prefix([key(0), bad]),
        lambda: index.insert([key(5), bad], ids(5, 6)),
        lambda: index.remove([key(0), bad]),
    ):
        with pytest.raises(error, match=message):
            call()
    assert sorted(index.items()) == [(key(0), 0), (key(1), 10)]


def test_ids_must_be_a_non_negative_int64_buffer_as_long_as_the_keys():
    index = HashIndex(8)
    with pytest.raises(TypeError, match="int64 buffer"):
        index.insert([key(0)], np.array([1], dtype=np.int32))
    with pytest.raises(ValueError, match="ids must be >= 0, got -1"):
        index.insert([key(0)], ids(-1))
    with pytest.raises(ValueError, match="2 keys but 1 ids"):
        index.insert([key(0), key(1)], ids(1))
    assert len(index) == 0


def test_insert_beyond_capacity_raises_and_changes_nothing():
    index = filled(3, 2)
    with pytest.raises(OverflowError, match="holds 2 of 3 keys, cannot add 2"):
        index.insert([key(5), key(6)], ids(5, 6))
    assert len(index) == 2


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity must be in"):
        HashIndex(0)


def test_clear_drops_every_key():
    index = filled(8, 5)
    index.clear()
    assert len(index) == 0 and index.find([key(0)]) == [None]


def test_random_batches_of_insert_remove_and_lookup_match_a_dict():
    # A small table fills densely: long probe runs, wrap-around and backward shifts.
    rng = random.Random(7)
    capacity = 24
    index, model = HashIndex(capacity), {}
    universe = [rng.randbytes(16) for _ in range(60)]
    for _ in range(5000):
        op = rng.random()
        if op < 0.4:
            room = capacity - len(model)
            batch = rng.sample(universe, rng.randint(1, room) if room else 0)
            values = [rng.randint(0, 10**9) for _ in batch]
            expected = [i for i, k in enumerate(batch) if k in model]
            for k, v in zip(batch, values):
                model.setdefault(k, v)
            assert index.insert(batch, np.array(values, dtype=np.int64)) == expected
        elif op < 0.7 and model:
            batch = rng.sample(sorted(model), rng.randint(1, len(model)))
            index.remove(batch)
            for k in batch:
                del model[k]
        else:
            batch = rng.sample(universe, 12)
            assert index.find(batch) == [model.get(k) for k in batch]
            run = []
            for k in batch:
                if k not in model:
                    break
                run.append(model[k])
            assert index.prefix(batch) == run
        assert len(index) == len(model)
    assert dict(index.items()) == model
