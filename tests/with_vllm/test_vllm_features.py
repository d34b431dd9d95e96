"""kvtier under the vLLM features deployments turn on, end to end in vLLM's CPU build:
chunked prefill, preemption, n-gram speculative decoding, LoRA adapters, ``cache_salt``
tenants, kvtier beside another connector (``MultiConnector``), and both
``kv_load_failure_policy`` values.

Every test compares greedy replies with vLLM alone's under the same settings (the
``reference`` server: the same flags, no connector) and reads from vLLM's own counters
of cached prompt tokens by source (``test_vllm_server._serve``) that kvtier supplied
them: ``host`` (its host pool), ``disk`` (LMDB) or ``external_unspecified`` (Redis).

Settings. Every server runs with ``test_vllm_server.MACHINE`` (vLLM's pool of 40
blocks of 128 tokens, small enough that other traffic pushes a prefix out of it and
that a batch of long replies outgrows it: preemption) and the ``features`` fixture's:

- ``--max-num-batched-tokens 512``: prompts of 2-3k tokens are prefilled in chunks of
  512 tokens, so a prompt's blocks are saved over several steps (the model's 4096
  positions leave ``--max-model-len`` at its default);
- ``--speculative-config`` n-gram (3 draft tokens, lookups of up to 3): the tiny random
  Llama repeats itself, so drafts are proposed and accepted, and a reply's blocks fill
  several tokens per step;
- ``--enable-lora`` with adapters ``a`` and ``b`` written by the test (rank 8 on q_proj
  and v_proj, random from fixed seeds, large enough that the three models reply
  differently).

Prefixes are whole chunks of the spill tiers (configs/vllm.yaml's 4 blocks), which
are written through to disk and Redis as they complete: a restarted or another server
finds them while the first still runs (a prefix's partial last chunk is written once
its request is over, ``test_vllm_connector_roles``).

None of these changes what kvtier is asked to do for the others (vLLM's block hashes
and its KV layout are those of every setting), so one reference server answers every
test and each kvtier server serves the traffic of several features (a module fixture
per server; the tests check what it recorded). Servers, each ~30 s to start here (up to
a minute on a busy 2-core machine):

- ``first``: configs/vllm.yaml on a fresh space; ``restarted``: the same space after it
  (host pool empty, its disk holds what ``first`` computed); ``shared``: another disk,
  the same Redis prefix (a Redis shared by two servers);
- ``multi``: vLLM's ``MultiConnector`` with its ``ExampleConnector`` first and kvtier
  second. ExampleConnector stores only what a prompt computes in its first step, so its
  prompts stay under one chunk (it fails vLLM's worker on a longer one);
- ``written`` and one server per policy: a server writes two prefixes; the policy
  servers find the first corrupt on disk and the second in a Redis server of the test's
  own that dies when kvtier's load reads it (``_KillOnRead``).

Sleep mode is left out: vLLM's CPU build does not support it (``CPUWorker.sleep`` only
logs a warning).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from redis_servers import LOCAL_HOST, RedisServer, delete_prefix, wait_until
from test_vllm_server import (
    BLOCK,
    CONFIG,
    FILLERS,
    MACHINE,
    Space,
    _cached_during,
    _chat,
    _metric,
    _serve,
    _tokens,
    corrupt_disk,
)

from kvtier.tiers.lmdb import LMDBTier

vllm_server = pytest.importorskip("kvtier.integrations.vllm_server")
vllm_metrics = pytest.importorskip("kvtier.integrations.vllm_metrics")
VLLMServer = vllm_server.VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.long, pytest.mark.timeout(1200)]

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
RANK = 8
# Who asks: the base model, each adapter (the request's model), two cache_salt tenants.
TENANTS: dict[str, dict[str, str]] = {
    "base": {},
    "a": {"model": "a"},
    "b": {"model": "b"},
    "salt-1": {"cache_salt": "tenant-1"},
    "salt-2": {"cache_salt": "tenant-2"},
}
PINNED = f"vllm:kvtier_{vllm_metrics.PINNED}"
LOAD_ERRORS = f"vllm:kvtier_{vllm_metrics.LOAD_ERRORS}_total"
REDIS = "external_unspecified"  # the source vLLM counts kvtier's Redis hits under

# Chunked prefill: 24 full blocks and 28 tokens (7 chunks of 512), then a later turn.
LONG = _tokens(3100, seed=500)
LONG_NEXT = LONG + _tokens(64, seed=501)
LONG_HIT = len(LONG) // BLOCK * BLOCK
# Speculative decoding: 15 blocks and 80 tokens, so a reply of 64 fills block 16 with 48
# of its tokens; the next turn (prompt, reply, a new message) hits all 16.
TURN = _tokens(2000, seed=600)
TURN_REPLY = 64
TURN_MESSAGE = _tokens(64, seed=601)
# Tenants: a document every tenant reads, then documents one tenant alone read.
DOC = _tokens(2048, seed=700)
ASKS = [_tokens(64, seed=701 + i) for i in range(2)]
DOC_OF_A, DOC_OF_SALT_1 = _tokens(2048, seed=710), _tokens(2048, seed=711)
# Preemption: six prompts of 11 blocks, four on 8-block prefixes ``first`` computed,
# each replying 384 tokens (14 blocks in all): three running outgrow vLLM's 40 blocks.
BATCH_DOCS = [_tokens(1024, seed=800 + i) for i in range(4)]
BATCH = [d + _tokens(384, seed=810 + i) for i, d in enumerate(BATCH_DOCS)]
BATCH += [_tokens(1408, seed=820 + i) for i in range(2)]
BATCH_REPLY = 384
# MultiConnector: a document of 3 blocks and two questions on it, the second longer
# (ExampleConnector matches a whole prompt's full blocks, so only the first asked again);
# other traffic of 16 prompts of 3 full blocks (vLLM reuses a prompt's partial block
# first): 48 blocks of 40. What ExampleConnector computes stays under one chunk.
MULTI_DOC = _tokens(384, seed=900)
MULTI_ASKS = [MULTI_DOC + _tokens(64, seed=901), MULTI_DOC + _tokens(192, seed=902)]
MULTI_FILLERS = [[_tokens(448, seed=910 + 16 * r + i) for i in range(16)] for r in range(2)]
# Load failures: a prefix corrupt on disk, and one only in Redis (4 chunks each), each
# asked with a question: (prefix, prompt, the source vLLM counts the hit under).
ON_DISK = _tokens(2048, seed=1000)
IN_REDIS = _tokens(2048, seed=1001)
FAILURES = {
    "disk": (ON_DISK, ON_DISK + _tokens(64, seed=1002), "disk"),
    "redis": (IN_REDIS, IN_REDIS + _tokens(64, seed=1003), REDIS),
}
# What a client of vLLM's OpenAI server gets for a request vLLM failed (finish reason
# "error": ``GenerationError("Internal server error")``, raised by ``_raise_if_error`` in
# vllm/entrypoints/generate/base/serving.py): the stream's error object, code 500.
GENERATION_ERROR = {"message": "Internal server error", "type": "InternalServerError", "code": 500}


def _write_adapter(path: Path, model: dict[str, Any], seed: int) -> Path:
    """A LoRA adapter in PEFT's files (``adapter_config.json``,
    ``adapter_model.safetensors``): rank ``RANK`` on q_proj and v_proj of every layer of
    ``model`` (its config.json), weights drawn from ``seed``."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hidden, head_dim = model["hidden_size"], model["head_dim"]
    outputs = {
        "q_proj": model["num_attention_heads"] * head_dim,
        "v_proj": model["num_key_value_heads"] * head_dim,
    }
    weights = {}
    for layer in range(model["num_hidden_layers"]):
        for proj, out in outputs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            weights[f"{name}.lora_A.weight"] = torch.randn(RANK, hidden, generator=gen) / 2
            weights[f"{name}.lora_B.weight"] = torch.randn(out, RANK, generator=gen) / 2
    path.mkdir()
    save_file(weights, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": RANK,
        "target_modules": list(outputs),
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def features(tiny_model, tmp_path_factory) -> list[str]:
    """The module's vLLM flags besides ``MACHINE`` (the module docstring)."""
    root = tmp_path_factory.mktemp("lora")
    model = json.loads((Path(tiny_model) / "config.json").read_text())
    adapters = [f"{n}={_write_adapter(root / n, model, seed)}" for n, seed in (("a", 1), ("b", 2))]
    return [
        "--max-num-batched-tokens", "512",
        "--speculative-config", json.dumps(NGRAM),
        "--enable-lora", "--max-lora-rank", str(RANK), "--lora-modules", *adapters,
    ]  # fmt: skip


class Reference:
    """vLLM alone under the module's settings; each reply asked once."""

    def __init__(self, server: VLLMServer) -> None:
        self.server = server
        self._replies: dict[tuple, list[int]] = {}

    def reply(self, prompt: list[int], tenant: str = "base", max_tokens: int = 8) -> list[int]:
        key = (tuple(prompt), tenant, max_tokens)
        if key not in self._replies:
            reply = self.server.complete(prompt, max_tokens, **TENANTS[tenant])
            self._replies[key] = reply.tokens
        return self._replies[key]


@pytest.fixture(scope="module")
def reference(tiny_model, features, tmp_path_factory) -> Iterator[Reference]:
    log = tmp_path_factory.mktemp("vllm-reference") / "vllm.log"
    with VLLMServer(tiny_model, None, [*MACHINE, *features], log_path=log) as server:
        yield Reference(server)


@pytest.fixture(scope="module")
def spaces(tmp_path_factory, real_client) -> Iterator[Callable[[str], Space]]:
    """Makes spaces; their Redis keys are deleted at the end of the module."""
    made: list[Space] = []

    def make(name: str) -> Space:
        made.append(Space(tmp_path_factory.mktemp(name)))
        return made[-1]

    yield make
    for space in made:
        delete_prefix(real_client, space.redis_prefix)


@pytest.fixture(scope="module")
def space(spaces) -> Space:
    """Where ``first``, ``restarted`` and ``shared`` keep their data."""
    return spaces("vllm-features")


def _by_tenant(server: VLLMServer, prompt: list[int]) -> dict[str, tuple[list[int], dict]]:
    """``prompt`` asked by each tenant in turn: (reply, sources) by tenant."""
    return {t: _serve(server, prompt, **fields) for t, fields in TENANTS.items()}


def _step(server: VLLMServer) -> None:
    """A request of one step: the workers report their counters' levels."""
    server.complete(_tokens(8, seed=99), max_tokens=1)


@pytest.fixture(scope="module")
def first(tiny_model, space, features) -> dict[str, Any]:
    """The first server on ``space``: each feature's first traffic, as recorded."""
    with space.server(tiny_model, features) as server:
        out: dict[str, Any] = {"long": [_serve(server, LONG), _chat(server, LONG_NEXT)]}

        accepted = _metric(server, "vllm:spec_decode_num_accepted_tokens_total")
        turn = _serve(server, TURN, max_tokens=TURN_REPLY)
        out["accepted"] = _metric(server, "vllm:spec_decode_num_accepted_tokens_total") - accepted
        out["turns"] = [turn, _chat(server, TURN + turn[0] + TURN_MESSAGE)]

        out["alone"] = _by_tenant(server, DOC + ASKS[0])
        out["owned"] = [
            _serve(server, DOC_OF_A + ASKS[0], **TENANTS["a"]),
            _serve(server, DOC_OF_SALT_1 + ASKS[0], **TENANTS["salt-1"]),
        ]
        for doc in BATCH_DOCS:  # for ``restarted``'s disk
            server.complete(doc, max_tokens=1)
        for filler in FILLERS:
            server.complete(filler, max_tokens=1)
        out["host"] = _by_tenant(server, DOC + ASKS[1])
    return out


def _batch(server: VLLMServer) -> list[list[int]]:
    """``BATCH``'s replies, its prompts sent at once."""
    with ThreadPoolExecutor(len(BATCH)) as pool:
        replies = pool.map(lambda p: server.complete(p, BATCH_REPLY).tokens, BATCH)
        return list(replies)


@pytest.fixture(scope="module")
def restarted(tiny_model, space, features, first) -> dict[str, Any]:
    """A server started on ``space`` after ``first``'s: what it recorded."""
    turn = first["turns"][0][0]
    with space.server(tiny_model, features) as server:
        preemptions = _metric(server, "vllm:num_preemptions_total")
        batch, sources = _cached_during(server, lambda: _batch(server))
        out: dict[str, Any] = {
            "batch": batch,
            "batch_sources": sources,
            "preemptions": _metric(server, "vllm:num_preemptions_total") - preemptions,
        }
        _step(server)
        out["pinned"] = _metric(server, PINNED)

        out["long"] = _serve(server, LONG_NEXT)
        out["turn"] = _serve(server, TURN + turn + TURN_MESSAGE)
        out["disk"] = _by_tenant(server, DOC + ASKS[1])
        out["owned"] = _by_tenant(server, DOC_OF_A + ASKS[1])
    return out


@pytest.fixture(scope="module")
def shared(tiny_model, space, features, first) -> dict[str, Any]:
    """A server on another disk, sharing ``first``'s Redis prefix: what it recorded."""
    env = {"KVTIER_CACHE_DIR": str(space.disk.parent / "shared-cache")}
    with space.server(tiny_model, features, env) as server:
        return {
            "long": _serve(server, LONG_NEXT),
            "redis": _by_tenant(server, DOC + ASKS[1]),
            "owned": _by_tenant(server, DOC_OF_SALT_1 + ASKS[1]),
        }


def test_chunked_prefill_a_later_turn_hits_every_full_block_of_a_long_prompt(
    first, restarted, shared, reference
):
    """A 3100-token prompt prefilled in 7 chunks of 512 tokens: the next turn finds all
    24 of its full blocks, in the host pool, on disk after a restart, and in Redis from
    another server, not only the first chunk's 4."""
    (long, long_sources), (after, host) = first["long"]
    assert long_sources == {}
    assert host == {"host": LONG_HIT}
    assert restarted["long"][1] == {"disk": LONG_HIT}
    assert shared["long"][1] == {REDIS: LONG_HIT}
    assert long == reference.reply(LONG)
    replies = [after, restarted["long"][0], shared["long"][0]]
    assert replies == [reference.reply(LONG_NEXT)] * 3


def test_preempted_requests_come_back_while_others_load_from_disk(restarted, reference):
    """Six requests at once on a server whose disk holds four of their prefixes: the
    four load from disk (or from the host pool, where kvtier staged them from disk while
    they waited) while vLLM's 40 blocks run out and vLLM preempts (and later resumes)
    some of them; no host slot stays pinned once they are done."""
    assert restarted["preemptions"] > 0
    assert restarted["batch_sources"].get("disk", 0) > 0
    assert sum(restarted["batch_sources"].values()) == len(BATCH_DOCS) * 8 * BLOCK
    assert restarted["pinned"] == 0
    alone = _batch(reference.server)
    # Token for token only where vLLM alone's own replies do not depend on the batch:
    # on a CPU whose kernels give other bf16 sums for other batch shapes (this one has
    # no AVX-512), vLLM alone answers the batch otherwise than each prompt on its own.
    one_by_one = [reference.reply(prompt, max_tokens=BATCH_REPLY) for prompt in BATCH]
    if alone != one_by_one:
        differ = [i for i, (a, b) in enumerate(zip(alone, one_by_one)) if a != b]
        pytest.skip(
            f"vLLM alone's replies to this batch differ from its replies to the same prompts "
            f"one at a time (requests {differ}): its kernels depend on the batch on this CPU, "
            f"so kvtier's replies in a batch cannot be compared with them token for token"
        )
    assert restarted["batch"] == alone


def test_a_turn_decoded_with_ngram_drafts_is_hit_with_the_blocks_its_reply_filled(
    first, restarted, reference
):
    """The reply was decoded with accepted n-gram drafts; the next turn (the prompt, the
    reply, a new message) hits 16 full blocks, the last holding 48 of the reply's
    tokens, from the host pool and, after a restart, from disk."""
    (turn, _), (after, host) = first["turns"]
    assert first["accepted"] > 0
    assert len(turn) == TURN_REPLY
    assert host == {"host": 16 * BLOCK}
    assert restarted["turn"][1] == {"disk": 16 * BLOCK}
    assert turn == reference.reply(TURN, max_tokens=TURN_REPLY)
    expected = reference.reply(TURN + turn + TURN_MESSAGE)
    assert [after, restarted["turn"][0]] == [expected, expected]


def _replies(asked: dict[str, tuple[list[int], dict]]) -> dict[str, list[int]]:
    return {tenant: reply for tenant, (reply, _) in asked.items()}


def _sources(asked: dict[str, tuple[list[int], dict]]) -> dict[str, dict]:
    return {tenant: sources for tenant, (_, sources) in asked.items()}


def test_lora_adapters_and_cache_salts_never_hit_another_tenants_blocks(
    first, restarted, shared, reference
):
    """The same document asked by the base model, adapters ``a`` and ``b`` and two
    ``cache_salt`` tenants: none hits the blocks another computed, each hits its own in
    the host pool, on disk after a restart and in Redis from another server; a document
    only ``a`` read (on disk) or only ``salt-1`` read (in Redis) is a miss for every
    other tenant. Each reply is vLLM alone's for that tenant."""
    hit = len(DOC) // BLOCK * BLOCK
    assert _sources(first["alone"]) == dict.fromkeys(TENANTS, {})
    assert _sources(first["host"]) == dict.fromkeys(TENANTS, {"host": hit})
    assert _sources(restarted["disk"]) == dict.fromkeys(TENANTS, {"disk": hit})
    assert _sources(shared["redis"]) == dict.fromkeys(TENANTS, {REDIS: hit})
    assert _sources(restarted["owned"]) == {**dict.fromkeys(TENANTS, {}), "a": {"disk": hit}}
    assert _sources(shared["owned"]) == {**dict.fromkeys(TENANTS, {}), "salt-1": {REDIS: hit}}

    def expected(prompt: list[int]) -> dict[str, list[int]]:
        return {tenant: reference.reply(prompt, tenant) for tenant in TENANTS}

    base, a, b = (reference.reply(DOC + ASKS[0], t) for t in ("base", "a", "b"))
    assert base != a != b != base  # the adapters change the replies
    assert _replies(first["alone"]) == expected(DOC + ASKS[0])
    for asked in (first["host"], restarted["disk"], shared["redis"]):
        assert _replies(asked) == expected(DOC + ASKS[1])
    assert [reply for reply, _ in first["owned"]] == [
        reference.reply(DOC_OF_A + ASKS[0], "a"),
        reference.reply(DOC_OF_SALT_1 + ASKS[0], "salt-1"),
    ]
    assert _replies(restarted["owned"]) == expected(DOC_OF_A + ASKS[1])
    assert _replies(shared["owned"]) == expected(DOC_OF_SALT_1 + ASKS[1])


@pytest.fixture(scope="module")
def multi(tiny_model, spaces, features) -> dict[str, Any]:
    """A server with ``MultiConnector``: vLLM's ExampleConnector, then kvtier."""
    space = spaces("vllm-multi")
    example = space.disk.parent / "example-connector"
    example.mkdir()
    transfer = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(example)},
                },
                json.loads(vllm_server.kv_transfer_config(CONFIG)),
            ]
        },
    }
    args = [*features, "--kv-transfer-config", json.dumps(transfer)]
    loaded = "vllm:kvtier_blocks_out_total"

    def fill(fillers: list[list[int]]) -> None:
        for filler in fillers:
            server.complete(filler, max_tokens=1)

    with space.server(tiny_model, args, config=None) as server:
        out: dict[str, Any] = {"first": _serve(server, MULTI_ASKS[0])}
        fill(MULTI_FILLERS[0])
        before = _metric(server, loaded)
        out["again"] = _serve(server, MULTI_ASKS[0])
        out["kvtier_loaded_again"] = _metric(server, loaded) - before
        fill(MULTI_FILLERS[1])
        out["other"] = _serve(server, MULTI_ASKS[1])
        _step(server)
        out["kvtier_loaded_other"] = _metric(server, loaded) - before
        out["pinned"] = _metric(server, PINNED)
        out["hook_calls"] = _metric(server, "vllm:kvtier_hook_calls_total")
    out["example_hits"] = space.logs().count("External Cache Hit!")
    return out


