"""Prometheus export of ``TieredCache.stats()`` (optional extra ``metrics``).

When ``metrics.prometheus_port`` is set, the cache serves ``/metrics`` over HTTP on
``metrics.prometheus_host`` (loopback by default). A custom collector reads one
``stats()`` snapshot per scrape, so there is no second set of counters to keep in
step. Names follow Prometheus conventions, one family per ``TierStats`` field:

- counters ``kvtier_<field>_total{tier="gpu|cpu|disk|redis"}`` for hits, misses,
  blocks_in, bytes_in, blocks_out, bytes_out, evictions, dropped, errors, rejected,
  short_loads (hits, misses, blocks, dropped and short_loads count blocks);
- histograms ``kvtier_tier_read_seconds{tier}`` and ``kvtier_tier_write_seconds{tier}``
  (one observation per batch), ``kvtier_lookup_seconds`` and ``kvtier_prefetch_seconds``;
- gauges ``kvtier_stored_entries{tier}``, ``kvtier_stored_bytes{tier}`` and
  ``kvtier_capacity_bytes{tier}`` (absent for a tier whose usage is unknown; the
  capacity also for an unbounded tier).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kvtier.config import ConfigError, MetricsConfig
from kvtier.metrics import CacheStats, Histogram
from kvtier.threads import thread_pool

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

COUNTERS: dict[str, str] = {
    "hits": "Blocks found in this tier by lookups.",
    "misses": "Blocks looked up in this tier and not found.",
    "blocks_in": "Blocks written into this tier.",
    "bytes_in": "Bytes written into this tier.",
    "blocks_out": "Blocks read out of this tier towards the GPU.",
    "bytes_out": "Bytes read out of this tier towards the GPU.",
    "evictions": "Entries this tier evicted to make room.",
    "dropped": "Blocks this tier could not store (no room, or writes not keeping up).",
    "errors": "Failed copies or I/O of this tier (each a miss, never raised).",
    "rejected": "Stored values that failed their checks (deleted, never loaded).",
    "short_loads": "Blocks a lookup promised from this tier that its load did not deliver.",
}


class StatsCollector:
    """A Prometheus collector that reads one ``stats()`` snapshot per scrape."""

    def __init__(self, stats: Callable[[], CacheStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        stats = self._stats()
        for field, doc in COUNTERS.items():
            family = CounterMetricFamily(f"kvtier_{field}", doc, labels=["tier"])
            for tier, s in stats.tiers.items():
                family.add_metric([tier], getattr(s, field))
            yield family
        for what, doc in (("read", "out of"), ("write", "into")):
            family = HistogramMetricFamily(
                f"kvtier_tier_{what}_seconds",
                f"Seconds per batch {doc} the tier.",
                labels=["tier"],
            )
            for tier, s in stats.tiers.items():
                h = getattr(s, f"{what}_latency")
                family.add_metric([tier], _buckets(h), h.sum)
            yield family
        for name, h, doc in (
            ("lookup", stats.lookup_latency, "Seconds per lookup call, all tiers."),
            ("prefetch", stats.prefetch_latency, "Seconds from allocate until a hit is in place."),
        ):
            family = HistogramMetricFamily(f"kvtier_{name}_seconds", doc)
            family.add_metric([], _buckets(h), h.sum)
            yield family
        gauges = {
            "stored_entries": ("entries", "Blocks (pools) or chunks (spill tiers) held."),
            "stored_bytes": ("nbytes", "Bytes this tier holds."),
            "capacity_bytes": ("capacity", "Bytes this tier may hold."),
        }
        for name, (attr, doc) in gauges.items():
            family = GaugeMetricFamily(f"kvtier_{name}", doc, labels=["tier"])
            for tier, s in stats.tiers.items():
                value = getattr(s.usage, attr) if s.usage is not None else None
                if value is not None:
                    family.add_metric([tier], value)
            yield family


def _buckets(h: Histogram) -> list[tuple[str, int]]:
    """Cumulative ``(le, count)`` pairs as Prometheus wants them (``+Inf`` last)."""
    return [("+Inf" if b == float("inf") else repr(b), n) for b, n in h.cumulative()]


class MetricsServer:
    """The HTTP server behind ``/metrics``; ``close`` stops it and frees the port."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the server listens on."""
        host, port = self._server.server_address[:2]
        return host, port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def serve_metrics(stats: Callable[[], CacheStats], config: MetricsConfig) -> MetricsServer:
    """Serve ``stats`` at ``http://{prometheus_host}:{prometheus_port}/metrics``.

    Raises ``ConfigError`` naming ``metrics.prometheus_port`` when ``prometheus_client``
    is not installed or the address cannot be bound.
    """
    port = config.prometheus_port
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise ConfigError(
            "metrics.prometheus_port",
            port,
            "is set, but prometheus_client is not installed: pip install 'kvtier[metrics]' "
            "(or set it to null)",
        ) from None
    # A registry of our own: several caches in one process each export their own stats.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats))
    # Started from a kvtier thread, the server's thread and those it starts for each
    # scrape inherit that thread's OS name and CPU affinity (threads.py).
    try:
        with thread_pool(1, "kvtier-prom") as starter:
            server, thread = starter.submit(
                start_http_server, port, addr=config.prometheus_host, registry=registry
            ).result()
    except OSError as e:
        raise ConfigError(
            "metrics.prometheus_port",
            port,
            f"cannot serve metrics on {config.prometheus_host}:{port}: {e.strerror or e}",
        ) from None
    return MetricsServer(server, thread)
