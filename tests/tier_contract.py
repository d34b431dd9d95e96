"""The behaviour every ``SpillTier`` must have, as a reusable test class.

Use it by subclassing and providing a ``tier`` fixture::

    class TestMyTierContract(TierContract):
        @pytest.fixture
        def tier(self, tmp_path):
            t = MyTier(...)
            yield t
            t.close()

The fixture must yield an empty, open tier that holds at least 64 MiB of values (so
nothing here is evicted) and whose ``close()`` is called afterwards (the tests call it
a second time to check it is idempotent). A tier whose store cannot hold an empty
value sets ``supports_empty_values = False``; every tier must then report ``b""`` as
not stored (``put_many`` does not count it) instead of raising. The class name does not
start with ``Test``, so pytest collects it only through its subclasses.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Sequence
from typing import ClassVar

import pytest

from kvtier.tiers.base import SpillTier, TierUsage

MiB = 1 << 20


def make_key(*parts: object) -> bytes:
    """A 16-byte chunk key, deterministic in ``parts``."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def make_value(key: bytes, size: int) -> bytes:
    """``size`` bytes that depend on ``key`` and on the position in the value."""
    return random.Random(key + size.to_bytes(8, "big")).randbytes(size)


def read_all(tier: SpillTier, keys: Sequence[bytes]) -> tuple[list[bool], dict[int, bytes]]:
    """``get_many``, with the values copied out by index (asserting each index once)."""
    got: dict[int, bytes] = {}

    def sink(i: int, value: memoryview) -> None:
        assert isinstance(value, memoryview)
        assert i not in got, f"sink called twice for index {i}"
        got[i] = bytes(value)

    return tier.get_many(keys, sink), got


