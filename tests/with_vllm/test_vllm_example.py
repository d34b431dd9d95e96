"""examples/vllm_offline.py runs as shipped (on the tiny model) and shows kvtier hits."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def test_vllm_offline_serves_the_shared_document_from_kvtier(tiny_model, tmp_path):
    config = tmp_path / "kvtier.yaml"
    config.write_text(
        "tiers:\n  cpu: {capacity: 4MiB}\n"
        f"  disk: {{path: {tmp_path / 'lmdb'}, capacity: 64MiB, chunk_blocks: 2}}\n"
    )
    args = ["--model", tiny_model, "--config", str(config), "--document-tokens", "320"]
    done = subprocess.run(
        [sys.executable, "examples/vllm_offline.py", *args, "--questions", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    cached = [int(n) for n in re.findall(r"(\d+) not computed again", done.stdout)]
    assert cached == [0, 320], done.stdout  # the document's 10 blocks, from kvtier
    # 10 document blocks + each question's first full block (11 of 360 tokens each)
    assert "kvtier cpu: 12 blocks stored, 10 blocks loaded" in done.stdout, done.stdout