def test_beside_vllms_example_connector_each_connector_serves_its_hits(multi, reference):
    """Asked again word for word, a prompt is ExampleConnector's hit (the first connector
    that has one loads it; vLLM counts it under ``external_unspecified``) and kvtier loads
    nothing; another question on the same document is kvtier's host hit. kvtier's own
    metrics reach vLLM's ``/metrics`` through MultiConnector."""
    hit = len(MULTI_DOC)
    assert multi["first"][1] == {}
    assert multi["again"][1] == {REDIS: hit}
    assert multi["example_hits"] == 1
    assert multi["kvtier_loaded_again"] == 0
    assert multi["other"][1] == {"host": hit}
    assert multi["kvtier_loaded_other"] == hit // BLOCK
    assert multi["pinned"] == 0
    assert multi["hook_calls"] > 0
    expected = [reference.reply(q) for q in (MULTI_ASKS[0], MULTI_ASKS[0], MULTI_ASKS[1])]
    assert [multi[k][0] for k in ("first", "again", "other")] == expected


class _KillOnRead:
    """A TCP proxy in front of ``redis``: once armed, the first value read through it
    (GET, or GETEX as kvtier reads with a ttl) kills the server (SIGKILL, by pid)
    instead of passing. kvtier's lookups only ask sizes, so Redis dies after the lookup
    that promised a hit, as the load reads it."""

    READS = (b"$3\r\nGET\r\n", b"$5\r\nGETEX\r\n")

    def __init__(self, redis: RedisServer) -> None:
        self.redis = redis
        self.armed = threading.Event()
        self.killed = threading.Event()
        self._listener = socket.create_server((LOCAL_HOST, 0))
        self.url = f"redis://{LOCAL_HOST}:{self._listener.getsockname()[1]}/0"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                server = socket.create_connection((LOCAL_HOST, self.redis.port))
            except OSError:  # killed: a refusal, as from a dead server
                client.close()
                continue
            for src, dst, asks in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pipe, args=(src, dst, asks), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, asks: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if asks and self.armed.is_set() and any(r in data for r in self.READS):
                    os.kill(self.redis.pid, signal.SIGKILL)
                    self.killed.set()
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            src.close()
            dst.close()

    def close(self) -> None:
        self._listener.close()


