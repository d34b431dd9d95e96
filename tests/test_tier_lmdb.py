"""Tests for kvtier.tiers.lmdb: the SpillTier contract, LRU eviction, map growth,
restarts and several processes on one store, and errors raised as TierError."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import lmdb
import pytest
from fs_faults import make_read_only
from tier_contract import TierContract, make_key, make_value, read_all

from kvtier.config import DiskTierConfig
from kvtier.tiers import lmdb as lmdb_tier
from kvtier.tiers.base import TierError
from kvtier.tiers.lmdb import INITIAL_MAP_CAP, LMDBTier

T = TypeVar("T")

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.fixture
def open_tier(tmp_path: Path) -> Iterator[type[LMDBTier]]:
    """``LMDBTier`` that closes every tier it made at teardown."""
    made: list[LMDBTier] = []

    class Tracked(LMDBTier):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self)

    yield Tracked
    for tier in made:
        tier.close()


def small_tier(open_tier: type[LMDBTier], path: Path, capacity: int = 4000) -> LMDBTier:
    return open_tier(path, capacity=capacity, chunk_blocks=4)


def present(tier: LMDBTier, keys: list[bytes]) -> list[int]:
    return [i for i, p in enumerate(tier.contains_many(keys)) if p]


def run_child(script: str, *args: object, timeout: float = 30) -> subprocess.Popen[str]:
    path = [str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]  # kvtier, then its deps
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    code = textwrap.dedent(script)
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def await_files(paths: list[Path], procs: list[subprocess.Popen[str]], timeout: float = 20) -> None:
    """Wait until the children have made every path; fail, with the output of any child
    that exited, if one exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        exited = [p for p in procs if p.poll() is not None]
        assert not exited and time.monotonic() < deadline, [p.communicate() for p in exited]
        time.sleep(0.005)


def finish(proc: subprocess.Popen[str], timeout: float = 30) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{out}\n{err}"
    return out


class TestLMDBContract(TierContract):
    @pytest.fixture
    def tier(self, tmp_path: Path) -> Iterator[LMDBTier]:
        tier = LMDBTier(tmp_path / "store", capacity=64 * MiB, chunk_blocks=16)
        yield tier
        tier.close()


# --- eviction ----------------------------------------------------------------------


def test_lru_eviction_evicts_the_least_recently_used(open_tier, tmp_path: Path) -> None:
    tier = small_tier(open_tier, tmp_path)
    keys = [make_key("lru", i) for i in range(5)]
    tier.put_many([(k, b"v" * 1000) for k in keys[:4]])  # exactly full
    read_all(tier, [keys[0]])  # k0 is now the most recently used
    assert tier.put_many([(keys[4], b"w" * 1000)]) == 1
    assert present(tier, keys) == [0, 2, 3, 4]
    assert tier.usage().nbytes == 4000
    assert tier.evictions == 1


EVICT_ONE = """
    import sys
    from kvtier.tiers.lmdb import LMDBTier
    from tier_contract import make_key
    tier = LMDBTier(sys.argv[1], capacity=4000, chunk_blocks=4)
    tier.put_many([(make_key("new", 0), b"w" * 1000)])
    tier.close()
"""