class TierContract:
    """Tests any ``SpillTier`` must pass; subclasses provide the ``tier`` fixture."""

    supports_empty_values: ClassVar[bool] = True

    @pytest.fixture
    def tier(self) -> SpillTier:
        raise NotImplementedError("a TierContract subclass provides the tier fixture")

    # --- round trips ---------------------------------------------------------------

    def test_round_trip_is_byte_exact_with_sink_indices(self, tier: SpillTier) -> None:
        keys = [make_key("rt", i) for i in range(8)]
        values = [make_value(k, 1000 + 37 * i) for i, k in enumerate(keys)]
        assert tier.put_many(list(zip(keys, values))) == 8
        found, got = read_all(tier, keys)
        assert found == [True] * 8
        assert got == dict(enumerate(values))

    def test_missing_keys_are_reported_false(self, tier: SpillTier) -> None:
        present = [make_key("p", i) for i in range(3)]
        tier.put_many([(k, make_value(k, 64)) for k in present])
        request = [make_key("absent", 0), present[0], make_key("absent", 1), present[2]]
        assert tier.contains_many(request) == [False, True, False, True]
        found, got = read_all(tier, request)
        assert found == [False, True, False, True]
        assert got == {1: make_value(present[0], 64), 3: make_value(present[2], 64)}

    def test_sizes_are_value_lengths_and_zero_for_missing_keys(self, tier: SpillTier) -> None:
        keys = [make_key("size", i) for i in range(3)]
        tier.put_many([(keys[0], make_value(keys[0], 100)), (keys[2], make_value(keys[2], MiB))])
        assert tier.sizes_many(keys) == [100, 0, MiB]
        assert tier.sizes_many([]) == []

    def test_repeated_key_in_one_get_calls_sink_for_each_index(self, tier: SpillTier) -> None:
        k = make_key("dup")
        tier.put_many([(k, b"abc")])
        found, got = read_all(tier, [k, make_key("none"), k])
        assert found == [True, False, True]
        assert got == {0: b"abc", 2: b"abc"}

    def test_overwrite_replaces_value_and_its_bytes(self, tier: SpillTier) -> None:
        k = make_key("ow")
        tier.put_many([(k, b"x" * 1000)])
        assert tier.put_many([(k, b"y" * 10)]) == 1
        assert read_all(tier, [k])[1] == {0: b"y" * 10}
        usage = tier.usage()
        assert (usage.entries, usage.nbytes) == (1, 10)

    def test_put_only_new_keeps_the_value_a_key_holds(self, tier: SpillTier) -> None:
        held, new = make_key("only-new", 0), make_key("only-new", 1)
        tier.put_many([(held, b"x" * 1000)])
        assert tier.put_many([(held, b"y" * 2000), (new, b"z" * 10)], only_new=True) == 1
        assert read_all(tier, [held, new])[1] == {0: b"x" * 1000, 1: b"z" * 10}
        usage = tier.usage()
        assert (usage.entries, usage.nbytes) == (2, 1010)

    def test_put_only_new_stores_the_first_of_a_key_given_twice(self, tier: SpillTier) -> None:
        k = make_key("only-new-twice")
        assert tier.put_many([(k, b"a" * 10), (k, b"b" * 20)], only_new=True) == 1
        assert read_all(tier, [k])[1] == {0: b"a" * 10}

    def test_put_accepts_bytes_bytearray_and_memoryview(self, tier: SpillTier) -> None:
        keys = [make_key("buf", i) for i in range(3)]
        raw = make_value(keys[0], 300)
        items = [(keys[0], raw), (keys[1], bytearray(raw)), (keys[2], memoryview(raw)[100:])]
        assert tier.put_many(items) == 3
        assert read_all(tier, keys)[1] == {0: raw, 1: raw, 2: raw[100:]}

    def test_delete_many_counts_only_present_keys(self, tier: SpillTier) -> None:
        keys = [make_key("del", i) for i in range(5)]
        tier.put_many([(k, b"v") for k in keys])
        assert tier.delete_many([keys[0], keys[3], make_key("never")]) == 2
        assert tier.contains_many(keys) == [False, True, True, False, True]
        assert tier.delete_many([keys[0]]) == 0
        assert tier.usage().entries == 3

    def test_empty_batches_do_nothing(self, tier: SpillTier) -> None:
        def sink(i: int, value: memoryview) -> None:
            raise AssertionError("sink called for an empty batch")

        assert tier.get_many([], sink) == []
        assert tier.contains_many([]) == []
        assert tier.put_many([]) == 0
        assert tier.delete_many([]) == 0
        assert tier.usage().entries == 0

    def test_large_value_of_4_mib_round_trips(self, tier: SpillTier) -> None:
        k = make_key("large")
        value = make_value(k, 4 * MiB)
        assert tier.put_many([(k, value)]) == 1
        assert read_all(tier, [k])[1][0] == value
        assert tier.usage().nbytes == 4 * MiB

    def test_thousand_keys_in_one_batch(self, tier: SpillTier) -> None:
        keys = [make_key("many", i) for i in range(1000)]
        values = [make_value(k, i % 97) for i, k in enumerate(keys)]
        assert tier.put_many(list(zip(keys, values))) == sum(
            1 for v in values if v or self.supports_empty_values
        )
        found, got = read_all(tier, keys)
        expected = {i: v for i, v in enumerate(values) if v or self.supports_empty_values}
        assert got == expected
        assert found == [i in expected for i in range(1000)]

    # --- inspection ----------------------------------------------------------------

    def test_keys_clear_and_usage_agree(self, tier: SpillTier) -> None:
        keys = [make_key("kcu", i) for i in range(50)]
        tier.put_many([(k, make_value(k, 100 + i)) for i, k in enumerate(keys)])
        usage = tier.usage()
        assert isinstance(usage, TierUsage)
        assert sorted(tier.keys()) == sorted(keys)
        assert usage.entries == 50
        assert usage.nbytes == sum(100 + i for i in range(50))
        assert usage.capacity is None or usage.capacity >= usage.nbytes
        assert tier.clear() == 50
        assert list(tier.keys()) == []
        assert (tier.usage().entries, tier.usage().nbytes) == (0, 0)
        assert tier.contains_many(keys) == [False] * 50
        assert tier.put_many([(keys[0], b"again")]) == 1  # usable after clear
        assert tier.usage().nbytes == 5

    def test_records_live_beside_the_values_and_outlive_clear(self, tier: SpillTier) -> None:
        key = make_key("rec")
        tier.put_many([(key, b"value")])
        tier.put_record("ns/shard 0", b"first")
        tier.put_record("ns/shard 0", b"second")  # replaces
        tier.put_record("ns/shard 1", b"\x00\xff")
        assert tier.records() == {"ns/shard 0": b"second", "ns/shard 1": b"\x00\xff"}
        assert list(tier.keys()) == [key]
        assert (tier.usage().entries, tier.usage().nbytes) == (1, 5)
        assert tier.clear() == 1
        assert set(tier.records()) == {"ns/shard 0", "ns/shard 1"}

    # --- opaque values -------------------------------------------------------------

    def test_values_are_never_interpreted(self, tier: SpillTier) -> None:
        odd = [
            bytes(range(256)) * 4,
            b"\x00" * 100,
            b"\x80\x04\x95" + b"\x00" * 20 + b".",  # looks like a pickle
            b"\x93\x01\xa3abc\xc0",  # looks like msgpack
            "ünïcödé \u2603".encode(),
            b"\xff",
        ]
        keys = [make_key("odd", i) for i in range(len(odd))]
        assert tier.put_many(list(zip(keys, odd))) == len(odd)
        assert read_all(tier, keys)[1] == dict(enumerate(odd))

    def test_empty_value(self, tier: SpillTier) -> None:
        k = make_key("empty")
        if self.supports_empty_values:
            assert tier.put_many([(k, b"")]) == 1
            assert tier.contains_many([k]) == [True]
            assert read_all(tier, [k]) == ([True], {0: b""})
            assert (tier.usage().entries, tier.usage().nbytes) == (1, 0)
        else:
            assert tier.put_many([(k, b"")]) == 0
            assert tier.contains_many([k]) == [False]

    # --- threads and lifecycle -----------------------------------------------------

    def test_concurrent_threads_get_exact_values(self, tier: SpillTier) -> None:
        threads, ops = 4, 300
        errors: list[BaseException] = []
        written: list[int] = []
        start = threading.Barrier(threads)

        def work(t: int) -> None:
            try:
                rng = random.Random(t)
                sizes: dict[bytes, int] = {}  # this thread's keys and their value sizes
                start.wait()
                for op in range(ops):
                    if op % 3 == 0:
                        batch = [make_key("thr", t, op, j) for j in range(rng.randint(1, 4))]
                        items = [(k, make_value(k, rng.randint(1, 4096))) for k in batch]
                        assert tier.put_many(items) == len(items)
                        sizes.update((k, len(v)) for k, v in items)
                    keys = rng.sample(sorted(sizes), min(len(sizes), 8))
                    found, got = read_all(tier, keys)
                    assert found == [True] * len(keys)
                    assert got == {i: make_value(k, sizes[k]) for i, k in enumerate(keys)}
                    assert tier.contains_many(keys) == [True] * len(keys)
                written.append(len(sizes))
            except BaseException as e:  # re-raised in the main thread
                errors.append(e)

        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=60)
        assert not any(w.is_alive() for w in workers), "a worker thread hung"
        if errors:
            raise errors[0]
        assert tier.usage().entries == len(list(tier.keys())) == sum(written)

    def test_close_is_idempotent(self, tier: SpillTier) -> None:
        tier.put_many([(make_key("c"), b"v")])
        tier.close()
        tier.close()
