"""kvtier in vLLM's OpenAI-compatible server, run the way the README tells a user to.

Each server is ``python -m vllm.entrypoints.openai.api_server`` with vLLM's defaults
(engine core and workers in processes of their own) and ``configs/vllm.yaml`` as
shipped, its paths and Redis prefix moved into the test's own space through the
environment variables the file reads. A plain HTTP client sends token-id prompts and
reads vLLM's own counters of cached prompt tokens by source from ``/metrics``.

Two flags are the machine's, not kvtier's: ``--gpu-memory-utilization 0.3`` (on CPU
vLLM reserves that share of the NUMA node's memory, 0.92 by default, which a shared
machine does not have free) and ``--num-gpu-blocks-override`` (vLLM's own KV pool kept
as small relative to the traffic as a GPU's is under load, so that a shared prefix
leaves it and comes back from kvtier). kvtier's servers run with
``VLLM_CPU_NUM_OF_RESERVED_CPU=1``, as the README tells users of vLLM's CPU build on a
small machine. The restarted server also publishes vLLM's KV events
(``--kv-events-config``, as the README shows for routers), read by ``kvtier.events``.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
from conftest import VOCAB
from redis_servers import delete_prefix, unique_prefix, wait_until

from kvtier.events import Subscriber
from kvtier.tiers.lmdb import LMDBTier

vllm_server = pytest.importorskip("kvtier.integrations.vllm_server")
VLLMServer = vllm_server.VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # servers start in ~1 min each

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "vllm.yaml"
MACHINE = ["--gpu-memory-utilization", "0.3", "--num-gpu-blocks-override", "40"]
TP2 = ["--tensor-parallel-size", "2"]
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank on a 2-core machine
BINDING_WARNING = "kvtier: vLLM bound this worker's compute threads to every CPU"
BLOCK = 128  # vLLM's default block size on CPU
T = TypeVar("T")


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


PREFIX = _tokens(2048, seed=1)  # 16 blocks shared by the questions
QUESTIONS = [PREFIX + _tokens(64, seed=10 + i) for i in range(3)]
# Other traffic between the questions: enough to push PREFIX out of vLLM's 40 blocks.
FILLERS = [_tokens(2112, seed=20 + i) for i in range(3)]


def kv_events_args(port: int) -> list[str]:
    """vLLM's server arguments that publish its KV events over ZMQ on ``port``."""
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    return ["--kv-events-config", json.dumps(events)]


def _cached_during(server: VLLMServer, ask: Callable[[], T]) -> tuple[T, dict[str, int]]:
    """What ``ask()`` returns, and the prompt tokens each source supplied meanwhile."""
    before = server.cached_tokens()
    out = ask()
    after = server.cached_tokens()
    return out, {s: after[s] - before[s] for s in after if after[s] > before[s]}


def _serve(
    server: VLLMServer, prompt: list[int], **fields: Any
) -> tuple[list[int], dict[str, int]]:
    """The reply's tokens, and the prompt tokens each source supplied for it (``fields``:
    ``VLLMServer.complete``'s)."""
    return _cached_during(server, lambda: server.complete(prompt, **fields).tokens)


def _chat(
    server: VLLMServer, question: list[int], **fields: Any
) -> tuple[list[int], dict[str, int]]:
    """Other traffic, then ``question``: its reply and where its prefix came from."""
    for filler in FILLERS:
        server.complete(filler, max_tokens=1)
    return _serve(server, question, **fields)


def corrupt_disk(store: Path, keys: Collection[bytes] | None = None) -> None:
    """Flip the last byte of every value of the disk store at ``store`` (of ``keys`` only,
    when given, the others deleted): each fails its checksum when read."""
    tier = LMDBTier(store, 64 << 20, 4)
    try:
        stored = list(tier.keys())
        if keys is not None:
            tier.delete_many([k for k in stored if k not in keys])
            stored = [k for k in stored if k in keys]
        values: dict[bytes, bytes] = {}
        tier.get_many(stored, lambda i, v: values.__setitem__(stored[i], bytes(v)))
        tier.put_many([(k, v[:-1] + bytes([v[-1] ^ 0xFF])) for k, v in values.items()])
    finally:
        tier.close()


