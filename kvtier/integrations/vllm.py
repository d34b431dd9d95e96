"""kvtier as vLLM's KV cache backend: ``KVTierConnector``, a vLLM (0.32) KV connector.

vLLM keeps its GPU blocks and its prefix cache; kvtier adds the host pool and the
spill tiers below them (``kvtier.connector.ConnectorCache``), keyed by vLLM's own
chained block hashes. Load it with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": "configs/vllm.yaml"}}'

Scheduler side. ``get_num_new_matched_tokens`` looks up the blocks past vLLM's own
hit (never the prompt's last token: vLLM needs its logits); a hit that needs spill
reads loads asynchronously, a host-only hit is copied before the step's forward.
``update_state_after_alloc`` pins the hit for the blocks vLLM allocated, and
``build_connector_meta`` hands the worker this step's loads and the blocks that
become full this step (to save once the forward has written them).

Worker side. ``register_kv_caches`` adopts vLLM's per-layer KV tensors (standardized
views with blocks on dim 0, any strides; on CPU ``[blocks, kv_heads, block_size,
2 * head_size]``). ``start_load_kv`` starts the loads, ``wait_for_save`` copies the
step's new full blocks into the host pool (on CUDA on the offload stream, with
vLLM's stream waiting on its event, so no block can be reused before it is copied);
``get_finished`` reports finished async loads and ``get_block_ids_with_load_errors``
every block that did not load, so vLLM recomputes it.

One process. The scheduler side reads the host pool the worker side fills, so both
must run in one process: tensor and pipeline parallel size 1 (the engine core runs
the worker in its process then, with or without ``VLLM_ENABLE_V1_MULTIPROCESSING``).
A larger world size is refused at start-up with an error saying so.

Keys. With vLLM's default sha256 block hashes, keys are the same in every process,
so engines sharing a disk or Redis tier share prefixes. With an xxhash algorithm
vLLM seeds its hashes per process unless ``PYTHONHASHSEED`` is set: the connector
warns, and the spill tiers then only ever hit within one process.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.config import KVTierConfig, load_config, parse_config
from kvtier.connector import ConnectorCache, ConnectorHit, EngineKV, engine_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# Where vLLM's hit sources name kvtier's tiers; Redis is a remote store.
HIT_SOURCES: dict[str, CacheHitSource] = {
    "cpu": CacheHitSource.HOST,
    "disk": CacheHitSource.DISK,
    "redis": CacheHitSource.EXTERNAL_UNSPECIFIED,
}


@dataclass
class _Engine:
    """What one engine's scheduler and worker sides share in this process."""

    cache: ConnectorCache
    delayed: set[str] = field(default_factory=set)  # request_finished returned True


# Each engine's shared state, by kv_transfer_config.engine_id: the worker side makes it
# in register_kv_caches, the scheduler side looks it up.
_engines: dict[str, _Engine] = {}
_engines_lock = threading.Lock()


@dataclass(frozen=True)
class LoadSpec:
    """Load request ``req_id``'s pinned hit; ``asynchronous`` when it reads spill tiers."""

    req_id: str
    asynchronous: bool


