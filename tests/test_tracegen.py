"""kvtier.tracegen: a synthetic trace in Mooncake's format, deterministic by seed."""

from __future__ import annotations

from kvtier.cli import main
from kvtier.replay import TRACE_BLOCK, ceiling_hits, read_trace
from kvtier.tracegen import WorkloadShape, generate, write_trace

SHORT = WorkloadShape(duration_s=60)


def test_the_same_seed_gives_the_same_trace_and_another_seed_another() -> None:
    assert generate(SHORT, seed=1) == generate(SHORT, seed=1)
    assert generate(SHORT, seed=1) != generate(SHORT, seed=2)


def test_equal_block_ids_at_a_position_mean_equal_prefixes() -> None:
    prefix_of: dict[int, tuple[int, ...]] = {}
    for line in generate(SHORT):
        ids = line["hash_ids"]
        for i, h in enumerate(ids):
            assert prefix_of.setdefault(h, tuple(ids[:i])) == tuple(ids[:i])


def test_requests_arrive_in_order_within_the_duration_and_fill_their_blocks() -> None:
    lines = generate(SHORT)
    stamps = [line["timestamp"] for line in lines]
    assert stamps == sorted(stamps) and stamps[-1] < 60_000
    for line in lines:
        assert -(-line["input_length"] // TRACE_BLOCK) == len(line["hash_ids"])


def test_the_written_trace_replays_with_shared_prefixes(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    write_trace(path, generate(SHORT))
    requests = read_trace(path)
    blocks = sum(r.input_length // 16 for r in requests)
    assert sum(ceiling_hits(requests, 16)) > blocks / 3  # system prompts, documents, turns


def test_kvtier_workload_writes_a_trace(tmp_path, capsys) -> None:
    path = tmp_path / "trace.jsonl"
    assert main(["workload", str(path), "--seed", "3", "--duration", "30"]) == 0
    assert len(read_trace(path)) == len(generate(WorkloadShape(duration_s=30), seed=3))
    assert f"-> {path}" in capsys.readouterr().out


def test_a_kind_of_session_at_rate_zero_is_left_out() -> None:
    nothing = WorkloadShape(duration_s=60, chat_rate=0, rag_rate=0, agent_rate=0, oneoff_rate=0)
    assert generate(nothing) == []
    assert generate(WorkloadShape(duration_s=60, rag_rate=0, agent_rate=0, oneoff_rate=0))
