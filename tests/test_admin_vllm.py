"""``kvtier stats``, ``inspect`` and ``clear`` on the stores a vLLM server wrote.

``configs/vllm.yaml`` has no layout section: vLLM defines it. The stores are written
as vLLM's connector writes them (a worker's ``ConnectorCache`` with the layout of its
KV tensors, then the scheduler's ``ConnectorIndex`` for the base keys), without vLLM;
Redis is fakeredis over TCP and, where one answers, the local server.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch
from redis_servers import LOCAL_URL, delete_prefix, fake_tcp_server, unique_prefix

from kvtier import admin
from kvtier.cli import main
from kvtier.config import load_config
from kvtier.connector import (
    ConnectorCache,
    ConnectorIndex,
    EngineKV,
    engine_layout,
    spill_namespace,
)
from kvtier.layout import KVLayout
from kvtier.namespaces import NamespaceRecord, read_records
from kvtier.tiers.lmdb import LMDBTier

VLLM_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "vllm.yaml")
SHARD = "tp0/1 pp0/1"
MODEL_A, MODEL_B = "vllm:org/model-a", "vllm:org/model-b"
CHAIN_BLOCKS = 8  # two chunks of configs/vllm.yaml's 4 blocks per tier


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.redis)])
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A Redis server: fakeredis over TCP, or the local server."""
    if request.param == "real":
        request.getfixturevalue("real_client")  # skips when none answers
        yield LOCAL_URL
        return
    with fake_tcp_server() as url:
        yield url


def use_vllm_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, url: str, prefix: str):
    """Point configs/vllm.yaml's stores at ``tmp_path`` and Redis ``url`` under ``prefix``."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVTIER_REDIS_URL", url)
    monkeypatch.setenv("KVTIER_REDIS_PREFIX", prefix)
    monkeypatch.setenv("KVTIER_CPU_CAPACITY", "64KiB")
    monkeypatch.setenv("KVTIER_DISK_CAPACITY", "16MiB")


@pytest.fixture
def stores(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, redis_url: str) -> Iterator[str]:
    """configs/vllm.yaml on a disk store in ``tmp_path`` and ``redis_url`` under a fresh
    key prefix (deleted afterwards); yields the prefix."""
    prefix = unique_prefix("kvadmin")
    use_vllm_config(monkeypatch, tmp_path, redis_url, prefix)
    yield prefix
    client = redis.Redis.from_url(redis_url)
    delete_prefix(client, prefix)
    client.close()


@pytest.fixture
def redis_down(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """configs/vllm.yaml on a disk store in ``tmp_path`` and a Redis nobody answers at."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    use_vllm_config(monkeypatch, tmp_path, f"redis://127.0.0.1:{port}/0", "kvadmin-down")


def serve_like_vllm(model: str, chains: int = 1, kv_heads: int = 1) -> str:
    """Save ``chains`` chains of ``CHAIN_BLOCKS`` blocks as one vLLM server of ``model``
    (KV of ``kv_heads`` heads) does through configs/vllm.yaml; returns the namespace."""
    config = load_config(VLLM_CONFIG)
    kv = EngineKV([torch.randn(32, 2, 4, kv_heads, 2) for _ in range(2)])  # vLLM's per layer
    layout = engine_layout(kv, block_size=4, num_kv_heads=kv_heads, head_dim=2, kv_factor=2)
    cache = ConnectorCache(config, kv, layout, model, SHARD)  # the worker first, as in vLLM
    index = ConnectorIndex(config, model)
    try:
        for c in range(chains):
            hashes = [hashlib.sha256(f"{c}/{i}".encode()).digest() for i in range(CHAIN_BLOCKS)]
            blocks = list(range(c * CHAIN_BLOCKS, (c + 1) * CHAIN_BLOCKS))
            cache.save(blocks, cache.keys(index.keys(hashes)), cache.root, 0)
        cache.flush()
    finally:
        index.close()
        cache.close()
    return spill_namespace(config, model)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``kvtier ARGS --config configs/vllm.yaml``: exit code, stdout, stderr."""
    code = main([*args, "--config", VLLM_CONFIG])
    out, err = capsys.readouterr()
    return code, out, err


def rows(out: str, tier: str) -> list[list[str]]:
    """The stats table's rows of ``tier``, split."""
    return [line.split() for line in out.splitlines() if line.split()[:1] == [tier]]


