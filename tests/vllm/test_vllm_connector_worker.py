"""KVTierConnector's worker side driven step by step, as vLLM's model runner calls it.

The connector is built from a real ``VllmConfig`` over the tiny model and adopts CPU
tensors shaped like vLLM's per-layer KV views; no engine runs, so each test can place
a hook call exactly where a race in a real engine would put it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvtier.integrations.vllm import KVTierConnector, KVTierMetadata, LoadSpec  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK = 32
NUM_BLOCKS = 8
LAYERS = 2


def _vllm_config(
    model: str, kvtier: dict, engine_id: str, on_load_failure: str = "recompute"
) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=model, dtype="bfloat16"),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both",
            engine_id=engine_id,
            kv_load_failure_policy=on_load_failure,
            kv_connector_extra_config={"kvtier": kvtier},
        ),
    )


def _connector(model: str, kvtier: dict, engine_id: str) -> KVTierConnector:
    """A worker-side connector over 2 layers of ``NUM_BLOCKS`` random KV blocks."""
    vllm_config = _vllm_config(model, kvtier, engine_id)
    connector = KVTierConnector(vllm_config, KVConnectorRole.WORKER, None)
    # vLLM's CPU view of a layer: [blocks, kv_heads, block_size, 2 * head_size]
    connector.register_kv_caches(
        {
            f"model.layers.{i}.self_attn.attn": torch.randn(
                NUM_BLOCKS, 2, BLOCK, 64, dtype=torch.bfloat16
            )
            for i in range(LAYERS)
        }
    )
    return connector


def _disk_config(tmp_path: Path) -> dict:
    """A host pool over a write-through disk tier of 2-block chunks."""
    return {
        "tiers": {
            "cpu": {"capacity": "1MiB"},
            "disk": {"path": str(tmp_path / "lmdb"), "capacity": "64MiB", "chunk_blocks": 2,
                     "write_policy": "write_through"},
        }
    }  # fmt: skip


def _step(connector: KVTierConnector, loads: list[LoadSpec]) -> None:
    """The worker's hooks around one forward: bind, start the loads, save, clear."""
    connector.bind_connector_metadata(KVTierMetadata(loads=loads))
    connector.start_load_kv(None)
    connector.wait_for_save()
    connector.clear_connector_metadata()


def _blocks(connector: KVTierConnector, ids: list[int]) -> list[torch.Tensor]:
    return [layer[ids].clone() for layer in connector.cache.kv.layers]


def test_an_async_load_over_before_a_sync_load_starts_is_still_reported_finished(
    tiny_model: str, tmp_path: Path
) -> None:
    kvtier = _disk_config(tmp_path)
    on_disk = [bytes([1, i]) * 16 for i in range(2)]  # vLLM block hashes of one chain
    in_host = [bytes([2, 0]) * 16]  # another chain's first block
    writer = _connector(tiny_model, kvtier, "writer")
    written = _blocks(writer, [0, 1])
    writer.cache.save("w", [0, 1], writer.cache.keys(on_disk), writer.cache.root, 0)
    writer.shutdown()

    reader = _connector(tiny_model, kvtier, "reader")
    cache = reader.cache
    cache.save("b", [5], cache.keys(in_host), cache.root, 0)  # an earlier request's block
    keys_a, keys_b = cache.keys(on_disk), cache.keys(in_host)
    hit_a, hit_b = cache.lookup(keys_a, 0), cache.lookup(keys_b, 0)
    assert hit_a.blocks_per_tier() == {"disk": 2} and hit_b.blocks_per_tier() == {"cpu": 1}

    cache.pin("a", keys_a, hit_a, [2, 3])
    _step(reader, [LoadSpec("a", asynchronous=True)])
    # This step's get_finished ran before the read was over (it found nothing); the
    # read ends before the next step's sync load, whose start collects every load.
    cache.wait_loads()
    cache.pin("b", keys_b, hit_b, [4])
    _step(reader, [LoadSpec("b", asynchronous=False)])

    sending, recving = reader.get_finished(set())
    assert recving == {"a"}
    assert reader.get_block_ids_with_load_errors() == set()
    for got, want in zip(_blocks(reader, [2, 3]), written, strict=True):
        assert torch.equal(got, want)
    reader.shutdown()


def test_reset_cache_leaves_nothing_stored_before_it_to_be_found(
    tiny_model: str, tmp_path: Path
) -> None:
    kvtier = _disk_config(tmp_path)
    worker = _connector(tiny_model, kvtier, "reset")
    scheduler = KVTierConnector(
        _vllm_config(tiny_model, kvtier, "reset"), KVConnectorRole.SCHEDULER, None
    )
    cache = worker.cache
    hashes = [bytes([3, i]) * 16 for i in range(2)]
    before = cache.keys(hashes)
    cache.save("old", [0, 1], before, cache.root, 0)
    cache.flush()
    assert cache.lookup(before, 0).blocks_per_tier() == {"cpu": 2}

    assert scheduler.reset_cache()
    after = cache.keys(hashes)
    assert cache.lookup(after, 0).num_blocks == 0
    # The disk is shared with other engines: it keeps their keys' values.
    assert cache.lookup(before, 0).blocks_per_tier() == {"disk": 2}
    cache.save("new", [0, 1], after, cache.root, 0)
    assert cache.lookup(after, 0).blocks_per_tier() == {"cpu": 2}
    worker.shutdown()


def test_vllm_failing_requests_on_a_load_error_is_warned_about(
    tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    kvtier = {"tiers": {"cpu": {"capacity": "1MiB"}}}
    with caplog.at_level("WARNING", logger="kvtier.integrations.vllm"):
        KVTierConnector(
            _vllm_config(tiny_model, kvtier, "recompute"), KVConnectorRole.SCHEDULER, None
        )
        assert "kv_load_failure_policy" not in caplog.text
        KVTierConnector(
            _vllm_config(tiny_model, kvtier, "fail", on_load_failure="fail"),
            KVConnectorRole.SCHEDULER,
            None,
        )
    assert "kv_load_failure_policy is 'fail'" in caplog.text