@pytest.fixture(scope="module")
def written(tiny_model, spaces, features, real_client) -> tuple[Space, dict[bytes, bytes]]:
    """A server's stores after it read ``ON_DISK`` and then ``IN_REDIS``: its disk with
    ``ON_DISK``'s values corrupt and ``IN_REDIS``'s deleted, and its Redis keys (dumped)."""
    space = spaces("vllm-written")
    store = space.disk / "vllm-lmdb"
    with space.server(tiny_model, features) as server:
        server.complete(ON_DISK, max_tokens=1)
        chunks = len(ON_DISK) // BLOCK // 4  # configs/vllm.yaml's chunk_blocks
        tier = LMDBTier(store, 64 << 20, 4)  # beside the server's: LMDB allows it
        try:
            wait_until(lambda: len(list(tier.keys())) >= chunks, 60, "ON_DISK on disk", 0.1)
            on_disk = set(tier.keys())
        finally:
            tier.close()
        server.complete(IN_REDIS, max_tokens=1)
    corrupt_disk(store, on_disk)
    keys = real_client.scan_iter(match=space.redis_prefix + "*")
    return space, {key: real_client.dump(key) for key in keys}


def _failing(server: VLLMServer, prompt: list[int]) -> dict[str, Any]:
    """``prompt`` asked twice: the first reply (or vLLM's error object), the tokens
    vLLM counted as cached for it by source, kvtier's blocks not loaded, and the
    second reply."""

    def ask() -> Any:
        try:
            return server.complete(prompt).tokens
        except vllm_server.ReplyError as e:
            return e.error

    errors = _metric(server, LOAD_ERRORS)
    reply, sources = _cached_during(server, ask)
    later = server.complete(prompt).tokens
    errors = _metric(server, LOAD_ERRORS) - errors
    return {"reply": reply, "sources": sources, "load_errors": errors, "later": later}


