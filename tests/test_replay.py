from pathlib import Path

import pytest

from kvtier.cache import TieredCache
from kvtier.config import parse_config
from kvtier.replay import TraceRequest, ceiling_hits, read_trace, replay

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
