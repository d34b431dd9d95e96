"""KVTierConnector's two halves driven step by step, as vLLM's processes call them.

One scheduler-side connector and one worker-side connector per shard (tensor-parallel
rank) are built from real ``VllmConfig`` objects over the tiny model, as vLLM builds
them in separate processes. Nothing passes between them but what vLLM itself passes:
the start-up handshake, the per-step ``KVTierMetadata`` and the worker's
``KVConnectorOutput``. Requests, block tables and scheduler output are small
stand-ins carrying only the fields the connector reads. Each test can thus place a hook
call exactly where a real engine, or a fault, would put it.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("vllm")
from redis_servers import LOCAL_URL, delete_prefix, unique_prefix, wait_until  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402

from kvtier.connector import ConnectorCache, ConnectorIndex  # noqa: E402
from kvtier.integrations import vllm as kvtier_vllm  # noqa: E402
from kvtier.integrations.vllm import KVTierConnector  # noqa: E402
from kvtier.integrations.vllm_layout import UnsupportedKVCache  # noqa: E402
from kvtier.integrations.vllm_metrics import (  # noqa: E402
    PINNED,
    RELAYED,
    SCHEDULER_HOOKS,
    STATS_HOOK,
    WORKER_HOOKS,
)
from kvtier.tiers.lmdb import LMDBTier  # noqa: E402
from kvtier.transfer import TransferEngine  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK = 32
NUM_BLOCKS = 16
LAYERS = 2
KV_HEADS = 2  # the tiny model's; each of TP ranks holds KV_HEADS // TP of them


def _vllm_config(
    model: str, kvtier: dict, tp: int = 1, rank: int = 0, on_load_failure: str = "recompute"
) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=model, dtype="bfloat16"),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, rank=rank),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy=on_load_failure,
            kv_connector_extra_config={"kvtier": kvtier},
        ),
    )


@dataclass
class Request:
    """The fields of vLLM's ``Request`` the connector reads."""

    request_id: str
    block_hashes: list[bytes]
    num_tokens: int
    num_computed_tokens: int = 0
    num_prompt_tokens: int = 0  # 0: all of num_tokens

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or self.num_tokens


@dataclass
class Blocks:
    """vLLM's ``KVCacheBlocks`` / the cache manager's block table: one group's, or a
    table per group."""

    ids: list[int] | tuple[list[int], ...]

    def get_block_ids(self, req_id: str | None = None) -> tuple[list[int], ...]:
        return self.ids if isinstance(self.ids, tuple) else (self.ids,)


@dataclass
class BlockState:
    """vLLM's ``KVConnectorBlockState``: the states it committed this step, by request:
    (group, block, tokens before the state)."""

    boundary_state_offloads: dict[str, list[tuple[int, int, int]]]


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    kv_connector_block_state: BlockState | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


MLA_LATENT = 576  # DeepSeek's compressed KV and rope key: one "head", alike on every rank


WINDOW = 2 * BLOCK  # of the sliding-window layer of a hybrid (``window=True``)
STATE_BYTES = 6000  # of the state layer of a hybrid (``state=True``), over all TP ranks


