"""TieredCache with the GPU and host tiers: offload on eviction, prefetch on a hit."""

import random
import threading
from pathlib import Path

import pytest
import torch

from kvtier.block_manager import StaleHitError
from kvtier.cache import LoadError, PrefixHit, TieredCache
from kvtier.config import parse_config
from kvtier.synthetic import PoolExhausted, expected_block, serve


def make_cache(
    gpu_blocks: int = 8,
    host_blocks: int = 64,
    dtype: str = "float32",
    kv_factor: int = 2,
    write_policy: str = "on_evict",
    device: str = "cpu",
    disk: Path | None = None,
) -> TieredCache:
    """A cache whose GPU pool lives on ``device``; with ``disk`` (a directory), an LMDB
    tier below the host pool."""
    layout = {
        "num_layers": 2,
        "kv_factor": kv_factor,
        "block_size": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "dtype": dtype,
    }
    block_nbytes = parse_config({"layout": layout}).layout.block_nbytes
    tiers: dict = {
        "gpu": {"num_blocks": gpu_blocks, "device": device},
        "cpu": {"capacity": host_blocks * block_nbytes, "write_policy": write_policy},
    }
    if disk is not None:
        tiers["disk"] = {"path": str(disk / "lmdb"), "capacity": "64MiB", "chunk_blocks": 4}
    return TieredCache(parse_config({"layout": layout, "tiers": tiers}))


def prompt(seed: int, blocks: int, bs: int = 4) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(blocks * bs + 1)]


class _HeldJob:
    """A copier job that is handed to the real copier only once its gate is open."""

    def __init__(self, copier: "HeldCopier", args: tuple) -> None:
        self.copier, self.args = copier, args
        self.job = None
        self.cancelled = False

    def _start(self) -> bool:
        if self.job is None and not self.cancelled and self.copier.gate.is_set():
            self.job = self.copier.real.submit(*self.args)
        return self.job is not None

    def done(self) -> bool:
        return self.cancelled or (self._start() and self.job.done())

    def wait(self) -> None:
        self.copier.gate.wait()
        if self._start():
            self.job.wait()

    def cancel(self) -> bool:
        if self.job is not None:
            return self.job.cancel()
        self.cancelled = True
        return True

    @property
    def seconds(self) -> float:
        return self.job.seconds if self.job is not None else 0.0


class HeldCopier:
    """Stands in for the transfer engine's copier thread while it is busy elsewhere: a
    background copy starts only once ``gate`` is set (then on the real copier)."""

    def __init__(self, real) -> None:
        self.real, self.gate = real, threading.Event()
        self.fail: BaseException | None = None  # raised by submit, if set

    def submit(self, *args) -> _HeldJob:
        if self.fail is not None:
            raise self.fail
        return _HeldJob(self, args)

    def close(self) -> None:
        self.real.close()


def hold_copies(cache: TieredCache) -> threading.Event:
    """Keep every background copy and I/O worker waiting until the returned event is set."""
    held = cache.transfer._copier = HeldCopier(cache.transfer._copier)
    for _ in range(cache.config.transfer.io_threads):
        cache.transfer._pool.submit(held.gate.wait)
    return held.gate


def prompt_in_host(cache: TieredCache, other_blocks: int = 6) -> list[int]:
    """Serve a 6-block prompt, then another that pushes it from the GPU to the host."""
    a = prompt(1, 6)
    serve(cache, "a", a)
    serve(cache, "b", prompt(2, other_blocks))
    return a


def begin(cache: TieredCache, req_id: str, tokens: list[int]) -> tuple[PrefixHit, list[int]]:
    """lookup + allocate: the request's prefetch starts."""
    hit = cache.lookup(req_id, tokens)
    return hit, cache.allocate(req_id, len(tokens) - hit.num_tokens, hit)


def check_pools(cache: TieredCache) -> None:
    cache.gpu.check_invariants()
    cache.host.check_invariants()


