"""The trace of hits: one JSON line per step, from any process, tiling a request's TTFT."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtier.trace import Trace, phases, read_trace


def test_a_trace_without_a_path_writes_nothing_and_is_false(tmp_path) -> None:
    trace = Trace(None)
    trace.event("lookup", "r1", seconds=0.001)
    assert not trace and list(tmp_path.iterdir()) == []


def test_each_event_is_one_line_with_time_process_name_and_request(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    trace = Trace(str(path))
    trace.event("lookup", "r1", t=10.0, seconds=0.5, blocks={"disk": 4})
    trace.close()
    assert read_trace(path) == [
        {"t": 10.0, "pid": os.getpid(), "event": "lookup", "req": "r1", "seconds": 0.5,
         "blocks": {"disk": 4}}
    ]  # fmt: skip


def test_processes_appending_to_one_trace_never_interleave_their_lines(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    write = (
        "import sys; from kvtier.trace import Trace; t = Trace(sys.argv[1])\n"
        "for i in range(2000): t.event('load', f'r{i}', blocks={'disk': i}, pad='x' * 500)"
    )
    procs = [subprocess.Popen([sys.executable, "-c", write, str(path)]) for _ in range(3)]
    assert [p.wait() for p in procs] == [0, 0, 0]
    events = read_trace(path)  # every line parses
    assert len(events) == 6000 and len({e["pid"] for e in events}) == 3


def _load(pinned: float, run: float | None, read: float | None, copied: float, **kw) -> dict:
    return {"event": "load", "t": copied, "req": "r", "pinned": pinned, "run": run,
            "read": read, "copied": copied, "read_seconds": kw.get("reads", {}),
            "blocks": {}}  # fmt: skip


def test_the_phases_of_an_async_spill_load_tile_its_time_to_first_token() -> None:
    events = [
        {"event": "lookup", "t": 1.0, "seconds": 0.5},
        _load(2.0, 3.0, 6.0, 7.0, reads={"disk": 2.0}),
        _load(2.5, 3.0, 5.0, 6.0, reads={"disk": 1.0}),  # a second shard, faster
        {"event": "load_over", "t": 8.0},
        {"event": "compute", "t": 9.5},
    ]
    got = phases(events, sent=0.0, first_token=12.0)
    assert got == {
        "to lookup": 1.0, "lookup": 0.5, "to load": 0.5, "I/O queue": 1.0, "tier read": 2.0,
        "checks + scatter": 1.0, "copy up": 1.0, "to engine": 1.0, "to compute": 1.5,
        "compute": 2.5,
    }  # fmt: skip
    assert sum(got.values()) == pytest.approx(12.0)


def test_a_host_load_in_the_computing_step_has_no_io_phases() -> None:
    events = [{"event": "lookup", "t": 1.0, "seconds": 0.5}, _load(2.0, None, None, 3.0)]
    got = phases(events, sent=0.0, first_token=5.0)
    assert got == {"to lookup": 1.0, "lookup": 0.5, "to load": 0.5, "copy up": 1.0, "compute": 2.0}


def test_a_native_disk_hit_traces_its_lookup_and_each_step_of_its_load_in_order(tmp_path) -> None:
    from kvtier.cache import TieredCache
    from kvtier.config import parse_config
    from kvtier.synthetic import serve

    path = tmp_path / "trace.jsonl"
    layout = {"num_layers": 1, "block_size": 4, "num_kv_heads": 1, "head_dim": 4}
    tiers = {
        "gpu": {"num_blocks": 4, "device": "cpu"},
        "cpu": {"capacity": 4 * 64},
        "disk": {"path": str(tmp_path / "lmdb"), "capacity": "1MiB", "chunk_blocks": 1},
    }
    config = {"layout": layout, "tiers": tiers, "metrics": {"trace_path": str(path)}}
    with TieredCache(parse_config(config)) as cache:
        prompt = list(range(13))  # 3 full blocks
        serve(cache, "a", prompt)
        for i in range(4):  # push "a" out of the GPU and host pools, onto disk
            serve(cache, f"other{i}", list(range(100 * (i + 1), 100 * (i + 1) + 13)))
        cache.flush()
        assert serve(cache, "again", prompt).valid_tokens == 12
    events = [e for e in read_trace(path) if e["req"] == "again"]
    assert [e["event"] for e in events] == ["lookup", "load"]
    lookup, load = events
    assert lookup["blocks"] == load["blocks"] == {"disk": 3} and load["valid"] == 3
    assert lookup["t"] <= load["pinned"] <= load["run"] <= load["read"] <= load["copied"]
    assert set(load["read_seconds"]) == {"disk"}