def _kv_cache_config(
    tp: int = 1, mla: bool = False, window: bool = False, state: bool = False
) -> KVCacheConfig:
    """vLLM's ``KVCacheConfig`` of the tiny model on one of ``tp`` ranks; with ``mla`` as
    an MLA model's: every rank holds the same latent (vLLM's ``kv_tp_replicas``); with
    ``window`` or ``state`` as a hybrid's under vLLM's hybrid KV cache manager: layer 0
    full attention, layer 1 a sliding window of ``WINDOW`` tokens or a Mamba layer's
    state (``STATE_BYTES`` split over the ranks), each group with its own block table."""
    if mla:
        spec = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=MLA_LATENT, dtype=torch.bfloat16
        )
        return KVCacheConfig(
            NUM_BLOCKS, [], [KVCacheGroupSpec(LAYER_NAMES, spec)], kv_tp_replicas=tp
        )
    page = {"block_size": BLOCK, "num_kv_heads": KV_HEADS // tp, "head_size": 32}
    spec = FullAttentionSpec(**page, dtype=torch.bfloat16)
    if window or state:
        other = (
            SlidingWindowSpec(**page, dtype=torch.bfloat16, sliding_window=WINDOW)
            if window
            else MambaSpec(BLOCK, ((STATE_BYTES // tp,),), (torch.int8,), mamba_cache_mode="align")
        )
        groups = [
            KVCacheGroupSpec(LAYER_NAMES[:1], spec),
            KVCacheGroupSpec(LAYER_NAMES[1:], other),
        ]
        return KVCacheConfig(NUM_BLOCKS, [], groups)
    return KVCacheConfig(NUM_BLOCKS, [], [KVCacheGroupSpec(LAYER_NAMES, spec)])


def _kv_caches(tp: int, mla: bool, state: bool) -> dict[str, torch.Tensor]:
    """A worker's KV tensors as vLLM's CPU backends view them: ``[blocks, kv_heads,
    block_size, 2 * head_size]`` of random KV, or MLA's ``[blocks, 1, block_size,
    latent]``, the same on every rank; with ``state``, layer 1 a Mamba layer's random
    state bytes."""
    if mla:
        seeds = [torch.Generator().manual_seed(i) for i in range(LAYERS)]
        shape = (NUM_BLOCKS, 1, BLOCK, MLA_LATENT)
        return {
            name: torch.randn(shape, generator=g).to(torch.bfloat16)
            for name, g in zip(LAYER_NAMES, seeds)
        }
    shape = (NUM_BLOCKS, KV_HEADS // tp, BLOCK, 64)
    kv = {name: torch.randn(shape, dtype=torch.bfloat16) for name in LAYER_NAMES}
    if state:
        shape = (NUM_BLOCKS, 1, 1, STATE_BYTES // tp)
        kv[LAYER_NAMES[1]] = torch.randint(-128, 128, shape).to(torch.int8)
    return kv


def _gloo_groups(size: int) -> list[tuple[dist.ProcessGroup, dist.ProcessGroup]]:
    """A tensor-parallel group of ``size`` ranks in this process, as vLLM's ``tp_groups``
    gives each rank: (its device group, its CPU group), both gloo on the CPU."""
    store = dist.HashStore()

    def rank_groups(rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        return tuple(
            dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, timedelta(seconds=60))
            for name in ("device", "cpu")
        )

    with ThreadPoolExecutor(size) as pool:  # each rank's construction waits for the others
        return list(pool.map(rank_groups, range(size)))


class Engine:
    """A scheduler-side connector and ``tp`` worker-side ones, wired as vLLM wires them.
    With ``mla`` at ``tp`` > 1 the workers' hooks run side by side, one thread per rank,
    as vLLM's worker processes do: every rank takes part in its group's relays."""

    def __init__(
        self,
        model: str,
        kvtier: dict,
        tp: int = 1,
        mla: bool = False,
        window: bool = False,
        state: bool = False,
    ) -> None:
        kv_cache_config = _kv_cache_config(tp, mla, window, state)
        self.workers = []  # first, as vLLM registers the KV caches before the scheduler
        self.registered: list[dict[str, torch.Tensor]] = []  # each worker's KV tensors
        self.groups = _gloo_groups(tp) if mla and tp > 1 else None
        for rank in range(tp):
            worker = KVTierConnector(
                _vllm_config(model, kvtier, tp, rank), KVConnectorRole.WORKER, kv_cache_config
            )
            self.registered.append(_kv_caches(tp, mla, state))
            groups = self.groups[rank] if self.groups else None
            with patch.object(kvtier_vllm, "tp_groups", lambda groups=groups: groups):
                worker.register_kv_caches(self.registered[-1])
            self.workers.append(worker)
        self.scheduler = KVTierConnector(
            _vllm_config(model, kvtier, tp), KVConnectorRole.SCHEDULER, kv_cache_config
        )
        self.scheduler.set_xfer_handshake_metadata_pp_aware(
            {(0, r): w.get_handshake_metadata() for r, w in enumerate(self.workers)}
        )
        self.tables: dict[str, Blocks] = {}
        self.scheduler._kv_cache_manager = self  # get_block_ids, as vLLM's manager
        # vLLM's own merge of the workers' outputs: a load is over once every rank has
        # reported it, in whichever steps they did.
        self.aggregator = KVOutputAggregator(tp)
        self.failed: set[str] = set()  # requests whose load failed, as vLLM was told
        self.freed: set[str] = set()  # finished requests whose blocks vLLM held, then freed

    def get_block_ids(self, req_id: str) -> tuple[list[int]]:
        return self.tables[req_id].get_block_ids()

    def arrive(self, request: Request) -> None:
        """A request arrives and waits: vLLM has no room to schedule it this step."""
        self.scheduler.on_new_request(request)
        self.step({})

    def admit(
        self, request: Request, table: list[int] | tuple[list[int], ...], new: bool = True
    ) -> tuple[int, bool]:
        """Scheduling of a ``new`` request (else one that ``arrive``d) with vLLM's own
        hit of ``num_computed_tokens``: lookup, allocation of ``table``, and what vLLM
        was told."""
        if new:
            self.scheduler.on_new_request(request)
        n, asynchronous = self.scheduler.get_num_new_matched_tokens(
            request, request.num_computed_tokens
        )
        self.tables[request.request_id] = Blocks(table)
        self.scheduler.update_state_after_alloc(request, Blocks(table), n)
        request.num_computed_tokens += n
        return n, asynchronous

    def step(
        self, scheduled: dict[str, int], states: dict[str, list[tuple[int, int, int]]] | None = None
    ) -> tuple[set[str], set[int]]:
        """One engine step (committing ``states``, as vLLM's ``boundary_state_offloads``):
        metadata to every worker, their hooks around the forward, their outputs merged by
        vLLM's aggregator; returns (loads over on every rank, failed blocks), and keeps
        the requests whose load failed in ``failed``."""
        block_state = BlockState(states) if states else None
        meta = self.scheduler.build_connector_meta(SchedulerOutput(scheduled, block_state))

        def run(worker: KVTierConnector) -> ModelRunnerOutput:
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            worker.wait_for_save()
            results = worker.get_transfer_results(set())
            output = KVConnectorOutput(
                finished_recving=results.finished_recving,
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                failed_recving=results.failed_recving,
                finished_sending=results.finished_sending,
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
            )
            worker.clear_connector_metadata()
            return ModelRunnerOutput([], {}, kv_connector_output=output)

        if self.groups:
            with ThreadPoolExecutor(len(self.workers)) as pool:
                outputs = list(pool.map(run, self.workers))
        else:
            outputs = [run(worker) for worker in self.workers]
        output = self.aggregator.aggregate(outputs).kv_connector_output
        self.scheduler.update_connector_output(output)
        self.failed |= output.failed_recving
        self.freed |= output.finished_sending or set()
        return output.finished_recving or set(), output.invalid_block_ids

    def run_another(self) -> None:
        """A request of one block computes in a step: the next lookups find another
        request running."""
        self.admit(_request("other", _hashes(99, 1)), [14, 15])
        self.step({"other": BLOCK + 1})

    def serve(self, request: Request, table: list[int] | tuple[list[int], ...]) -> tuple[int, bool]:
        """Admit ``request``, run the step that computes (and saves) its prompt, and
        finish it there."""
        n, asynchronous = self.admit(request, table)
        if asynchronous:
            self.load()
        self.step({request.request_id: request.num_tokens - request.num_computed_tokens})
        request.num_computed_tokens = request.num_tokens
        self.scheduler.request_finished(request, table)
        return n, asynchronous

    def load(self) -> tuple[set[str], set[int]]:
        """Steps while async loads run: the one that starts them, then one after they
        are over; returns (loads over, failed blocks) of both."""
        done, errors = self.step({})
        for w in self.workers:
            if w._cache is not None:  # else a rank whose loads its group's holder relays
                w.cache.wait_loads()
        more_done, more_errors = self.step({})
        return done | more_done, errors | more_errors

    def kv(self, rank: int, ids: list[int]) -> list[torch.Tensor]:
        return [self.registered[rank][name][ids].clone() for name in LAYER_NAMES]

    def close(self) -> None:
        for connector in [*self.workers, self.scheduler]:
            connector.shutdown()


def _hashes(chain: int, n: int) -> list[bytes]:
    return [bytes([chain, i]) * 16 for i in range(n)]


def _request(req_id: str, hashes: list[bytes], computed: int = 0) -> Request:
    """A prompt of ``len(hashes)`` full blocks and one more token."""
    return Request(req_id, hashes, len(hashes) * BLOCK + 1, computed)


def _host_only(host: str = "1MiB") -> dict:
    return {"tiers": {"cpu": {"capacity": host}}}


def _disk(tmp_path: Path, host: str = "1MiB", **cpu: object) -> dict:
    return {
        "tiers": {
            "cpu": {"capacity": host, **cpu},
            "disk": {"path": str(tmp_path / "lmdb"), "capacity": "64MiB", "chunk_blocks": 2,
                     "write_policy": "write_through"},
        }
    }  # fmt: skip


def _redis(prefix: str) -> dict:
    """A host pool over the local Redis server (shards of one process can share it;
    an LMDB store opens once per process, as each TP rank's process does)."""
    return {
        "tiers": {
            "cpu": {"capacity": "1MiB", "stage_share": 0.5},
            "redis": {"url": LOCAL_URL, "key_prefix": prefix, "chunk_blocks": 2},
        }
    }


@pytest.fixture
def redis_prefix(real_client):
    prefix = unique_prefix("kvtier-roles")
    yield prefix
    delete_prefix(real_client, prefix)


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(model: str, kvtier: dict, **options: int | bool) -> Engine:
        """An ``Engine`` (its ``options``: tp, mla, window, state), closed after the test."""
        made.append(Engine(model, kvtier, **options))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def test_the_scheduler_finds_what_the_worker_reported_saving(tiny_model, engines):
    engine = engines(tiny_model, _host_only())
    chain = _hashes(1, 4)
    engine.serve(_request("a", chain), [0, 1, 2, 3, 4])
    saved = engine.kv(0, [0, 1, 2, 3])

    n, asynchronous = engine.serve(_request("b", chain), [8, 9, 10, 11, 12])
    assert (n, asynchronous) == (4 * BLOCK, False)  # host hits load before the forward
    for got, want in zip(engine.kv(0, [8, 9, 10, 11]), saved, strict=True):
        assert torch.equal(got, want)


def test_a_host_hit_loads_asynchronously_while_another_request_runs(tiny_model, engines):
    engine = engines(tiny_model, _host_only())
    chain = _hashes(1, 4)
    engine.serve(_request("a", chain), [0, 1, 2, 3, 4])
    saved = engine.kv(0, [0, 1, 2, 3])
    engine.run_another()

    n, asynchronous = engine.admit(_request("b", chain), [8, 9, 10, 11, 12])
    assert (n, asynchronous) == (4 * BLOCK, True)  # copied while "other" computes
    assert engine.load() == ({"b"}, set())
    for got, want in zip(engine.kv(0, [8, 9, 10, 11]), saved, strict=True):
        assert torch.equal(got, want)


def _count_lookups(engine: Engine, monkeypatch) -> list[bytes]:
    """The first base key of each lookup the scheduler's index makes from now on."""
    made: list[bytes] = []
    index = engine.scheduler.index
    lookup = index.lookup
    monkeypatch.setattr(index, "lookup", lambda keys, *a: made.append(keys[0]) or lookup(keys, *a))
    return made


def _lookups_made_over_three_asks(engine: Engine, monkeypatch) -> int:
    """How many lookups the scheduler's index makes while vLLM asks three times, in
    three steps, for a request it cannot schedule."""
    made = _count_lookups(engine, monkeypatch)
    request = _request("r", _hashes(5, 4))
    engine.scheduler.on_new_request(request)
    for _ in range(3):
        engine.scheduler.get_num_new_matched_tokens(request, 0)
    return len(made)


def test_a_waiting_requests_lookup_answers_vllms_asks_in_later_steps(
    tiny_model, engines, tmp_path, monkeypatch
):
    engine = engines(tiny_model, _disk(tmp_path))
    assert _lookups_made_over_three_asks(engine, monkeypatch) == 1


def test_a_lookup_older_than_the_reuse_period_is_made_again(
    tiny_model, engines, tmp_path, monkeypatch
):
    engine = engines(tiny_model, _disk(tmp_path))
    monkeypatch.setattr(kvtier_vllm, "LOOKUP_REUSE", 0.0)
    assert _lookups_made_over_three_asks(engine, monkeypatch) == 3


def test_vllms_own_hit_is_not_looked_up_again(tiny_model, engines):
    engine = engines(tiny_model, _host_only())
    chain = _hashes(1, 4)
    engine.serve(_request("a", chain), [0, 1, 2, 3, 4])
    n, _ = engine.admit(_request("b", chain, computed=3 * BLOCK), [0, 1, 2, 5, 6])
    assert n == BLOCK


def test_a_spill_hit_with_no_request_running_is_read_before_the_step_computes(
    tiny_model, engines, tmp_path
):
    chain = _hashes(2, 4)
    saved = _on_disk(tiny_model, engines, _disk(tmp_path), chain)
    reader = engines(tiny_model, _disk(tmp_path))  # a restart: empty host pool
    n, asynchronous = reader.admit(_request("r", chain), [5, 6, 7, 8, 9])
    assert (n, asynchronous) == (4 * BLOCK, False)
    assert reader.step({"r": 1}) == (set(), set())  # computes in the step that loads it
    for got, want in zip(reader.kv(0, [5, 6, 7, 8]), saved, strict=True):
        assert torch.equal(got, want)


def test_a_spill_hit_loads_asynchronously_while_another_request_runs(tiny_model, engines, tmp_path):
    chain = _hashes(2, 4)
    saved = _on_disk(tiny_model, engines, _disk(tmp_path), chain)
    reader = engines(tiny_model, _disk(tmp_path))
    reader.run_another()
    n, asynchronous = reader.admit(_request("r", chain), [5, 6, 7, 8, 9])
    assert (n, asynchronous) == (4 * BLOCK, True)
    assert reader.load() == ({"r"}, set())
    for got, want in zip(reader.kv(0, [5, 6, 7, 8]), saved, strict=True):
        assert torch.equal(got, want)


def test_a_prefix_evicted_while_its_spill_write_is_queued_is_still_a_hit(
    tiny_model, engines, tmp_path, monkeypatch
):
    landed = threading.Event()
    put_many = LMDBTier.put_many

    def slow_put_many(self, *args, **kwargs):
        landed.wait(30)
        return put_many(self, *args, **kwargs)

    monkeypatch.setattr(LMDBTier, "put_many", slow_put_many)
    engine = engines(tiny_model, _disk(tmp_path, host="64KiB"))  # 4 blocks
    try:
        # The encoder thread encodes write-through chunks from pinned host slots: let it
        # finish after each request, so that its pins neither keep "a" in the host pool
        # nor leave the load without staging slots.
        encoder = engine.workers[0].cache.spill._encoder
        chain = _hashes(9, 4)
        engine.serve(_request("a", chain), [0, 1, 2, 3, 4])
        saved = engine.kv(0, [0, 1, 2, 3])
        encoder.submit(lambda: None).result()
        engine.serve(_request("other", _hashes(10, 4)), [5, 6, 7, 8, 9])  # evicts "a"
        encoder.submit(lambda: None).result()
        engine.step({})  # the report of what "other" queued reaches the index

        n, _ = engine.admit(_request("b", chain), [10, 11, 12, 13, 14])
        assert n == 4 * BLOCK
        assert engine.step({"b": 1}) == (set(), set())  # read from the worker's write queue
        for got, want in zip(engine.kv(0, [10, 11, 12, 13]), saved, strict=True):
            assert torch.equal(got, want)
    finally:
        landed.set()


def test_a_request_whose_load_failed_is_not_offered_another(
    tiny_model, engines, tmp_path, monkeypatch
):
    writer = engines(tiny_model, _disk(tmp_path))
    chain = _hashes(11, 4)
    writer.serve(_request("w", chain), [0, 1, 2, 3, 4])
    writer.close()
    reader = engines(tiny_model, _disk(tmp_path))
    request = _request("r", chain)
    assert reader.admit(request, [5, 6, 7, 8, 9])[0] == 4 * BLOCK
    monkeypatch.setattr(LMDBTier, "get_many", _raise)  # reads fail; sizes still answer
    assert reader.step({"r": 1}) == (set(), {5, 6, 7, 8})

    request.num_computed_tokens = 0  # vLLM takes the request back to its valid prefix
    assert reader.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)


def test_blocks_evicted_since_the_last_report_and_held_nowhere_below_are_load_errors(
    tiny_model, engines
):
    engine = engines(tiny_model, _host_only())
    chain = _hashes(3, 2)
    engine.serve(_request("a", chain), [0, 1, 2])
    n, _ = engine.admit(_request("b", chain), [3, 4, 5])
    assert n == 2 * BLOCK
    engine.workers[0].cache.reset()  # gone from the host pool before the load starts
    _, errors = engine.step({"b": 1})
    assert errors == {3, 4}


def test_blocks_evicted_since_the_last_report_load_from_the_spill_tier_that_holds_them(
    tiny_model, engines, tmp_path
):
    engine = engines(tiny_model, _disk(tmp_path))
    chain = _hashes(39, 4)
    engine.serve(_request("a", chain), [0, 1, 2, 3, 4])
    saved = engine.kv(0, [0, 1, 2, 3])
    cache = engine.workers[0].cache
    cache.flush()  # written through to disk
    assert engine.admit(_request("b", chain), [5, 6, 7, 8, 9]) == (4 * BLOCK, False)  # host
    cache.reset()  # gone from the host pool before the load starts
    assert engine.step({"b": 1}) == (set(), set())
    for got, want in zip(engine.kv(0, [5, 6, 7, 8]), saved, strict=True):
        assert torch.equal(got, want)


def test_shards_store_under_keys_of_their_own(tiny_model, engines, tmp_path):
    one = engines(tiny_model, _host_only())
    two = engines(tiny_model, _host_only(), tp=2)
    base = one.scheduler.index.keys(_hashes(4, 1))
    keys = {w.cache.shard: w.cache.keys(base)[0] for engine in (one, two) for w in engine.workers}
    assert set(keys) == {"tp0/1 pp0/1", "tp0/2 pp0/1", "tp1/2 pp0/1"}
    assert len(set(keys.values())) == 3


def test_a_hit_counts_only_the_blocks_every_shard_can_load(tiny_model, engines, redis_prefix):
    writer = engines(tiny_model, _redis(redis_prefix), tp=2)
    chain = _hashes(5, 4)
    writer.serve(_request("w", chain), [0, 1, 2, 3, 4])
    saved = [writer.kv(rank, [0, 1]) for rank in (0, 1)]
    for w in writer.workers:
        w.cache.flush()
    rank1 = writer.workers[1].cache  # loses its value of the second chunk (blocks 2-3)
    rank1.spill.tiers[0].delete_many(rank1.keys(writer.scheduler.index.keys(chain[3:])))
    writer.close()

    reader = engines(tiny_model, _redis(redis_prefix), tp=2)  # a restart
    assert reader.admit(_request("r", chain), [5, 6, 7, 8, 9])[0] == 2 * BLOCK  # the chunk
    assert reader.step({"r": 1}) == (set(), set())  # both ranks hold
    for rank in (0, 1):
        for got, want in zip(reader.kv(rank, [5, 6]), saved[rank], strict=True):
            assert torch.equal(got, want)


def test_reset_cache_leaves_nothing_stored_before_it_to_be_found(tiny_model, engines, tmp_path):
    engine = engines(tiny_model, _disk(tmp_path))
    chain = _hashes(6, 2)
    engine.serve(_request("old", chain), [0, 1, 2])
    assert engine.admit(_request("probe", chain), [3, 4, 5])[0] == 2 * BLOCK
    engine.step({})

    assert engine.scheduler.reset_cache()
    engine.step({})  # the workers drop their host pools
    assert engine.admit(_request("after", chain), [6, 7, 8])[0] == 0
    assert len(engine.workers[0].cache.host.lookup(engine.workers[0].cache.keys(
        engine.scheduler.index.keys(chain)))) == 0  # fmt: skip


def test_a_reset_keeps_what_was_stored_where_resets_keep_the_weights(tiny_model, engines, tmp_path):
    config = {**_disk(tmp_path), "hashing": {"on_engine_reset": "keep"}}
    engine = engines(tiny_model, config)
    chain = _hashes(7, 2)
    engine.serve(_request("old", chain), [0, 1, 2])

    assert engine.scheduler.reset_cache()  # vLLM's sleep
    engine.step({})
    assert engine.admit(_request("after", chain), [6, 7, 8]) == (2 * BLOCK, False)


class Boom(RuntimeError):
    pass


def _raise(*args: object, **kwargs: object) -> None:
    raise Boom("injected")


@pytest.mark.parametrize(
    ("target", "method"),
    [
        (ConnectorIndex, "lookup"),
        (ConnectorIndex, "keys"),
        (ConnectorIndex, "apply"),
        (ConnectorCache, "pin"),
        (ConnectorCache, "load"),
        (ConnectorCache, "save"),
        (ConnectorCache, "finished_loads"),
        (ConnectorCache, "take_report"),
    ],
)
@pytest.mark.parametrize("others_run", [False, True], ids=["sync", "async"])
def test_a_failure_in_any_hook_is_a_miss_or_a_load_error_never_an_exception(
    tiny_model, engines, tmp_path, monkeypatch, target, method, others_run
):
    chain = _hashes(7, 4)
    saved = _on_disk(tiny_model, engines, _disk(tmp_path), chain)
    engine = engines(tiny_model, _disk(tmp_path))  # the hit is on disk
    if others_run:
        engine.run_another()
    monkeypatch.setattr(target, method, _raise)

    n, asynchronous = engine.admit(_request("r", chain), [5, 6, 7, 8, 9])
    done, errors = engine.load()
    if asynchronous:
        assert done == {"r"}  # an async load always ends
    assert len(errors) <= n // BLOCK  # only promised blocks can fail
    loaded = n // BLOCK - len(errors)
    for got, want in zip(engine.kv(0, [5, 6, 7, 8][:loaded]), saved, strict=True):
        assert torch.equal(got, want[:loaded])
    engine.serve(_request("next", _hashes(8, 2)), [10, 11, 12])  # and it goes on serving
    assert sum(engine.scheduler.faults.values()) + sum(engine.workers[0].faults.values()) > 0


def test_vllm_failing_requests_on_a_load_error_is_warned_about(
    tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="kvtier.integrations.vllm"):
        KVTierConnector(
            _vllm_config(tiny_model, _host_only()), KVConnectorRole.SCHEDULER, _kv_cache_config()
        ).shutdown()
        assert "kv_load_failure_policy" not in caplog.text
        KVTierConnector(
            _vllm_config(tiny_model, _host_only(), on_load_failure="fail"),
            KVConnectorRole.SCHEDULER,
            _kv_cache_config(),
        ).shutdown()
    assert "kv_load_failure_policy is 'fail'" in caplog.text


@pytest.mark.parametrize("role", list(KVConnectorRole), ids=lambda role: role.name.lower())
def test_a_model_kvtier_cannot_hold_is_refused_as_either_half_is_built(
    tiny_model: str, role: KVConnectorRole
) -> None:
    state = MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.bfloat16,))
    config = KVCacheConfig(NUM_BLOCKS, [], [KVCacheGroupSpec(LAYER_NAMES, state)])
    with pytest.raises(UnsupportedKVCache, match="^kvtier caches Mamba and linear-attention"):
        KVTierConnector(_vllm_config(tiny_model, _host_only()), role, config)


def test_each_hook_reports_its_calls_and_the_time_spent_in_it(tiny_model, engines):
    engine = engines(tiny_model, _host_only())
    engine.serve(_request("a", _hashes(1, 4)), [0, 1, 2, 3, 4])  # one request, one step, over

    for connector, hooks in (
        (engine.scheduler, SCHEDULER_HOOKS),
        (engine.workers[0], WORKER_HOOKS),
    ):
        stats = connector.get_kv_connector_stats().data
        called = {hook: stats.get(f"hook.{hook}.calls", 0) for hook in hooks}
        assert called == dict.fromkeys(hooks, 1)
        assert sum(stats.get(f"hook.{hook}.us", 0) for hook in hooks) > 0


def test_the_stats_hook_reports_its_own_calls_from_the_next_one(tiny_model, engines, monkeypatch):
    monkeypatch.setattr(kvtier_vllm, "HOOK_REPORT_PERIOD", 0.0)
    engine = engines(tiny_model, _host_only())
    engine.serve(_request("a", _hashes(1, 4)), [0, 1, 2, 3, 4])

    for connector in (engine.scheduler, engine.workers[0]):
        first = connector.get_kv_connector_stats().data
        second = connector.get_kv_connector_stats().data
        assert f"hook.{STATS_HOOK}.calls" not in first
        assert second[f"hook.{STATS_HOOK}.calls"] == 1


def test_each_tiers_counters_are_handed_to_vllm_as_their_gain_since_the_last_step(
    tiny_model, engines
):
    engine = engines(tiny_model, _host_only())
    worker = engine.workers[0]
    engine.serve(_request("a", _hashes(1, 4)), [0, 1, 2, 3, 4])
    assert worker.get_kv_connector_stats().data["cpu.blocks_in"] == 4

    engine.serve(_request("b", _hashes(2, 2)), [5, 6, 7])
    step = worker.get_kv_connector_stats().data

    assert step["cpu.blocks_in"] == 2
    assert "cpu.blocks_out" not in step  # no counter that did not move


def test_hook_costs_are_handed_to_vllm_at_most_once_a_period(tiny_model, engines, monkeypatch):
    monkeypatch.setattr(kvtier_vllm, "HOOK_REPORT_PERIOD", 3600.0)
    engine = engines(tiny_model, _host_only())
    worker = engine.workers[0]
    engine.serve(_request("a", _hashes(1, 4)), [0, 1, 2, 3, 4])
    assert worker.get_kv_connector_stats().data["hook.wait_for_save.calls"] == 1

    engine.step({})  # hooks run, no other counter moves

    assert worker.get_kv_connector_stats() is None
    monkeypatch.setattr(kvtier_vllm, "HOOK_REPORT_PERIOD", 0.0)  # the period is over
    assert worker.get_kv_connector_stats().data["hook.wait_for_save.calls"] == 1


def test_host_slots_a_load_holds_are_reported_pinned_until_it_is_over(
    tiny_model, engines, tmp_path
):
    chain = _hashes(26, 4)
    _on_disk(tiny_model, engines, _disk(tmp_path), chain)
    engine = engines(tiny_model, _one_io_worker(tmp_path))
    worker = engine.workers[0]
    gate = _busy(worker.cache.transfer)
    engine.run_another()  # so that the load is asynchronous
    engine.admit(_request("r", chain), [5, 6, 7, 8, 9])
    engine.step({})  # the load is pinned and waits for the I/O worker
    pinned = worker.get_kv_connector_stats().data[PINNED]
    gate.set()
    engine.load()
    assert pinned == 4
    assert worker.get_kv_connector_stats().data[PINNED] == -4  # the change: none left


def _on_disk(tiny_model, engines, config: dict, chain: list[bytes], tp: int = 1) -> list:
    """Store ``chain`` below a first engine and close it; returns its blocks' KV (rank 0)."""
    writer = engines(tiny_model, config, tp=tp)
    writer.serve(_request("w", chain), list(range(len(chain) + 1)))
    saved = writer.kv(0, list(range(len(chain))))
    writer.close()
    return saved


def _one_io_worker(tmp_path: Path) -> dict:
    return {**_disk(tmp_path), "transfer": {"io_threads": 1}}


def _busy(pool: TransferEngine | ThreadPoolExecutor) -> threading.Event:
    """Keep the only thread of ``pool`` (the I/O worker, the stager) busy until the
    returned gate is set."""
    gate = threading.Event()
    pool.submit(gate.wait, 30)
    return gate


def _gate_first_read(cache: ConnectorCache, monkeypatch) -> tuple[list[int], threading.Event]:
    """Make the first spill read of ``cache`` wait until the gate is set; returns the
    reads made so far (their numbers) and the gate."""
    reads, gate = [], threading.Event()
    load = cache.spill.load

    def gated(runs, slots):
        reads.append(len(reads))
        if len(reads) == 1:
            gate.wait(30)
        return load(runs, slots)

    monkeypatch.setattr(cache.spill, "load", gated)
    return reads, gate


def _staged(engine: Engine) -> list[int]:
    """Each worker's blocks staged so far, once its stages are over and reported."""
    for worker in engine.workers:
        worker.cache.wait_loads()
    engine.step({})
    return [worker.cache.stage_counts.staged for worker in engine.workers]


def test_a_waiting_requests_disk_hit_is_staged_and_then_loads_from_the_host_pool(
    tiny_model, engines, tmp_path
):
    chain = _hashes(20, 4)
    saved = _on_disk(tiny_model, engines, _disk(tmp_path), chain)
    engine = engines(tiny_model, _disk(tmp_path))  # a restart: empty host pool
    request = _request("r", chain)
    engine.arrive(request)
    assert _staged(engine) == [4]

    assert engine.admit(request, [5, 6, 7, 8, 9], new=False) == (4 * BLOCK, False)  # host
    engine.step({"r": 1})
    for got, want in zip(engine.kv(0, [5, 6, 7, 8]), saved, strict=True):
        assert torch.equal(got, want)
    assert engine.workers[0].cache.stage_counts.used == 4


def test_a_request_scheduled_while_its_stage_reads_waits_for_it_and_nothing_is_read_twice(
    tiny_model, engines, tmp_path
):
    chain = _hashes(21, 4)
    _on_disk(tiny_model, engines, _disk(tmp_path), chain)
    engine = engines(tiny_model, _disk(tmp_path))
    gate = _busy(engine.workers[0].cache._stager)
    request = _request("r", chain)
    engine.arrive(request)  # the stage went to the stager with this step, and waits
    assert engine.scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    gate.set()
    _staged(engine)

    assert engine.admit(request, [5, 6, 7, 8, 9], new=False) == (4 * BLOCK, False)
    engine.step({"r": 1})
    assert engine.workers[0].cache.counters()["disk"].blocks_out == 4  # read once


def test_a_request_whose_stage_reads_is_not_looked_up_again_while_it_waits(
    tiny_model, engines, tmp_path, monkeypatch
):
    chain = _hashes(25, 4)
    _on_disk(tiny_model, engines, _disk(tmp_path), chain)
    engine = engines(tiny_model, _disk(tmp_path))
    gate = _busy(engine.workers[0].cache._stager)
    request = _request("r", chain)
    engine.arrive(request)
    lookups = []
    index = engine.scheduler.index
    lookup = index.lookup
    monkeypatch.setattr(index, "lookup", lambda *a: lookups.append(a) or lookup(*a))
    for _ in range(3):  # vLLM asks each step while the request waits
        assert engine.scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    gate.set()
    assert lookups == []


def test_a_stage_reads_once_the_loads_being_read_are_over(
    tiny_model, engines, tmp_path, monkeypatch
):
    running, waiting = _hashes(31, 4), _hashes(32, 4)
    _on_disk(tiny_model, engines, _disk(tmp_path), running + waiting)
    engine = engines(tiny_model, _disk(tmp_path))
    cache = engine.workers[0].cache
    monkeypatch.setattr("kvtier.connector.STAGE_YIELD", 60.0)  # it waits for the load only
    reads, gate = _gate_first_read(cache, monkeypatch)  # the load's
    engine.run_another()  # so that the load is asynchronous
    engine.admit(_request("r", running), [5, 6, 7, 8, 9])
    engine.arrive(_request("s", running + waiting))  # its stage is submitted with the load
    wait_until(lambda: cache.stage_yielding, 30, "the stage to wait for the load", 0.005)
    assert reads == [0]
    gate.set()
    cache.wait_loads()
    assert reads == [0, 1]


def test_a_load_never_waits_for_a_stage_under_way(tiny_model, engines, tmp_path, monkeypatch):
    waiting, scheduled = _hashes(35, 4), _hashes(36, 4)
    _on_disk(tiny_model, engines, _disk(tmp_path), waiting)
    saved = _on_disk(tiny_model, engines, _disk(tmp_path), scheduled)
    engine = engines(tiny_model, _one_io_worker(tmp_path))
    cache = engine.workers[0].cache
    _, gate = _gate_first_read(cache, monkeypatch)  # the stage's
    try:
        engine.arrive(_request("s", waiting))
        assert engine.admit(_request("r", scheduled), [5, 6, 7, 8, 9]) == (4 * BLOCK, False)
        assert engine.step({"r": 1}) == (set(), set())
        assert cache.staging  # the stage still waits for the gate
        for got, want in zip(engine.kv(0, [5, 6, 7, 8]), saved, strict=True):
            assert torch.equal(got, want)
    finally:
        gate.set()


def test_a_request_scheduled_in_the_step_it_arrives_is_loaded_not_staged(
    tiny_model, engines, tmp_path
):
    chain = _hashes(22, 4)
    _on_disk(tiny_model, engines, _disk(tmp_path), chain)
    engine = engines(tiny_model, _disk(tmp_path))
    assert engine.admit(_request("r", chain), [5, 6, 7, 8, 9]) == (4 * BLOCK, False)
    assert engine.step({"r": 1}) == (set(), set())
    assert engine.workers[0].cache.stage_counts.staged == 0


def test_staged_blocks_take_at_most_the_stage_share_of_the_host_pool(tiny_model, engines, tmp_path):
    chain = _hashes(23, 8)
    _on_disk(tiny_model, engines, _disk(tmp_path), chain)
    # 16 KiB blocks: a pool of 16, a quarter of it for stages
    engine = engines(tiny_model, _disk(tmp_path, host="256KiB", stage_share=0.25))
    engine.arrive(_request("r", chain))
    assert _staged(engine) == [4]
    engine.arrive(_request("s", chain))  # the first stage's blocks are not used yet
    assert _staged(engine) == [4]


def test_a_stage_the_share_had_no_room_for_is_made_once_the_staged_blocks_are_used(
    tiny_model, engines, tmp_path, monkeypatch
):
    first, second = _hashes(29, 4), _hashes(30, 4)
    _on_disk(tiny_model, engines, _disk(tmp_path), first)
    _on_disk(tiny_model, engines, _disk(tmp_path), second)
    engine = engines(tiny_model, _disk(tmp_path, host="256KiB", stage_share=0.25))
    monkeypatch.setattr(kvtier_vllm, "LOOKUP_REUSE", 0.0)  # every step is a later one
    r, s = _request("r", first), _request("s", second)
    engine.arrive(r)
    engine.arrive(s)  # no room: r's staged blocks fill the share
    assert _staged(engine) == [4]
    assert engine.admit(r, [5, 6, 7, 8, 9], new=False) == (4 * BLOCK, False)  # uses them
    engine.step({"r": 1})
    assert _staged(engine) == [8]
    assert engine.admit(s, [10, 11, 12, 13, 14], new=False) == (4 * BLOCK, False)  # host hit
    engine.step({"s": 1})
    assert engine.workers[0].cache.stage_counts.used == 8


def _fill_the_stage_share(tiny_model, engines, tmp_path) -> tuple[Engine, Request, list[bytes]]:
    """An engine whose stage share (4 blocks) is full of the stage of waiting request
    ``r``, and the chain of another request whose blocks are on disk."""
    first, second = _hashes(26, 4), _hashes(27, 4)
    _on_disk(tiny_model, engines, _disk(tmp_path), first)
    _on_disk(tiny_model, engines, _disk(tmp_path), second)
    engine = engines(tiny_model, _disk(tmp_path, host="256KiB", stage_share=0.25))
    r = _request("r", first)
    engine.arrive(r)
    assert _staged(engine) == [4]
    return engine, r, second


def test_staged_blocks_that_vllms_own_hit_made_unneeded_leave_the_stage_share(
    tiny_model, engines, tmp_path
):
    engine, r, second = _fill_the_stage_share(tiny_model, engines, tmp_path)
    r.num_computed_tokens = 4 * BLOCK  # vLLM's own prefix cache holds r's prefix by now
    assert engine.admit(r, [5, 6, 7, 8, 9], new=False) == (0, False)
    engine.step({"r": 1})
    engine.arrive(_request("s", second))
    assert _staged(engine) == [8]
    assert engine.workers[0].cache.stage_counts.used == 0


def test_staged_blocks_of_a_request_that_went_away_leave_the_stage_share(
    tiny_model, engines, tmp_path
):
    engine, r, second = _fill_the_stage_share(tiny_model, engines, tmp_path)
    engine.scheduler.request_finished(r, [])  # the client gave up while r waited
    engine.arrive(_request("s", second))
    assert _staged(engine) == [8]


def test_a_stage_the_workers_had_no_room_for_is_not_planned_again_in_each_step_vllm_asks(
    tiny_model, engines, tmp_path, monkeypatch
):
    chain = _hashes(28, 4)
    _on_disk(tiny_model, engines, _disk(tmp_path), chain)
    engine = engines(tiny_model, _disk(tmp_path))
    cache = engine.workers[0].cache
    cache._stage_budget = 0  # the share is full on the worker
    planned = []
    stage = cache.stage
    monkeypatch.setattr(
        cache, "stage", lambda req_id, *a: planned.append(req_id) or stage(req_id, *a)
    )
    request = _request("s", chain)
    engine.arrive(request)
    for _ in range(3):  # vLLM cannot schedule it: it asks in each step, finding it on disk
        engine.scheduler.get_num_new_matched_tokens(request, 0)
        engine.step({})
    assert planned == ["s"]


def test_requests_queued_behind_a_full_stage_share_are_not_looked_up(
    tiny_model, engines, tmp_path, monkeypatch
):
    chains = [_hashes(50 + i, 4) for i in range(3)]
    for chain in chains:
        _on_disk(tiny_model, engines, _disk(tmp_path), chain)
    engine = engines(tiny_model, _disk(tmp_path, host="256KiB", stage_share=0.25))
    monkeypatch.setattr(kvtier_vllm, "LOOKUP_REUSE", 0.0)
    lookups = _count_lookups(engine, monkeypatch)
    for i, chain in enumerate(chains):
        engine.arrive(_request(f"r{i}", chain))
    assert _staged(engine) == [4]  # the first one's stage fills the share
    behind = {engine.scheduler.index.keys(chain[:1])[0] for chain in chains[1:]}
    assert lookups and not behind.intersection(lookups)


def test_a_waiting_request_whose_lookup_found_nothing_is_not_looked_up_again_for_a_stage(
    tiny_model, engines, tmp_path, monkeypatch
):
    engine = engines(tiny_model, _disk(tmp_path))
    monkeypatch.setattr(kvtier_vllm, "LOOKUP_REUSE", 0.0)
    lookups = _count_lookups(engine, monkeypatch)
    engine.arrive(_request("r", _hashes(53, 4)))
    for _ in range(3):
        engine.step({})
    assert len(lookups) == 1


def test_a_waiting_requests_host_hit_outlives_the_evictions_of_stages_behind_it(
    tiny_model, engines, tmp_path
):
    waiting, *others = (_hashes(40 + i, 4) for i in range(5))
    _on_disk(tiny_model, engines, _disk(tmp_path), others[-1])
    # 16 KiB blocks: a pool of 16 that the first four chains fill, the waiting one oldest
    engine = engines(tiny_model, _disk(tmp_path, host="256KiB", stage_share=0.25))
    for i, chain in enumerate([waiting, *others[:3]]):
        engine.serve(_request(f"o{i}", chain), [0, 1, 2, 3, 4])
    engine.workers[0].cache.flush()  # no slot pinned by a write-through encode
    request = _request("r", waiting)
    engine.arrive(request)  # waits, its hit in the host pool
    engine.arrive(_request("s", others[-1]))  # its stage evicts 4 blocks
    assert _staged(engine) == [4]
    assert engine.admit(request, [5, 6, 7, 8, 9], new=False) == (4 * BLOCK, False)  # host


def test_a_waiting_requests_host_hit_outlives_a_stage_planned_before_it_is_due_again(
    tiny_model, engines, tmp_path, monkeypatch
):
    waiting, staged, *others = (_hashes(62 + i, 4) for i in range(5))
    _on_disk(tiny_model, engines, _disk(tmp_path), staged)
    engine = engines(tiny_model, _disk(tmp_path, host="256KiB", stage_share=0.25))
    monkeypatch.setattr(kvtier_vllm, "LOOKUP_REUSE", 60.0)  # r is due on arrival only
    engine.serve(_request("o", waiting), [0, 1, 2, 3, 4])
    request = _request("r", waiting)
    engine.arrive(request)  # waits, its hit in the host pool (16 blocks of 16 KiB)
    for i, chain in enumerate(others):  # served meanwhile: r's hit is the oldest now
        engine.serve(_request(f"o{i}", chain), [10, 11, 12, 13, 14])
        engine.workers[0].cache.flush()  # no slot pinned by a write-through encode
    engine.arrive(_request("s", staged))  # its stage evicts 4 blocks
    assert _staged(engine) == [4]

    n, _ = engine.admit(request, [5, 6, 7, 8, 9], new=False)
    assert engine.scheduler.get_external_cache_hit_sources(request, n) == {
        CacheHitSource.HOST: 4 * BLOCK
    }
    assert engine.step({"r": 1}) == (set(), set())


def test_a_waiting_requests_lookup_is_made_again_once_its_host_blocks_are_evicted(
    tiny_model, engines, tmp_path, monkeypatch
):
    engine = engines(tiny_model, _disk(tmp_path, host="256KiB"))  # 16 blocks of 16 KiB
    monkeypatch.setattr(kvtier_vllm, "LOOKUP_REUSE", 60.0)  # any later ask reuses it
    chain = _hashes(60, 4)
    engine.serve(_request("a", chain), [0, 1, 2, 3, 4])
    engine.workers[0].cache.flush()  # on disk too, no slot pinned by a write-through
    request = _request("r", chain)
    engine.arrive(request)
    assert engine.scheduler.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, False)
    saved = engine.kv(0, [0, 1, 2, 3])
    engine.serve(_request("b", _hashes(61, 14)), list(range(15)))  # evicts 2 of a's
    engine.workers[0].cache.flush()

    assert engine.admit(request, [5, 6, 7, 8, 9], new=False) == (4 * BLOCK, False)
    assert engine.step({"r": 1}) == (set(), set())  # none failed: 2 read from disk
    for got, want in zip(engine.kv(0, [5, 6, 7, 8]), saved, strict=True):
        assert torch.equal(got, want)


def test_the_host_pool_evicts_a_saved_chain_from_its_tail(tiny_model, engines):
    engine = engines(tiny_model, _host_only("256KiB"))  # 16 blocks of 16 KiB
    chain = _hashes(45, 4)
    engine.serve(_request("a", chain), [0, 1, 2, 3, 4])
    engine.serve(_request("b", _hashes(46, 14)), list(range(15)))  # evicts 2 of a's
    assert engine.admit(_request("c", chain), [0, 1, 2, 3, 4])[0] == 2 * BLOCK


def test_blocks_staged_before_a_reset_no_longer_count_against_the_share(
    tiny_model, engines, tmp_path
):
    engine, _, second = _fill_the_stage_share(tiny_model, engines, tmp_path)
    cache, index = engine.workers[0].cache, engine.scheduler.index
    base = index.keys(second)
    hit = index.lookup(base, 0)  # on disk
    assert cache.stage("s", cache.keys(base), cache.root, hit) == 0  # r's fill the share
    cache.reset()  # r still waits: its staged blocks are gone unused
    assert cache.stage("t", cache.keys(base), cache.root, hit) == 4


def test_no_stage_is_made_with_a_stage_share_of_zero(tiny_model, engines, tmp_path):
    chain = _hashes(24, 4)
    _on_disk(tiny_model, engines, _disk(tmp_path), chain)
    engine = engines(tiny_model, _disk(tmp_path, stage_share=0))
    engine.arrive(_request("r", chain))
    assert _staged(engine) == [0]


def test_a_load_takes_the_host_slots_of_a_stage_whose_read_has_not_begun(
    tiny_model, engines, tmp_path
):
    waiting, scheduled = _hashes(37, 4), _hashes(38, 6)
    _on_disk(tiny_model, engines, _disk(tmp_path), waiting)
    saved = _on_disk(tiny_model, engines, _disk(tmp_path), scheduled)
    # 16 KiB blocks: a pool of 8, half of it for stages
    engine = engines(tiny_model, _disk(tmp_path, host="128KiB", stage_share=0.5))
    cache = engine.workers[0].cache
    gate = _busy(cache._stager)
    engine.arrive(_request("s", waiting))  # its stage pins 4 slots, queued behind the gate
    try:
        assert engine.admit(_request("r", scheduled), list(range(5, 12))) == (6 * BLOCK, False)
        assert engine.step({"r": 1}) == (set(), set())
    finally:
        gate.set()
    for got, want in zip(engine.kv(0, list(range(5, 11))), saved, strict=True):
        assert torch.equal(got, want)
    assert _staged(engine) == [0]
    assert cache.host.num_free == cache.host.num_blocks  # no slot left pinned


def test_a_stage_whose_request_goes_away_before_its_read_reads_nothing_and_pins_nothing(
    tiny_model, engines, tmp_path
):
    chain = _hashes(25, 4)
    _on_disk(tiny_model, engines, _disk(tmp_path), chain)
    engine = engines(tiny_model, _disk(tmp_path))
    cache = engine.workers[0].cache
    gate = _busy(cache._stager)
    request = _request("r", chain)
    engine.arrive(request)  # its stage is queued behind the busy stager
    engine.scheduler.request_finished(request, [])  # the client gave up
    engine.step({})
    gate.set()
    _staged(engine)

    assert cache.counters()["disk"].blocks_out == 0
    assert cache.host.num_free == cache.host.num_blocks  # no slot pinned
    assert engine.serve(_request("next", chain), [0, 1, 2, 3, 4])[0] == 4 * BLOCK  # serving


def test_each_tensor_parallel_shard_stages_its_own_blocks(tiny_model, engines, redis_prefix):
    chain = _hashes(26, 4)
    saved = _on_disk(tiny_model, engines, _redis(redis_prefix), chain, tp=2)
    engine = engines(tiny_model, _redis(redis_prefix), tp=2)
    request = _request("r", chain)
    engine.arrive(request)
    assert _staged(engine) == [4, 4]

    assert engine.admit(request, [5, 6, 7, 8, 9], new=False) == (4 * BLOCK, False)
    engine.step({"r": 1})
    for got, want in zip(engine.kv(0, [5, 6, 7, 8]), saved, strict=True):
        assert torch.equal(got, want)


# ------------------------------------------------------------ sleep and replayed reports
def test_sleep_returns_once_a_spill_load_in_flight_has_copied_and_no_copy_follows_it(
    tiny_model, engines, tmp_path, monkeypatch
):
    chain = _hashes(30, 4)
    saved = _on_disk(tiny_model, engines, _disk(tmp_path), chain)
    engine = engines(tiny_model, _disk(tmp_path))
    worker = engine.workers[0]
    reads, gate = _gate_first_read(worker.cache, monkeypatch)
    engine.run_another()
    assert engine.admit(_request("r", chain), [5, 6, 7, 8, 9]) == (4 * BLOCK, True)
    engine.step({})  # the load starts; its read waits at the gate
    wait_until(lambda: reads, 30, "the load's read to begin")
    asleep = threading.Thread(target=worker.unregister_kv_caches)
    asleep.start()
    asleep.join(0.2)
    assert asleep.is_alive()  # it waits for the load's copy
    gate.set()
    asleep.join(30)

    for got, want in zip(engine.kv(0, [5, 6, 7, 8]), saved, strict=True):
        assert torch.equal(got, want)  # copied before vLLM could unmap the KV
    unmapped = engine.kv(0, list(range(NUM_BLOCKS)))
    worker.cache.save([(0,), (1,)], worker.cache.keys(_hashes(31, 2)), worker.cache.root, 0)
    assert engine.step({}) == ({"r"}, set())  # the load is reported over
    assert all(map(torch.equal, engine.kv(0, list(range(NUM_BLOCKS))), unmapped))
    assert worker.cache.counters()["cpu"].dropped == 2  # the save found no KV to copy


def test_after_wake_up_a_hit_loads_from_the_host_pool_kept_through_sleep(
    tiny_model, engines, tmp_path
):
    # vLLM 0.33's sleep: its reset of the connector (kept: the weights do not change),
    # the KV unmapped; then mapped again, and the handshake repeated.
    engine = engines(tiny_model, {**_disk(tmp_path), "hashing": {"on_engine_reset": "keep"}})
    chain = _hashes(32, 4)
    engine.serve(_request("a", chain), [0, 1, 2, 3, 4])
    saved = engine.kv(0, [0, 1, 2, 3])
    worker = engine.workers[0]
    assert engine.scheduler.reset_cache()
    worker.unregister_kv_caches()
    for layer in worker.cache.kv.layers:  # the KV's contents are lost in sleep
        layer.zero_()
    worker.restore_kv_caches()
    engine.scheduler.set_xfer_handshake_metadata_pp_aware(  # vLLM repeats the handshake
        {(0, 0): worker.get_handshake_metadata()}
    )

    n, _ = engine.admit(_request("b", chain), [5, 6, 7, 8, 9])
    assert n == 4 * BLOCK
    engine.step({"b": 1})
    assert engine.workers[0].cache.counters()["cpu"].blocks_out == 4
    for got, want in zip(engine.kv(0, [5, 6, 7, 8]), saved, strict=True):
        assert torch.equal(got, want)


def _reports(engine: Engine, held: list[dict[int, bool]]) -> list[kvtier_vllm.KVTierWorkerMeta]:
    """Rank 0's next reports, one per step, each with keys ``held`` (block -> in its host
    pool) of chain 33."""
    cache = engine.workers[0].cache
    keys = cache.keys(engine.scheduler.index.keys(_hashes(33, 4)))
    out = []
    for step in held:
        report = cache.take_report()
        report.held = {keys[i]: present for i, present in step.items()}
        out.append(kvtier_vllm.KVTierWorkerMeta({cache.shard: report}))
    return out


def _index_holds(engine: Engine, block: int) -> bool:
    return engine.scheduler.index.holds(engine.scheduler.index.keys(_hashes(33, 4)[block:][:1]))


@pytest.mark.parametrize("order", ["older first", "newer first"])
def test_a_report_replayed_beside_a_newer_one_applies_as_they_were_made(tiny_model, engines, order):
    engine = engines(tiny_model, _host_only())
    older, newer = _reports(engine, [{0: True, 1: True}, {1: False, 2: True}])
    merged = older.aggregate(newer) if order == "older first" else newer.aggregate(older)
    engine.scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=merged))
    assert [_index_holds(engine, i) for i in range(3)] == [True, False, True]


