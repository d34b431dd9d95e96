"""`kvtier demo`: a real Llama served through every tier answers like a recompute."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from kvtier.cli import main  # noqa: E402

SMALL_TIERS = """
tiers:
  gpu: {{num_blocks: 128, device: cpu}}
  cpu: {{capacity: 4MiB}}
  disk: {{path: {path}, capacity: 256MiB, chunk_blocks: 4}}
"""


def test_demo_serves_from_every_tier_and_every_reply_equals_recompute(tmp_path, capsys):
    config = tmp_path / "small.yaml"
    config.write_text(SMALL_TIERS.format(path=tmp_path / "lmdb"))
    out_json, out_png = tmp_path / "demo.json", tmp_path / "demo.png"
    args = ["--conversations", "4", "--turns", "3", "--json", str(out_json)]
    assert main(["demo", "--config", str(config), *args, "--plot", str(out_png)]) == 0
    assert "replies with kvtier vs recompute: equal (12 turns, greedy)" in capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert all(turn["same_output"] for turn in result["turns"])
    assert all(result["hit_rate"][tier] > 0 for tier in ("gpu", "cpu", "disk")), result
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
