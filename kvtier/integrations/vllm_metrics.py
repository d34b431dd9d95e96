"""kvtier's counters through vLLM's connector stats, into vLLM's own ``/metrics``.

The counters live where the work happens: each worker's host pool and spill tiers,
and the hooks of both connector halves. Each step a connector hands vLLM what its
counters gained since the last step (``KVTierStats``); vLLM sums them over the workers
and the scheduler, logs them with its periodic stats, and records them into the
Prometheus counters ``KVTierPromMetrics`` registers (``vllm:kvtier_<counter>_total``,
labelled by tier, and ``vllm:kvtier_load_error_blocks_total`` /
``vllm:kvtier_faults_total``). Counts of all ranks are summed: with tensor parallel
size 2 a block loaded on both ranks counts twice.

The payload is a flat ``{name: int}`` dict (``"<tier>.<counter>"``, ``LOAD_ERRORS``,
``FAULTS``, ``"hook.<hook>.calls"`` / ``"hook.<hook>.us"``): plain data, so that it
crosses vLLM's process boundaries as it is. One entry is a level, not a count:
``PINNED``, the host slots that copies in flight hold, reported as its change, so that
the same sums give the gauge ``vllm:kvtier_host_pinned_blocks`` (0 whenever nothing is
being loaded, staged or saved; more at rest is a leak).

Hook costs. Every connector hook that does work counts its calls and the time spent
in it (``vllm:kvtier_hook_calls_total`` / ``vllm:kvtier_hook_seconds_total``, labelled
by hook): what the connector costs the engine's step, per hook, scheduler and worker
side alike (``benchmarks/bench_vllm_serve.py`` prints it per step). They move in every
step, so they are handed over at most once a second (``HOOK_REPORT_PERIOD``); a step
in which no other counter moved hands vLLM no stats at all.

Under vLLM's ``MultiConnector`` the API server rebuilds each child's stats by the
child's class name from vLLM's connector registry
(``KVConnectorFactory.get_connector_class_by_name``), which holds only the connectors
registered in that process, not one loaded by ``kv_connector_module_path``: an
unregistered child's first stats end the server's output handler (every request
fails from then on). So importing this module (the connector does, and vLLM imports
the connector in the API server when it builds the children's Prometheus metrics)
registers ``KVTierConnector`` under its class name.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvtier.connector import StageCounts
from kvtier.metrics import COUNTS
from kvtier.prometheus import COUNTERS

if TYPE_CHECKING:
    from vllm.config import VllmConfig

LOAD_ERRORS = "load_error_blocks"  # blocks reported to vLLM as not loaded
FAULTS = "faults"  # exceptions a connector hook caught
PINNED = "host_pinned_blocks"  # host slots held by copies in flight: a gauge
RELAYED = "relayed_blocks"  # blocks a rank received from its group's holder (``Relay``)
TIERS = ("cpu", "disk", "redis")
# The hooks that are timed, by the side of vLLM that calls them (vLLM's per-layer
# hooks are not: kvtier does nothing in them, and a timer would cost more than they do).
# ``STATS_HOOK`` runs on both sides, every step; a call's own time is reported by the
# next one.
SCHEDULER_HOOKS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)
WORKER_HOOKS = (
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "build_connector_worker_meta",
)
STATS_HOOK = "get_kv_connector_stats"
HOOKS = (*SCHEDULER_HOOKS, *WORKER_HOOKS, STATS_HOOK)
EXTRA: dict[str, str] = {
    LOAD_ERRORS: "Blocks kvtier reported to vLLM as not loaded (vLLM recomputed them).",
    FAULTS: "Exceptions inside kvtier that its connector hooks caught (each a miss or a "
    "load error).",
    "staged_blocks": "Blocks read from disk or Redis into the host pool while their "
    "request waited to be scheduled.",
    "staged_used_blocks": "Staged blocks that a request's load then used.",
    "staged_evicted_unused_blocks": "Staged blocks evicted from the host pool before any "
    "load used them.",
    RELAYED: "Blocks that ranks of a tensor-parallel group whose ranks hold the same KV (MLA) "
    "received from the rank that holds it below, instead of reading them below.",
}


def stage_counters(counts: StageCounts) -> dict[str, int]:
    """The flat counters of a shard's stages."""
    return {
        "staged_blocks": counts.staged,
        "staged_used_blocks": counts.used,
        "staged_evicted_unused_blocks": counts.evicted_unused,
    }


