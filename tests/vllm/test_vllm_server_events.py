"""kvtier's tiers in vLLM's KV events, in the OpenAI server run as the README says, with
``--kv-events-config`` (vLLM's ZMQ publisher) beside kvtier's ``--kv-transfer-config``.

A ``kvtier.events`` subscriber keeps the router's view while the test sends a prompt
with a 2k-token prefix, pushes the prefix out of vLLM's small KV pool with other
traffic, and asks the prompt again: the view must say where each block is, and the
server's own counters of cached tokens by source must agree with it. Servers, flags
and spaces are ``test_vllm_server``'s.
"""

# ruff: noqa: F811  (the imported ``space`` fixture is the tests' argument)
from __future__ import annotations

import json
import time

import pytest
from test_vllm_server import BLOCK, FILLERS, PREFIX, QUESTIONS, _serve, space  # noqa: F401

from kvtier.events import Subscriber

vllm_server = pytest.importorskip("kvtier.integrations.vllm_server")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PREFIX_BLOCKS = len(PREFIX) // BLOCK


def _settle(sub: Subscriber, quiet: float = 1.5, timeout: float = 60) -> list:
    """Every event batch until none came for ``quiet`` seconds (spill writes land
    after the reply), as (replica, events)."""
    out: list = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batches = sub.poll(quiet)
        if not batches:
            break
        out += batches
    return out


def _held(sub: Subscriber, prompt: list[int]) -> dict[str, int]:
    """The prompt's leading blocks the (one) replica holds, by the best tier of each."""
    return sub.fleet.match(prompt)[0].blocks_per_tier()


def _tiers_of_prefix(sub: Subscriber, endpoint: str) -> dict[str, int]:
    """How many of the prefix's blocks each tier holds (any tier, not only the best)."""
    view = sub.fleet.views[endpoint]
    out: dict[str, int] = {}
    parent = None
    for start in range(0, len(PREFIX), BLOCK):
        h = view.children.get((parent, tuple(PREFIX[start : start + BLOCK])))
        if h is None:
            break
        for tier in view.blocks[h].tiers:
            out[tier] = out.get(tier, 0) + 1
        parent = h
    return out


def test_kvtiers_tiers_are_announced_and_a_router_sees_where_the_next_hit_comes_from(
    tiny_model, space
):
    port = vllm_server._free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    endpoint = f"tcp://127.0.0.1:{port}"
    with space.server(tiny_model, ["--kv-events-config", json.dumps(events)]) as server:
        sub = Subscriber([endpoint])
        try:
            time.sleep(1)  # the subscription reaches the publisher
            _serve(server, QUESTIONS[0])
            first = _settle(sub)
            stored = {e.get("ownership") or e["medium"] for _, b in first for e in b
                      if e["type"] == "BlockStored"}  # fmt: skip
            assert {"GPU", "kvtier:cpu", "kvtier:disk"} <= stored
            assert _tiers_of_prefix(sub, endpoint).keys() >= {"gpu", "cpu", "disk"}
            assert _tiers_of_prefix(sub, endpoint)["cpu"] == PREFIX_BLOCKS

            for filler in FILLERS:  # pushes the prefix out of vLLM's 40 blocks
                server.complete(filler, max_tokens=1)
            after = _settle(sub)
            assert any(e["type"] == "BlockRemoved" and e["medium"] == "GPU"
                       for _, b in after for e in b)  # fmt: skip
            tiers = _tiers_of_prefix(sub, endpoint)
            assert tiers["cpu"] == tiers["disk"] == PREFIX_BLOCKS  # kvtier still holds it
            assert tiers.get("gpu", 0) < PREFIX_BLOCKS

            said = _held(sub, QUESTIONS[1])
            _, sources = _serve(server, QUESTIONS[1])
            assert said.get("gpu", 0) * BLOCK == sources.get("device", 0)
            assert said.get("cpu", 0) * BLOCK == sources.get("host", 0) > 0
            assert sum(said.values()) == PREFIX_BLOCKS
        finally:
            sub.close()
