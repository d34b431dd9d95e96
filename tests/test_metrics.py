"""Histograms, and the stats tree ``TieredCache.stats()`` returns."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

from kvtier.cache import TieredCache
from kvtier.chunk import ChunkCodec
from kvtier.config import load_config
from kvtier.metrics import COUNTS, LATENCY_BOUNDS, Histogram, TierStats
from kvtier.prometheus import COUNTERS
from kvtier.synthetic import serve

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
BLOCK_NBYTES = 2 * 2 * 4 * 2 * 8 * 4  # its layout: 1 KiB per block


def observed(values: list[float]) -> Histogram:
    h = Histogram()
    for v in values:
        h.observe(v)
    return h


# --- Histogram ---------------------------------------------------------------------


def test_each_value_lands_in_the_bucket_whose_bounds_hold_it():
    values = [0.0, 1e-9, *LATENCY_BOUNDS, *(b * 1.0001 for b in LATENCY_BOUNDS), 1e6]
    values += [random.Random(1).lognormvariate(-8, 3) for _ in range(1000)]
    bounds = [0.0, *LATENCY_BOUNDS, float("inf")]  # bucket i holds (bounds[i], bounds[i + 1]]
    for v in values:
        i = observed([v]).buckets.index(1)
        assert bounds[i] < v <= bounds[i + 1] or (i == 0 and v == 0.0), v


def test_bounds_are_log_spaced_from_a_microsecond_past_two_minutes():
    ratios = np.array(LATENCY_BOUNDS[1:]) / np.array(LATENCY_BOUNDS[:-1])
    assert LATENCY_BOUNDS[0] == 1e-6 and LATENCY_BOUNDS[-1] > 120
    assert np.allclose(ratios, 2**0.5)


def test_percentiles_are_within_a_bucket_of_the_exact_ones():
    rng = random.Random(7)
    values = [rng.lognormvariate(-7, 1.5) for _ in range(20_000)]
    h = observed(values)
    for q in (1, 50, 90, 99, 99.9):
        exact = float(np.percentile(values, q))
        assert exact / 2**0.5 <= h.percentile(q) <= exact * 2**0.5, q


def test_a_percentile_never_exceeds_the_largest_value_observed():
    h = observed([0.003] * 10)
    assert h.percentile(100) == h.percentile(99) == 0.003


def test_an_empty_histogram_reports_zero():
    h = Histogram()
    assert (h.count, h.sum, h.mean, h.percentile(50)) == (0, 0.0, 0.0, 0.0)


def test_a_percentile_outside_0_to_100_is_an_error_naming_it():
    with pytest.raises(ValueError, match="percentile must be in"):
        Histogram().percentile(101)


def test_merging_equals_observing_both_sets():
    a, b = [1e-5, 2e-3, 0.5], [3e-4, 7.0, 200.0]
    merged = observed(a)
    merged.merge(observed(b))
    both = observed(a + b)
    assert merged.buckets == both.buckets and merged.count == both.count == 6
    assert merged.sum == pytest.approx(both.sum) and merged.max == both.max == 200.0


def test_cumulative_counts_end_at_infinity_with_the_total():
    h = observed([1e-6, 1e-3, 1e3])
    cumulative = h.cumulative()
    assert cumulative[-1] == (float("inf"), 3)
    assert [n for _, n in cumulative] == sorted(n for _, n in cumulative)
    assert dict(cumulative)[LATENCY_BOUNDS[0]] == 1


# --- TieredCache.stats() -------------------------------------------------------------


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """configs/tiny.yaml (16 GPU blocks, LMDB chunks of 4) with 16 host slots, evicted
    least recently used first, so that prompts of 8 blocks soon reach the disk."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    config = load_config(TINY)
    assert config.layout.block_nbytes == BLOCK_NBYTES
    cpu = replace(config.tiers.cpu, capacity=16 * BLOCK_NBYTES, eviction="lru")
    tiers = replace(config.tiers, cpu=cpu)
    with TieredCache(replace(config, tiers=tiers)) as c:
        yield c