@dataclass(frozen=True)
class SaveSpec:
    """Copy vLLM ``block_ids`` (chain positions ``start..``) into the host pool."""

    req_id: str
    block_ids: list[int]
    keys: list[bytes]
    parent: bytes
    start: int


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """What the worker does this step: loads before the forward, saves after it."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _RequestState:
    """Scheduler-side state of one request."""

    request: Request
    keys: list[bytes] = field(default_factory=list)  # of request.block_hashes, grown lazily
    num_saved: int = 0  # leading blocks handed to the worker to save
    hit: ConnectorHit | None = None  # the last lookup's answer, until it is pinned
    loaded: dict[str, int] = field(default_factory=dict)  # blocks per tier being loaded
    saves: bool = True  # False once reset_cache ran: its KV may be the old weights'


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


class KVTierConnector(KVConnectorBase_V1):
    """kvtier's host pool and spill tiers under vLLM's GPU blocks (see module docstring)."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that did not happen is a later miss, nothing more

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        world = vllm_config.parallel_config.world_size
        if world != 1:
            raise ValueError(
                f"KVTierConnector runs the scheduler and worker sides in one process; "
                f"it needs tensor and pipeline parallel size 1, got a world size of {world}"
            )
        cache_config = vllm_config.cache_config
        if not cache_config.enable_prefix_caching:
            raise ValueError("KVTierConnector needs vLLM's prefix caching (its block hashes)")
        hash_block = cache_config.hash_block_size or cache_config.block_size
        if hash_block != cache_config.block_size:
            raise ValueError(
                f"KVTierConnector needs block hashes per KV block: hash_block_size "
                f"{hash_block} != block_size {cache_config.block_size}"
            )
        algo = cache_config.prefix_caching_hash_algo
        if algo.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None:
            log.warning(
                "kvtier: prefix_caching_hash_algo %s without PYTHONHASHSEED gives block "
                "hashes that differ per process: disk and Redis hits are lost on restart "
                "and never shared between engines. Set PYTHONHASHSEED or use sha256.",
                algo,
            )
        if role is KVConnectorRole.SCHEDULER and (
            self._kv_transfer_config.kv_load_failure_policy != "recompute"
        ):
            log.warning(
                "kvtier: kv_load_failure_policy is %r: a block that does not load (a corrupt "
                "value, an unreachable Redis) fails its request. Set it to 'recompute' to "
                "have vLLM compute such blocks instead.",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        self.config = load_connector_config(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = cache_config.block_size
        self._engine_id = self._kv_transfer_config.engine_id
        self._engine: _Engine | None = None
        # Scheduler side.
        self._requests: dict[str, _RequestState] = {}
        self._loads: list[LoadSpec] = []
        # Worker side.
        self._async_loads: set[str] = set()  # started, not yet over
        self._recving: set[str] = set()  # async loads over, not yet told to vLLM
        self._load_errors: set[int] = set()
        self.num_load_errors = 0  # blocks reported to vLLM as not loaded, in all
        self._failed_now: set[str] = set()  # requests whose sync load failed this step
        self._finishing: set[str] = set()  # finished requests whose free may be delayed

    @property
    def engine(self) -> _Engine:
        """State shared with the other side (made by ``register_kv_caches``)."""
        if self._engine is None:
            with _engines_lock:
                self._engine = _engines.get(self._engine_id)
            if self._engine is None:
                raise RuntimeError(
                    "KVTierConnector: no KV caches registered in this process; the scheduler "
                    "and worker sides must share a process (world size 1)"
                )
        return self._engine

    @property
    def cache(self) -> ConnectorCache:
        """The engine's host pool and spill tiers."""
        return self.engine.cache

    # ============================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Adopt vLLM's per-layer KV tensors and open the tiers below them."""
        names = sorted(kv_caches, key=extract_layer_index)
        kv = EngineKV([kv_caches[name] for name in names])
        model = self._vllm_config.model_config
        parallel = self._vllm_config.parallel_config
        layout = engine_layout(
            kv, self.block_size, model.get_num_kv_heads(parallel), model.get_head_size()
        )
        name = self.config.model if self.config.model != "default" else model.model
        cache = ConnectorCache(self.config, kv, layout, f"vllm:{name}:{kv.describe()}")
        self._engine = _Engine(cache)
        with _engines_lock:
            _engines[self._engine_id] = self._engine
        log.info("kvtier: connector on %s (%s)", kv.describe(), layout.describe())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads: host hits are copied now, spill hits on a worker."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        for spec in meta.loads:
            if spec.asynchronous:
                self._async_loads.add(spec.req_id)
            self.cache.load(spec.req_id)
        if any(not spec.asynchronous for spec in meta.loads):
            self._collect_loads()  # see which sync loads failed before saving below

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

    def wait_for_save(self) -> None:
        """Copy the blocks that became full this step into the host pool."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        for spec in meta.saves:
            if spec.req_id in self._failed_now:
                continue  # its KV past the failed blocks was computed from bad KV
            self.cache.save(spec.req_id, spec.block_ids, spec.keys, spec.parent, spec.start)
        self._failed_now.clear()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose delayed free may happen now, requests whose async load is over,
        failed or not: its failed blocks are in ``get_block_ids_with_load_errors``)."""
        if self._async_loads:
            # vLLM calls this every step, and steps back to back while a request waits
            # for its load; the loads run on Python threads that need the GIL between
            # their reads. Yield it here, or each of their turns waits for the
            # interpreter's switch interval (5 ms) and a load of a few MiB takes ~1 s.
            time.sleep(0)
        self._collect_loads()
        recving, self._recving = self._recving, set()
        engine = self.engine
        with _engines_lock:
            # request_finished ran (and decided) before vLLM passes an id in here.
            self._finishing = (self._finishing | finished_req_ids) & engine.delayed
            sending = {r for r in self._finishing if not engine.cache.saving(r)}
            self._finishing -= sending
            engine.delayed -= sending
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM blocks that did not load since the last call; vLLM recomputes them."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Finish the copies and writes in flight and close the tiers (worker side)."""
        if self._role is KVConnectorRole.WORKER and self._engine is not None:
            with _engines_lock:
                _engines.pop(self._engine_id, None)
            self._engine.cache.close()

    def _collect_loads(self) -> None:
        """Settle the loads that are over: async ones go to ``_recving`` (for the next
        ``get_finished``, whichever call collected them), failed blocks of every one to
        ``get_block_ids_with_load_errors``; a failed sync load's request is not saved."""
        for req_id, failed in self.cache.finished_loads():
            self._load_errors.update(failed)
            self.num_load_errors += len(failed)
            if req_id in self._async_loads:
                self._async_loads.discard(req_id)
                self._recving.add(req_id)
            elif failed:
                self._failed_now.add(req_id)

    # ============================================================ scheduler side
    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = _RequestState(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens past vLLM's own hit held below it; async when spill tiers must be read."""
        state = self._state(request)
        wanted = (request.num_tokens - 1) // self.block_size
        start = num_computed_tokens // self.block_size
        if start >= wanted:
            state.hit = None
            return 0, False
        state.hit = self.cache.lookup(self._keys(state)[:wanted], start)
        n = state.hit.num_blocks * self.block_size
        return n, bool(n and state.hit.spill)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Pin the hit for the blocks vLLM allocated; the worker loads it this step."""
        state = self._state(request)
        hit, state.hit = state.hit, None
        if not num_external_tokens or hit is None:
            return
        hit = hit.truncated(num_external_tokens // self.block_size)
        table = blocks.get_block_ids()[0]
        targets = table[hit.start : hit.start + hit.num_blocks]
        self.cache.pin(request.request_id, state.keys, hit, targets)
        state.loaded = hit.blocks_per_tier()
        self._loads.append(LoadSpec(request.request_id, bool(hit.spill)))

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

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        """This step's loads, and the blocks each scheduled request fills this step."""
        meta = KVTierMetadata(loads=self._loads)
        self._loads = []
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None or not state.saves:
                continue
            request = state.request
            full = min(
                len(request.block_hashes),
                (request.num_computed_tokens + num_new) // self.block_size,
            )
            if full <= state.num_saved:
                continue
            keys = self._keys(state)
            start = state.num_saved
            table = self._kv_cache_manager.get_block_ids(req_id)[0]
            meta.saves.append(
                SaveSpec(
                    req_id,
                    table[start:full],
                    keys[start:full],
                    keys[start - 1] if start else self.cache.root,
                    start,
                )
            )
            state.num_saved = full
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Free the blocks now unless a save is still copying out of them (CUDA)."""
        self._requests.pop(request.request_id, None)
        engine = self.engine
        with _engines_lock:
            delay = engine.cache.saving(request.request_id)
            if delay:
                engine.delayed.add(request.request_id)
        return delay, None

    def reset_cache(self) -> bool:
        """Forget everything kvtier stored for this engine (vLLM's
        ``reset_prefix_cache(reset_connector=True)``, e.g. after a weight update): keys
        move to a new namespace (``ConnectorCache.reset``), and requests alive now are
        never saved again, since their KV may have been computed with the old weights."""
        self.cache.reset()
        for state in self._requests.values():
            state.keys.clear()
            state.hit = None
            state.saves = False
        return True

    # ------------------------------------------------------------------ helpers
    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(request)
        return state

    def _keys(self, state: _RequestState) -> list[bytes]:
        """Keys of all of the request's block hashes so far (extended as it grows)."""
        hashes = state.request.block_hashes
        if len(state.keys) < len(hashes):
            state.keys.extend(self.cache.keys(hashes[len(state.keys) :]))
        return state.keys