def test_reads_reach_other_processes_once_max_pending_uses_wait(
    open_tier, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(lmdb_tier, "MAX_PENDING_USES", 2)
    tier = small_tier(open_tier, tmp_path)
    keys = [make_key("lru", i) for i in range(4)]
    tier.put_many([(k, b"v" * 1000) for k in keys])  # exactly full
    read_all(tier, [keys[0]])  # pending: another process would still evict k0
    read_all(tier, [keys[1]])  # two pending: written
    finish(run_child(EVICT_ONE, tmp_path))
    assert present(tier, keys) == [0, 1, 3]


HOLD_WRITER = """
    import sys, time
    from pathlib import Path
    import lmdb
    from kvtier.tiers.lmdb import ENV_OPTIONS
    env = lmdb.open(sys.argv[1], map_size=1 << 20, **ENV_OPTIONS)
    with env.begin(write=True):
        Path(sys.argv[2]).touch()
        while not Path(sys.argv[3]).exists():
            time.sleep(0.005)
"""


def test_a_read_does_not_wait_for_another_processes_writer(open_tier, tmp_path) -> None:
    tier = small_tier(open_tier, tmp_path / "s")
    key = make_key("r", 0)
    tier.put_many([(key, b"v" * 1000)])
    holding, release = tmp_path / "holding", tmp_path / "release"
    proc = run_child(HOLD_WRITER, tmp_path / "s", holding, release)
    try:
        await_files([holding], [proc])
        reader = threading.Thread(target=read_all, args=(tier, [key]), daemon=True)
        reader.start()
        reader.join(timeout=10)
        assert not reader.is_alive(), "get_many waited for the writer lock"
    finally:
        release.touch()
        finish(proc)


@pytest.mark.parametrize("query", ["contains_many", "sizes_many"])
def test_an_existence_or_size_query_is_not_a_use(open_tier, tmp_path: Path, query) -> None:
    tier = small_tier(open_tier, tmp_path)
    keys = [make_key("c", i) for i in range(5)]
    tier.put_many([(k, b"v" * 1000) for k in keys[:4]])
    getattr(tier, query)([keys[0]])
    tier.put_many([(keys[4], b"w" * 1000)])
    assert present(tier, keys) == [1, 2, 3, 4]


def test_overwrite_is_a_use(open_tier, tmp_path: Path) -> None:
    tier = small_tier(open_tier, tmp_path)
    keys = [make_key("o", i) for i in range(5)]
    tier.put_many([(k, b"v" * 1000) for k in keys[:4]])
    tier.put_many([(keys[0], b"u" * 1000)])
    tier.put_many([(keys[4], b"w" * 1000)])
    assert present(tier, keys) == [0, 2, 3, 4]
    assert read_all(tier, [keys[0]])[1] == {0: b"u" * 1000}


def test_eviction_frees_as_many_values_as_needed(open_tier, tmp_path: Path) -> None:
    tier = small_tier(open_tier, tmp_path)
    keys = [make_key("m", i) for i in range(5)]
    tier.put_many([(k, b"v" * 1000) for k in keys[:4]])
    tier.put_many([(keys[4], b"w" * 2500)])
    assert present(tier, keys) == [3, 4]
    assert tier.usage().nbytes == 3500


def test_value_larger_than_capacity_is_skipped(open_tier, tmp_path: Path) -> None:
    tier = small_tier(open_tier, tmp_path)
    keys = [make_key("big", i) for i in range(3)]
    tier.put_many([(keys[0], b"v" * 3000)])
    assert tier.put_many([(keys[1], b"x" * 4001), (keys[2], b"y" * 1000)]) == 1
    assert present(tier, keys) == [0, 2]
    assert tier.evictions == 0


def test_a_batch_larger_than_capacity_keeps_its_newest_values(open_tier, tmp_path) -> None:
    tier = small_tier(open_tier, tmp_path)
    keys = [make_key("batch", i) for i in range(10)]
    assert tier.put_many([(k, make_value(k, 1000)) for k in keys]) == 10  # all written
    assert present(tier, keys) == [6, 7, 8, 9]
    assert read_all(tier, keys[6:])[1] == {i: make_value(k, 1000) for i, k in enumerate(keys[6:])}


def test_accounting_matches_contents_under_random_load(open_tier, tmp_path: Path) -> None:
    tier = small_tier(open_tier, tmp_path, capacity=20_000)
    rng = random.Random(7)
    keys = [make_key("rand", i) for i in range(40)]
    for _ in range(150):
        op = rng.random()
        batch = rng.sample(keys, rng.randint(1, 6))
        if op < 0.6:
            tier.put_many([(k, make_value(k, rng.randint(0, 5000))) for k in batch])
        elif op < 0.8:
            read_all(tier, batch)
        else:
            tier.delete_many(batch)
        held = list(tier.keys())
        found, got = read_all(tier, held)
        assert all(found)
        usage = tier.usage()
        assert usage.entries == len(held)
        assert usage.nbytes == sum(map(len, got.values())) <= 20_000
    assert tier.evictions > 0


# --- the memory map ------------------------------------------------------------------


def test_initial_map_is_small_for_a_large_capacity(open_tier, tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "s", capacity=16 * GiB, chunk_blocks=16)
    assert tier.map_size == INITIAL_MAP_CAP
    assert (tmp_path / "s" / "data.mdb").stat().st_size < INITIAL_MAP_CAP


def test_map_grows_to_hold_more_data(open_tier, tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "s", capacity=64 * MiB, chunk_blocks=4, map_size=1 * MiB)
    env_start = tier._env.info()["map_size"]
    keys = [make_key("grow", i) for i in range(128)]
    for i in range(0, 128, 16):
        assert tier.put_many([(k, make_value(k, 64 * KiB)) for k in keys[i : i + 16]]) == 16
    assert env_start == 1 * MiB
    assert tier._env.info()["map_size"] >= 8 * MiB
    found, got = read_all(tier, keys)
    assert all(found)
    assert got == {i: make_value(k, 64 * KiB) for i, k in enumerate(keys)}


def test_threads_grow_the_map_while_others_read(open_tier, tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "s", capacity=64 * MiB, chunk_blocks=4, map_size=1 * MiB)
    seed = [make_key("seed", i) for i in range(4)]
    tier.put_many([(k, make_value(k, 4 * KiB)) for k in seed])
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        try:
            for b in range(8):
                keys = [make_key("tg", t, b, j) for j in range(8)]
                assert tier.put_many([(k, make_value(k, 64 * KiB)) for k in keys]) == 8
                assert read_all(tier, keys)[1] == {
                    i: make_value(k, 64 * KiB) for i, k in enumerate(keys)
                }
        except BaseException as e:
            errors.append(e)

    def reader() -> None:
        try:
            for _ in range(50):
                found, got = read_all(tier, seed)
                assert got == {i: make_value(k, 4 * KiB) for i, k in enumerate(seed)}
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(3)]
    threads.append(threading.Thread(target=reader))
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    if errors:
        raise errors[0]
    assert tier.map_size >= 12 * MiB
    assert tier.usage().entries == 4 + 3 * 8 * 8


