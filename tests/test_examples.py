"""The examples run as shipped (at small sizes) and show what they promise."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, f"examples/{name}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_native_engine_serves_every_request_exactly_from_every_tier():
    out = run_example("native_engine.py", "--requests", "24", "--user-tokens", "320")
    assert "24 requests, every one's KV equal to a recompute" in out
    served = dict(re.findall(r"(\w+) (\d+)", out.splitlines()[-1].split(":", 1)[1]))
    assert all(int(served[tier]) > 0 for tier in ("gpu", "cpu", "disk")), served


def test_hf_chat_reuses_the_conversation_so_far():
    pytest.importorskip("transformers")
    out = run_example("hf_chat.py", "--turns", "2", "--max-new-tokens", "4")
    cached = [int(n) for n in re.findall(r"cached (\d+)", out)]
    assert cached[0] == 0 and cached[1] > 0, out
