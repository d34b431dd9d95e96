"""kvtier as vLLM's KV connector, end to end in real vLLM (CPU), greedy decoding.

Every engine is its own process; outputs are compared with an engine without the
connector. vLLM's own prefix cache is reset between prompts of one engine, so a hit
can only come from kvtier.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from conftest import VOCAB
from redis_servers import delete_prefix, unique_prefix

from kvtier.tiers.lmdb import LMDBTier

vllm_engine = pytest.importorskip("kvtier.integrations.vllm_engine")
EngineReport, EngineSpec = vllm_engine.EngineReport, vllm_engine.EngineSpec

pytestmark = pytest.mark.vllm

BLOCK = vllm_engine.BLOCK_SIZE
HOST_4_BLOCKS = "64KiB"  # the tiny model's blocks are 16 KiB


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


PROMPT = _tokens(300, seed=1)  # 9 full blocks and a partial one
SIBLING = PROMPT[: 6 * BLOCK] + _tokens(100, seed=2)  # shares PROMPT's first 6 blocks


def _spec(model: str, prompts: list[list[int]], kvtier: dict | None) -> EngineSpec:
    return EngineSpec(model, prompts, max_tokens=8, kvtier=kvtier, reset_between=True)


def run_engine(workdir: Path, spec: EngineSpec) -> EngineReport:
    return vllm_engine.run_engine(spec, workdir, timeout=280)


def _disk_config(path: Path, host: str) -> dict:
    return {
        "tiers": {
            "cpu": {"capacity": host},
            "disk": {"path": str(path), "capacity": "64MiB", "chunk_blocks": 2},
        }
    }


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-e2e")


@pytest.fixture(scope="module")
def reference(tiny_model: str, workdir: Path) -> dict[str, list[int]]:
    """Output tokens of each prompt from an engine without the connector."""
    report = run_engine(workdir, _spec(tiny_model, [PROMPT, SIBLING], None))
    first, second = report.requests
    return {"prompt": first.tokens, "sibling": second.tokens}


@pytest.fixture(scope="module")
def disk_writer(tiny_model: str, workdir: Path) -> tuple[Path, dict]:
    """An engine with a 4-block host pool over a disk tier that serves PROMPT twice."""
    disk = workdir / "lmdb"
    spec = _spec(tiny_model, [PROMPT, PROMPT], _disk_config(disk, HOST_4_BLOCKS))
    return disk, run_engine(workdir, spec)


def test_blocks_spilled_from_a_small_host_pool_come_back_exact(disk_writer, reference):
    _, report = disk_writer
    first, second = report.requests
    assert first.num_cached_tokens == 0
    assert report.tiers["cpu"]["evictions"] > 0
    assert report.tiers["disk"]["blocks_in"] > 0
    assert report.tiers["disk"]["blocks_out"] > 0
    assert second.num_cached_tokens >= 4 * BLOCK
    assert report.load_errors == 0
    assert first.tokens == second.tokens == reference["prompt"]


def test_second_engine_process_loads_the_prefix_from_disk(
    tiny_model, workdir, disk_writer, reference
):
    disk, _ = disk_writer
    report = run_engine(workdir, _spec(tiny_model, [PROMPT, SIBLING], _disk_config(disk, "1MiB")))
    prompt, sibling = report.requests
    assert prompt.num_cached_tokens > 0
    assert report.tiers["disk"]["blocks_out"] * BLOCK == prompt.num_cached_tokens
    assert sibling.num_cached_tokens == 6 * BLOCK  # from the host pool it filled
    assert prompt.blocks_per_tier == {"disk": prompt.num_cached_tokens // BLOCK}
    assert sibling.blocks_per_tier == {"cpu": 6}
    # vLLM's own stats, through the connector's hit-source hook, say the same.
    assert report.cached_by_source == {"disk": prompt.num_cached_tokens, "host": 6 * BLOCK}
    assert report.load_errors == 0
    assert prompt.tokens == reference["prompt"]
    assert sibling.tokens == reference["sibling"]


def test_engines_sharing_only_redis_share_the_prefix(tiny_model, workdir, reference, real_client):
    prefix = unique_prefix("kvtier-vllm")
    config = {
        "tiers": {
            "cpu": {"capacity": "1MiB"},
            "redis": {"url": "redis://127.0.0.1:6379/0", "key_prefix": prefix, "chunk_blocks": 2},
        }
    }
    try:
        writer = run_engine(workdir, _spec(tiny_model, [PROMPT], config))
        reader = run_engine(workdir, _spec(tiny_model, [PROMPT], config))
    finally:
        delete_prefix(real_client, prefix)
    assert writer.tiers["redis"]["blocks_in"] >= 8  # write-through: every full chunk
    (result,) = reader.requests
    assert result.num_cached_tokens == 8 * BLOCK  # 4 whole chunks of 2 blocks
    assert reader.tiers["redis"]["blocks_out"] == 8
    assert reader.cached_by_source == {"external_unspecified": 8 * BLOCK}  # a remote store
    assert reader.load_errors == 0
    assert result.tokens == reference["prompt"]


def test_a_corrupted_value_is_a_load_error_and_vllm_recomputes(
    tiny_model, workdir, disk_writer, reference
):
    disk, _ = disk_writer
    corrupt = workdir / "lmdb-corrupt"
    shutil.copytree(disk, corrupt)
    tier = LMDBTier(corrupt, 64 << 20, 2)
    try:
        values: dict[bytes, bytes] = {}
        keys = list(tier.keys())
        tier.get_many(keys, lambda i, v: values.__setitem__(keys[i], bytes(v)))
        # Flip one payload byte of every value: headers stay valid, checksums do not.
        tier.put_many([(k, v[:-1] + bytes([v[-1] ^ 0xFF])) for k, v in values.items()])
    finally:
        tier.close()
    report = run_engine(workdir, _spec(tiny_model, [PROMPT], _disk_config(corrupt, "1MiB")))
    (result,) = report.requests
    assert report.load_errors > 0
    assert report.tiers["disk"]["rejected"] > 0
    assert report.tiers["disk"]["blocks_out"] == 0
    assert result.tokens == reference["prompt"]