def test_map_full_at_its_limit_raises_tier_error(open_tier, tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "s", capacity=64 * MiB, chunk_blocks=4, map_size=1 * MiB)
    tier.put_many([(make_key("kept"), b"k" * 1000)])
    tier.max_map_size = tier.map_size  # pretend the limit is reached
    with pytest.raises(TierError, match="map is full"):
        tier.put_many([(make_key("f", i), b"x" * 256 * KiB) for i in range(8)])
    assert read_all(tier, [make_key("kept")])[1] == {0: b"k" * 1000}
    assert tier.usage().entries == 1  # the failed batch left nothing behind


# --- restarts and processes ----------------------------------------------------------

WRITER = """
    import sys
    from kvtier.tiers.lmdb import LMDBTier
    from tier_contract import make_key, make_value
    path, n = sys.argv[1], int(sys.argv[2])
    tier = LMDBTier(path, capacity=64 << 20, chunk_blocks=16)
    tier.put_many([(make_key("restart", i), make_value(make_key("restart", i), 100 * i))
                   for i in range(n)])
    print(tier.usage().nbytes)
    # no close(): a process that exits (or dies) after a commit keeps it
"""


def test_restart_in_a_new_process_keeps_values(open_tier, tmp_path: Path) -> None:
    out = finish(run_child(WRITER, tmp_path / "s", 50))
    assert int(out) == sum(100 * i for i in range(50))
    tier = open_tier(tmp_path / "s", capacity=64 * MiB, chunk_blocks=16)
    keys = [make_key("restart", i) for i in range(50)]
    found, got = read_all(tier, keys)
    assert all(found)
    assert got == {i: make_value(k, 100 * i) for i, k in enumerate(keys)}
    assert tier.usage().nbytes == int(out)


def test_accounting_and_lru_order_survive_reopen(open_tier, tmp_path: Path) -> None:
    keys = [make_key("reopen", i) for i in range(5)]
    with LMDBTier(tmp_path / "s", capacity=4000, chunk_blocks=4) as tier:
        tier.put_many([(k, b"v" * 1000) for k in keys[:4]])
        read_all(tier, [keys[0]])
        before = tier.usage()
    tier = small_tier(open_tier, tmp_path / "s")
    assert tier.usage() == before
    tier.put_many([(keys[4], b"w" * 1000)])
    assert present(tier, keys) == [0, 2, 3, 4]


def test_reopen_with_a_smaller_capacity_evicts_oldest(open_tier, tmp_path: Path) -> None:
    keys = [make_key("shrink", i) for i in range(4)]
    with LMDBTier(tmp_path / "s", capacity=4000, chunk_blocks=4) as tier:
        tier.put_many([(k, b"v" * 1000) for k in keys])
    tier = small_tier(open_tier, tmp_path / "s", capacity=2500)
    assert present(tier, keys) == [2, 3]
    assert tier.usage().nbytes == 2000