class Space:
    """Where one kvtier instance keeps its data: a disk directory and a Redis prefix."""

    def __init__(self, root: Path) -> None:
        self.disk = root / "cache"
        self.redis_prefix = unique_prefix("kvtier-vllm-e2e")

    def env(self) -> dict[str, str]:
        return {
            "KVTIER_CACHE_DIR": str(self.disk),
            "KVTIER_CPU_CAPACITY": "64MiB",
            "KVTIER_REDIS_PREFIX": self.redis_prefix,
            **vllm_server.SMALL_MACHINE_CORES,
        }

    def logs(self) -> str:
        """Everything this space's servers logged so far."""
        return "".join(log.read_text() for log in self.disk.parent.glob("vllm-*.log"))

    def server(
        self, model: str, args: list[str], env: dict | None = None, config=CONFIG, **kw
    ) -> VLLMServer:
        """A server on this space (``config``: kvtier's; None when ``args`` configure
        the connector)."""
        log = self.disk.parent / f"vllm-{len(list(self.disk.parent.glob('vllm-*.log')))}.log"
        return VLLMServer(model, config, MACHINE + args, {**self.env(), **(env or {})}, log, **kw)


@pytest.fixture(scope="module")
def space(tmp_path_factory, real_client) -> Iterator[Space]:
    s = Space(tmp_path_factory.mktemp("vllm-server"))
    yield s
    delete_prefix(real_client, s.redis_prefix)


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory) -> list[list[int]]:
    """Each question's reply from a server without kvtier."""
    log = tmp_path_factory.mktemp("vllm-reference") / "vllm.log"
    with VLLMServer(tiny_model, None, MACHINE, log_path=log) as server:
        return [server.complete(q).tokens for q in QUESTIONS]


@pytest.fixture(scope="module")
def first_run(tiny_model, space, reference):
    """A kvtier server that answers question 0, then question 1 after other traffic."""
    with space.server(tiny_model, []) as server:
        first = _serve(server, QUESTIONS[0])
        second = _chat(server, QUESTIONS[1])
    return first, second


def test_a_shared_prefix_evicted_from_vllm_comes_back_from_kvtiers_host_pool(first_run, reference):
    (first, first_sources), (second, second_sources) = first_run
    assert first_sources == {}  # nothing cached yet
    assert second_sources.get("host", 0) >= 8 * BLOCK  # most of the 16 prefix blocks
    assert second_sources.get("host", 0) + second_sources.get("device", 0) == len(PREFIX)
    assert [first, second] == reference[:2]


@pytest.fixture(scope="module")
def events_port() -> int:
    """Where ``restarted`` publishes vLLM's KV events (and kvtier's with them)."""
    return vllm_server._free_port()


@pytest.fixture(scope="module")
def restarted(tiny_model, space, first_run, events_port) -> Iterator[VLLMServer]:
    """A server started after ``first_run``'s: its host pool is empty, its disk holds
    the prefix and the fillers. It publishes KV events (``--kv-events-config``)."""
    with space.server(tiny_model, kv_events_args(events_port)) as server:
        yield server


def test_after_a_restart_the_prefix_is_a_disk_hit(restarted, reference):
    tokens, sources = _serve(restarted, QUESTIONS[2])
    assert sources == {"disk": len(PREFIX)}
    assert tokens == reference[2]


def _send(server: VLLMServer, prompt: list[int], max_tokens: int) -> http.client.HTTPConnection:
    """A streamed completion of ``prompt``, sent; closing the connection before the
    reply ends is a client giving up (vLLM aborts the request)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def _running(server: VLLMServer, prompt: list[int], max_tokens: int) -> http.client.HTTPConnection:
    """``_send``, once vLLM has computed the first token: the request holds its blocks
    of vLLM's pool until it ends."""
    conn = _send(server, prompt, max_tokens)
    response = conn.getresponse()
    while not response.readline().startswith(b"data:"):
        pass
    return conn