def test_a_report_delivered_again_after_a_newer_one_is_not_applied_again(tiny_model, engines):
    engine = engines(tiny_model, _host_only())
    older, newer = _reports(engine, [{0: True}, {0: False}])
    for meta in (older, newer, older):
        engine.scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))
    assert not _index_holds(engine, 0)


# ------------------------------------------------------------ MLA: one copy per model
def _redis_through(prefix: str) -> dict:
    config = _redis(prefix)
    config["tiers"]["redis"]["write_policy"] = "write_through"
    return config


def _mla_on_redis(tiny_model, engines, prefix: str, chain: list[bytes]) -> list[torch.Tensor]:
    """Serve ``chain`` once on an MLA engine at TP=2 writing through to Redis, then stop
    it; returns the latent it computed for the chain's blocks."""
    writer = engines(tiny_model, _redis_through(prefix), tp=2, mla=True)
    writer.serve(_request("w", chain), [0, 1, 2, 3, 4])
    writer.workers[0].cache.flush()
    saved = writer.kv(0, [0, 1, 2, 3])
    writer.close()
    return saved


def test_an_mla_models_latent_is_held_and_stored_once_at_tp_2_by_the_first_rank(
    tiny_model, engines, redis_prefix
):
    engine = engines(tiny_model, _redis_through(redis_prefix), tp=2, mla=True)
    engine.serve(_request("w", _hashes(40, 4)), [0, 1, 2, 3, 4])
    holder, other = engine.workers
    holder.cache.flush()
    assert holder.cache.counters()["redis"].blocks_in == 4
    assert holder.cache.counters()["cpu"].blocks_in == 4
    assert other._cache is None  # no host pool, no tiers: rank 0 holds the group's latent
    assert [s.name for s in engine.scheduler.index.shards] == ["tp0/2 pp0/1"]


