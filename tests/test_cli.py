import json
from pathlib import Path

import pytest

from kvtier.cli import main


def test_demo_serves_through_every_default_tier_and_reports_hits(capsys):
    assert main(["demo", "--conversations", "16", "--turns", "4"]) == 0
    out = capsys.readouterr().out
    assert "tiers gpu, cpu, disk" in out
    rates = {
        line.split(":")[0].strip(): float(line.split(":")[1].split("%")[0])
        for line in out.splitlines()
        if line.strip().startswith(("gpu:", "cpu:", "disk:"))
    }
    assert rates["gpu"] > 0 and rates["cpu"] > 0 and rates["disk"] > 0
    assert "matched a recompute bit for bit" in out


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