def _hang_up(conn: http.client.HTTPConnection, after: float) -> None:
    time.sleep(after)
    conn.close()


def _busy(server: VLLMServer) -> float:
    """Requests vLLM runs or keeps waiting."""
    running = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    return sum(v for k, v in server.metrics().items() if k.startswith(running))


def _metric(server: VLLMServer, name: str) -> float:
    """The sum of ``name``'s samples (over engines and labels)."""
    return sum(v for k, v in server.metrics().items() if k.split("{")[0] == name)


def test_clients_hanging_up_while_their_prefixes_stage_leave_no_host_slot_pinned(
    restarted, reference
):
    """Two long requests fill vLLM's pool (40 blocks, 19 each), so sixteen requests on
    the prefixes the disk holds wait, and their disk hits are staged. Once a stage has
    been read, every client gives up within 0.3 s, the long ones too (the requests
    still there are scheduled meanwhile): while its prefix is staged, loaded or its
    reply computed."""
    draw = random.Random(5)
    staged = "vllm:kvtier_staged_blocks_total"
    before = _metric(restarted, staged)
    long = [_running(restarted, _tokens(2080, seed=300 + i), max_tokens=256) for i in range(2)]
    prompts = [(PREFIX, *FILLERS)[i % 4] + _tokens(32, seed=100 + i) for i in range(16)]
    storm = [_send(restarted, p, max_tokens=16) for p in prompts]
    wait_until(lambda: _metric(restarted, staged) > before, 120, "a stage read", 0.05)
    clients = storm + long
    with ThreadPoolExecutor(len(clients)) as pool:
        list(pool.map(_hang_up, clients, [draw.uniform(0, 0.3) for _ in clients]))
    wait_until(lambda: not _busy(restarted), 120, "vLLM to finish its requests", 0.5)
    restarted.complete(_tokens(8, seed=99), max_tokens=1)  # a step, to report the level
    assert _metric(restarted, "vllm:kvtier_host_pinned_blocks") == 0
    assert restarted.complete(QUESTIONS[0]).tokens == reference[0]


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


def _tiers_of_prefix(sub: Subscriber, endpoint: str, prefix: list[int]) -> dict[str, int]:
    """How many of ``prefix``'s blocks each tier holds (any tier, not only the best)."""
    view = sub.fleet.views[endpoint]
    out: dict[str, int] = {}
    parent = None
    for start in range(0, len(prefix), BLOCK):
        h = view.children.get((parent, tuple(prefix[start : start + BLOCK])))
        if h is None:
            break
        for tier in view.blocks[h].tiers:
            out[tier] = out.get(tier, 0) + 1
        parent = h
    return out


def test_kvtiers_tiers_are_announced_and_a_router_sees_where_the_next_hit_comes_from(
    restarted, events_port
):
    """A ``kvtier.events`` subscriber keeps the router's view while a prompt with a new
    2k-token prefix is served, other traffic pushes the prefix out of vLLM's small KV
    pool, and the prefix is asked again: the view must say where each block is, and the
    server's own counters of cached tokens by source must agree with it."""
    prefix = _tokens(2048, seed=200)
    first, second = (prefix + _tokens(64, seed=201 + i) for i in range(2))
    endpoint = f"tcp://127.0.0.1:{events_port}"
    blocks = len(prefix) // BLOCK
    sub = Subscriber([endpoint])
    try:
        time.sleep(1)  # the subscription reaches the publisher
        _serve(restarted, first)
        stored = {e.get("ownership") or e["medium"] for _, b in _settle(sub) for e in b
                  if e["type"] == "BlockStored"}  # fmt: skip
        assert {"GPU", "kvtier:cpu", "kvtier:disk"} <= stored
        assert _tiers_of_prefix(sub, endpoint, prefix)["cpu"] == blocks

        for i in range(3):  # pushes the prefix out of vLLM's 40 blocks
            restarted.complete(_tokens(2112, seed=210 + i), max_tokens=1)
        after = _settle(sub)
        assert any(e["type"] == "BlockRemoved" and e["medium"] == "GPU"
                   for _, b in after for e in b)  # fmt: skip
        tiers = _tiers_of_prefix(sub, endpoint, prefix)
        assert tiers["cpu"] == tiers["disk"] == blocks  # kvtier still holds it
        assert tiers.get("gpu", 0) < blocks

        said = sub.fleet.match(second)[0].blocks_per_tier()
        _, sources = _serve(restarted, second)
        assert said.get("gpu", 0) * BLOCK == sources.get("device", 0)
        assert said.get("cpu", 0) * BLOCK == sources.get("host", 0) > 0
        assert sum(said.values()) == blocks
    finally:
        sub.close()