# --- what a connector records -----------------------------------------------------


def test_a_connector_worker_records_its_namespace_in_each_spill_tier(stores):
    namespace = serve_like_vllm(MODEL_A)
    config = load_config(VLLM_CONFIG)
    for tier in ("disk", "redis"):
        [found] = admin.tier_namespaces(config, tier)
        [record] = found.records
        assert (found.name, record.engine, record.shard) == (namespace, MODEL_A, SHARD)
        assert found.layouts == (record.layout,) and record.layout.num_kv_heads == 1


def test_a_namespace_record_decodes_to_what_was_encoded():
    layout = KVLayout(2, 2, 16, 8, 64, torch.bfloat16)
    record = NamespaceRecord("0123456789abcdef", MODEL_A, SHARD, layout, 1.5)
    assert NamespaceRecord.decode(record.name, record.encode()) == record


def test_a_bad_namespace_record_is_named_and_left_out(tmp_path, caplog):
    layout = KVLayout(2, 2, 16, 8, 64, torch.bfloat16)
    good = NamespaceRecord("0123456789abcdef", MODEL_A, SHARD, layout, 1.5)
    with LMDBTier(tmp_path / "lmdb", 1 << 20, chunk_blocks=4) as tier:
        tier.put_record(good.name, good.encode())
        tier.put_record("fedcba9876543210/tp0/1 pp0/1", b"\x93not a record")
        with caplog.at_level(logging.WARNING):
            assert read_records(tier) == [good]
    assert "bad namespace record 'fedcba9876543210/tp0/1 pp0/1'" in caplog.text


# --- stats ------------------------------------------------------------------------


def test_stats_with_the_vllm_config_counts_what_a_vllm_server_stored(stores, capsys):
    namespace = serve_like_vllm(MODEL_A, chains=2)
    code, out, err = cli(capsys, "stats")
    assert code == 0, err
    [disk] = rows(out, "disk")
    [row] = rows(out, "redis")
    assert disk[1] == row[1] == "4"  # 2 chains of 2 chunks
    assert row[-1] == f"{stores}:{namespace}:*"
    assert f"{namespace}  {MODEL_A}  shard {SHARD}" in out


def test_stats_shows_each_redis_namespace_on_a_row_of_its_own(stores, capsys):
    a = serve_like_vllm(MODEL_A, chains=2)
    b = serve_like_vllm(MODEL_B, chains=1, kv_heads=2)
    code, out, err = cli(capsys, "stats")
    assert code == 0, err
    assert rows(out, "disk")[0][1] == "6"  # one store for both
    by_namespace = {row[-1]: row[1] for row in rows(out, "redis")}
    assert by_namespace == {f"{stores}:{a}:*": "4", f"{stores}:{b}:*": "2"}


def test_stats_of_one_namespace_shows_only_it(stores, capsys):
    serve_like_vllm(MODEL_A, chains=2)
    b = serve_like_vllm(MODEL_B, chains=1)
    code, out, err = cli(capsys, "stats", "--namespace", b)
    assert code == 0, err
    [row] = rows(out, "redis")
    assert row[1] == "2" and row[-1] == f"{stores}:{b}:*"
    assert MODEL_B in out and MODEL_A not in out


def test_stats_json_gives_each_row_its_namespace_and_records(stores, capsys):
    namespace = serve_like_vllm(MODEL_A)
    code, out, err = cli(capsys, "stats", "--json")
    assert code == 0, err
    disk, redis_row = json.loads(out)
    assert (disk["namespace"], redis_row["namespace"]) == (None, namespace)
    [record] = redis_row["records"]
    assert record["engine"] == MODEL_A and record["layout"]["num_kv_heads"] == 1
    assert disk["records"] == redis_row["records"]


def test_stats_of_an_unknown_namespace_is_an_error_listing_the_recorded_ones(stores, capsys):
    namespace = serve_like_vllm(MODEL_A)
    code, _, err = cli(capsys, "stats", "--namespace", "0000000000000000")
    assert code == 2
    assert f"namespace 0000000000000000 is not recorded in the store (recorded: {namespace})" in err


