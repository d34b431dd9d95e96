"""`kvtier demo --engine vllm`: the chat through vLLM with kvtier answers like vLLM alone.
Two vLLM engines of minutes together: ``long`` (``make test-long``)."""

from __future__ import annotations

import json

import pytest

from kvtier.cli import main

pytestmark = [pytest.mark.vllm, pytest.mark.long]


def test_vllm_demo_serves_from_kvtier_and_every_reply_equals_vllm_alone(tmp_path, capsys):
    pytest.importorskip("vllm")
    out_json = tmp_path / "demo.json"
    args = ["--engine", "vllm", "--conversations", "4", "--turns", "4", "--json", str(out_json)]
    assert main(["demo", *args]) == 0
    out = capsys.readouterr().out
    assert "replies with kvtier vs vLLM alone: equal (16 turns, greedy)" in out
    result = json.loads(out_json.read_text())
    assert result["hit_rate"]["vllm"] > 0
    assert result["hit_rate"]["cpu"] + result["hit_rate"]["disk"] > 0, result["hit_rate"]
