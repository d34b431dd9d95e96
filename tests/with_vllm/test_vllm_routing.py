"""Two replicas side by side, sharing a Redis tier, behind ``examples/route_by_prefix.py``'s
router: a repeated prefix goes to the replica that holds it in host memory, and a
prefix held only in Redis counts for both (the first of equals gets it, and loads it
from Redis).

Each replica is vLLM's OpenAI server with kvtier (a host pool and the shared Redis, no
disk: the replicas share nothing else) and KV events on. vLLM's pool and the host
pools are small, so a few other prompts push a prefix out of both. What one replica
writes through to Redis counts for both, below what a replica holds itself.
"""

from __future__ import annotations

import importlib.util
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from redis_servers import LOCAL_URL, delete_prefix, unique_prefix
from test_vllm_server import BLOCK, _tokens, kv_events_args

vllm_server = pytest.importorskip("kvtier.integrations.vllm_server")
VLLMServer = vllm_server.VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.long, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
ARGS = [
    "--gpu-memory-utilization",
    "0.3",
    "--num-gpu-blocks-override",
    "24",
    "--max-model-len",
    "2560",
]
CHAT = _tokens(2048, seed=31)  # 16 blocks: a chat's history
SHARED = _tokens(2048, seed=32)  # 16 blocks: a document one replica read
OTHER = [_tokens(2112, seed=40 + i) for i in range(2)]  # other traffic, 17 blocks each


def _router_module():
    path = ROOT / "examples" / "route_by_prefix.py"
    spec = importlib.util.spec_from_file_location("route_by_prefix", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def replicas(tiny_model, tmp_path_factory, real_client):
    """Two servers sharing one Redis prefix: [(server, events endpoint)]."""
    root = tmp_path_factory.mktemp("vllm-routing")
    prefix = unique_prefix("kvtier-routing")
    config = root / "kvtier.yaml"
    config.write_text(json.dumps({
        "model": "default",
        "tiers": {
            "cpu": {"capacity": "2MiB", "stage_share": 0},  # 32 blocks of 64 KiB
            "redis": {"url": LOCAL_URL, "key_prefix": prefix, "chunk_blocks": 4,
                      "write_policy": "write_through"},
        },
    }))  # fmt: skip

    def start(i: int) -> tuple[VLLMServer, str]:
        port = vllm_server._free_port()
        server = VLLMServer(tiny_model, config, [*ARGS, *kv_events_args(port)],
                            vllm_server.SMALL_MACHINE_CORES, root / f"vllm-{i}.log")  # fmt: skip
        return server, f"tcp://127.0.0.1:{port}"

    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(start, range(2)))
    yield started
    for server, _ in started:
        server.stop()
    delete_prefix(real_client, prefix)


def _sources(server: VLLMServer, before: dict[str, int]) -> dict[str, int]:
    after = server.cached_tokens()
    return {s: after[s] - before[s] for s in after if after[s] > before[s]}


def test_the_router_sends_a_prefix_where_it_is_held_and_a_redis_prefix_to_either(replicas):
    (a, a_events), (b, b_events) = replicas
    module = _router_module()
    router = module.Router({a_events: a.url, b_events: b.url})
    servers = {a_events: a, b_events: b}
    try:
        time.sleep(1)  # the subscriptions reach the publishers

        def route(prompt: list[int]) -> tuple[str, list, dict[str, int]]:
            best, matches = router.pick(prompt, listen=3.0)
            before = servers[best.replica].cached_tokens()
            router.send(best.replica, prompt, max_tokens=1)
            return best.replica, matches, _sources(servers[best.replica], before)

        first, _, _ = route(CHAT + _tokens(64, seed=50))
        assert first == a_events  # nothing held anywhere: the first replica
        a.complete(OTHER[0], max_tokens=1)  # the chat leaves a's GPU pool, stays in host
        chosen, matches, sources = route(CHAT + _tokens(64, seed=51))
        held = {m.replica: m.blocks_per_tier() for m in matches}
        assert chosen == a_events and held[a_events].get("cpu", 0) > 0, held
        assert set(held[b_events]) == {"redis"}  # a wrote it through to the shared Redis
        assert sources.get("host", 0) > 0

        b.complete(SHARED + _tokens(64, seed=52), max_tokens=1)  # written through to Redis
        for prompt in OTHER:  # ... and out of b's GPU pool and host pool
            b.complete(prompt, max_tokens=1)
        chosen, matches, sources = route(SHARED + _tokens(64, seed=53))
        held = {m.replica: m.blocks_per_tier() for m in matches}
        assert held[a_events] == held[b_events] == {"redis": len(SHARED) // BLOCK}, held
        assert chosen == a_events  # the first of equals
        assert sources.get("external_unspecified", 0) > 0  # a read b's prefix from Redis
    finally:
        router.close()