SHARER = """
    import sys, time
    from pathlib import Path
    from kvtier.tiers.lmdb import LMDBTier
    from tier_contract import make_key, make_value, read_all
    path, me, other, sync = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])

    def wait_for(name):
        deadline = time.monotonic() + 20
        while not (sync / name).exists():
            assert time.monotonic() < deadline, f"timed out waiting for {name}"
            time.sleep(0.005)

    tier = LMDBTier(path, capacity=256 << 20, chunk_blocks=16, map_size=1 << 20)
    (sync / f"ready-{me}").touch()
    wait_for("go")
    mine = [make_key(me, i) for i in range(400)]
    theirs = [make_key(other, i) for i in range(400)]
    for b in range(0, 400, 16):  # 400 x 16 KiB: both processes grow the map
        batch = mine[b : b + 16]
        assert tier.put_many([(k, make_value(k, 16 << 10)) for k in batch]) == 16
        found, got = read_all(tier, batch)
        assert got == {i: make_value(k, 16 << 10) for i, k in enumerate(batch)}
        tier.contains_many(theirs)
    (sync / f"done-{me}").touch()
    wait_for(f"done-{other}")
    for keys in (mine, theirs):
        found, got = read_all(tier, keys)
        assert all(found), f"{found.count(False)} keys missing"
        assert got == {i: make_value(k, 16 << 10) for i, k in enumerate(keys)}
    print(tier.usage().entries, tier.map_size)
    tier.close()
"""


def test_two_processes_share_one_store(open_tier, tmp_path: Path) -> None:
    sync = tmp_path / "sync"
    sync.mkdir()
    store = tmp_path / "s"
    procs = [run_child(SHARER, store, me, other, sync) for me, other in (("a", "b"), ("b", "a"))]
    await_files([sync / f"ready-{me}" for me in "ab"], procs)
    (sync / "go").touch()
    outs = [finish(p) for p in procs]
    for out in outs:
        entries, map_size = map(int, out.split())
        assert entries == 800
        assert map_size > 1 * MiB
    tier = open_tier(store, capacity=256 * MiB, chunk_blocks=16)
    assert tier.usage().entries == 800
    assert tier.usage().nbytes == 800 * 16 * KiB


# --- errors --------------------------------------------------------------------------


def test_read_only_directory_raises_tier_error(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    undo = make_read_only(ro)
    if undo is None:
        pytest.skip("cannot make a directory read-only here (root without chattr +i)")
    try:
        with pytest.raises(TierError, match="cannot open") as info:
            LMDBTier(ro, capacity=1 * MiB, chunk_blocks=4)
        assert isinstance(info.value.__cause__, lmdb.Error)
    finally:
        undo()


def test_path_under_a_regular_file_raises_tier_error(tmp_path: Path) -> None:
    (tmp_path / "afile").write_bytes(b"not a directory")
    with pytest.raises(TierError, match="cannot create") as info:
        LMDBTier(tmp_path / "afile" / "db", capacity=1 * MiB, chunk_blocks=4)
    assert isinstance(info.value.__cause__, OSError)


FULL_DISK = """
    import resource, signal, sys
    from kvtier.tiers.base import TierError
    from kvtier.tiers.lmdb import LMDBTier
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, resource.RLIM_INFINITY))
    tier = LMDBTier(sys.argv[1], capacity=64 << 20, chunk_blocks=4)
    assert tier.put_many([(b"k" * 16, b"small")]) == 1
    try:
        tier.put_many([(b"b" * 16, b"x" * (4 << 20))])
    except TierError as e:
        print("TierError", type(e.__cause__).__name__, e)
    else:
        print("stored")
    found = tier.contains_many([b"k" * 16, b"b" * 16])
    assert tier.put_many([(b"s" * 16, b"after")]) == 1
    print(found, tier.usage().entries)
    tier.close()
"""


def test_full_disk_during_put_raises_tier_error(tmp_path: Path) -> None:
    out = finish(run_child(FULL_DISK, tmp_path / "s"))
    first, second = out.splitlines()
    assert first.startswith("TierError"), out
    assert second == "[True, False] 2"  # the failed batch left no trace; the tier still works


def test_foreign_lmdb_store_is_rejected(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "other"), map_size=1 * MiB)
    with env.begin(write=True) as txn:
        txn.put(b"somebody", b"else")
    env.close()
    with pytest.raises(TierError, match="not kvtier"):
        LMDBTier(tmp_path / "other", capacity=1 * MiB, chunk_blocks=4)