def test_an_mla_hit_at_tp_2_is_read_once_and_relayed_to_the_other_rank(
    tiny_model, engines, redis_prefix
):
    chain = _hashes(41, 4)
    saved = _mla_on_redis(tiny_model, engines, redis_prefix, chain)
    reader = engines(tiny_model, _redis_through(redis_prefix), tp=2, mla=True)  # a restart
    assert reader.admit(_request("r", chain), [5, 6, 7, 8, 9]) == (4 * BLOCK, False)
    assert reader.step({"r": 1}) == (set(), set())
    for rank in (0, 1):
        for got, want in zip(reader.kv(rank, [5, 6, 7, 8]), saved, strict=True):
            assert torch.equal(got, want)
    redis = reader.workers[0].cache.counters()["redis"]
    assert (redis.blocks_out, redis.bytes_out) == (
        4,
        4 * reader.workers[0].cache.layout.block_nbytes,
    )
    assert [w._relay.blocks for w in reader.workers] == [4, 4]
    assert reader.workers[1].get_kv_connector_stats().data[RELAYED] == 4  # vLLM's /metrics


def test_an_async_mla_load_ends_on_the_other_rank_once_the_holder_relayed_it(tiny_model, engines):
    engine = engines(tiny_model, _host_only(), tp=2, mla=True)
    chain = _hashes(42, 4)
    engine.serve(_request("a", chain), [0, 1, 2, 3, 4])
    saved = engine.kv(0, [0, 1, 2, 3])
    engine.run_another()
    assert engine.admit(_request("b", chain), [5, 6, 7, 8, 9]) == (4 * BLOCK, True)
    holder, other = engine.workers
    assert engine.step({}) == (set(), set())  # over on the holder, which reports it
    assert holder._relay.blocks == 0 and other._async_loads
    assert engine.step({}) == ({"b"}, set())  # relayed: over on every rank
    for got, want in zip(engine.kv(1, [5, 6, 7, 8]), saved, strict=True):
        assert torch.equal(got, want)


