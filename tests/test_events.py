"""The router's view of KV events (``kvtier.events``): per replica, blocks per tier; for
a prompt, the leading blocks each replica serves from which tier; the router's choice."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgpack
import pytest

from kvtier.cli import main
from kvtier.events import Fleet, PrefixMatch, Subscriber, choose, decode_batch, tier_of

BLOCK = 4
PROMPT = list(range(100, 100 + 6 * BLOCK + 1))  # six full blocks and one token
ROOT = Path(__file__).resolve().parents[1]


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


def test_a_fleet_that_heard_nothing_matches_nothing_and_routes_to_the_first_replica():
    matches = Fleet(["a", "b"]).match(PROMPT)
    assert [m.num_blocks for m in matches] == [0, 0] and choose(matches).replica == "a"


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


@pytest.fixture
def publish() -> Iterator:
    """``publish(batch)``: a ZMQ PUB socket on a free loopback port that sends ``batch``
    (a payload) over and over until the test is done, and its endpoint (a SUB socket
    misses what is sent before it has joined; stores are idempotent)."""
    zmq = pytest.importorskip("zmq")
    done = threading.Event()
    started: list[tuple[threading.Thread, object]] = []

    def run(pub, payload: bytes) -> None:
        while not done.wait(0.02):
            pub.send_multipart([b"", (7).to_bytes(8, "big"), payload])

    def start(payload: bytes) -> str:
        pub = zmq.Context.instance().socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        thread = threading.Thread(target=run, args=(pub, payload))
        thread.start()
        started.append((thread, pub))
        return f"tcp://127.0.0.1:{port}"

    yield start
    done.set()
    for thread, pub in started:
        thread.join()
        pub.close(linger=0)


def batch(*events) -> bytes:
    return msgpack.packb([0.0, list(events), None])


def test_the_subscriber_applies_what_a_publisher_sends(publish):
    endpoint = publish(batch(stored([0, 1], **CPU)))
    sub = Subscriber([endpoint])
    try:
        sub.poll(1.0)
        assert sub.fleet.views[endpoint].blocks_per_tier() == {"cpu": 2}
        assert sub.fleet.last_seq[endpoint] == 7
    finally:
        sub.close()


def test_kvtier_events_prints_each_replicas_tiers_and_a_prompts_route(publish, tmp_path, capsys):
    endpoint = publish(batch(stored([0, 1, 2]), stored([0, 1, 2, 3], **CPU)))
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(PROMPT))
    assert main(["events", endpoint, "--seconds", "1", "--json", "--prompt-file", str(prompt)]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["replicas"][endpoint]["blocks"] == {"gpu": 3, "cpu": 4}
    assert view["replicas"][endpoint]["prompt"]["per_tier"] == {"gpu": 3, "cpu": 1}
    assert view["route"] == endpoint


class FakeServer(ThreadingHTTPServer):
    """The two routes of vLLM's OpenAI server the router calls; counts completions."""

    def __init__(self) -> None:
        self.completions = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._reply({"data": [{"id": "m"}]})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                server.completions += 1
                self._reply({"choices": [{"token_ids": [1, 2]}]})

            def _reply(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def test_route_by_prefix_sends_a_prompt_to_the_replica_holding_more_of_it(publish, tmp_path):
    gpu, host = FakeServer(), FakeServer()
    replicas = [
        f"{gpu.url}={publish(batch(stored([0, 1])))}",
        f"{host.url}={publish(batch(stored([0, 1, 2, 3], **CPU)))}",
    ]
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(PROMPT))
    args = [a for r in replicas for a in ("--replica", r)]
    done = subprocess.run(
        [sys.executable, "examples/route_by_prefix.py", *args, "--prompt-file", str(prompt)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"routed to {host.url}; reply [1, 2]" in done.stdout
    assert (gpu.completions, host.completions) == (0, 1)
    for server in (gpu, host):
        server.shutdown()