def prompt(seed: int, blocks: int = 8) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(blocks * 4 + 1)]


def served_from_disk(cache: TieredCache) -> list[int]:
    """Serve a prompt, push it down to the disk with fillers, serve it again."""
    a = prompt(0)
    serve(cache, "a", a)
    for s in range(1, 8):
        serve(cache, f"filler{s}", prompt(s))
    cache.flush()
    hit = serve(cache, "a2", a).hit
    assert hit.tokens_per_tier().get("disk", 0) > 0
    return a


def test_every_lookup_is_timed(cache):
    for i in range(3):
        serve(cache, f"r{i}", prompt(i))
    s = cache.stats()
    assert s.lookup_latency.count == 3 and s.lookup_latency.sum > 0


def test_a_prefetch_from_below_the_gpu_is_timed_and_a_gpu_hit_is_not(cache):
    a = prompt(0)
    serve(cache, "a", a)
    serve(cache, "a-again", a)  # all on the GPU: nothing to prefetch
    assert cache.stats().prefetch_latency.count == 0
    served_from_disk(cache)
    assert cache.stats().prefetch_latency.count == 1


def test_spill_tier_batches_are_timed_as_reads_and_writes(cache):
    served_from_disk(cache)
    disk = cache.stats()["disk"]
    assert disk.write_latency.count >= 1 and disk.read_latency.count == 1
    assert disk.copy_seconds == disk.read_latency.sum + disk.write_latency.sum > 0


def test_usage_says_what_each_tier_holds_and_can_hold(cache):
    served_from_disk(cache)
    s = cache.stats()
    gpu, cpu, disk = s["gpu"].usage, s["cpu"].usage, s["disk"].usage
    assert gpu.capacity == 16 * BLOCK_NBYTES and 0 < gpu.entries <= 16
    assert gpu.nbytes == gpu.entries * BLOCK_NBYTES
    assert cpu.capacity == 16 * BLOCK_NBYTES and cpu.entries == 16
    codec = ChunkCodec(cache.layout)  # a chunk holds 1 to 4 blocks
    assert disk.capacity == 16 << 20 and disk.entries > 0
    assert disk.entries * codec.encoded_nbytes(1) <= disk.nbytes
    assert disk.nbytes <= disk.entries * codec.encoded_nbytes(4)


def test_a_snapshot_does_not_change_as_the_cache_goes_on(cache):
    before = cache.stats()
    frozen = json.dumps(asdict(before))
    served_from_disk(cache)
    assert json.dumps(asdict(before)) == frozen
    assert cache.stats().lookup_latency.count > before.lookup_latency.count


def test_stats_serialise_to_json_through_asdict(cache):
    served_from_disk(cache)
    tree = json.loads(json.dumps(asdict(cache.stats())))
    assert list(tree["tiers"]) == ["gpu", "cpu", "disk"]
    assert tree["tiers"]["disk"]["hits"] > 0
    assert tree["tiers"]["disk"]["usage"]["entries"] > 0
    assert sum(tree["prefetch_latency"]["buckets"]) == tree["prefetch_latency"]["count"] == 1


def test_evictions_of_the_gpu_and_host_pools_are_counted(cache):
    served_from_disk(cache)
    s = cache.stats()
    assert s["gpu"].evictions == cache.gpu.stats().evictions > 0
    assert s["cpu"].evictions == cache.host.stats().evictions > 0


def test_a_tiers_counts_are_its_counters_and_prometheus_exports_each_of_them():
    stats = TierStats(hits=3, blocks_in=5, short_loads=1)
    stats.read_latency.observe(0.01)

    assert dict(zip(COUNTS, stats.counts())) == {name: getattr(stats, name) for name in COUNTERS}
    assert tuple(COUNTERS) == COUNTS