def test_the_connector_does_not_warn_of_the_core_binding_with_the_readmes_setting(space, first_run):
    assert "Starting to load model" in space.logs()  # the worker's log is there
    assert BINDING_WARNING not in space.logs()


@pytest.mark.long
@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="the binding collapses on 2 CPUs")
def test_the_connector_warns_when_vllm_binds_compute_threads_to_every_cpu(tiny_model, space):
    """Without ``VLLM_CPU_NUM_OF_RESERVED_CPU``, vLLM reserves both CPUs of this machine
    for its other processes once a connector is configured, so it reserves none."""
    env = {**space.env(), "KVTIER_CACHE_DIR": str(space.disk.parent / "cores-cache")}
    del env["VLLM_CPU_NUM_OF_RESERVED_CPU"]
    log = space.disk.parent / "cores.log"
    with VLLMServer(tiny_model, CONFIG, MACHINE, env, log):
        pass
    assert log.read_text().count(BINDING_WARNING) == 1
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=1" in log.read_text()


@pytest.mark.long
def test_tensor_parallel_2_hits_host_and_disk_and_replies_as_without_kvtier(
    tiny_model, tmp_path_factory, real_client, reference
):
    """The replies equal the module's reference, a single-rank server without kvtier:
    greedy decoding of this model gives the same tokens on one rank and on two, so a
    TP=2 server without kvtier would only add a minute of start-up."""
    space = Space(tmp_path_factory.mktemp("vllm-tp2"))
    try:
        with space.server(tiny_model, TP2, TP2_ENV) as server:
            first, _ = _serve(server, QUESTIONS[0])
            second, host = _chat(server, QUESTIONS[1])
        with space.server(tiny_model, TP2, TP2_ENV) as server:
            third, disk = _serve(server, QUESTIONS[2])
    finally:
        delete_prefix(real_client, space.redis_prefix)
    assert host.get("host", 0) >= 8 * BLOCK
    assert disk == {"disk": len(PREFIX)}
    assert [first, second, third] == reference


def test_the_engine_serves_every_request_while_kvtier_fails_in_every_hook(
    tiny_model, space, first_run, reference
):
    """Every other call of each step of kvtier's (lookup, index update, pin, load,
    save, settle, report) raises, and every value on disk is corrupt."""
    broken = space.disk.parent / "broken"
    shutil.copytree(space.disk, broken / "cache")
    corrupt_disk(broken / "cache" / "vllm-lmdb")
    env = {
        **space.env(),
        "KVTIER_CACHE_DIR": str(broken / "cache"),
        "KVTIER_REDIS_URL": "redis://127.0.0.1:1/0",  # nothing listens there
        "PYTHONPATH": str(Path(__file__).parent),
    }
    kv_transfer = vllm_server.kv_transfer_config(CONFIG, module="faulty_connector")
    args = MACHINE + ["--kv-transfer-config", kv_transfer]
    with VLLMServer(tiny_model, None, args, env, broken / "vllm.log") as server:
        replies = [_chat(server, q)[0] for q in QUESTIONS]
        again = server.complete(QUESTIONS[0]).tokens
    assert replies == reference
    assert again == reference[0]
    assert "kvtier: " in (broken / "vllm.log").read_text()  # each hook's first failure