def test_second_open_in_the_same_process_raises(open_tier, tmp_path: Path) -> None:
    open_tier(tmp_path / "s", capacity=1 * MiB, chunk_blocks=4)
    with pytest.raises(TierError, match="already open"):
        LMDBTier(tmp_path / "s", capacity=1 * MiB, chunk_blocks=4)


def test_calls_on_a_closed_tier_raise_tier_error(tmp_path: Path) -> None:
    tier = LMDBTier(tmp_path / "s", capacity=1 * MiB, chunk_blocks=4)
    tier.close()
    for call in (
        lambda: tier.put_many([(b"k" * 16, b"v")]),
        lambda: tier.get_many([b"k" * 16], lambda i, v: None),
        lambda: tier.contains_many([b"k" * 16]),
        lambda: tier.delete_many([b"k" * 16]),
        lambda: list(tier.keys()),
        tier.usage,
        tier.clear,
    ):
        with pytest.raises(TierError, match="closed"):
            call()
    LMDBTier(tmp_path / "s", capacity=1 * MiB, chunk_blocks=4).close()  # reopenable


def test_sink_exception_propagates_and_the_tier_stays_usable(open_tier, tmp_path) -> None:
    tier = small_tier(open_tier, tmp_path)
    k = make_key("sink")
    tier.put_many([(k, b"v")])

    def bad(i: int, value: memoryview) -> None:
        raise KeyError("from the sink")

    with pytest.raises(KeyError, match="from the sink"):
        tier.get_many([k], bad)
    assert read_all(tier, [k])[1] == {0: b"v"}