def _vanishing_mla_hit(
    tiny_model, engines, prefix: str, client, chain: list[bytes], asynchronous: bool
) -> tuple[Engine, list[torch.Tensor]]:
    """An MLA engine at TP=2, restarted over Redis, that admitted a hit of ``chain``
    (``asynchronous``: with another request running) whose values then left Redis
    before the load; with rank 1's KV of the hit's blocks as it was before."""
    _mla_on_redis(tiny_model, engines, prefix, chain)
    reader = engines(tiny_model, _redis_through(prefix), tp=2, mla=True)
    before = reader.kv(1, [5, 6, 7, 8])
    if asynchronous:
        reader.run_another()
    admitted = reader.admit(_request("r", chain), [5, 6, 7, 8, 9])
    assert admitted == (4 * BLOCK, asynchronous)
    delete_prefix(client, prefix)  # gone between the lookup and the load
    return reader, before


def _failed_on_every_rank(reader: Engine, before: list[torch.Tensor]) -> None:
    """Both ranks reported the hit's 4 blocks not loaded, and rank 1 wrote none of them."""
    assert [w.num_load_errors for w in reader.workers] == [4, 4]
    for got, want in zip(reader.kv(1, [5, 6, 7, 8]), before, strict=True):
        assert torch.equal(got, want)  # nothing written where nothing was loaded


