"""The same round trips on every device there is: the GPU tier on the CPU here, and on
CUDA (pinned host slab, copy streams and events) where a CUDA device is present; in
native mode (``TieredCache``) and in connector mode (``ConnectorCache`` below an
engine's KV tensors)."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch
from test_cache_host import make_cache, prompt

from kvtier.block_manager import StaleHitError
from kvtier.cache import TieredCache
from kvtier.config import parse_config
from kvtier.connector import ConnectorCache, ConnectorHit, EngineKV, engine_layout
from kvtier.synthetic import PoolExhausted, serve
from kvtier.transfer import copy_blocks

NO_CUDA = not torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(NO_CUDA, reason="no CUDA device"))]


def serve_twice(cache: TieredCache, prompts: list[list[int]]) -> dict[str, int]:
    """Serve every prompt, then every prompt again, newest first: each second request
    must hit all its full blocks (``serve`` checks every loaded block bit for bit).
    Returns the tokens the second pass found per tier."""
    for i, p in enumerate(prompts):
        serve(cache, f"first{i}", p)
    cache.flush()  # spill writes land before the second pass looks for them
    found: dict[str, int] = {}
    for i, p in reversed(list(enumerate(prompts))):
        served = serve(cache, f"again{i}", p)
        assert served.valid_tokens == served.hit.num_tokens == len(p) - 1
        for tier, n in served.hit.tokens_per_tier().items():
            found[tier] = found.get(tier, 0) + n
    cache.gpu.check_invariants()
    cache.host.check_invariants()
    return found


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("dtype", "kv_factor"),
    [("float16", 2), ("bfloat16", 2), ("float32", 2), ("float16", 1)],
)
def test_host_tier_round_trip_is_bit_exact(device: str, dtype: str, kv_factor: int) -> None:
    # 64 blocks of prompts: 4x the GPU pool, 0.5x the host pool.
    cache = make_cache(16, 128, dtype, kv_factor, device=device)
    found = serve_twice(cache, [prompt(s, 8) for s in range(8)])
    assert found.get("cpu", 0) > 0
    cache.close()


@pytest.mark.parametrize("device", DEVICES)
def test_eager_host_copies_round_trip_bit_exact(device: str) -> None:
    cache = make_cache(16, 128, write_policy="eager", device=device)
    found = serve_twice(cache, [prompt(s, 8) for s in range(8)])
    assert found.get("cpu", 0) > 0
    cache.close()


@pytest.mark.parametrize("device", DEVICES)
def test_disk_tier_round_trip_is_bit_exact(device: str, tmp_path: Path) -> None:
    cache = make_cache(16, 16, device=device, disk=tmp_path)
    found = serve_twice(cache, [prompt(s, 8) for s in range(8)])
    assert found.get("disk", 0) > 0
    cache.close()


@pytest.mark.skipif(NO_CUDA, reason="no CUDA device")
def test_host_slab_is_pinned_on_cuda() -> None:
    cache = make_cache(device="cuda")
    assert cache.host.slab.is_pinned()
    assert cache.kv.is_cuda
    cache.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", DEVICES)
def test_threads_serving_at_once_keep_kv_exact_and_pools_consistent(
    device: str, tmp_path: Path
) -> None:
    cache = make_cache(48, 48, device=device, disk=tmp_path)
    prompts = [prompt(s, 3 + s % 5) for s in range(24)]
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        try:
            for step in range(300):
                req = f"t{tid}-{step}"
                try:
                    served = serve(cache, req, prompts[rng.randrange(len(prompts))])
                except (StaleHitError, PoolExhausted):  # contention: another request
                    cache.free(req)
                    continue
                assert served.valid_tokens == served.hit.num_tokens
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    cache.flush()
    assert cache.gpu.num_free == cache.gpu.num_blocks
    cache.gpu.check_invariants()
    cache.host.check_invariants()
    cache.close()


def connector_worker(device: str, host_blocks: int, disk: Path | None = None) -> ConnectorCache:
    """A worker's cache below 16 engine blocks of 2 layers on ``device`` (random bf16 KV),
    with a host pool of ``host_blocks`` and, with ``disk``, an LMDB tier of 4-block
    chunks; a waiting request's stage may take the whole pool."""
    kv = EngineKV([torch.randn(16, 2, 4, 2, 8).to(torch.bfloat16).to(device) for _ in range(2)])
    layout = engine_layout(kv, block_size=4, num_kv_heads=2, head_dim=8, kv_factor=2)
    tiers: dict = {"cpu": {"capacity": host_blocks * layout.block_nbytes, "stage_share": 1.0}}
    if disk is not None:
        tiers["disk"] = {"path": str(disk / "lmdb"), "capacity": "64MiB", "chunk_blocks": 4}
    return ConnectorCache(parse_config({"tiers": tiers}), kv, layout, "model", "rank0")


def engine_kv(cache: ConnectorCache, blocks: slice) -> list[torch.Tensor]:
    """A copy, on the CPU, of engine ``blocks`` of every layer."""
    return [layer[blocks].to("cpu", copy=True) for layer in cache.kv.layers]


