import io
import json
import socket
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from redis_servers import delete_prefix, unique_prefix

from kvtier import admin
from kvtier.cache import TieredCache
from kvtier.cli import main
from kvtier.config import load_config
from kvtier.synthetic import serve
from kvtier.tiers.base import TierUsage
from kvtier.tiers.lmdb import LMDBTier


def test_a_bad_config_is_reported_with_its_key_and_exit_code_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  disk:\n    chunk_blocks: 0\n")
    assert main(["demo", "--config", str(bad)]) == 2
    assert "tiers.disk.chunk_blocks" in capsys.readouterr().err


def test_replay_prints_hit_rates_against_the_ceiling(tmp_path, capsys):
    trace = Path(__file__).resolve().parents[2] / "shared" / "traces"
    trace = trace / "mooncake_synthetic_trace.jsonl"
    if not trace.exists():
        pytest.skip(f"the shared trace is not at {trace}")
    out_json = tmp_path / "replay.json"
    assert main(["replay", str(trace), "--limit", "40", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "replayed 40 requests (0 skipped" in out
    assert "ceiling (unbounded cache)" in out and "lookup latency ms" in out
    result = json.loads(out_json.read_text())
    assert 0 <= result["hit_rate"] <= result["ceiling"] <= 1


# --- stats, inspect, clear ----------------------------------------------------------

BLOCK_NBYTES = 2 * 2 * 4 * 2 * 8 * 4  # the layout below: 1 KiB per block


def write_config(tmp_path: Path, redis_prefix: str | None = None, **redis_keys) -> Path:
    """A tiny config: its disk store under ``tmp_path``; a Redis tier when given a prefix."""
    text = f"""
model: cli-test
layout: {{num_layers: 2, block_size: 4, num_kv_heads: 2, head_dim: 8, dtype: float32}}
tiers:
  gpu: {{num_blocks: 8, device: cpu}}
  cpu: {{capacity: 8KiB}}
  disk: {{path: {tmp_path / "lmdb"}, capacity: 16MiB, chunk_blocks: 4}}
"""
    if redis_prefix is not None:
        extra = "".join(f", {k}: {v}" for k, v in redis_keys.items())
        text += f"  redis: {{key_prefix: {redis_prefix}, ttl: 60{extra}}}\n"
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    return path


def fill(config: Path, prompts: int = 6) -> None:
    """Serve prompts of 4 blocks through a cache until chunks reach the spill tiers."""
    with TieredCache.from_yaml(config) as cache:
        for i in range(prompts):
            serve(cache, f"r{i}", list(range(i * 100, i * 100 + 17)))
        cache.flush()


def stored(config: Path, tier: str) -> TierUsage:
    loaded = load_config(config)
    with admin.open_tier(loaded, tier) as t:
        return t.usage()


def test_stats_prints_entries_bytes_and_capacity_of_each_spill_tier(tmp_path, capsys):
    config = write_config(tmp_path)
    fill(config)
    usage = stored(config, "disk")
    assert usage.entries > 0
    assert main(["stats", "--config", str(config)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "disk" in line)
    assert row.split()[:2] == ["disk", str(usage.entries)]
    assert "16.0 MiB" in row and str(tmp_path / "lmdb") in row


def test_stats_json_is_one_object_per_tier(tmp_path, capsys):
    config = write_config(tmp_path)
    fill(config)
    assert main(["stats", "--config", str(config), "--json"]) == 0
    [disk] = json.loads(capsys.readouterr().out)
    assert disk["tier"] == "disk" and disk["error"] is None
    assert disk["usage"] == asdict(stored(config, "disk"))


def test_stats_of_a_store_not_created_yet_is_empty_and_creates_nothing(tmp_path, capsys):
    config = write_config(tmp_path)
    assert main(["stats", "--config", str(config)]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:3] == ["disk", "0", "0"]
    assert not (tmp_path / "lmdb").exists()


def test_stats_reports_an_unreachable_redis_and_exits_1(tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = write_config(tmp_path, "kvtest", url=f"redis://127.0.0.1:{port}/0")
    assert main(["stats", "--config", str(config)]) == 1
    row = next(line for line in capsys.readouterr().out.splitlines() if "redis" in line)
    assert "unavailable" in row and "Connection" in row


def test_inspect_lists_each_chunk_with_its_blocks_position_and_size(tmp_path, capsys):
    config = write_config(tmp_path)
    fill(config)
    assert main(["inspect", "--config", str(config), "--tier", "disk", "--limit", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "the first 3:" in lines[0] and lines[1].split() == [
        "key",
        "blocks",
        "first",
        "bytes",
        "check",
    ]
    rows = [line.split() for line in lines[2:]]
    assert len(rows) == 3
    for key, blocks, first, _, _, check in rows:
        assert len(key) == 32 and check == "ok"
        assert 1 <= int(blocks) <= 4 and int(first) % 4 == 0


def test_inspect_names_what_is_wrong_with_a_corrupted_value(tmp_path, capsys):
    config = write_config(tmp_path)
    fill(config)
    loaded = load_config(config)
    with admin.open_tier(loaded, "disk") as tier:
        key = next(tier.keys())
        values = {}
        tier.get_many([key], lambda i, v: values.update(value=bytearray(v)))
        values["value"][-1] ^= 0xFF  # one payload bit pattern changed
        tier.put_many([(key, values["value"])])
    assert main(["inspect", "--config", str(config), "--tier", "disk", "--limit", "100"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(key.hex()))
    assert "bad chunk (checksum)" in row
    assert row.split()[1].isdigit()  # the header still says how many blocks
    assert "1 bad values" in out


def test_inspect_of_a_tier_not_configured_is_an_error_naming_it(tmp_path, capsys):
    config = write_config(tmp_path)
    assert main(["inspect", "--config", str(config), "--tier", "redis"]) == 2
    assert "tiers.redis: no redis tier is configured" in capsys.readouterr().err


def test_inspect_needs_a_layout_or_namespace_records_to_check_chunks(tmp_path, capsys):
    config = tmp_path / "no-layout.yaml"
    config.write_text(f"tiers:\n  cpu: {{}}\n  disk: {{path: {tmp_path / 'lmdb'}}}\n")
    with LMDBTier(tmp_path / "lmdb", 1 << 20, chunk_blocks=4) as tier:
        tier.put_many([(bytes(16), b"a value no record describes")])
    assert main(["inspect", "--config", str(config), "--tier", "disk"]) == 2
    assert "layout: a layout section, or namespace records" in capsys.readouterr().err


def test_clear_yes_deletes_every_value_of_the_tier(tmp_path, capsys):
    config = write_config(tmp_path)
    fill(config)
    entries = stored(config, "disk").entries
    assert main(["clear", "--config", str(config), "--yes"]) == 0
    assert f"disk: deleted {entries} values" in capsys.readouterr().out
    assert stored(config, "disk").entries == 0


def test_clear_without_yes_off_a_terminal_is_an_error_and_deletes_nothing(
    tmp_path, capsys, monkeypatch
):
    config = write_config(tmp_path)
    fill(config)
    entries = stored(config, "disk").entries
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # not a terminal
    assert main(["clear", "--config", str(config)]) == 2
    assert "pass --yes" in capsys.readouterr().err
    assert stored(config, "disk").entries == entries


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_clear_asks_first_and_a_no_deletes_nothing(tmp_path, capsys, monkeypatch):
    config = write_config(tmp_path)
    fill(config)
    entries = stored(config, "disk").entries
    monkeypatch.setattr(sys, "stdin", Terminal("n\n"))
    assert main(["clear", "--config", str(config)]) == 1
    assert "nothing deleted" in capsys.readouterr().out
    assert stored(config, "disk").entries == entries


def test_clear_asks_first_and_a_yes_deletes(tmp_path, monkeypatch):
    config = write_config(tmp_path)
    fill(config)
    monkeypatch.setattr(sys, "stdin", Terminal("y\n"))
    assert main(["clear", "--config", str(config)]) == 0
    assert stored(config, "disk").entries == 0


@pytest.mark.redis
def test_clear_of_redis_deletes_this_namespace_and_nothing_else(tmp_path, real_client):
    prefix = unique_prefix("kvcli")
    config = write_config(tmp_path, prefix)
    other = f"{prefix}:another-namespace:0123"
    real_client.set(other, b"not ours")
    try:
        fill(config, prompts=8)
        assert stored(config, "redis").entries > 0
        assert main(["clear", "--config", str(config), "--tier", "redis", "--yes"]) == 0
        assert stored(config, "redis").entries == 0
        assert real_client.get(other) == b"not ours"
        assert stored(config, "disk").entries > 0  # --tier redis: the disk is left alone
    finally:
        delete_prefix(real_client, prefix)


# --- replay --plot ------------------------------------------------------------------


def small_trace(tmp_path: Path) -> Path:
    """Ten requests over 9 s, sharing prefixes of 512-token blocks."""
    lines = [
        {"timestamp": 1000 * i, "input_length": 1024 + 50 * i, "hash_ids": [0, 1, 2 + i % 3]}
        for i in range(10)
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_replay_of_a_missing_trace_is_an_error_naming_it(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "absent.jsonl")]) == 2
    assert "absent.jsonl" in capsys.readouterr().err


def test_replay_plot_writes_a_png(tmp_path, capsys):
    png = tmp_path / "replay.png"
    assert main(["replay", str(small_trace(tmp_path)), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {png}" in capsys.readouterr().out


def test_replay_plot_without_matplotlib_fails_before_replaying(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    png = tmp_path / "replay.png"
    assert main(["replay", str(small_trace(tmp_path)), "--plot", str(png)]) == 2
    captured = capsys.readouterr()
    assert "pip install 'kvtier[plot]'" in captured.err and "replayed" not in captured.out
    assert not png.exists()


# --- replay --policy, --shares --------------------------------------------------------


def test_replay_with_a_policy_evicts_every_tier_by_it(tmp_path, capsys):
    out_json = tmp_path / "replay.json"
    args = ["replay", str(small_trace(tmp_path)), "--policy", "reuse", "--json", str(out_json)]
    assert main(args) == 0
    assert "eviction: gpu reuse, cpu reuse, disk reuse" in capsys.readouterr().out
    assert json.loads(out_json.read_text())["eviction"] == dict.fromkeys(
        ["gpu", "cpu", "disk"], "reuse"
    )


def test_replay_without_a_policy_evicts_each_tier_by_the_configs(tmp_path, capsys):
    config = tmp_path / "replay.yaml"
    config.write_text("""
layout: {num_layers: 1, block_size: 16, num_kv_heads: 1, head_dim: 8}
tiers:
  gpu: {num_blocks: 512, device: cpu, eviction: reuse}
  cpu: {capacity: 1MiB, eviction: lru}
""")
    assert main(["replay", str(small_trace(tmp_path)), "--config", str(config)]) == 0
    assert "eviction: gpu reuse, cpu lru" in capsys.readouterr().out


def test_replay_shares_size_the_tiers(tmp_path, capsys):
    out_json = tmp_path / "replay.json"
    trace = str(small_trace(tmp_path))  # 5 distinct trace blocks of 32 cache blocks each
    assert main(["replay", trace, "--shares", "20,40,60", "--json", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["capacity_blocks"] == (1 + 2 + 3) * 32


@pytest.mark.parametrize("shares", ["5", "1,2,3,4", "0,5", "a,b", "5,200"])
def test_replay_rejects_malformed_shares(tmp_path, capsys, shares):
    with pytest.raises(SystemExit):
        main(["replay", str(small_trace(tmp_path)), "--shares", shares])
    assert "--shares" in capsys.readouterr().err


def test_replay_shares_that_hold_no_block_are_a_usage_error(tmp_path, capsys):
    assert main(["replay", str(small_trace(tmp_path)), "--shares", "1,50"]) == 2
    assert "the GPU share 1.0% holds no block of 5 distinct" in capsys.readouterr().err