def test_an_async_mla_load_the_holder_cannot_read_ends_failed_on_every_rank(
    tiny_model, engines, redis_prefix, real_client
):
    chain = _hashes(44, 4)
    reader, before = _vanishing_mla_hit(
        tiny_model, engines, redis_prefix, real_client, chain, asynchronous=True
    )
    done, errors = reader.step({})
    reader.workers[0].cache.wait_loads()
    for _ in range(2):  # the holder reports it over, then relays it
        more_done, more_errors = reader.step({})
        done, errors = done | more_done, errors | more_errors
    assert (done, errors) == ({"r"}, {5, 6, 7, 8})
    _failed_on_every_rank(reader, before)


def test_an_mla_load_the_holder_cannot_read_fails_on_every_rank(
    tiny_model, engines, redis_prefix, real_client
):
    chain = _hashes(43, 4)
    reader, before = _vanishing_mla_hit(
        tiny_model, engines, redis_prefix, real_client, chain, asynchronous=False
    )
    assert reader.step({"r": 1}) == (set(), {5, 6, 7, 8})  # vLLM recomputes them
    assert not any(w._failed_now for w in reader.workers)  # forgotten once the step is over
    _failed_on_every_rank(reader, before)


# ------------------------------------------------- hybrid: full attention and a window
def test_a_hybrids_hit_loads_every_group_and_the_windows_null_blocks_are_left_alone(
    tiny_model, engines
):
    engine = engines(tiny_model, _host_only(), window=True)
    chain = _hashes(60, 4)
    engine.serve(_request("a", chain), ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]))
    full, window = engine.kv(0, [1, 2, 3, 4])[0], engine.kv(0, [6, 7, 8, 9])[1]
    null = engine.kv(0, [0])[1]

    # vLLM's table for the window holds its null block where positions fell out of it.
    b = _request("b", chain)
    assert engine.admit(b, ([11, 12, 13, 14, 15], [0, 0, 1, 2, 3])) == (4 * BLOCK, True)
    engine.load()
    assert torch.equal(engine.kv(0, [11, 12, 13, 14])[0], full)
    assert torch.equal(engine.kv(0, [1, 2])[1], window[2:])
    assert torch.equal(engine.kv(0, [0])[1], null)