def save_chain(cache: ConnectorCache, first: int) -> tuple[list[bytes], list[torch.Tensor]]:
    """Save engine blocks 0-7 as a chain of 8 blocks whose base keys start at ``first``,
    then overwrite them at once (the engine may reuse its blocks as soon as ``save``
    returns). Returns the chain's keys and the KV it saved."""
    keys = cache.keys([key.to_bytes(16, "little") for key in range(first, first + 8)])
    saved = engine_kv(cache, slice(0, 8))
    cache.save(list(range(8)), keys, cache.root, 0)
    for layer in cache.kv.layers:
        layer[:8].normal_()
    return keys, saved


def load_into_blocks_8_to_15(
    cache: ConnectorCache, keys: list[bytes], hit: ConnectorHit, asynchronous: bool
) -> None:
    """Pin and load ``hit`` (8 blocks) into engine blocks 8-15, then wait until
    ``finished_loads`` reports it over with no failed block."""
    assert cache.pin("r", keys, cache.root, hit, list(range(8, 16))) == 8
    cache.load("r", asynchronous)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        cache.wait_loads(timeout=1)
        finished = dict(cache.finished_loads())
        if "r" in finished:
            assert finished["r"] == []
            return
        time.sleep(0.001)  # an inline copy on CUDA: over once its event is
    raise AssertionError("the load was not over within 30 s")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["inline", "on a worker"])
def test_connector_blocks_saved_to_the_host_pool_load_bit_exact(
    device: str, asynchronous: bool
) -> None:
    cache = connector_worker(device, host_blocks=8)
    try:
        keys, saved = save_chain(cache, 0)
        load_into_blocks_8_to_15(cache, keys, ConnectorHit(0, host_blocks=8), asynchronous)
        assert all(map(torch.equal, engine_kv(cache, slice(8, 16)), saved))
    finally:
        cache.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("staged", [False, True], ids=["read by the load", "staged first"])
def test_connector_blocks_spilled_to_disk_load_bit_exact(
    device: str, staged: bool, tmp_path: Path
) -> None:
    cache = connector_worker(device, host_blocks=8, disk=tmp_path)
    try:
        keys, saved = save_chain(cache, 0)
        save_chain(cache, 100)  # evicts the first chain from the 8-block host pool
        cache.flush()
        assert cache.host.lookup(keys) == []
        runs = tuple(cache.spill.lookup(keys, 0))
        hit = ConnectorHit(0, spill={cache.shard: runs})
        assert hit.num_blocks == 8
        if staged:
            assert cache.stage("r", keys, cache.root, hit) == 8
            cache.wait_loads()
            cache.take_report()  # the stage is over: its blocks are host blocks
            cache.unstage("r")
            hit = ConnectorHit(0, host_blocks=len(cache.host.lookup(keys)))
        load_into_blocks_8_to_15(cache, keys, hit, asynchronous=False)
        assert all(map(torch.equal, engine_kv(cache, slice(8, 16)), saved))
        assert cache.pinned_slots == 0
    finally:
        cache.close()


@pytest.mark.skipif(NO_CUDA, reason="no CUDA device")
@pytest.mark.parametrize(
    ("min_runs", "stage_nbytes"),
    [(10**9, 64 << 20), (2, 64 << 20), (2, 3 * 128)],
    ids=["per run", "staged", "staged 3 blocks a piece"],
)
def test_copy_blocks_across_devices_moves_scattered_blocks_exactly(
    monkeypatch: pytest.MonkeyPatch, min_runs: int, stage_nbytes: int
) -> None:
    monkeypatch.setattr("kvtier.transfer._STAGE_MIN_RUNS", min_runs)
    monkeypatch.setattr("kvtier.transfer.STAGE_NBYTES", stage_nbytes)
    host = torch.randn(32, 2, 4, 8).to(torch.bfloat16).pin_memory()  # 128 B per block
    gpu = torch.randn(40, 2, 4, 8).to(torch.bfloat16).cuda()
    rng = random.Random(min_runs + stage_nbytes)
    slots, blocks = rng.sample(range(32), 20), rng.sample(range(40), 20)
    expected = gpu.cpu()
    expected[blocks] = host[slots]
    copy_blocks(host, slots, gpu, blocks, non_blocking=True)  # load
    assert torch.equal(gpu.cpu(), expected)
    gpu_before, host_before = gpu.clone(), host.clone()
    back = torch.zeros_like(host).pin_memory()
    copy_blocks(gpu, blocks, back, slots, non_blocking=True)  # offload
    torch.cuda.synchronize()
    assert torch.equal(back[slots], host_before[slots])
    assert torch.equal(gpu, gpu_before)


@pytest.mark.skipif(NO_CUDA, reason="no CUDA device")
def test_copy_blocks_to_a_destination_named_twice_keeps_the_last_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("kvtier.transfer._STAGE_MIN_RUNS", 2)  # the offload is staged
    host = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16)
    gpu = torch.zeros(8, 16, device="cuda")
    copy_blocks(host, [0, 5, 2, 7], gpu, [3, 1, 3, 6])
    assert torch.equal(gpu[3].cpu(), host[2]) and torch.equal(gpu[1].cpu(), host[5])
    back = torch.zeros(8, 16)
    copy_blocks(gpu, [1, 6, 3, 1], back, [4, 0, 4, 2])
    assert torch.equal(back[4], host[2]) and torch.equal(back[0], host[7])