def hook_counters(calls: Mapping[str, int], ns: Mapping[str, int]) -> dict[str, int]:
    """The flat counters of the hooks' calls and time in them (µs)."""
    out = {f"hook.{hook}.calls": n for hook, n in calls.items()}
    out.update({f"hook.{hook}.us": t // 1000 for hook, t in ns.items()})
    return out


class Increments:
    """What a process's counters gained since the last ``take``: the payload of one
    step's ``KVTierStats``. Cheap enough for every engine step: each tier's counters are
    compared as one tuple, and only those that moved are named."""

    def __init__(self) -> None:
        self._flat: dict[str, int] = {}
        self._tiers: dict[str, tuple[int, ...]] = {}

    def take(self, flat: Mapping[str, int], tiers: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
        """The gains of counters ``flat`` (by name; one left out keeps its last value)
        and of each tier's ``tiers`` (``TierStats.counts``, named ``"<tier>.<counter>"``)."""
        last = self._flat
        step = {k: v - last.get(k, 0) for k, v in flat.items() if v != last.get(k, 0)}
        last.update(flat)
        for tier, now in tiers.items():
            before = self._tiers.get(tier) or (0,) * len(now)
            if now != before:
                keys = _tier_keys(tier)
                step.update({k: a - b for k, a, b in zip(keys, now, before) if a != b})
                self._tiers[tier] = now
        return step


@functools.cache
def _tier_keys(tier: str) -> tuple[str, ...]:
    return tuple(f"{tier}.{name}" for name in COUNTS)


@dataclass
class KVTierStats(KVConnectorStats):
    """One step's (or, aggregated, one interval's) counter increments."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, n in other.data.items():
            self.data[name] = self.data.get(name, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVTierPromMetrics(KVConnectorPromMetrics):
    """vLLM Prometheus counters for kvtier's per-tier counters and its connector's."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, dict[int, PromMetric]] = {}
        for name, doc in {**COUNTERS, **EXTRA}.items():
            per_tier = name in COUNTERS
            labels = [*labelnames, "tier"] if per_tier else labelnames
            metric = self._counter_cls(name=f"vllm:kvtier_{name}", documentation=doc,
                                       labelnames=labels)  # fmt: skip
            for tier in TIERS if per_tier else (None,):
                values = {i: [*v, tier] if tier else v for i, v in per_engine_labelvalues.items()}
                key = f"{tier}.{name}" if tier else name
                self._metrics[key] = create_metric_per_engine(metric, values)
        for what, doc in (("calls", "Calls of the connector's hook."),
                          ("seconds", "Seconds spent in the connector's hook.")):  # fmt: skip
            metric = self._counter_cls(name=f"vllm:kvtier_hook_{what}", documentation=doc,
                                       labelnames=[*labelnames, "hook"])  # fmt: skip
            unit = "calls" if what == "calls" else "us"
            for hook in HOOKS:
                values = {i: [*v, hook] for i, v in per_engine_labelvalues.items()}
                self._metrics[f"hook.{hook}.{unit}"] = create_metric_per_engine(metric, values)
        pinned = self._gauge_cls(name=f"vllm:kvtier_{PINNED}", labelnames=labelnames,
                                 documentation="Host pool slots held by kvtier's copies in "
                                 "flight (loads, stages, saves), over all ranks.")  # fmt: skip
        self._metrics[PINNED] = create_metric_per_engine(pinned, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, n in transfer_stats_data.items():
            metric = self._metrics.get(key)
            if metric is not None and (n > 0 or key == PINNED):  # a gauge goes down too
                metric[engine_idx].inc(n / 1e6 if key.endswith(".us") else n)


def register_connector() -> None:
    """Register ``KVTierConnector`` in vLLM's connector registry under its class name,
    as ``MultiConnector`` looks its stats up (module docstring); once per process."""
    # ValueError: registered already (a second import, or vLLM's own some day).
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(
            "KVTierConnector", "kvtier.integrations.vllm", "KVTierConnector"
        )


register_connector()
