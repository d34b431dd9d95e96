"""The router's view of KV events (``kvtier.events``): per replica, blocks per tier; for
a prompt, the leading blocks each replica serves from which tier; the router's choice."""

from __future__ import annotations

import msgpack
import pytest

from kvtier.events import Fleet, PrefixMatch, Subscriber, choose, decode_batch, tier_of

BLOCK = 4
PROMPT = list(range(100, 100 + 6 * BLOCK + 1))  # six full blocks and one token


def stored(hashes, parent=None, tokens=PROMPT, medium="GPU", locality=None, ownership=None):
    start = 0 if parent is None else BLOCK * (parent + 1)
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens[start : start + BLOCK * len(hashes)],
        "block_size": BLOCK,
        "medium": medium,
        "locality": locality,
        "ownership": ownership,
    }


def removed(hashes, medium="GPU", locality=None, ownership=None):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium,
            "locality": locality, "ownership": ownership}  # fmt: skip


CPU = {"medium": "CPU", "locality": "LOCAL", "ownership": "kvtier:cpu"}
DISK = {"medium": "STORAGE", "locality": "LOCAL", "ownership": "kvtier:disk"}
REDIS = {"medium": "STORAGE", "locality": "REMOTE", "ownership": "kvtier:redis"}


def test_media_name_kvtiers_tiers_and_other_publishers_by_medium_and_locality():
    assert tier_of("CPU", "LOCAL", "kvtier:cpu") == "cpu"
    assert tier_of("STORAGE", "REMOTE", "kvtier:redis") == "redis"
    assert tier_of("GPU", None, None) == "gpu"
    assert tier_of("STORAGE", "LOCAL", None) == "disk"
    assert tier_of("STORAGE", "REMOTE", "kvcr") == "redis"


def test_a_prompt_is_matched_block_by_block_from_the_best_tier_holding_each():
    fleet = Fleet(["a"])
    fleet.apply("a", [stored([0, 1, 2, 3]), stored([0, 1, 2, 3, 4], **CPU)])
    fleet.apply("a", [removed([2, 3])])  # vLLM evicted the tail of its GPU copy
    [match] = fleet.match(PROMPT)
    assert match.tiers == ("gpu", "gpu", "cpu", "cpu", "cpu")
    assert match.blocks_per_tier() == {"gpu": 2, "cpu": 3}


def test_a_block_no_tier_holds_ends_the_prefix_and_is_forgotten():
    fleet = Fleet(["a"])
    fleet.apply("a", [stored([0, 1, 2], **DISK), removed([1], **DISK)])
    assert fleet.match(PROMPT)[0].tiers == ("disk",)
    assert fleet.views["a"].blocks_per_tier() == {"disk": 2}
    assert 1 not in fleet.views["a"].blocks


def test_stores_and_removals_are_idempotent():
    fleet = Fleet(["a"])
    fleet.apply("a", [stored([0, 1]), stored([0, 1]), removed([7]), removed([1]), removed([1])])
    assert fleet.views["a"].blocks_per_tier() == {"gpu": 1}


def test_all_blocks_cleared_clears_the_gpu_tier_only():
    fleet = Fleet(["a"])
    fleet.apply("a", [stored([0, 1]), stored([0, 1], **CPU), {"type": "AllBlocksCleared"}])
    assert fleet.views["a"].blocks_per_tier() == {"cpu": 2}


def test_remote_blocks_count_for_every_replica():
    fleet = Fleet(["a", "b"])
    fleet.apply("a", [stored([0, 1, 2], **REDIS)])
    assert [m.tiers for m in fleet.match(PROMPT)] == [("redis",) * 3] * 2


def test_a_prompt_shorter_than_a_block_matches_nothing():
    fleet = Fleet(["a"])
    fleet.apply("a", [stored([0])])
    assert fleet.match(PROMPT[:3])[0].num_blocks == 0


def test_the_router_picks_the_longest_held_prefix():
    best = choose([PrefixMatch("a", ("gpu",) * 2), PrefixMatch("b", ("disk",) * 5)])
    assert best.replica == "b"


def test_the_router_weighs_gpu_over_host_over_disk_over_redis_at_equal_length():
    tiers = ["redis", "disk", "cpu", "gpu"]
    best = choose([PrefixMatch(t, (t,) * 4) for t in tiers])
    assert best.replica == "gpu"
    assert choose([PrefixMatch(t, (t,) * 4) for t in tiers[:3]]).replica == "cpu"


def test_the_router_sends_a_prefix_held_equally_everywhere_to_the_first_replica():
    assert choose([PrefixMatch("a", ("redis",)), PrefixMatch("b", ("redis",))]).replica == "a"


def test_a_batch_payload_decodes_as_vllm_encodes_it():
    payload = msgpack.packb([1.5, [stored([0]), {"type": "AllBlocksCleared"}], None])
    ts, events = decode_batch(payload)
    assert ts == 1.5 and [e["type"] for e in events] == ["BlockStored", "AllBlocksCleared"]
    with pytest.raises(ValueError):
        decode_batch(b"\x01")


def test_the_subscriber_applies_what_a_publisher_sends():
    zmq = pytest.importorskip("zmq")
    pub = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    sub = Subscriber([endpoint])
    try:
        payload = msgpack.packb([0.0, [stored([0, 1], **CPU)], None])
        for seq in range(50):  # a SUB misses what is sent before it has joined
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            if sub.poll(0.05):
                break
        assert sub.fleet.views[endpoint].blocks_per_tier() == {"cpu": 2}
        assert sub.fleet.last_seq[endpoint] == seq
    finally:
        sub.close()
        pub.close(linger=0)
