"""KVTierConnector's KV events, with both halves driven step by step as in
``test_vllm_connector_roles`` (its ``Engine``), with vLLM's KV events enabled."""

# ruff: noqa: F811  (the roles' ``engines`` fixture, imported, is each test's argument)
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

pytest.importorskip("vllm")
import test_vllm_connector_roles as roles  # noqa: E402
from test_vllm_connector_roles import engines  # noqa: E402, F401  (the fixture)
from vllm.config import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK = roles.BLOCK


@dataclass
class Request(roles.Request):
    """With the prompt's tokens, which KV events carry."""

    all_token_ids: list[int] = field(default_factory=list)


def _request(req_id: str, hashes: list[bytes]) -> Request:
    tokens = list(range(len(hashes) * BLOCK + 1))
    return Request(req_id, hashes, len(tokens), 0, tokens)


@pytest.fixture
def events_on(monkeypatch):
    """Every config the roles' Engine builds publishes KV events (to nobody)."""
    make = roles._vllm_config

    def with_events(*args, **kwargs):
        config = make(*args, **kwargs)
        config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        return config

    monkeypatch.setattr(roles, "_vllm_config", with_events)


def _taken(engine: roles.Engine) -> list[tuple[str, str | None, list]]:
    return [
        (type(e).__name__, e.ownership, list(e.block_hashes))
        for e in engine.scheduler.take_events()
        if isinstance(e, BlockStored | BlockRemoved)
    ]


def _ids(hashes: list[bytes]) -> list:
    return [maybe_convert_block_hash(h) for h in hashes]


def test_without_kv_events_the_connector_keeps_no_event_state(tiny_model, engines):
    engine = engines(tiny_model, roles._host_only())
    assert engine.scheduler.events is None
    engine.serve(_request("a", roles._hashes(1, 2)), [0, 1, 2])
    assert list(engine.scheduler.take_events()) == []


def test_saved_blocks_are_stored_in_the_host_pool_once_every_rank_holds_them(
    tiny_model, engines, events_on
):
    engine = engines(tiny_model, roles._host_only(), tp=2)
    chain = roles._hashes(1, 4)
    engine.serve(_request("a", chain), [0, 1, 2, 3, 4])
    engine.step({})  # the saves' report
    assert _taken(engine) == [("BlockStored", "kvtier:cpu", _ids(chain))]


def test_blocks_written_to_disk_are_stored_there_and_host_evictions_removed(
    tiny_model, engines, events_on, tmp_path
):
    engine = engines(tiny_model, roles._disk(tmp_path, host="64KiB"))  # 4 host blocks
    first, second = roles._hashes(1, 4), roles._hashes(2, 4)
    engine.serve(_request("a", first), [0, 1, 2, 3, 4])
    engine.workers[0].cache.flush()
    engine.step({})
    assert sorted(_taken(engine)) == [
        ("BlockStored", "kvtier:cpu", _ids(first)),
        ("BlockStored", "kvtier:disk", _ids(first)),  # two chunks of 2: one chain
    ]
    engine.serve(_request("b", second), [5, 6, 7, 8, 9])  # evicts "a" from the host pool
    engine.workers[0].cache.flush()
    engine.step({})
    taken = _taken(engine)
    assert ("BlockRemoved", "kvtier:cpu", _ids(first[::-1])) in taken  # tail first
    assert not any(kind == "BlockRemoved" and owner == "kvtier:disk" for kind, owner, _ in taken)


def test_reset_removes_everything_kvtier_announced(tiny_model, engines, events_on):
    engine = engines(tiny_model, roles._host_only())
    chain = roles._hashes(1, 2)
    engine.serve(_request("a", chain), [0, 1, 2])
    engine.step({})
    _taken(engine)
    engine.scheduler.reset_cache()
    assert _taken(engine) == [("BlockRemoved", "kvtier:cpu", _ids(chain))]
