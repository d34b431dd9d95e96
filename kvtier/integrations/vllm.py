"""kvtier as vLLM's KV cache backend: ``KVTierConnector``, a vLLM (0.32, 0.33) KV connector.

vLLM keeps its GPU blocks and its prefix cache; kvtier adds the host pool and the
spill tiers below them (``kvtier.connector``), keyed by vLLM's own chained block
hashes. Load it with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": "configs/vllm.yaml"}}'

Processes. vLLM builds one connector per role: the scheduler's, in the engine core
process, and one per worker (tensor- and pipeline-parallel rank), in the worker's
process or the same one. They share no memory; they talk only through vLLM's channels:

- start-up: each worker reports its shard (``get_handshake_metadata``: the root of its
  keys, its value size); the scheduler collects them all
  (``set_xfer_handshake_metadata_pp_aware``) before the first request.
- each step, scheduler -> workers: ``build_connector_meta`` hands every worker this
  step's loads (the hit, the vLLM blocks it goes into) and saves (the blocks that
  become full this step, to copy once the forward has written them), as base keys.
- each step, workers -> scheduler: ``build_connector_worker_meta`` reports the keys each
  worker's host pool gained and lost, and the spill writes it queued;
  ``update_connector_output`` applies them to the scheduler's index. Finished async
  loads and failed blocks travel in vLLM's own
  fields (``get_finished``, ``get_block_ids_with_load_errors``), aggregated over ranks.

Scheduler side. ``get_num_new_matched_tokens`` looks up the blocks past vLLM's own hit
(never the prompt's last token: vLLM needs its logits) in the index and the spill
tiers. A hit loads asynchronously while other requests run, its reads and copy
overlapping their step instead of lengthening it (decode latency); with none running
it is read and copied before the step's forward, so that the request computes in that
step. Worker side. ``register_kv_caches`` adopts vLLM's per-layer KV tensors (blocks
on dim 0, any strides; every KV cache group's, ``vllm_layout``), ``start_load_kv``
starts the loads, ``wait_for_save`` copies the step's new full blocks into the host
pool (on CUDA on the offload stream, with vLLM's stream waiting on its event, so no
block can be reused before it is copied: vLLM may free a finished request's blocks at
once). ``unregister_kv_caches`` / ``restore_kv_caches`` (vLLM 0.33's sleep) wait for
the copies in flight before vLLM unmaps its KV, and start none until it is back.

Models. What the connector can hold is decided as it is built, from vLLM's
``KVCacheConfig`` (``vllm_layout``): KV cache groups of full attention, sliding windows
and MLA, every group at each block (it supports vLLM's hybrid KV cache manager), and
beside them Mamba state, saved where vLLM commits one (``boundary_state_offloads``)
and loaded at the end of a hit; any other model is refused with one sentence before
any request. Beside full attention a sliding window's KV is a state too: saved before
a prompt's end and where the request's prompt parts from the positions held past the
last window held (``_save_specs``), and before a reply's end once the request finishes
(vLLM holds its blocks until the workers have copied it: ``finished_sending``), so
that a hit reads one window, not every block's.
Where every tensor-parallel rank holds the same KV (MLA), the first rank holds it below
for the group and relays each load to the others (``kvtier.relay``): a sync load in its
step, an async one at the start of the step after the first rank reports it over
(``KVTierWorkerMeta.relays``, then ``KVTierMetadata.relays``).
With several groups every load is asynchronous and a failed one is
reported by request (``get_transfer_results``): vLLM stops the engine on failed block
ids it cannot map to one request.

Never fatal. Every hook catches what kvtier raises: it is logged (once per hook, then
counted in ``faults``) and becomes a miss, a skipped save, or a load error for the
blocks concerned, which vLLM recomputes (``kv_load_failure_policy: recompute``). A
promised load always ends: an async load is reported finished on every rank, failed
or not, so no request waits forever.

Costs. Each hook that does work counts its calls and the time spent in it (vLLM's
``/metrics``: ``vllm:kvtier_hook_seconds_total{hook=...}``). On vLLM's CPU build a
worker warns at start-up when vLLM bound its compute threads to every CPU of the
process, as vLLM does on a small machine once any connector is configured (see
``_warn_about_binding``; the README gives the setting). kvtier's own threads never
change the engine's (``kvtier.threads``).

KV events. With vLLM's ``--kv-events-config`` the scheduler's half also publishes
kvtier's tiers through vLLM's own stream (``take_events``): ``BlockStored`` when a block
is held in the host pool, on disk or in Redis by every shard of the replica,
``BlockRemoved`` when it no longer is, derived from the workers' reports
(``vllm_events``); without it neither half does any event work.

Keys. With vLLM's default sha256 block hashes, keys are the same in every process,
so engines sharing a disk or Redis tier share prefixes. With an xxhash algorithm
vLLM seeds its hashes per process unless ``PYTHONHASHSEED`` is set: the connector
warns, and the spill tiers then only ever hit within one process.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
from vllm.distributed.parallel_state import (
    get_pp_group,
    get_tp_group,
    model_parallel_is_initialized,
)
from vllm.platforms import current_platform
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.config import KVTierConfig, load_config, parse_config
from kvtier.connector import (
    BlockIds,
    ConnectorCache,
    ConnectorHit,
    ConnectorIndex,
    ShardReport,
    ShardSpec,
    StatePiece,
)
from kvtier.integrations.vllm_events import TierEvents, events_enabled, to_vllm
from kvtier.integrations.vllm_layout import (
    NULL_BLOCK,
    cached_groups,
    engine_ids,
    engine_kv,
    holds_all,
    position_groups,
    state_groups,
    window_blocks,
    window_groups,
    windowed,
)
from kvtier.integrations.vllm_metrics import (
    FAULTS,
    HOOKS,
    LOAD_ERRORS,
    PINNED,
    RELAYED,
    Increments,
    KVTierPromMetrics,
    KVTierStats,
    hook_counters,
    stage_counters,
)
from kvtier.relay import Relay
from kvtier.threads import process_cpus
from kvtier.trace import Trace

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# Seconds a worker waits at most, in a step that computes nothing, for its async loads.
IDLE_STEP_WAIT = 0.02
# Seconds a request vLLM would schedule while its stage is under way waits for the stage
# (vLLM asks again each step); past them its load reads what the stage has not.
STAGE_PATIENCE = 2.0
# Seconds a waiting request's lookup answers vLLM's later asks (it asks in every step
# while the request cannot be scheduled): a spill-tier lookup is a read, a Redis one a
# round trip, on the scheduler's critical path. A stale answer costs at most a miss or a
# load error (recomputed), as an index not yet updated does.
LOOKUP_REUSE = 0.1

# Seconds between two hand-overs of the hooks' counters to vLLM's stats. They move in
# every step, and each hand-over is shipped to the engine core and on to the API server
# and summed in both: a hook's cost reaches ``/metrics`` up to this late (what the
# hooks cost in the last second before the engine goes idle, with its next step).
HOOK_REPORT_PERIOD = 1.0

# Where vLLM's hit sources name kvtier's tiers; Redis is a remote store.
HIT_SOURCES: dict[str, CacheHitSource] = {
    "cpu": CacheHitSource.HOST,
    "disk": CacheHitSource.DISK,
    "redis": CacheHitSource.EXTERNAL_UNSPECIFIED,
}


def timed(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Count the calls of a connector hook and the time spent in it (``HOOKS``)."""
    name = hook.__name__
    assert name in HOOKS, name

    @functools.wraps(hook)
    def run(self: KVTierConnector, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return hook(self, *args, **kwargs)
        finally:
            self.hook_ns[name] += time.perf_counter_ns() - start
            self.hook_calls[name] += 1

    return run


@dataclass(frozen=True)
class KVTierHandshake(KVConnectorHandshakeMetadata):
    """A worker's shard, sent to the scheduler once at start-up."""

    shard: ShardSpec


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """Each shard's report of one step (``ShardReport``), by shard; ``relays``: the
    async loads that ended on a holder since (``Relay``), for the other ranks of its
    group, by the group's ``Shard.keys``."""

    reports: dict[str, ShardReport]
    relays: dict[str, list[str]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """One report per shard: two of the same shard (a replayed one beside a newer
        one) are merged in the order they were made, not the order they came in."""
        assert isinstance(other, KVTierWorkerMeta)
        reports = dict(self.reports)
        for shard, report in other.reports.items():
            reports[shard] = reports[shard].merged(report) if shard in reports else report
        relays = {
            g: self.relays.get(g, []) + other.relays.get(g, [])
            for g in {**self.relays, **other.relays}
        }
        return KVTierWorkerMeta(reports, relays)


@dataclass(frozen=True)
class LoadSpec:
    """Load the hit of ``req_id`` into vLLM ``block_ids``: ``keys`` are the base keys of
    its blocks, ``parent`` that of the block before (None for block 0). A spec with no
    hit only reports ``block_ids`` as not loaded (the scheduler failed to pin them)."""

    req_id: str
    hit: ConnectorHit | None
    keys: list[bytes]
    parent: bytes | None
    block_ids: list[BlockIds]
    asynchronous: bool


@dataclass(frozen=True)
class SaveSpec:
    """Copy vLLM ``block_ids`` (chain positions ``start..``, base keys ``keys``, the first
    one's parent ``parent``, None for block 0) into the host pool."""

    req_id: str
    block_ids: list[BlockIds]
    keys: list[bytes]
    parent: bytes | None
    start: int


@dataclass(frozen=True)
class StageSpec:
    """Read the spill-tier part of waiting request ``req_id``'s hit into the host pools
    ahead of its load: ``hit`` holds each shard's runs from chain position
    ``hit.start``, ``keys`` the base keys of its blocks, ``parent`` that of the block
    before (None for block 0)."""

    req_id: str
    hit: ConnectorHit
    keys: list[bytes]
    parent: bytes | None


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """What the workers do this step: loads before the forward, saves after it, and
    ``reset``: drop the host pool first (the scheduler moved to a new key space).
    ``idle``: the step computes nothing (every request waits for its load).
    ``stages``: reads ahead for waiting requests; ``keep``: the base keys of waiting
    requests' hits, the first in vLLM's queue first, whose host blocks are queued again
    as the newest before those reads evict; ``unstaged``: requests with a stage that
    no longer wait (scheduled, or gone): their stages are no longer ahead of them.
    ``tails``: the last saved block (base key, chain position) of each request that
    finished, whose partial chunk goes to the write-through tiers after the saves.
    ``sending``: finished requests whose blocks vLLM holds until this step's saves have
    copied them (``finished_sending``). ``relays``: async loads a holder has ended, to
    relay to the other ranks of its group before this step's loads (``Relay``), by the
    group's ``Shard.keys``."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    tails: list[tuple[bytes, int]] = field(default_factory=list)
    reset: bool = False
    idle: bool = False
    stages: list[StageSpec] = field(default_factory=list)
    keep: list[list[bytes]] = field(default_factory=list)
    unstaged: list[str] = field(default_factory=list)
    sending: list[str] = field(default_factory=list)
    relays: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Lookup:
    """A lookup's answer for blocks ``start..wanted`` of a request, made at ``at``
    (``time.monotonic()``)."""

    at: float
    start: int
    wanted: int
    hit: ConnectorHit


@dataclass
class _RequestState:
    """Scheduler-side state of one request."""

    request: Request
    keys: list[bytes] = field(default_factory=list)  # of request.block_hashes, grown lazily
    num_saved: int = 0  # leading blocks handed to the workers to save
    hit: ConnectorHit | None = None  # the last lookup's answer, until it is pinned
    asynchronous: bool = False  # what the last lookup told vLLM
    loaded: dict[str, int] = field(default_factory=dict)  # blocks per tier being loaded
    loading: set[int] = field(default_factory=set)  # vLLM blocks of its load in flight
    failed: bool = False  # a load of it failed: it is not offered another (vLLM recomputes)
    saves: bool = True  # False once reset_cache ran: its KV may be the old weights'
    computing: bool = False  # the engine has scheduled tokens of it to compute
    start: int = 0  # vLLM's own hit in blocks, as of its last ask
    staging: set[str] = field(default_factory=set)  # shards whose stage of it is not over
    staged_at: float = 0.0  # when its stage went to the workers (time.monotonic())
    stage_due: float = 0.0  # when to look for a stage of it next (time.monotonic())
    held: list[bytes] = field(default_factory=list)  # base keys of its hit as of that look
    stage_blocks: int = 0  # blocks of its last stage (in the host pools once it is over)
    last_lookup: _Lookup | None = None  # reused for ``LOOKUP_REUSE`` seconds
    # (last base key, chain position) of each state it saved: their partial chunks
    # go to the write-through tiers once it finishes, as its chain's does.
    state_tails: list[tuple[bytes, int]] = field(default_factory=list)
    branch: int = 0  # positions held below where its chain parts from the states held


@dataclass(frozen=True)
class Shard:
    """This worker's part of the engine's KV: ``name`` its tensor- and pipeline-parallel
    rank among how many; ``keys`` the name its keys are made from, the same for ranks
    that hold the same KV (``replicas`` consecutive TP ranks: MLA's one latent on every
    rank, KV heads fewer than ranks), so that one copy is stored below; ``writes``:
    whether it writes that copy to the spill tiers (the first of its replicas).
    ``relayed``: every rank of its TP group holds the same KV, so the first one holds
    it below for all (host pool, reads and writes) and relays their loads to them
    (``kvtier.relay``)."""

    name: str
    keys: str
    writes: bool
    relayed: bool = False

    @classmethod
    def of(cls, parallel: ParallelConfig, replicas: int = 1) -> Shard:
        """From vLLM's process groups once they exist, else from ``parallel.rank`` (a
        worker built outside an engine)."""
        tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        if model_parallel_is_initialized():
            tp, pp = get_tp_group().rank_in_group, get_pp_group().rank_in_group
        else:
            tp, pp = parallel.rank % tp_size, parallel.rank // tp_size % pp_size
        name = f"tp{tp}/{tp_size} pp{pp}/{pp_size}"
        keys = f"tp{tp // replicas}/{tp_size // replicas} pp{pp}/{pp_size}"
        return cls(name, keys, tp % replicas == 0, 1 < replicas == tp_size)


def tp_groups() -> tuple[ProcessGroup, ProcessGroup]:
    """This worker's tensor-parallel group: on its device, and on the CPU."""
    group = get_tp_group()
    return group.device_group, group.cpu_group


def omp_cpus(environ: Mapping[str, str]) -> set[int] | None:
    """The CPUs vLLM's CPU backend bound a worker's OpenMP threads to, read from the
    variables it sets for each worker process (``KMP_AFFINITY``'s proclist,
    ``GOMP_CPU_AFFINITY``, or ``OMP_PLACES`` under ``OMP_PROC_BIND``); None if unbound."""
    if "proclist=[" in environ.get("KMP_AFFINITY", ""):
        text = environ["KMP_AFFINITY"].split("proclist=[", 1)[1].split("]", 1)[0]
    elif "GOMP_CPU_AFFINITY" in environ:
        text = environ["GOMP_CPU_AFFINITY"]
    elif environ.get("OMP_PROC_BIND", "false").lower() != "false":
        text = environ.get("OMP_PLACES", "")
    else:
        return None
    ranges = re.findall(r"(\d+)(?:-(\d+))?", text)
    cpus = {cpu for lo, hi in ranges for cpu in range(int(lo), int(hi or lo) + 1)}
    return cpus or None


def load_connector_config(extra: dict[str, Any]) -> KVTierConfig:
    """The kvtier config named by ``kv_connector_extra_config``: ``config`` (a YAML path)
    or ``kvtier`` (the same document inline), not both."""
    if "config" in extra and "kvtier" in extra:
        raise ValueError("kv_connector_extra_config: give either 'config' or 'kvtier', not both")
    if "config" in extra:
        return load_config(extra["config"])
    if "kvtier" in extra:
        return parse_config(extra["kvtier"], "kv_connector_extra_config.kvtier")
    raise ValueError(
        "kv_connector_extra_config needs 'config' (a kvtier YAML file, e.g. configs/vllm.yaml)"
    )


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """kvtier's host pool and spill tiers under vLLM's GPU blocks (see module docstring).
    With vLLM's hybrid KV cache manager, every KV cache group at once (``vllm_layout``)."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that did not happen is a later miss, nothing more

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cache_config = vllm_config.cache_config
        if not cache_config.enable_prefix_caching:
            raise ValueError("KVTierConnector needs vLLM's prefix caching (its block hashes)")
        hash_block = cache_config.hash_block_size or cache_config.block_size
        if hash_block != cache_config.block_size:
            raise ValueError(
                f"KVTierConnector needs block hashes per KV block: hash_block_size "
                f"{hash_block} != block_size {cache_config.block_size}"
            )
        self._groups = cached_groups(kv_cache_config)  # refuses what kvtier cannot hold
        self._position_groups = position_groups(self._groups)  # a position's blocks
        self._state_groups = state_groups(self._groups)  # a state's blocks, then the windows'
        self._windows = [(g, window_blocks(self._groups[g])) for g in window_groups(self._groups)]
        self._windowed = windowed([self._groups[g] for g in self._position_groups])
        self._keeps_states = bool(self._state_groups or self._windows)  # a hit ends at one
        # Windows kept as states of their own, where the scheduler picks the positions
        # (beside Mamba state vLLM picks them, and the windows go with its states).
        self._windows_alone = bool(self._windows and not self._state_groups)
        # vLLM maps load errors reported by block back to requests only for one group (for
        # more it stops the engine): a hybrid's loads are all asynchronous, and a failed
        # one is reported by request, so that vLLM recomputes it (``failed_recving``).
        self._by_request = len(self._groups) > 1
        self.config = load_connector_config(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = cache_config.block_size
        model = self.config.model
        self._name = f"vllm:{vllm_config.model_config.model if model == 'default' else model}"
        self.faults: Counter[str] = Counter()  # exceptions caught, by hook
        self.hook_calls: Counter[str] = Counter()  # calls of each timed hook
        self.hook_ns: Counter[str] = Counter()  # nanoseconds spent in each timed hook
        self.trace = Trace(self.config.metrics.trace_path)
        self._increments = Increments()  # of the counters handed to vLLM's stats
        self._hooks_handed = -math.inf  # when the hooks' counters were last handed to it
        # Scheduler side.
        self.index: ConnectorIndex | None = None
        self._requests: dict[str, _RequestState] = {}
        self._loads: list[LoadSpec] = []
        # Requests not yet scheduled, in arrival order (vLLM's queue, first come first
        # served): those that may wait, whose hits are staged and kept in that order.
        self._waiting: dict[str, _RequestState] = {}
        self._running: set[str] = set()  # requests of the last step, unless finished since
        self._unstaged: list[str] = []
        self._tails: list[tuple[bytes, int]] = []  # of requests finished (``KVTierMetadata``)
        self._final_saves: list[SaveSpec] = []  # of requests finished, whose blocks vLLM
        self._sending: list[str] = []  # holds until the workers have copied them
        self._relays: dict[str, list[str]] = {}  # async loads holders ended, by group
        # Each shard's last report applied (its origin and seq only): ``_fresh``.
        self._applied: dict[str, ShardReport] = {}
        cpu = self.config.tiers.cpu
        self._staging = cpu is not None and cpu.stage_share > 0
        self._pool_blocks = self._stage_room = 0  # what staging looks ahead over, in blocks
        self._reset = False
        # Worker side.
        self._cache: ConnectorCache | None = None
        self._async_loads: dict[str, list[int]] = {}  # started, not yet reported: blocks
        self._recving: set[str] = set()  # async loads over, not yet told to vLLM
        self._load_errors: set[int] = set()
        self._failed_requests: set[str] = set()  # whose load failed, for ``_by_request``
        self.num_load_errors = 0  # blocks reported to vLLM as not loaded, in all
        self._failed_now: set[str] = set()  # requests whose sync load failed this step
        self._sent: set[str] = set()  # finished requests whose held blocks are copied
        # Where every TP rank holds the same KV (``Shard.relayed``): the group's relay and
        # name (``Shard.keys``), the blocks of each load not relayed yet, and on the
        # holder the blocks each load that ended failed to load and the async ones among
        # them to report.
        self._relay: Relay | None = None
        self._relay_group = ""
        self._unrelayed: dict[str, list[BlockIds]] = {}
        self._failed_of: dict[str, int] = {}
        self._relay_ready: list[str] = []
        # kvtier's tiers as KV events (scheduler side), only with --kv-events-config.
        self.events: TierEvents | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._warn_about_settings()
            self.index = ConnectorIndex(self.config, self._name)
            if events_enabled(vllm_config):
                self.events = TierEvents.from_config(self.config)

    @property
    def cache(self) -> ConnectorCache:
        """This worker's host pool and spill tiers (after ``register_kv_caches``)."""
        if self._cache is None:
            raise RuntimeError("KVTierConnector: register_kv_caches has not run in this worker")
        return self._cache

    # ============================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Adopt vLLM's per-layer KV tensors and open this rank's tiers below them."""
        kv, layout = engine_kv(kv_caches, self._kv_cache_config, self._groups)
        shard = Shard.of(self._vllm_config.parallel_config, self._kv_cache_config.kv_tp_replicas)
        self._guarded("register_kv_caches", self._warn_about_binding)
        if shard.relayed:
            self._relay = Relay(kv, *tp_groups(), holder=shard.writes)
            self._relay_group = shard.keys
        if shard.relayed and not shard.writes:
            log.info(
                "kvtier: connector on %s (%s), shard %s: the first rank holds its KV below "
                "and relays its loads",
                kv.describe(),
                layout.describe(),
                shard.name,
            )
            return
        self._cache = ConnectorCache(
            self.config, kv, layout, self._name, shard.name, shard.keys, shard.writes
        )
        if events_enabled(self._vllm_config):
            self._cache.track_tiers()
        log.info(
            "kvtier: connector on %s (%s), shard %s%s",
            kv.describe(),
            layout.describe(),
            shard.name,
            "" if shard.writes else f" (a replica of {shard.keys}'s KV: stored once, by it)",
        )
        if self._relay is not None:
            log.info("kvtier: it holds its TP group's KV below and relays its loads")

    def unregister_kv_caches(self) -> None:
        """vLLM is about to unmap its KV tensors (sleep, or a discard of the KV cache):
        returns once no copy of a load or save in flight can touch them, and none starts
        until ``restore_kv_caches`` (the loads over are reported in the next
        ``get_finished``). The host pool and the tiers below keep what they hold."""
        if self._relay is not None:
            self._relay.attached = False
        if self._cache is not None:
            self._guarded("unregister_kv_caches", self._cache.detach)
            self._collect_loads()

    def restore_kv_caches(self) -> None:
        """vLLM mapped its KV tensors again (wake-up): loads and saves copy again."""
        if self._relay is not None:
            self._relay.attached = True
        if self._cache is not None:
            self._guarded("restore_kv_caches", self._cache.attach)

    def get_handshake_metadata(self) -> KVTierHandshake | None:
        return KVTierHandshake(self._cache.spec) if self._cache is not None else None

    @timed
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Relay the async loads a holder has ended, start this step's loads (host hits
        are copied now, spill hits on a worker) and relay the sync ones, then start its
        stages (on a worker too)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        if meta.reset and self._cache is not None:
            self._guarded("reset", self._cache.reset)
        if self._relay is not None and self._relay_group in meta.relays:
            self._relay_loads(meta.relays[self._relay_group])
        for spec in meta.loads:
            if spec.asynchronous:
                self._async_loads[spec.req_id] = spec.block_ids
            if self._relay is not None:
                self._unrelayed[spec.req_id] = spec.block_ids
            if self._cache is None:  # the holder's relay brings it
                continue
            if spec.hit is None or not self._guarded("start_load_kv", self._start_load, spec):
                self._fail_load(spec)
        sync = [spec.req_id for spec in meta.loads if not spec.asynchronous]
        if sync and self._cache is not None:  # this step computes with them: in place now
            copies = self._relay is not None  # the relay reads what the copies wrote
            self._guarded("start_load_kv", self._cache.wait_loads, None, sync, copies)
            self._collect_loads()  # see which sync loads failed before saving below
        if sync and self._relay is not None:
            self._relay_loads(sync)
        if self._cache is None:
            return
        for req_id in meta.unstaged:  # after the loads: they count the staged blocks used
            self._guarded("start_load_kv", self.cache.unstage, req_id)
        if meta.keep:  # before the stages evict
            self._guarded("start_load_kv", self._keep, meta.keep)
        for stage in meta.stages:  # after the loads: they are wanted now
            self._guarded("start_load_kv", self._stage, stage)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: sync loads are in place (or stream-ordered) already."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing per layer: ``wait_for_save`` copies all layers of a batch at once."""

    @timed
    def wait_for_save(self) -> None:
        """Copy the blocks that became full this step into the host pool, then write the
        partial last chunks of requests that finished to the write-through tiers."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self._sent.update(meta.sending)  # their copies are ordered before any reuse
        failed, self._failed_now = self._failed_now, set()
        if self._cache is None:  # the holder saves what this rank computes
            return
        for spec in meta.saves:
            if spec.req_id not in failed:  # else computed from bad KV
                self._guarded("wait_for_save", self._save, spec)
        for key, position in meta.tails:  # after the saves: the tails are host blocks
            self._guarded("wait_for_save", self._write_tail, key, position)

    @timed
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished requests whose blocks vLLM held for a save that is now copied, so
        that it may free them; requests whose async load is over, failed or not: failed
        blocks are in ``get_block_ids_with_load_errors``)."""
        if self._async_loads or (self._cache is not None and self._cache.staging):
            # vLLM calls this every step, and steps back to back while a request waits
            # for its load; the loads run on Python threads that need the GIL between
            # their reads. In a step that computes nothing, wait for them here (a while
            # at most: a new request may be waiting for the next step): the engine's
            # processes no longer spin against the reads for the cores, and a load is
            # reported in the step it ends in. Otherwise yield the GIL, or each of the
            # reads' turns waits for the interpreter's switch interval (5 ms).
            meta = self._get_connector_metadata()
            if isinstance(meta, KVTierMetadata) and meta.idle and self._cache is not None:
                self._guarded("get_finished", self._cache.wait_loads, IDLE_STEP_WAIT)
            else:
                time.sleep(0)
        self._collect_loads()
        recving, self._recving = self._recving, set()
        for req_id in recving if self.trace else ():
            self.trace.event("load_reported", req_id)
        sent, self._sent = self._sent, set()
        return sent, recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``'s requests, and of them those whose load failed, where load
        errors are reported by request (``_by_request``); vLLM recomputes them."""
        sent, recving = self.get_finished(finished_req_ids)
        failed, self._failed_requests = self._failed_requests, set()
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM blocks that did not load since the last call; vLLM recomputes them."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    @timed
    def build_connector_worker_meta(self) -> KVTierWorkerMeta | None:
        """What this worker's host pool gained and lost this step, for the index."""
        if self._cache is None:
            return None
        report = self._guarded("build_connector_worker_meta", self._cache.take_report)
        relays, self._relay_ready = self._relay_ready, []
        if not report and not relays:
            return None
        reports = {self._cache.shard: report} if report else {}
        return KVTierWorkerMeta(reports, {self._relay_group: relays} if relays else {})

    @timed
    def get_kv_connector_stats(self) -> KVTierStats | None:
        """What kvtier's counters in this process gained since the last step: the
        worker's tiers, load errors, pinned host slots (a level: its change) and blocks
        relayed to it, each half's caught faults, and every ``HOOK_REPORT_PERIOD`` the
        hooks' costs (this hook's as of its last call)."""
        flat = {FAULTS: sum(self.faults.values())}
        now = time.monotonic()
        if now - self._hooks_handed >= HOOK_REPORT_PERIOD:
            self._hooks_handed = now
            flat.update(hook_counters(self.hook_calls, self.hook_ns))
        tiers: dict[str, tuple[int, ...]] = {}
        if self._cache is not None or self._relay is not None:  # a worker's
            flat[LOAD_ERRORS] = self.num_load_errors
        if self._relay is not None and not self._relay.holder:
            flat[RELAYED] = self._relay.blocks
        if self._cache is not None:
            flat[PINNED] = self._cache.pinned_slots
            flat.update(stage_counters(self._cache.stage_counts))
            tiers = self._cache.counts()
        step = self._increments.take(flat, tiers)
        return KVTierStats(step) if step else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierStats:
        return KVTierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Finish the copies and writes in flight and close the tiers."""
        if self._cache is not None:
            self._cache.close()
        if self.index is not None:
            self.index.close()
        self.trace.close()

    def _start_load(self, spec: LoadSpec) -> bool:
        cache = self.cache
        keys, parent = self._shard_chain(spec.keys, spec.parent)
        cache.pin(spec.req_id, keys, parent, spec.hit, spec.block_ids)
        try:
            cache.load(spec.req_id, spec.asynchronous)
        except BaseException:
            cache.abandon(spec.req_id)
            raise
        return True

    def _keep(self, keep: list[list[bytes]]) -> None:
        cache = self.cache
        for keys in reversed(keep):  # the first request's blocks end up the newest
            cache.keep(cache.keys(keys))

    def _stage(self, spec: StageSpec) -> None:
        keys, parent = self._shard_chain(spec.keys, spec.parent)
        self.cache.stage(spec.req_id, keys, parent, spec.hit)

    def _shard_chain(self, keys: list[bytes], parent: bytes | None) -> tuple[list[bytes], bytes]:
        """This shard's keys of base ``keys``, and of ``parent`` (the root for block 0)."""
        cache = self.cache
        if parent is None:
            return cache.keys(keys), cache.root
        *shard, parent_key = cache.keys([*keys, parent])
        return shard, parent_key

    def _fail_load(self, spec: LoadSpec) -> None:
        """Report every block of ``spec`` as not loaded; an async load is over."""
        self._ended(spec.req_id, spec.block_ids)

    def _ended(self, req_id: str, failed: list[BlockIds]) -> None:
        """The load of ``req_id`` is over on this rank, ``failed`` its blocks not loaded:
        vLLM hears of it (an async one in the next ``get_finished``); a holder relays it
        to the other ranks (an async one once the scheduler has heard of it)."""
        if self._async_loads.pop(req_id, None) is not None:
            self._recving.add(req_id)
            if self._relay is not None and self._relay.holder:
                self._relay_ready.append(req_id)
        self._report_failed(req_id, failed)
        if self._relay is not None and self._relay.holder:
            self._failed_of[req_id] = len(failed)

    def _relay_loads(self, req_ids: list[str]) -> None:
        """Relay the loads of ``req_ids`` from the holder (every rank of the group runs
        this for the same loads, in this order); on the other ranks they end here, the
        blocks the holder did not send not loaded."""
        loads = [self._unrelayed.pop(r, None) for r in req_ids]
        valid = [
            len(blocks) - self._failed_of.pop(r, len(blocks)) if blocks is not None else 0
            for r, blocks in zip(req_ids, loads)
        ]
        got = self._guarded("start_load_kv", self._relay.run, loads, valid) or [0] * len(loads)
        if not self._relay.holder:
            for req_id, blocks, n in zip(req_ids, loads, got):
                if blocks is not None:
                    self._ended(req_id, blocks[n:])

    def _write_tail(self, key: bytes, position: int) -> None:
        self.cache.write_tail(self.cache.keys([key])[0], position)

    def _save(self, spec: SaveSpec) -> None:
        keys, parent = self._shard_chain(spec.keys, spec.parent)
        self.cache.save(spec.block_ids, keys, parent, spec.start)

    def _collect_loads(self) -> None:
        """Settle the loads that are over: async ones go to ``_recving`` (for the next
        ``get_finished``, whichever call collected them), failed blocks of every one to
        ``get_block_ids_with_load_errors``; a failed sync load's request is not saved.

        Should settling itself fail, every async load is waited for and reported failed
        (the engine recomputes it; no request waits forever, and no copy still running
        writes into blocks the engine recomputes)."""
        if self._cache is None or not (self._async_loads or self._cache.loading):
            return
        finished = self._guarded("get_finished", self._cache.finished_loads)
        if finished is None:
            self._guarded("get_finished", self._cache.wait_loads)
            finished = list(self._async_loads.items())
        for req_id, failed in finished:
            self._ended(req_id, failed)

    def _report_failed(self, req_id: str, blocks: list[BlockIds]) -> None:
        if blocks:
            if self._by_request:
                self._failed_requests.add(req_id)
            else:
                self._load_errors.update(engine_ids(blocks, self._windowed))
            self.num_load_errors += len(blocks)
            self._failed_now.add(req_id)

    # ============================================================ scheduler side
    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Every worker's shard, keyed by (pipeline rank, tensor rank)."""
        shards = [m.shard for _, m in sorted(metadata.items()) if isinstance(m, KVTierHandshake)]
        self.index.set_shards(shards)
        cpu = self.config.tiers.cpu
        if self._staging and shards:  # the blocks of the smallest shard's host pool
            self._pool_blocks = min(cpu.capacity // s.shape.block_nbytes for s in shards)
            self._stage_room = int(cpu.stage_share * self._pool_blocks)
        if self.events is not None:
            self.events.set_shards(shards)
        log.info("kvtier: scheduler index over %d shard(s)", len(shards))

    @timed
    def on_new_request(self, request: Request) -> None:
        """A request arrived: should it wait, the part of its hit on disk or in Redis is
        staged into the host pools (``tiers.cpu.stage_share``), so that it is a host hit
        by the time vLLM schedules it (``build_connector_meta``)."""
        state = self._requests[request.request_id] = _RequestState(request)
        if self._staging:
            self._waiting[request.request_id] = state

    @timed
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens past vLLM's own hit held below it; async when other requests are
        running (module docstring). A request that waits is looked up once per
        ``LOOKUP_REUSE`` seconds, not in every step. None while the request's stage is
        reading its spill part (at most ``STAGE_PATIENCE``): vLLM asks again in a later
        step, and by then it is a host hit."""
        state = self._state(request)
        state.hit, state.asynchronous = None, False
        if state.staging and time.monotonic() - state.staged_at < STAGE_PATIENCE:
            # Its stage is reading the spill part of its hit: vLLM asks again next step
            # (a lookup now would only find that part still below the host pools, and
            # vLLM asks for every waiting request in every step), never read it twice.
            if self.trace:
                self.trace.event("lookup", request.request_id, waiting=True)
            return None, False
        start = time.time()
        state.start = num_computed_tokens // self.block_size
        hit = self._guarded("get_num_new_matched_tokens", self._match, state)
        if self.trace:
            blocks = hit.blocks_per_tier() if hit else {}
            seconds = time.time() - start
            self.trace.event("lookup", request.request_id, start, seconds=seconds, blocks=blocks)
        if hit is None or not hit.num_positions:
            return 0, False
        # Async only while others run: then the load's copy (and reads) overlap their
        # step instead of lengthening it. With none running the load delays nothing but
        # its own request, which computes in this very step instead of a later one.
        # Always where a failed load can only be reported by request (``_by_request``).
        others_run = bool(self._running.difference((request.request_id,)))
        state.hit, state.asynchronous = hit, others_run or self._by_request
        if self._staging and hit.spill:  # staged at the step's end unless vLLM runs it now
            self._waiting.setdefault(request.request_id, state)
            if state.stage_due == math.inf:  # its last look for a stage found no hit
                state.stage_due = 0.0
        return hit.num_positions * self.block_size, state.asynchronous

    @timed
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Pin the hit for the blocks vLLM allocated; the workers load it this step."""
        state = self._state(request)
        hit, state.hit = state.hit, None
        self._waiting.pop(request.request_id, None)
        self._unstage(state)
        if not num_external_tokens or hit is None:
            return
        accepted, tables = num_external_tokens // self.block_size, blocks.get_block_ids()
        end = hit.start + accepted
        targets = self._targets(tables, hit.start, end)
        if not hit.pieces:
            hit = hit.truncated(accepted)
        elif accepted == hit.num_positions and self._windows_cover(tables, hit.start, end):
            ids = self._state_ids(tables, end - 1, hit.start)
            targets += [StatePiece(ids, j) for j in range(hit.pieces)] if ids else []
            hit = hit if ids else None
        else:  # vLLM took fewer blocks than the hit: kvtier holds no state after them
            hit = None
        spec = None
        if hit is not None:
            spec = self._guarded("update_state_after_alloc", self._load_spec, state, hit, targets)
        if spec is None:  # the workers must still hear of it: as blocks not loaded
            spec = LoadSpec(request.request_id, None, [], None, targets, state.asynchronous)
        self._loads.append(spec)
        state.loading = engine_ids(targets, self._windowed)
        if self.trace:
            self.trace.event(
                "load_planned", spec.req_id, blocks=len(targets), asynchronous=spec.asynchronous
            )

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """The tokens of this request's load, by the tier that holds them."""
        state = self._requests.get(request.request_id)
        out: dict[CacheHitSource, int] = {}
        for tier, blocks in (state.loaded if state else {}).items():
            source = HIT_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + blocks * self.block_size
        return out

    @timed
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        """This step's loads, the blocks each scheduled request fills this step, and the
        stages of waiting requests (``_plan_stages``)."""
        idle = scheduler_output.total_num_scheduled_tokens == 0
        stages, keep = self._plan_stages() if self._waiting else ([], [])
        meta = KVTierMetadata(
            loads=self._loads,
            reset=self._reset,
            idle=idle,
            stages=stages,
            keep=keep,
            unstaged=self._unstaged,
            tails=self._tails,
            saves=self._final_saves,
            sending=self._sending,
            relays=self._relays,
        )
        self._loads, self._reset, self._unstaged, self._tails = [], False, [], []
        self._final_saves, self._sending, self._relays = [], [], {}
        self._running = set(scheduler_output.num_scheduled_tokens)
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is not None and state.loaded and not state.computing and num_new:
                state.computing = True
                if self.trace:
                    self.trace.event("compute", req_id, tokens=num_new)
            if state is not None and state.saves:
                saves = self._guarded("build_connector_meta", self._save_specs, state, num_new)
                meta.saves.extend(saves or ())
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        for req_id, offers in block_state.boundary_state_offloads.items() if block_state else ():
            state = self._requests.get(req_id)
            if self._state_groups and state is not None and state.saves:
                saves = self._guarded("build_connector_meta", self._state_saves, state, offers)
                meta.saves.extend(saves or ())
        return meta

    @timed
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Apply the workers' reports to the index, and note the requests whose load
        failed: the same tier would likely fail their retry too, and a request holding
        blocks may not be admitted for another asynchronous load (vLLM's reservation
        rule), so their retry recomputes instead."""
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVTierWorkerMeta):
            # Every one, whether or not the request is still here: the other ranks wait
            # for it, and vLLM holds the request's blocks until they have it.
            for group, req_ids in meta.relays.items():
                relays = self._relays.setdefault(group, [])
                relays.extend(r for r in req_ids if r not in relays)
            reports = self._fresh(meta.reports)
            self._guarded("update_connector_output", self.index.apply, reports)
            if self.events is not None:
                self._guarded("take_events", self.events.apply, reports)
            for shard, report in reports.items():
                for req_id in report.staged:
                    if req_id in self._requests:
                        self._requests[req_id].staging.discard(shard)
        invalid = connector_output.invalid_block_ids
        failed = connector_output.failed_recving
        done = connector_output.finished_recving or ()
        for state in self._requests.values():
            if not state.loading:
                continue
            if state.loading & invalid or state.request.request_id in failed:
                state.failed = True
            if state.request.request_id in done or not state.asynchronous:
                state.loading = set()
        for req_id in done if self.trace else ():
            self.trace.event("load_over", req_id)

    @timed
    def request_finished(
        self, request: Request, block_ids: list[int] | tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM may free the blocks at once: a save's copy is ordered before their reuse.
        A stage of the request still under way need not be read any more. Where a window
        is kept as a state, one before the last position the request saved past its
        prompt (its reply's end: a conversation's next turn hits there) is saved next
        step, and vLLM holds the blocks until the workers have copied it (True)."""
        tables = block_ids if isinstance(block_ids, tuple) else (block_ids,)
        state = self._requests.pop(request.request_id, None)
        self._waiting.pop(request.request_id, None)
        self._running.discard(request.request_id)
        held = False
        if state is not None:
            self._unstage(state)
            if state.saves and state.num_saved:
                held = bool(self._guarded("request_finished", self._reply_window, state, tables))
                self._tails.append((state.keys[state.num_saved - 1], state.num_saved - 1))
                self._tails.extend(state.state_tails)
        return held, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished``, as vLLM's hybrid KV cache manager calls it."""
        return self.request_finished(request, block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """kvtier's tiers as KV events since the last step (``vllm_events``); vLLM
        publishes them with its own. None without ``--kv-events-config``."""
        if self.events is None:
            return ()
        events = self.events
        return self._guarded("take_events", lambda: to_vllm(events.take(), self.block_size)) or ()

    def reset_cache(self) -> bool:
        """Forget everything kvtier stored for this engine (vLLM's
        ``reset_prefix_cache(reset_connector=True)``, e.g. after a weight update): keys
        move to a new key space, the workers drop their host pools, and requests alive
        now are never saved again, since their KV may have been computed with the old
        weights. With ``hashing.on_engine_reset: keep`` (the weights never change across
        a reset) nothing changes."""
        if self.config.hashing.on_engine_reset == "keep":
            return True
        self.index.reset()
        if self.events is not None:
            self._guarded("take_events", self.events.reset)
        self._reset = True
        self._final_saves.clear()  # of the old weights' KV (vLLM still waits for _sending)
        for state in self._requests.values():
            state.keys.clear()
            state.hit = state.last_lookup = None
            state.saves = False
            self._unstage(state)
            state.held = []
        return True

    # ------------------------------------------------------------------ helpers
    def _fresh(self, reports: dict[str, ShardReport]) -> dict[str, ShardReport]:
        """The reports not applied yet: each shard's reports apply once, in order (a
        report that vLLM delivers again, or after a newer one, is dropped)."""
        fresh = {}
        for shard, report in reports.items():
            last = self._applied.get(shard)
            if last is None or report.after(last):
                fresh[shard] = report
                self._applied[shard] = ShardReport(origin=report.origin, seq=report.seq)
        return fresh

    def _match(self, state: _RequestState) -> ConnectorHit | None:
        """The hit past vLLM's own (``state.start``), looked up at most once per
        ``LOOKUP_REUSE`` seconds, and again as soon as the host pools no longer hold the
        host blocks of the last answer: a load of host blocks gone finds them below only
        by a spill lookup of its own, on the worker in the engine's step."""
        wanted = (state.request.num_tokens - 1) // self.block_size
        start = state.start
        if start >= wanted or state.failed:
            return None
        last, now, keys = state.last_lookup, time.monotonic(), self._keys(state)
        if (
            last
            and (last.start, last.wanted) == (start, wanted)
            and now - last.at < LOOKUP_REUSE
            and self.index.holds(self._hit_keys(state, last.hit)[: last.hit.host_blocks])
        ):
            return last.hit
        hit = self.index.lookup(keys[:wanted], start)
        if self._keeps_states:
            held, hit = hit.start + hit.num_blocks, self._state_hit(keys, hit)
            if self._windows_alone:
                # Where prompts part, the positions held run on past the last state: the
                # request saves a window there, so that the next one sharing them hits it.
                state.branch = held if held > hit.start + hit.num_positions else 0
        state.last_lookup = _Lookup(now, start, wanted, hit)
        return hit

    def _state_hit(self, keys: list[bytes], hit: ConnectorHit) -> ConnectorHit:
        """The longest part of ``hit`` (the blocks of ``keys`` past ``hit.start``) that
        ends at a position whose state every shard can load, with that state's pieces;
        a hit of nothing where no position of it has one. vLLM keeps few states: the
        last piece of every position's is looked for at once (one size query per spill
        tier), and only the positions found are looked up whole, the last first."""
        ends = range(hit.start + hit.num_blocks, hit.start, -1)
        pieces = [self.index.state_keys(keys[end - 1]) for end in ends]
        found = self.index.holds_each([p[-1] for p in pieces])
        for end, state, held in zip(ends, pieces, found):
            if not held:
                continue
            chain = [*keys[:end], *state]
            whole = self.index.lookup(chain, hit.start)
            if whole.num_blocks == len(chain) - hit.start:
                return replace(whole, pieces=len(state))
        return ConnectorHit(hit.start)

    def _hit_keys(self, state: _RequestState, hit: ConnectorHit) -> list[bytes]:
        """The base keys of ``hit``'s blocks: its chain positions', then its state's."""
        keys = self._keys(state)
        end = hit.start + hit.num_positions
        return keys[hit.start : end] + (self.index.state_keys(keys[end - 1]) if hit.pieces else [])

    def _targets(self, tables: Sequence[list[int]], start: int, end: int) -> list[BlockIds]:
        """The vLLM blocks of chain positions ``start..end``: one id per position group."""
        return list(zip(*(tables[g][start:end] for g in self._position_groups)))

    def _state_ids(
        self, tables: Sequence[list[int]], position: int, start: int, states: tuple[int, ...] = ()
    ) -> tuple[int, ...] | None:
        """A ``StatePiece``'s ids for the state after ``position``: the state groups'
        blocks there (``states``, else vLLM's table's), then each window's blocks up to
        it, the null block for those before ``start`` (vLLM's own blocks) or before the
        chain. None where a window's table no longer holds a block the state needs."""
        ids = list(states or (tables[g][position] for g in self._state_groups))
        for g, n in self._windows:
            for p in range(position - n + 1, position + 1):
                ids.append(tables[g][p] if p >= max(start, 0) else NULL_BLOCK)
                if p >= max(start, 0) and ids[-1] == NULL_BLOCK:
                    return None
        return tuple(ids)

    def _windows_cover(self, tables: Sequence[list[int]], start: int, end: int) -> bool:
        """Whether the windows before position ``end`` hold every block vLLM gave the
        window groups for positions ``start..end`` (it gives the earlier ones its null
        block): else a load would leave blocks that vLLM takes as computed unwritten."""
        return all(
            tables[g][p] == NULL_BLOCK for g, n in self._windows for p in range(start, end - n)
        )

    def _plan_stages(self) -> tuple[list[StageSpec], list[list[bytes]]]:
        """The stages of the waiting requests due for one, and the keys of their hits to
        keep, both in arrival order (the order vLLM schedules them in).

        A request is due on arrival and every ``LOOKUP_REUSE`` seconds while it waits,
        not in every step vLLM asks for it (one whose last look found no hit: once a
        lookup of vLLM's finds spill blocks). It is looked up again while the stages of
        the requests before it leave room in the share (a stage the workers had no
        room for is made, in queue order, once staged blocks are used or released),
        and the blocks of its hit (host and staged) are kept from the evictions of the
        stages and saves behind it while the hits before it leave room in the pool: when
        it is due, and in every step that plans a stage. A
        long queue costs no lookups past the share, and one whose lookup found nothing
        is not looked up again here (vLLM's own lookup finds what has come since)."""
        stages, due, walked, now = [], [], [], time.monotonic()
        staged = held = 0  # blocks that the requests walked so far stage, and hold
        for state in self._waiting.values():
            if held >= self._pool_blocks:
                break  # the hits ahead fill the pool
            if not state.staging and state.stage_due <= now:
                state.stage_due = now + LOOKUP_REUSE
                if staged < self._stage_room:
                    stage = self._guarded("build_connector_meta", self._stage_spec, state)
                    stages += [stage] if stage is not None else []
                due += [state.held] if state.held else []
            walked.append(state)
            staged += state.stage_blocks
            held += len(state.held)
        if stages:  # they evict: every hit walked is kept from them, not only those due
            return stages, [state.held for state in walked if state.held]
        return stages, due

    def _stage_spec(self, state: _RequestState) -> StageSpec | None:
        """The stage of the spill-tier part of a waiting request's hit past vLLM's own
        (as of vLLM's last ask; block 0 before it asked), if any; notes the base keys of
        the whole hit (``state.held``), and a request with no hit as never due again."""
        hit = self._match(state) if self.index.tiers else None
        if hit is None or not hit.num_blocks:
            state.stage_due, state.held = math.inf, []
            return None
        state.held = self._hit_keys(state, hit)
        if not hit.spill_blocks:
            return None
        state.hit = state.last_lookup = None  # staged once: a later lookup gives a new hit
        keys = self._keys(state)[: hit.start] + state.held  # the chain the hit ends
        start = hit.start + hit.host_blocks
        parent = keys[start - 1] if start else None
        spill = ConnectorHit(start, 0, hit.spill, pieces=hit.pieces)
        req_id = state.request.request_id
        state.staging = {shard.name for shard in self.index.shards}
        state.staged_at = time.monotonic()
        state.stage_blocks = spill.num_blocks
        if self.trace:
            self.trace.event("stage_planned", req_id, blocks=spill.num_blocks)
        self._note(state, start, hit.start + hit.num_positions)
        return StageSpec(req_id, spill, keys[start : start + spill.num_blocks], parent)

    def _unstage(self, state: _RequestState) -> None:
        """The request no longer waits for a stage of it (vLLM scheduled it, it went away,
        or the key space moved): the workers stop reading its stage if they have not
        begun, and its staged blocks leave the stage share."""
        if state.staging or state.stage_blocks:
            self._unstaged.append(state.request.request_id)
            state.staging.clear()
            state.stage_blocks = 0

    def _load_spec(
        self, state: _RequestState, hit: ConnectorHit, targets: list[tuple[int, ...]]
    ) -> LoadSpec:
        start = hit.start
        state.loaded = hit.truncated(hit.num_positions).blocks_per_tier()
        self._note(state, start, start + hit.num_positions)
        parent = self._keys(state)[start - 1] if start else None
        req_id = state.request.request_id
        keys = self._hit_keys(state, hit)
        return LoadSpec(req_id, hit, keys, parent, targets, state.asynchronous)

    def _save_specs(self, state: _RequestState, num_new: int) -> list[SaveSpec]:
        """The saves of the blocks that become full this step: a run of positions per
        spec, a position that a sliding window's table no longer holds left out (it fell
        out of the window before this step: the blocks of vLLM's own hit; the position
        was saved when it was computed, or is not a hit below). A model whose windows
        are kept as states (and that has no Mamba state, whose positions vLLM picks)
        saves a window before the prompt's last full block, before the last block a
        repeat of the prompt can hit, and before where its prompt parts from the
        positions held (``_RequestState.branch``), when this step computes them."""
        request = state.request
        full = min(
            len(request.block_hashes),
            (request.num_computed_tokens + num_new) // self.block_size,
        )
        if full <= state.num_saved:
            return []
        keys = self._keys(state)
        start = state.num_saved
        tables = self._kv_cache_manager.get_block_ids(request.request_id)
        table = self._targets(tables, start, full)
        state.num_saved = full
        self._note(state, start, full)
        specs, first = [], start
        for i in range(start, full + 1):
            if i == full or not holds_all(table[i - start], self._windowed):
                if i > first:
                    parent = keys[first - 1] if first else None
                    ids = table[first - start : i - start]
                    specs.append(SaveSpec(request.request_id, ids, keys[first:i], parent, first))
                first = i + 1
        if self._windows_alone:
            for end in (e for e in self._prompt_windows(state) if start < e <= full):
                specs.extend(self._state_save(state, end - 1, self._state_ids(tables, end - 1, 0)))
        return specs

    def _prompt_windows(self, state: _RequestState) -> list[int]:
        """The ends (in positions) of the windows a request keeps as it computes its
        prompt, in order: where its prompt parts from the positions held, the last
        block a repeat of it can hit, its last full block."""
        prompt = state.request.num_prompt_tokens
        ends = {state.branch, (prompt - 1) // self.block_size, prompt // self.block_size}
        return sorted(ends)

    def _state_saves(
        self, state: _RequestState, offers: list[tuple[int, int, int]]
    ) -> list[SaveSpec]:
        """The saves of the states vLLM committed for the request this step (``offers``:
        (group, vLLM block, tokens before the state)): each whole-block position's, as
        its pieces after that position's block; a partial block's state has no key."""
        by_tokens: dict[int, dict[int, int]] = {}
        for group, block, tokens in offers:
            by_tokens.setdefault(tokens, {})[group] = block
        # The windows' blocks go with each state (none to look up without windows).
        tables = (
            self._kv_cache_manager.get_block_ids(state.request.request_id) if self._windows else ()
        )
        specs = []
        for tokens, blocks in sorted(by_tokens.items()):
            position = tokens // self.block_size - 1
            if tokens % self.block_size or set(blocks) != set(self._state_groups):
                continue
            ids = tuple(blocks[g] for g in self._state_groups)
            specs.extend(
                self._state_save(state, position, self._state_ids(tables, position, 0, ids))
            )
        return specs

    def _state_save(
        self, state: _RequestState, position: int, ids: tuple[int, ...] | None
    ) -> list[SaveSpec]:
        """The save of the state after ``position`` from vLLM blocks ``ids``
        (``_state_ids``), as its pieces after that position's block; none where the
        position is not saved (the state would never be a hit) or a window's table no
        longer holds a block the state needs."""
        keys = self._keys(state)
        if ids is None or not 0 <= position < min(state.num_saved, len(keys)):
            return []
        pieces = self.index.state_keys(keys[position])
        block_ids: list[BlockIds] = [StatePiece(ids, j) for j in range(len(pieces))]
        state.state_tails.append((pieces[-1], position + len(pieces)))
        return [SaveSpec(state.request.request_id, block_ids, pieces, keys[position], position + 1)]

    def _reply_window(self, state: _RequestState, tables: tuple[list[int], ...]) -> bool:
        """Whether the request's last saved position is past its prompt's and gets a
        window of its own (``_save_specs`` saved those up to the prompt's end): then its
        save goes to the workers next step, with the request among those they report
        copied (vLLM holds its blocks until then)."""
        end = state.num_saved
        if not self._windows_alone or end <= state.request.num_prompt_tokens // self.block_size:
            return False
        save = self._state_save(state, end - 1, self._state_ids(tables, end - 1, 0))
        if save:
            self._final_saves.extend(save)
            self._sending.append(state.request.request_id)
        return bool(save)

    def _note(self, state: _RequestState, start: int, end: int) -> None:
        """Blocks ``start..end`` of the request go to the workers: their KV events may
        need their hashes and tokens."""
        if self.events is not None:
            args = state.request, state.keys, start, end, self.block_size
            self._guarded("take_events", self.events.note, *args)

    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(request)
        return state

    def _keys(self, state: _RequestState) -> list[bytes]:
        """Base keys of all of the request's block hashes so far (extended as it grows)."""
        hashes = state.request.block_hashes
        if len(state.keys) < len(hashes):
            state.keys.extend(self.index.keys(hashes[len(state.keys) :]))
        return state.keys

    def _guarded(self, hook: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, or None when it raises: kvtier never takes the engine down. The
        first failure of each hook is logged with its traceback, later ones counted."""
        try:
            return fn(*args)
        except Exception:
            self.faults[hook] += 1
            if self.faults[hook] == 1:
                log.exception(
                    "kvtier: %s failed; the engine goes on without kvtier's part of it "
                    "(further failures of this hook are counted, not logged)",
                    hook,
                )
            return None

    def _warn_about_binding(self) -> None:
        """Warn once if vLLM bound this worker's compute threads to every CPU the process
        has. Its CPU backend keeps cores free for its other processes (engine core, API
        server), one more per rank when any KV connector is configured; where that would
        keep every core, it keeps none and binds the compute threads to all of them, and
        each decode step then contends with those processes."""
        if not current_platform.is_cpu() or not hasattr(os, "sched_getaffinity"):
            return
        bound, cpus = omp_cpus(os.environ), process_cpus()
        if bound is not None and len(cpus) > 1 and cpus <= bound:
            log.warning(
                "kvtier: vLLM bound this worker's compute threads to every CPU of the "
                "process (%s), beside its engine-core and API-server processes: with a KV "
                "connector configured its CPU backend reserves one more core per rank for "
                "them, which on %d CPUs reserves all of them, and decode steps slow down. "
                "Set VLLM_CPU_NUM_OF_RESERVED_CPU=1 (vLLM's reservation without a "
                "connector) or bind the threads with VLLM_CPU_OMP_THREADS_BIND.",
                ",".join(map(str, sorted(bound))),
                len(cpus),
            )

    def _warn_about_settings(self) -> None:
        cache_config = self._vllm_config.cache_config
        algo = cache_config.prefix_caching_hash_algo
        if algo.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None:
            log.warning(
                "kvtier: prefix_caching_hash_algo %s without PYTHONHASHSEED gives block "
                "hashes that differ per process: disk and Redis hits are lost on restart "
                "and never shared between engines. Set PYTHONHASHSEED or use sha256.",
                algo,
            )
        policy = self._kv_transfer_config.kv_load_failure_policy
        if policy != "recompute":
            log.warning(
                "kvtier: kv_load_failure_policy is %r: a block that does not load (a corrupt "
                "value, an unreachable Redis) fails its request. Set it to 'recompute' to "
                "have vLLM compute such blocks instead.",
                policy,
            )