@pytest.fixture(scope="module", params=["recompute", "fail"])
def failures(request, tiny_model, features, written, tmp_path_factory) -> dict[str, Any]:
    """A server under ``kv_load_failure_policy`` ``request.param`` on copies of
    ``written``'s stores (its Redis a server of the test's own behind ``_KillOnRead``):
    ``ON_DISK`` asked (corrupt on disk), then ``IN_REDIS`` (Redis killed as it is read)."""
    policy = request.param
    space, dumps = written
    root = tmp_path_factory.mktemp(f"vllm-{policy}")
    shutil.copytree(space.disk, root / "cache")
    transfer = json.loads(vllm_server.kv_transfer_config(CONFIG))
    transfer["kv_load_failure_policy"] = policy
    args = [*features, "--kv-transfer-config", json.dumps(transfer)]
    with RedisServer(root / "redis") as redis:
        client = redis.client()
        for key, dump in dumps.items():
            client.restore(key, 0, dump)
        client.close()
        proxy = _KillOnRead(redis)
        env = {"KVTIER_CACHE_DIR": str(root / "cache"), "KVTIER_REDIS_URL": proxy.url}
        try:
            with space.server(tiny_model, args, env, config=None) as server:
                out = {"policy": policy, "disk": _failing(server, FAILURES["disk"][1])}
                proxy.armed.set()
                out["redis"] = _failing(server, FAILURES["redis"][1])
                out["killed"] = proxy.killed.is_set()
                _step(server)
                out["pinned"] = _metric(server, PINNED)
        finally:
            proxy.close()
    return out


def _check_failure(failures: dict[str, Any], case: str, reference: Reference) -> None:
    """vLLM counted the hit kvtier promised and kvtier reported its blocks not loaded;
    under ``recompute`` the reply is vLLM alone's, under ``fail`` it is vLLM's error;
    the server answers the next request as vLLM alone does; no host slot stays pinned."""
    prefix, prompt, source = FAILURES[case]
    got = failures[case]
    assert got["sources"] == {source: len(prefix)}
    assert got["load_errors"] == len(prefix) // BLOCK
    if failures["policy"] == "recompute":
        assert got["reply"] == reference.reply(prompt)
    else:
        assert {k: got["reply"].get(k) for k in GENERATION_ERROR} == GENERATION_ERROR
    assert got["later"] == reference.reply(prompt)
    assert failures["pinned"] == 0


def test_load_failure_policy_with_a_corrupt_value_on_disk(failures, reference):
    _check_failure(failures, "disk", reference)


def test_load_failure_policy_with_redis_killed_as_the_load_reads_it(failures, reference):
    assert failures["killed"]
    _check_failure(failures, "redis", reference)
