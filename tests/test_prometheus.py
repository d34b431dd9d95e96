"""Prometheus export: a real ``/metrics`` endpoint on a free loopback port."""

from __future__ import annotations

import socket
import sys
import urllib.request
from pathlib import Path

import pytest

from kvtier.cache import TieredCache
from kvtier.config import ConfigError, parse_config
from kvtier.synthetic import serve
from kvtier.tiers.lmdb import LMDBTier

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(tmp_path: Path, port: int) -> dict:
    return {
        "model": "prometheus-test",
        "layout": {"num_layers": 1, "block_size": 4, "num_kv_heads": 1, "head_dim": 8},
        "tiers": {
            "gpu": {"num_blocks": 8, "device": "cpu"},
            "cpu": {"capacity": "1KiB"},
            "disk": {"path": str(tmp_path / "lmdb"), "capacity": "16MiB", "chunk_blocks": 2},
        },
        "metrics": {"prometheus_port": port},
    }


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """Every sample of the endpoint: name -> {sorted label items: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


@pytest.fixture
def served(tmp_path: Path):
    """A cache exporting on a free port, after serving a few prompts: (cache, port)."""
    port = free_port()
    with TieredCache(parse_config(config(tmp_path, port))) as cache:
        for i in range(6):
            serve(cache, f"r{i}", list(range(i * 100, i * 100 + 17)))
        serve(cache, "again", list(range(17)))
        cache.flush()
        yield cache, port


def test_counters_are_exported_per_tier_with_the_values_of_stats(served):
    cache, port = served
    samples = scrape(port)
    stats = cache.stats()
    for tier in ("gpu", "cpu", "disk"):
        label = (("tier", tier),)
        assert samples["kvtier_hits_total"][label] == stats[tier].hits
        assert samples["kvtier_blocks_in_total"][label] == stats[tier].blocks_in
        assert samples["kvtier_errors_total"][label] == stats[tier].errors == 0
    assert samples["kvtier_blocks_in_total"][(("tier", "disk"),)] > 0


def test_latencies_are_exported_as_prometheus_histograms(served):
    cache, port = served
    samples = scrape(port)
    lookups = cache.stats().lookup_latency.count
    assert samples["kvtier_lookup_seconds_count"][()] == lookups == 7
    assert samples["kvtier_lookup_seconds_bucket"][(("le", "+Inf"),)] == lookups
    writes = samples["kvtier_tier_write_seconds_count"][(("tier", "disk"),)]
    assert writes == cache.stats()["disk"].write_latency.count > 0


def test_what_each_tier_holds_is_exported_as_gauges(served):
    cache, port = served
    samples = scrape(port)
    disk = cache.stats()["disk"].usage
    assert samples["kvtier_stored_entries"][(("tier", "disk"),)] == disk.entries > 0
    assert samples["kvtier_capacity_bytes"][(("tier", "disk"),)] == 16 << 20


def test_the_endpoint_stops_when_the_cache_closes(tmp_path):
    port = free_port()
    TieredCache(parse_config(config(tmp_path, port))).close()
    with pytest.raises(OSError):
        scrape(port)


def test_a_port_in_use_is_a_config_error_and_opens_no_tier(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"metrics.prometheus_port: cannot serve .*{port}"):
            TieredCache(parse_config(config(tmp_path, port)))
    LMDBTier(tmp_path / "lmdb", 1 << 20, chunk_blocks=2).close()  # was closed again


def test_a_port_without_prometheus_client_is_a_config_error_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    with pytest.raises(ConfigError, match=r"metrics.prometheus_port: .*kvtier\[metrics\]"):
        TieredCache(parse_config(config(tmp_path, free_port())))