@pytest.mark.parametrize(
    ("dtype", "kv_factor"),
    [("float16", 2), ("bfloat16", 2), ("float32", 2), ("float16", 1)],
)
def test_evicted_blocks_come_back_from_host_bit_exact(dtype, kv_factor):
    cache = make_cache(gpu_blocks=8, dtype=dtype, kv_factor=kv_factor)
    a, b = prompt(1, 6), prompt(2, 6)
    serve(cache, "a", a)
    serve(cache, "b", b)  # evicts a's blocks to the host pool
    again = serve(cache, "a2", a)  # serve() checks every loaded block bit for bit
    assert again.hit.tokens_per_tier()["cpu"] > 0
    assert again.valid_tokens == again.hit.num_tokens == 24
    check_pools(cache)


def test_working_set_4x_gpu_and_half_host_always_hits_exactly():
    gpu_blocks, host_blocks = 16, 128
    cache = make_cache(gpu_blocks=gpu_blocks, host_blocks=host_blocks)
    prompts = [prompt(i, 4) for i in range(16)]  # 64 distinct full blocks = 4x GPU, 0.5x host
    for i, p in enumerate(prompts):
        serve(cache, f"cold{i}", p)
    for rnd in range(3):
        for i in random.Random(rnd).sample(range(16), 16):
            served = serve(cache, f"r{rnd}-{i}", prompts[i])
            assert served.hit.num_tokens == 16, f"prompt {i} missed in round {rnd}"
    stats = cache.stats()
    assert stats["cpu"].hits > 0 and stats["gpu"].hits > 0
    check_pools(cache)


def test_blocks_already_in_host_are_not_copied_again():
    cache = make_cache(gpu_blocks=8)
    a, b = prompt(1, 6), prompt(2, 6)
    serve(cache, "a", a)
    serve(cache, "b", b)  # a goes down to the host
    serve(cache, "a2", a)  # b goes down
    copied = cache.stats()["cpu"].blocks_in
    serve(cache, "b2", b)  # evicts a again: its blocks are in the host already
    serve(cache, "a3", a)  # and b's
    assert cache.stats()["cpu"].blocks_in == copied
    check_pools(cache)


def test_eager_policy_copies_on_commit_so_eviction_copies_nothing():
    cache = make_cache(gpu_blocks=8, write_policy="eager")
    serve(cache, "a", prompt(1, 6))
    assert cache.stats()["cpu"].blocks_in == 6
    serve(cache, "b", prompt(2, 6))  # evicts a: already in host
    assert cache.stats()["cpu"].blocks_in == 12
    assert serve(cache, "a2", prompt(1, 6)).hit.num_tokens == 24
    check_pools(cache)


def host_positions_in_eviction_order(cache: TieredCache) -> list[int]:
    return cache.host.cached_blocks(cache.host.eviction_order()).positions


def test_eager_copies_queue_a_chain_in_the_host_pool_tail_first():
    cache = make_cache(gpu_blocks=8, write_policy="eager")
    serve(cache, "a", prompt(1, 6))
    cache.flush()
    assert host_positions_in_eviction_order(cache) == [5, 4, 3, 2, 1, 0]


def test_a_chain_loaded_from_the_host_pool_is_queued_again_tail_first():
    cache = make_cache(gpu_blocks=8)
    a = prompt_in_host(cache)
    serve(cache, "a2", a)  # blocks 1-5 loaded from the host (0 stayed on the GPU)
    cache.flush()
    assert host_positions_in_eviction_order(cache)[-5:] == [5, 4, 3, 2, 1]


def test_ready_is_false_until_the_background_copy_lands_and_wait_blocks_for_it():
    cache = make_cache(gpu_blocks=8)
    a = prompt_in_host(cache)
    gate = hold_copies(cache)
    begin(cache, "a2", a)
    assert cache.ready("a2") is False
    gate.set()
    assert cache.wait("a2") == 24
    assert cache.ready("a2") is True


def test_prefetching_blocks_are_not_hittable_until_ready():
    cache = make_cache(gpu_blocks=16)
    a = prompt_in_host(cache, other_blocks=12)
    gate = hold_copies(cache)
    hit, _ = begin(cache, "a2", a)
    other = cache.lookup("a3", a)
    assert other.gpu_blocks == hit.gpu_blocks  # the in-flight blocks are not a GPU hit
    gate.set()
    cache.wait("a2")
    assert len(cache.lookup("a4", a).gpu_blocks) == 6


