import random
from pathlib import Path

import pytest

from kvtier.cache import TieredCache
from kvtier.config import parse_config
from kvtier.replay import (
    ReplayResult,
    ReplaySample,
    TraceRequest,
    ceiling_hits,
    optimal_hits,
    read_trace,
    replay,
    sized_to_shares,
)

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def unbounded_cache() -> TieredCache:
    """A GPU pool larger than all the blocks 300 requests commit; tiny blocks."""
    layout = {
        "num_layers": 1,
        "kv_factor": 1,
        "block_size": 16,
        "num_kv_heads": 1,
        "head_dim": 1,
        "dtype": "uint8",
    }
    return TieredCache(
        parse_config({"layout": layout, "tiers": {"gpu": {"num_blocks": 400_000, "device": "cpu"}}})
    )


@pytest.mark.skipif(not TRACE.exists(), reason=f"the shared trace is not at {TRACE}")
def test_replaying_300_trace_requests_unbounded_reaches_the_ceiling_exactly():
    requests = read_trace(TRACE, limit=300)
    with unbounded_cache() as cache:
        result = replay(cache, requests)
    assert result.skipped == 0 and result.requests == 300
    assert result.ceiling_blocks > 0
    assert sum(result.hit_blocks.values()) == result.ceiling_blocks


def test_the_ceiling_counts_committed_full_blocks_and_never_the_last_token():
    bs, per = 16, 512 // 16
    first = TraceRequest(0, 512 + 100, (1, 2))  # commits 32 + 6 full blocks
    again = TraceRequest(1, 1024, (1, 2))  # hits 32 + 6; its own cap would allow 63
    short = TraceRequest(2, 512, (1,))  # all 32 committed, but the last token caps at 31
    assert ceiling_hits([first, again, short], bs) == [0, per + 6, per - 1]


def test_a_malformed_trace_line_is_reported_with_its_line_number(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: not a trace request"):
        read_trace(bad)


def result_of(*samples: ReplaySample) -> ReplayResult:
    result = ReplayResult(samples=list(samples))
    for s in samples:
        for tier, n in s.hit_blocks.items():
            result.hit_blocks[tier] = result.hit_blocks.get(tier, 0) + n
    return result


def test_windows_give_each_tiers_share_of_the_blocks_arriving_in_them():
    result = result_of(
        ReplaySample(0, 10, {"gpu": 2, "disk": 3}, 6),
        ReplaySample(400, 30, {"gpu": 0, "disk": 12}, 20),  # same first half-second
        ReplaySample(1000, 8, {"gpu": 4, "disk": 0}, 4),
    )
    w = result.windows(2)
    assert w.width_s == 0.5 and w.start_s == [0.0, 0.5]
    assert w.per_tier == {"gpu": [2 / 40, 4 / 8], "disk": [15 / 40, 0.0]}
    assert w.ceiling == [26 / 40, 4 / 8]


def test_windows_no_request_arrived_in_are_left_out():
    result = result_of(ReplaySample(0, 4, {"gpu": 1}, 1), ReplaySample(900, 4, {"gpu": 2}, 2))
    w = result.windows(3)
    assert w.start_s == [0.0, 0.6] and w.per_tier["gpu"] == [0.25, 0.5]


def test_a_replay_records_one_sample_per_request_adding_up_to_its_totals():
    requests = [TraceRequest(10 * i, 700 + 30 * i, (1, 2 + i % 2)) for i in range(6)]
    with unbounded_cache() as cache:
        result = replay(cache, requests)
    assert [s.timestamp_ms for s in result.samples] == [r.timestamp_ms for r in requests]
    assert sum(s.prompt_blocks for s in result.samples) == result.prompt_blocks
    assert sum(s.ceiling_blocks for s in result.samples) == result.ceiling_blocks > 0
    for tier, n in result.hit_blocks.items():
        assert sum(s.hit_blocks[tier] for s in result.samples) == n


def test_the_optimum_of_an_unbounded_cache_is_the_ceiling():
    requests = [TraceRequest(i, 1000, (1, 2 + i % 3)) for i in range(12)]
    assert optimal_hits(requests, 10**6, 16) == sum(ceiling_hits(requests, 16))


def test_the_optimum_keeps_the_block_used_again_soonest():
    # Room for one trace block: after request 0 it keeps 1 (used next), not 2 or 3.
    requests = [
        TraceRequest(0, 1536, (1, 2, 3)),
        TraceRequest(1, 1024, (1, 4)),
        TraceRequest(2, 1024, (2, 5)),
    ]
    assert optimal_hits(requests, 512 // 16, 16) == 512 // 16


def small_cache(gpu_blocks: int, host_blocks: int) -> TieredCache:
    """GPU and host pools of the given sizes in 512-token blocks (one trace block each)."""
    layout = {"num_layers": 1, "kv_factor": 1, "block_size": 512, "num_kv_heads": 1}
    layout |= {"head_dim": 1, "dtype": "uint8"}
    tiers = {
        "gpu": {"num_blocks": gpu_blocks, "device": "cpu"},
        "cpu": {"capacity": host_blocks * 512},
    }
    return TieredCache(parse_config({"layout": layout, "tiers": tiers}))


def test_the_optimum_is_at_least_the_replayed_hit_rate_at_the_same_capacity():
    rng = random.Random(7)
    requests = []
    for i in range(200):  # shared roots, chains continued or left
        root = rng.choice((0, 0, 1, 2, 3))
        ids = [root] + [
            1000 * root + rng.randrange(6) * 100 + d for d in range(rng.randrange(1, 6))
        ]
        requests.append(TraceRequest(i, len(ids) * 512, tuple(ids)))
    with small_cache(gpu_blocks=8, host_blocks=12) as cache:
        result = replay(cache, requests)
        capacity = cache.gpu.num_blocks + cache.host.num_blocks
    served = [requests[i] for i in result.served]
    assert sum(result.hit_blocks.values()) <= optimal_hits(served, capacity, 512)


def shared_config(**disk):
    layout = {"num_layers": 1, "block_size": 16, "num_kv_heads": 1, "head_dim": 8}
    tiers = {"gpu": {"num_blocks": 10}, "cpu": {}, "disk": {"chunk_blocks": 32, **disk}}
    return parse_config({"layout": layout, "tiers": tiers})


def test_shares_size_each_tier_in_whole_trace_blocks_of_the_distinct_ones():
    requests = [TraceRequest(0, 512 * 40, tuple(range(40))), TraceRequest(1, 512, (0,))]
    config = sized_to_shares(shared_config(), requests, [5, 12.5, 30])  # of 40 blocks
    tiers, nbytes = config.tiers, config.layout.block_nbytes
    assert tiers.gpu.num_blocks == 2 * 32  # 2 trace blocks of 32 cache blocks
    assert tiers.cpu.capacity == 5 * 32 * nbytes
    assert tiers.disk.capacity == 12 * 32 * nbytes
    assert tiers.disk.chunk_blocks == 32 and tiers.spill_order == ("disk",)


def test_two_shares_leave_the_disk_tier_out():
    requests = [TraceRequest(0, 512 * 40, tuple(range(40)))]
    tiers = sized_to_shares(shared_config(), requests, [5, 10]).tiers
    assert tiers.disk is None and tiers.spill_order == ()