def test_stats_with_redis_down_reports_it_and_still_counts_the_disk(redis_down, capsys):
    serve_like_vllm(MODEL_A)  # Redis unreachable: the worker warns and keeps the disk
    code, out, _ = cli(capsys, "stats")
    assert code == 1
    assert rows(out, "disk")[0][1] == "2"
    [row] = rows(out, "redis")
    assert "unavailable:" in row and "Connection" in " ".join(row)


# --- inspect ----------------------------------------------------------------------


def test_inspect_disk_checks_each_chunk_against_the_layout_its_namespace_recorded(stores, capsys):
    serve_like_vllm(MODEL_A, chains=2, kv_heads=1)
    serve_like_vllm(MODEL_B, chains=1, kv_heads=2)  # another layout in the same store
    code, out, err = cli(capsys, "inspect", "--tier", "disk")
    assert code == 0, err
    chunks = [line.split() for line in out.splitlines()[2:]]
    assert len(chunks) == 6 and all(chunk[-1] == "ok" for chunk in chunks)
    assert {chunk[1] for chunk in chunks} == {"4"}


def test_inspect_redis_lists_the_chunks_of_each_namespace(stores, capsys):
    a = serve_like_vllm(MODEL_A, chains=2)
    b = serve_like_vllm(MODEL_B, chains=1, kv_heads=2)
    code, out, err = cli(capsys, "inspect", "--tier", "redis")
    assert code == 0, err
    assert f"keys {stores}:{a}:*): 4 chunks" in out
    assert f"keys {stores}:{b}:*): 2 chunks" in out
    checks = [line.split()[-1] for line in out.splitlines() if len(line.split()[0]) == 32]
    assert checks == ["ok"] * 6


def test_inspect_of_redis_when_it_is_down_is_reported_with_exit_1(redis_down, capsys):
    serve_like_vllm(MODEL_A)
    code, _, err = cli(capsys, "inspect", "--tier", "redis")
    assert code == 1
    assert "kvtier: RedisTier" in err and "Connection" in err


def test_clear_with_redis_down_is_reported_and_deletes_nothing(redis_down, capsys):
    serve_like_vllm(MODEL_A)
    code, _, err = cli(capsys, "clear", "--yes")
    assert code == 1 and "Connection" in err
    code, out, _ = cli(capsys, "stats")
    assert rows(out, "disk")[0][1] == "2"


def test_inspect_disk_with_a_namespace_is_an_error_saying_why(redis_down, capsys):
    namespace = serve_like_vllm(MODEL_A)
    code, _, err = cli(capsys, "inspect", "--tier", "disk", "--namespace", namespace)
    assert code == 2
    assert "the disk tier keeps every namespace's values in one store" in err


# --- clear ------------------------------------------------------------------------


def test_clear_with_the_vllm_config_deletes_what_a_vllm_server_stored(stores, capsys):
    namespace = serve_like_vllm(MODEL_A, chains=2)
    code, out, err = cli(capsys, "clear", "--yes")
    assert code == 0, err
    assert "disk: deleted 4 values" in out
    assert f"redis: deleted 4 values of namespace {namespace}" in out
    code, out, _ = cli(capsys, "stats")
    assert rows(out, "disk")[0][1] == rows(out, "redis")[0][1] == "0"
    assert MODEL_A in out  # the records stay


def test_clear_of_one_namespace_keeps_the_other_namespaces_and_the_disk(stores, capsys):
    a = serve_like_vllm(MODEL_A, chains=2)
    b = serve_like_vllm(MODEL_B, chains=1)
    code, out, err = cli(capsys, "clear", "--namespace", b, "--yes")
    assert code == 0, err
    assert f"redis: deleted 2 values of namespace {b}" in out and "disk: kept" in out
    code, out, _ = cli(capsys, "stats")
    by_namespace = {row[-1]: row[1] for row in rows(out, "redis")}
    assert by_namespace == {f"{stores}:{a}:*": "4", f"{stores}:{b}:*": "0"}
    assert rows(out, "disk")[0][1] == "6"