def test_a_hybrid_stores_full_attention_at_every_position_and_the_window_at_the_prompts_end(
    tiny_model, engines
):
    engine = engines(tiny_model, _host_only(), window=True)
    chain = _hashes(61, 4)
    # vLLM's own hit covers positions 0-1 (computed before kvtier saw them), which its
    # table for the window no longer holds; the step computes positions 2-3.
    engine.serve(_request("a", chain, computed=2 * BLOCK), ([1, 2, 3, 4, 5], [0, 0, 6, 7, 8]))
    computed = engine.kv(0, [3, 4])[0], engine.kv(0, [6, 7])[1]
    cache = engine.workers[0].cache
    assert cache.layout.num_layers == 1  # a position holds the full-attention layer alone
    assert cache.counters()["cpu"].blocks_in == 4 + 2  # positions 0-3, the window's 2 pieces

    b = _request("b", chain, computed=2 * BLOCK)  # vLLM still holds positions 0-1
    assert engine.admit(b, ([1, 2, 9, 10, 11], [0, 0, 12, 13, 14]))[0] == 2 * BLOCK
    engine.load()
    assert torch.equal(engine.kv(0, [9, 10])[0], computed[0])
    assert torch.equal(engine.kv(0, [12, 13])[1], computed[1])


def test_a_hybrids_hit_ends_at_the_last_position_with_a_window(tiny_model, engines):
    engine = engines(tiny_model, _host_only(), window=True)
    chain = _hashes(64, 5)
    engine.serve(_request("a", chain[:3]), ([1, 2, 3, 4], [5, 6, 7, 8]))
    # A longer prompt finds positions 0-2 held, the window at the end of the first one.
    b = _request("b", chain)
    assert engine.admit(b, ([9, 10, 11, 12, 13, 14], [0, 9, 10, 11, 12, 13])) == (3 * BLOCK, True)
    engine.load()
    assert torch.equal(engine.kv(0, [9, 10])[1], engine.kv(0, [6, 7])[1])