def test_from_config_opens_the_resolved_path(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_DIR", str(tmp_path))
    cfg = DiskTierConfig(path="$KVTIER_TEST_DIR/cache", capacity=2 * MiB, chunk_blocks=8)
    with LMDBTier.from_config(cfg) as tier:
        assert (tier.name, tier.chunk_blocks, tier.usage().capacity) == ("disk", 8, 2 * MiB)
        assert tier.path == tmp_path / "cache"
    assert (tmp_path / "cache" / "data.mdb").exists()


@pytest.mark.parametrize("capacity, chunk_blocks", [(0, 4), (1 * MiB, 0), (True, 4)])
def test_bad_arguments_raise_value_error(tmp_path, capacity, chunk_blocks) -> None:
    with pytest.raises(ValueError):
        LMDBTier(tmp_path / "s", capacity=capacity, chunk_blocks=chunk_blocks)


# --- what a lookup reads ---------------------------------------------------------------

RESIDENT = """
import ctypes, mmap, os, sys
from kvtier.tiers.lmdb import LMDBTier
from tier_contract import make_key

path, n = sys.argv[1], int(sys.argv[2])
data = os.path.join(path, "data.mdb")
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

def resident() -> int:
    \"\"\"Bytes of data.mdb in the page cache (mincore on a mapping of this one's own).\"\"\"
    size = os.path.getsize(data)
    fd = os.open(data, os.O_RDONLY)
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    os.close(fd)
    vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    try:
        assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
    finally:
        libc.munmap(addr, size)
    return sum(v & 1 for v in vec) * mmap.PAGESIZE

fd = os.open(data, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
os.close(fd)
dropped = resident()
keys = [make_key("cold", i) for i in range(n)]
tier = LMDBTier(path, capacity=256 << 20, chunk_blocks=1)
assert tier.sizes_many(keys) == [1 << 20] * n and all(tier.contains_many(keys))
looked_up = resident()
tier.get_many(keys, lambda i, v: None)
print(dropped, looked_up, resident())
tier.close()
"""


def test_a_lookup_reads_no_value_from_disk(tmp_path: Path) -> None:
    """Sizes and existence come from ``sizes``, not from the values (py-lmdb reads every
    page of a value it returns): after the page cache dropped the store, opening it and
    looking up 128 values of 1 MiB brings in a small part of what reading them does
    (the kernel reads around each page LMDB's B-trees fault in)."""
    n = 128
    keys = [make_key("cold", i) for i in range(n)]
    with LMDBTier(tmp_path / "s", capacity=256 * MiB, chunk_blocks=1) as tier:
        tier.put_many([(k, os.urandom(MiB)) for k in keys])
    dropped, looked_up, read = map(int, finish(run_child(RESIDENT, tmp_path / "s", n)).split())
    if dropped > n * MiB // 8:
        pytest.skip(f"this file system kept {dropped} B of the store in the page cache")
    assert read - dropped >= n * MiB
    assert looked_up - dropped < n * MiB // 4


def rewrite_store(path: Path, edit: Callable[[lmdb.Environment, lmdb.Transaction], None]) -> None:
    """Change a closed store with raw lmdb, as an older kvtier would have left it."""
    env = lmdb.open(str(path), **lmdb_tier.ENV_OPTIONS)
    with env.begin(write=True) as txn:
        edit(env, txn)
    env.close()


def read_raw(path: Path, read: Callable[[lmdb.Environment, lmdb.Transaction], T]) -> T:
    """What a raw read transaction finds in a closed store."""
    env = lmdb.open(str(path), **lmdb_tier.ENV_OPTIONS)
    with env.begin() as txn:
        out = read(env, txn)
    env.close()
    return out


def stored_version(env: lmdb.Environment, txn: lmdb.Transaction) -> int:
    return int.from_bytes(txn.get(b"version", db=env.open_db(b"meta", txn=txn)), "big")


def sized_values(env: lmdb.Environment, txn: lmdb.Transaction) -> int:
    return txn.stat(env.open_db(b"sizes", txn=txn))["entries"]


def test_a_store_written_before_sizes_existed_has_its_values_measured_on_open(
    open_tier, tmp_path: Path
) -> None:
    """A version 2 store has no ``sizes``: opening it gives every value its entry, from
    the value itself, and makes it version 3; lookups, overwrites and deletes then
    find the right lengths."""
    keys = [make_key("v2", i) for i in range(3)]
    with LMDBTier(tmp_path / "s", capacity=4000, chunk_blocks=4) as tier:
        tier.put_many([(k, b"v" * (100 * (i + 1))) for i, k in enumerate(keys)])

    def as_version_2(env: lmdb.Environment, txn: lmdb.Transaction) -> None:
        txn.drop(env.open_db(b"sizes", txn=txn), delete=True)
        txn.put(b"version", (2).to_bytes(8, "big"), db=env.open_db(b"meta", txn=txn))

    rewrite_store(tmp_path / "s", as_version_2)
    tier = small_tier(open_tier, tmp_path / "s")
    assert tier.sizes_many(keys) == [100, 200, 300]
    assert tier.contains_many(keys) == [True, True, True]
    tier.put_many([(keys[0], b"w" * 50)])
    assert tier.delete_many([keys[1]]) == 1
    assert tier.sizes_many(keys) == [50, 0, 300]
    assert tier.usage().nbytes == 350
    tier.close()
    assert read_raw(tmp_path / "s", stored_version) == 3
    assert read_raw(tmp_path / "s", sized_values) == 2


def test_a_version_3_store_with_values_adopted_unsized_has_them_measured_on_open(
    open_tier, tmp_path: Path
) -> None:
    """Earlier releases kept the values of a version 2 store without ``sizes`` entries
    until they were written again: opening such a store measures those, and only those."""
    keys = [make_key("v3", i) for i in range(3)]
    with LMDBTier(tmp_path / "s", capacity=4000, chunk_blocks=4) as tier:
        tier.put_many([(k, b"v" * (100 * (i + 1))) for i, k in enumerate(keys)])

    def unmeasure_second(env: lmdb.Environment, txn: lmdb.Transaction) -> None:
        txn.delete(keys[1], db=env.open_db(b"sizes", txn=txn))

    rewrite_store(tmp_path / "s", unmeasure_second)  # the store is version 3 already
    assert read_raw(tmp_path / "s", sized_values) == 2
    small_tier(open_tier, tmp_path / "s").close()
    assert read_raw(tmp_path / "s", sized_values) == 3
    assert read_raw(tmp_path / "s", stored_version) == 3
    assert small_tier(open_tier, tmp_path / "s").sizes_many(keys) == [100, 200, 300]