def test_prefetching_blocks_are_not_evictable():
    cache = make_cache(gpu_blocks=8)
    a = prompt_in_host(cache)
    gate = hold_copies(cache)
    hit, table = begin(cache, "a2", a)
    assert cache.allocate("c", 8 * 4) is None  # would need a2's blocks
    gate.set()
    cache.wait("a2")
    assert all(torch.equal(cache.kv[table[i]], expected_block(cache, a, i)) for i in range(6))


def test_free_during_prefetch_leaks_nothing():
    cache = make_cache(gpu_blocks=8)
    a = prompt_in_host(cache)
    gate = hold_copies(cache)
    hit, _ = begin(cache, "a2", a)
    assert cache.free("a2") is True  # the queued copy is cancelled
    gate.set()
    cache.flush()
    assert cache.gpu.num_free == cache.gpu.num_blocks
    assert cache.host.num_free == cache.host.num_blocks
    assert serve(cache, "a3", a).hit.num_tokens == 24  # the host copy is still there
    check_pools(cache)


def test_failed_prefetch_reports_only_gpu_tokens_and_counts_the_error():
    cache = make_cache(gpu_blocks=8)
    a = prompt_in_host(cache)
    copier = cache.transfer._copier = HeldCopier(cache.transfer._copier)
    copier.gate.set()
    copier.fail = RuntimeError("copy failed")
    hit, _ = begin(cache, "a2", a)
    assert cache.wait("a2") == hit.tokens_per_tier()["gpu"]
    assert cache.stats()["cpu"].errors == 1
    copier.fail = None
    cache.free("a2")
    assert serve(cache, "a3", a).valid_tokens == 24  # host copy intact, loads now
    check_pools(cache)


def test_commit_before_wait_is_refused():
    cache = make_cache(gpu_blocks=8)
    a = prompt_in_host(cache)
    begin(cache, "a2", a)
    with pytest.raises(LoadError):
        cache.commit("a2", a)


def test_stats_count_hits_and_bytes_per_tier():
    cache = make_cache(gpu_blocks=8)
    a = prompt_in_host(cache)
    hit = serve(cache, "a2", a).hit
    s = cache.stats()
    nbytes = cache.layout.block_nbytes
    assert s["cpu"].hits == len(hit.host_slots)
    assert s["cpu"].blocks_out == len(hit.host_slots)
    assert s["cpu"].bytes_out == len(hit.host_slots) * nbytes
    assert s["gpu"].blocks_out == s["cpu"].blocks_in
    assert s["cpu"].copy_seconds > 0


@pytest.mark.timeout(120)
def test_threads_prefetching_allocating_and_freeing_keep_pools_consistent():
    cache = make_cache(gpu_blocks=48, host_blocks=96)
    prompts = [prompt(i, 3 + i % 4) for i in range(24)]
    errors: list[BaseException] = []
    steps = 1000

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        try:
            for step in range(steps):
                p = prompts[rng.randrange(len(prompts))]
                req = f"t{tid}-{step}"
                try:
                    served = serve(cache, req, p, free=False)
                except (StaleHitError, PoolExhausted):  # contention: try another request
                    cache.free(req)
                    continue
                if rng.random() < 0.5:  # decode a few tokens
                    tokens = list(p)
                    for _ in range(rng.randrange(1, 6)):
                        if cache.allocate(req, 1) is None:
                            break
                        tokens.append(rng.randrange(50000))
                        cache.commit(req, tokens)
                assert served.valid_tokens == served.hit.num_tokens
                cache.free(req)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    def checker(stop: threading.Event) -> None:
        while not stop.wait(0.001):
            with cache._lock:
                check_pools(cache)

    stop = threading.Event()
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    watcher = threading.Thread(target=checker, args=(stop,))
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert not errors, errors[0]
    cache.flush()
    check_pools(cache)
    assert cache.gpu.num_free == cache.gpu.num_blocks
    assert cache.host.num_free == cache.host.num_blocks
    assert cache.stats()["cpu"].hits > 0