def test_where_prompts_part_the_next_request_keeps_a_window_for_the_one_after(tiny_model, engines):
    engine = engines(tiny_model, _host_only(), window=True)
    shared = _hashes(65, 3)
    engine.serve(_request("a", [*shared, *_hashes(66, 3)]), ([*range(1, 8)], [*range(1, 8)]))
    # b shares 3 positions with a, whose window is at its own end: no hit; b keeps a
    # window where its prompt parts from a's.
    b = _request("b", [*shared, *_hashes(67, 3)])
    assert engine.serve(b, ([*range(8, 15)], [*range(8, 15)])) == (0, False)
    c = _request("c", [*shared, *_hashes(68, 3)])
    assert engine.admit(c, ([*range(9, 16)], [*range(0, 7)])) == (3 * BLOCK, True)
    engine.load()
    assert torch.equal(engine.kv(0, [1, 2])[1], engine.kv(0, [9, 10])[1])


def test_a_reply_past_the_prompt_gets_a_window_while_vllm_holds_the_blocks_for_it(
    tiny_model, engines
):
    engine = engines(tiny_model, _host_only(), window=True)
    chain = _hashes(70, 6)
    # A prompt of 2 blocks and a token, and a reply that fills 2 more blocks.
    a = Request("a", chain[:4], 4 * BLOCK + 1, num_prompt_tokens=2 * BLOCK + 1)
    table = ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5])
    engine.admit(a, table)
    engine.step({"a": a.num_tokens})
    a.num_computed_tokens = a.num_tokens
    assert engine.scheduler.request_finished_all_groups(a, table) == (True, None)
    engine.step({})  # the window's copy, then every worker reports the blocks free
    assert engine.freed == {"a"}
    # The next turn of the conversation hits the reply too.
    b = _request("b", chain)
    assert engine.admit(b, ([6, 7, 8, 9, 10, 11, 12], [0, 0, 6, 7, 8, 9, 10])) == (4 * BLOCK, True)
    engine.load()
    assert torch.equal(engine.kv(0, [6, 7])[1], engine.kv(0, [3, 4])[1])


def test_a_window_vllm_allocated_past_what_kvtier_holds_is_a_failed_load(tiny_model, engines):
    # vLLM takes every block it allocated for the loaded positions as computed: a block of
    # the window's group before the window kvtier holds would be left unwritten.
    engine = engines(tiny_model, _host_only(), window=True)
    chain = _hashes(69, 4)
    engine.serve(_request("a", chain), ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]))
    b = _request("b", chain)
    assert engine.admit(b, ([11, 12, 13, 14, 15], [11, 12, 13, 14, 15])) == (4 * BLOCK, True)
    engine.load()
    assert engine.failed == {"b"}


def test_a_hybrids_failed_load_is_reported_by_request_for_vllm_to_recompute(tiny_model, engines):
    # vLLM cannot map a failed block back to its request where block ids repeat across
    # KV cache groups (it stops the engine): the request is named instead.
    engine = engines(tiny_model, _host_only(), window=True)
    chain = _hashes(62, 2)
    engine.serve(_request("a", chain), ([1, 2, 3], [4, 5, 6]))
    assert engine.admit(_request("b", chain), ([7, 8, 9], [10, 11, 12])) == (2 * BLOCK, True)
    engine.workers[0].cache.reset()  # gone from the host pool before the load starts
    done, errors = engine.load()
    assert (done, errors, engine.failed) == ({"b"}, set(), {"b"})


# ------------------------------------------- a hybrid's Mamba state (``state=True``)
def _serve_with_state(engine: Engine, request: Request, table: tuple, states: dict) -> None:
    """Serve ``request`` in one step that commits ``states`` (position: the state
    group's block that holds the state after it)."""
    engine.admit(request, table)
    offers = [(1, block, (position + 1) * BLOCK) for position, block in states.items()]
    engine.step({request.request_id: request.num_tokens}, {request.request_id: offers})
    request.num_computed_tokens = request.num_tokens
    engine.scheduler.request_finished_all_groups(request, table)


def test_a_hybrids_hit_ends_at_the_last_position_whose_state_it_holds(tiny_model, engines):
    engine = engines(tiny_model, _host_only(), state=True)
    chain = _hashes(63, 4)
    _serve_with_state(engine, _request("a", chain), ([1, 2, 3, 4, 5], [0, 6, 0, 0, 7]), {1: 6})
    full, state = engine.kv(0, [1, 2])[0], engine.kv(0, [6])[1]

    # vLLM gives the hit's last position a block of the state group: the state goes there.
    b = _request("b", chain)
    assert engine.admit(b, ([8, 9, 10, 11, 12], [0, 13, 14, 0, 0])) == (2 * BLOCK, True)
    assert engine.load()[1] == set() and not engine.failed
    assert torch.equal(engine.kv(0, [8, 9])[0], full)
    assert torch.equal(engine.kv(0, [13])[1], state)


def test_each_tensor_parallel_rank_restores_its_own_part_of_the_state(tiny_model, engines):
    engine = engines(tiny_model, _host_only(), tp=2, state=True)
    chain = _hashes(67, 2)
    _serve_with_state(engine, _request("a", chain), ([1, 2, 3], [0, 4, 5]), {1: 4})
    saved = [(engine.kv(rank, [1, 2])[0], engine.kv(rank, [4])[1]) for rank in (0, 1)]
    assert not torch.equal(saved[0][1], saved[1][1])  # the ranks' states differ

    assert engine.admit(_request("b", chain), ([6, 7, 8], [0, 9, 10])) == (2 * BLOCK, True)
    assert engine.load()[1] == set() and not engine.failed
    for rank, (full, state) in enumerate(saved):
        assert torch.equal(engine.kv(rank, [6, 7])[0], full)
        assert torch.equal(engine.kv(rank, [9])[1], state)


def test_a_hybrids_positions_with_no_state_after_them_are_no_hit(tiny_model, engines):
    engine = engines(tiny_model, _host_only(), state=True)
    chain = _hashes(64, 4)
    _serve_with_state(engine, _request("a", chain), ([1, 2, 3, 4, 5], [0, 0, 0, 0, 6]), {})
    assert engine.workers[0].cache.counters()["cpu"].blocks_in == 4  # the KV is there
    assert engine.admit(_request("b", chain), ([7, 8, 9, 10, 11], [0, 0, 0, 0, 12]))[0] == 0


def test_a_hybrids_lookup_asks_each_spill_tier_once_for_the_states_of_all_positions(
    tiny_model, engines, tmp_path, monkeypatch
):
    chain = _hashes(66, 8)
    writer = engines(tiny_model, _disk(tmp_path), state=True)
    _serve_with_state(writer, _request("a", chain), (list(range(1, 10)), [0] * 8 + [10]), {})
    writer.close()  # eight positions on disk, and no state after any of them
    reader = engines(tiny_model, _disk(tmp_path), state=True)
    asked: list[int] = []
    sizes_many = LMDBTier.sizes_many
    monkeypatch.setattr(
        LMDBTier, "sizes_many", lambda tier, keys: asked.append(len(keys)) or sizes_many(tier, keys)
    )
    assert reader.admit(_request("b", chain), (list(range(1, 10)), [0] * 9))[0] == 0
    assert asked == [8, 8]  # the positions' KV, then a state's last piece for each


def test_a_state_of_a_partial_block_is_not_saved(tiny_model, engines):
    engine = engines(tiny_model, _host_only(), state=True)
    request = _request("a", _hashes(65, 2))
    engine.admit(request, ([1, 2, 3], [0, 0, 4]))
    offers = {"a": [(1, 4, 2 * BLOCK + 1)]}  # after the prompt's last token
    engine.step({"a": request.num_tokens}, offers)
    assert engine.workers[0].cache.counters()["cpu"].blocks_in == 2  # the positions' KV only


# ------------------------------------------------- the partial last chunk of a prefix
def test_a_finished_requests_partial_last_chunk_is_written_through_in_the_next_step(
    tiny_model, engines, tmp_path
):
    engine = engines(tiny_model, _disk(tmp_path))  # chunks of 2 blocks, written through
    engine.serve(_request("a", _hashes(70, 3)), [0, 1, 2, 3])
    cache = engine.workers[0].cache
    cache.flush()
    assert cache.counters()["disk"].blocks_in == 2  # the whole chunk, as it completed
    engine.step({})  # the first step after "a" finished
    cache.flush()
    assert cache.counters()["disk"].blocks_in == 3


def test_a_stopping_worker_writes_what_the_write_through_tiers_have_not_taken(
    tiny_model, engines, tmp_path
):
    chain = _hashes(71, 3)
    saved = _on_disk(tiny_model, engines, _disk(tmp_path), chain)  # closed right after
    engine = engines(tiny_model, _disk(tmp_path))  # started again: its host pool empty
    assert engine.admit(_request("b", chain), [5, 6, 7, 8]) == (3 * BLOCK, False)
    engine.step({"b": 1})
    assert engine.workers[0].cache.counters()["disk"].blocks_out == 3
    for got, want in zip(engine.kv(0, [5, 6, 7]), saved, strict=True):
        assert torch.equal(got, want)
