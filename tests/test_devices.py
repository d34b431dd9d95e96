"""The same round trips on every device there is: the GPU tier on the CPU here, and on
CUDA (pinned host slab, copy streams and events) where a CUDA device is present; in
native mode (``TieredCache``) and in connector mode (``ConnectorCache`` below an
engine's KV tensors)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from test_cache_host import make_cache, prompt
from test_relay import blocks_of, make_kv, relay

from kvtier.block_manager import StaleHitError
from kvtier.cache import TieredCache
from kvtier.config import parse_config
from kvtier.connector import (
    ConnectorCache,
    ConnectorHit,
    EngineKV,
    StatePiece,
    engine_blocks,
    engine_layout,
    state_keys,
)
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


def kv_layers(device: str, ratio: int = 1, kv_factor: int = 2) -> list[torch.Tensor]:
    """2 layers of random bf16 KV in 16 engine blocks of ``4 * ratio`` tokens on
    ``device``, as an attention kernel of 4-token blocks sees them: FlashInfer's
    ``[16 * ratio, 2, 4, 2, 8]`` (K and V after the kernel block), or with ``kv_factor``
    1 an MLA latent's ``[16 * ratio, 4, 32]`` (FlashMLA's)."""
    shape = (16 * ratio, 2, 4, 2, 8) if kv_factor == 2 else (16 * ratio, 4, 32)
    return [torch.randn(shape).to(torch.bfloat16).to(device) for _ in range(2)]


def connector_worker(
    device: str,
    host_blocks: int,
    disk: Path | None = None,
    layers: list[torch.Tensor] | None = None,
    kv_factor: int = 2,
    states: Sequence[torch.Tensor] = (),
    state_groups: Sequence[int] = (),
    windows: Sequence[tuple[torch.Tensor, int]] = (),
) -> ConnectorCache:
    """A worker's cache below the engine's KV tensors ``layers`` (``kv_layers(device)``
    by default) as 16 engine blocks, its recurrent ``states`` (layer i's blocks in
    state group ``state_groups[i]``) and ``windows`` (``EngineKV``'s), block 0 the
    engine's null block, with a host pool of ``host_blocks`` and, with ``disk``, an LMDB
    tier of 4-block chunks; a waiting request's stage may take the whole pool."""
    layers = kv_layers(device) if layers is None else layers
    blocks = [engine_blocks(t, 16) for t in layers]
    kv = EngineKV(blocks, (), 0, states, state_groups, windows)
    heads, head_dim = (2, 8) if kv_factor == 2 else (1, 32)
    block_size = 4 * len(layers[0]) // 16
    layout = engine_layout(kv, block_size, heads, head_dim, kv_factor)
    tiers: dict = {"cpu": {"capacity": host_blocks * layout.block_nbytes, "stage_share": 1.0}}
    if disk is not None:
        tiers["disk"] = {"path": str(disk / "lmdb"), "capacity": "64MiB", "chunk_blocks": 4}
    return ConnectorCache(parse_config({"tiers": tiers}), kv, layout, "model", "rank0")


def cpu_copies(tensors: list[torch.Tensor], index: slice | int) -> list[torch.Tensor]:
    """A copy, on the CPU, of ``index`` of each of ``tensors``."""
    return [t[index].to("cpu", copy=True) for t in tensors]


def engine_kv(cache: ConnectorCache, blocks: slice) -> list[torch.Tensor]:
    """A copy, on the CPU, of engine ``blocks`` of every layer."""
    return cpu_copies(cache.kv.layers, blocks)


def save_chain(
    cache: ConnectorCache, first: int, pieces: Sequence[StatePiece] = ()
) -> tuple[list[bytes], list[torch.Tensor]]:
    """Save engine blocks 0-7 as a chain of 8 blocks whose base keys start at ``first``
    (and the state after its last position as ``pieces``, keyed by ``state_keys``),
    then overwrite them at once (the engine may reuse its blocks as soon as ``save``
    returns). Returns the keys saved and the KV of blocks 0-7."""
    base = [key.to_bytes(16, "little") for key in range(first, first + 8)]
    base += state_keys(base[-1], len(pieces), parse_config({}).hashing.algorithm)
    keys = cache.keys(base)
    saved = engine_kv(cache, slice(0, 8))
    cache.save([*range(8), *pieces], keys, cache.root, 0)
    for layer in cache.kv.layers:
        layer[:8].normal_()
    return keys, saved


def load_into_blocks_8_to_15(
    cache: ConnectorCache,
    keys: list[bytes],
    hit: ConnectorHit,
    asynchronous: bool,
    pieces: Sequence[StatePiece] = (),
) -> None:
    """Pin and load ``hit`` (8 blocks, then a state's ``pieces``) into engine blocks 8-15
    (and ``pieces``), then wait until ``finished_loads`` reports it over with no failed
    block."""
    blocks = [*range(8, 16), *pieces]
    assert cache.pin("r", keys, cache.root, hit, blocks) == len(blocks)
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("ratio", "kv_factor"),
    [(1, 2), (2, 2), (4, 2), (4, 1)],
    ids=["FlashInfer ratio 1", "FlashInfer ratio 2", "FlashInfer ratio 4", "FlashMLA ratio 4"],
)
def test_kernel_block_views_load_whole_engine_blocks_bit_exact(
    device: str, ratio: int, kv_factor: int
) -> None:
    layers = kv_layers(device, ratio, kv_factor)
    cache = connector_worker(device, host_blocks=8, layers=layers, kv_factor=kv_factor)
    try:
        assert cache.layout.block_size == 4 * ratio
        saved = cpu_copies(layers, slice(0, 8 * ratio))  # engine blocks 0-7
        keys, _ = save_chain(cache, 0)
        overwritten = cpu_copies(layers, slice(0, 8 * ratio))
        load_into_blocks_8_to_15(cache, keys, ConnectorHit(0, host_blocks=8), asynchronous=False)
        # Engine blocks 8-15 are kernel blocks 8 * ratio to 16 * ratio - 1.
        assert all(map(torch.equal, cpu_copies(layers, slice(8 * ratio, None)), saved))
        assert all(map(torch.equal, cpu_copies(layers, slice(0, 8 * ratio)), overwritten))
    finally:
        cache.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_recurrent_states_pieces_load_bit_exact_into_other_state_blocks(device: str) -> None:
    # 3 state layers of 200 B in 2 Mamba groups, views of one int8 buffer as vLLM
    # allocates them; host slots of 2 layers x 256 B: layers 0 and 1 are piece 0, layer
    # 2 piece 1.
    states = list(torch.randint(-128, 128, (3, 16, 1, 1, 200), dtype=torch.int8).to(device))
    cache = connector_worker(device, host_blocks=10, states=states, state_groups=[0, 0, 1])
    try:
        assert cache.kv.num_pieces == 2
        # The state after position 7 is in blocks 3 (group 0) and 4 (group 1); it loads
        # into blocks 9 and 12.
        saved_ids, loaded_ids = (3, 3, 4), (9, 9, 12)
        pieces = [StatePiece((3, 4), j) for j in range(cache.kv.num_pieces)]
        saved_states = [s[b].to("cpu", copy=True) for s, b in zip(states, saved_ids)]
        keys, saved = save_chain(cache, 0, pieces)
        for s in states:
            s.random_(-128, 128)
        before = cpu_copies(states, slice(None))
        overwritten = engine_kv(cache, slice(0, 8))
        hit = ConnectorHit(0, host_blocks=10, pieces=2)
        loaded = [StatePiece((9, 12), j) for j in range(cache.kv.num_pieces)]
        load_into_blocks_8_to_15(cache, keys, hit, asynchronous=False, pieces=loaded)
        assert all(map(torch.equal, engine_kv(cache, slice(8, 16)), saved))
        assert all(map(torch.equal, engine_kv(cache, slice(0, 8)), overwritten))
        for s, b, state, old in zip(states, loaded_ids, saved_states, before):
            assert torch.equal(s[b].cpu(), state)
            untouched = [i for i in range(16) if i != b]
            assert torch.equal(s[untouched].cpu(), old[untouched])
    finally:
        cache.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_windows_pieces_load_bit_exact_around_the_null_block(device: str) -> None:
    # A sliding-window layer kept as a state: its 2 blocks before a position, a layer
    # block each, in a host slot of 2 layers: one piece.
    window = kv_layers(device)[0]
    cache = connector_worker(device, host_blocks=9, windows=[(window, 0), (window, 1)])
    try:
        assert cache.kv.num_pieces == 1
        # The window before position 7 is in blocks 6 and 7; it loads into block 13
        # alone: the engine holds the other block itself (the null block in its place).
        saved_window = window[7].to("cpu", copy=True)
        keys, saved = save_chain(cache, 0, [StatePiece((6, 7), 0)])
        window.normal_()
        before = window.to("cpu", copy=True)
        hit = ConnectorHit(0, host_blocks=9, pieces=1)
        loaded = [StatePiece((0, 13), 0)]
        load_into_blocks_8_to_15(cache, keys, hit, asynchronous=False, pieces=loaded)
        assert all(map(torch.equal, engine_kv(cache, slice(8, 16)), saved))
        assert torch.equal(window[13].cpu(), saved_window)
        untouched = [i for i in range(16) if i != 13]
        assert torch.equal(window[untouched].cpu(), before[untouched])
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


@pytest.mark.parametrize("device", DEVICES)
def test_a_relay_between_two_ranks_on_the_device_moves_the_holders_blocks_bit_exact(
    device: str,
) -> None:
    holder, other = make_kv(True, device), make_kv(False, device)
    loads = ([[0, 1, 2], [5]], [[4, 6, 7], [3]])
    assert relay((holder, other), loads, [3, 1])[:2] == ([3, 1], [3, 1])
    for got, want in zip(blocks_of(other, [4, 6, 7, 3]), blocks_of(holder, [0, 1, 2, 5])):
        assert torch.equal(got, want)
