"""A remote tier that dies, hangs or loses a node degrades to misses within a bound
(DESIGN.md rule 4), and the same cache object uses it again when it comes back.

Every server here is a throwaway on a free loopback port, started and stopped by pid
by the test (or the session cluster fixture, which is resumed before the test ends).
The bound asserted for one engine step (lookup + allocate + wait) is ``STEP_BOUND``;
the measured times are printed (run with ``-s`` to see them).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_servers import (
    LOCAL_HOST,
    LocalCluster,
    RedisServer,
    free_port,
    redis_server_binary,
    unique_prefix,
    wait_until,
)

from kvtier.cache import PrefixHit, TieredCache
from kvtier.config import parse_config
from kvtier.spill import ChunkRef, SpillRun
from kvtier.synthetic import Served, complete, serve
from kvtier.tiers.redis import RedisTier

BLOCK_SIZE = 4
BLOCK_NBYTES = 2 * 2 * BLOCK_SIZE * 2 * 8 * 4  # the layout below: 1 KiB per block
SOCKET_TIMEOUT = 0.2
CONNECT_TIMEOUT = 0.2
STEP_BOUND = 1.0  # seconds one engine step may take while Redis is dead or silent
PROMPT_BLOCKS = 12


# --- helpers -------------------------------------------------------------------------


def cache_config(redis_section: dict[str, Any], gpu: int = 16, host: int = 16) -> dict:
    """GPU and host pools of 16 blocks, eager copies to the host, a Redis tier only."""
    return {
        "model": "reliability",
        "layout": {
            "num_layers": 2,
            "block_size": BLOCK_SIZE,
            "num_kv_heads": 2,
            "head_dim": 8,
            "dtype": "float32",
        },
        "tiers": {
            "gpu": {"num_blocks": gpu, "device": "cpu"},
            "cpu": {"capacity": host * BLOCK_NBYTES, "write_policy": "eager"},
            "redis": {
                "chunk_blocks": 4,
                "write_policy": "write_through",
                "ttl": None,
                "socket_timeout": SOCKET_TIMEOUT,
                "connect_timeout": CONNECT_TIMEOUT,
                "required": True,
                **redis_section,
            },
        },
    }


def make_cache(redis_section: dict[str, Any], gpu: int = 16, host: int = 16) -> TieredCache:
    """A cache whose Redis tier is built by ``RedisTier.from_config`` from the config."""
    return TieredCache(parse_config(cache_config(redis_section, gpu, host)))


def redis_tier(cache: TieredCache) -> RedisTier:
    assert cache.spill is not None
    (tier,) = cache.spill.tiers
    assert isinstance(tier, RedisTier)
    return tier


def prompt(seed: int, blocks: int = PROMPT_BLOCKS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(blocks * BLOCK_SIZE + 1)]


def push_down(cache: TieredCache, seeds: range, blocks: int = 6) -> None:
    """Serve fresh prompts until earlier ones have left the GPU and host pools."""
    for s in seeds:
        serve(cache, f"filler{s}", prompt(10_000 + s, blocks))
    cache.flush()


def redis_tokens(hit: PrefixHit) -> int:
    return hit.tokens_per_tier().get("redis", 0)


def probe(cache: TieredCache, tokens: list[int]) -> PrefixHit:
    """A lookup that leaves nothing behind."""
    hit = cache.lookup("probe", tokens)
    cache.free("probe")
    return hit


def timed_serve(cache: TieredCache, req_id: str, tokens: list[int]) -> tuple[Served, float]:
    """``serve`` (which checks every loaded block bit for bit), timed. Its engine step
    (lookup + allocate + wait) is all of it that may touch Redis synchronously."""
    start = time.monotonic()
    served = serve(cache, req_id, tokens)
    return served, time.monotonic() - start


def finish(cache: TieredCache, req_id: str, tokens: list[int], hit: PrefixHit) -> tuple[int, float]:
    """``complete`` a hit looked up earlier; returns (valid tokens, allocate-to-wait seconds)."""
    served = complete(cache, req_id, tokens, hit)
    return served.valid_tokens, served.seconds


def kill(server: RedisServer) -> None:
    """SIGKILL the server by its pid (a crash: no goodbye on its sockets), then reap it."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGKILL)
    server.stop()


# --- a server that dies and comes back ---------------------------------------------------


@dataclass
class Deployment:
    server: RedisServer
    cache: TieredCache
    warm: list[int]  # a prompt whose chunks are in Redis only (not on the GPU, not on host)


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    server = RedisServer(tmp_path / "redis").start()
    cache = None
    try:
        cache = make_cache({"url": server.url, "key_prefix": unique_prefix("fault")})
        warm = prompt(1)
        serve(cache, "warm", warm)
        push_down(cache, range(8))
        hit = probe(cache, warm)
        assert redis_tokens(hit) == hit.num_tokens == PROMPT_BLOCKS * BLOCK_SIZE
        yield Deployment(server, cache, warm)
    finally:
        server.stop()  # throwaway server, nothing persisted: its keys go with it
        if cache is not None:
            cache.close()


@pytest.mark.redis
def test_lookup_while_redis_is_dead_is_a_fast_miss_and_never_raises(deployment):
    cache, warm = deployment.cache, deployment.warm
    errors_before = cache.stats()["redis"].errors
    kill(deployment.server)
    times = []
    for tokens in (warm, prompt(2), warm):
        start = time.monotonic()
        hit = probe(cache, tokens)
        times.append(time.monotonic() - start)
        assert redis_tokens(hit) == 0
        assert hit.num_tokens == 0
    print(f"\n[redis killed] lookup latencies: {', '.join(f'{t * 1000:.1f} ms' for t in times)}")
    assert max(times) < STEP_BOUND
    assert cache.stats()["redis"].errors - errors_before == len(times)
    served, elapsed = timed_serve(cache, "recompute", warm)  # checks KV bit for bit
    assert served.valid_tokens == 0
    assert elapsed < STEP_BOUND


@pytest.mark.redis
def test_a_prefetch_found_before_redis_died_degrades_to_a_recompute(deployment):
    cache, warm = deployment.cache, deployment.warm
    hit = cache.lookup("pre", warm)
    assert redis_tokens(hit) == PROMPT_BLOCKS * BLOCK_SIZE
    errors_before = cache.stats()["redis"].errors
    kill(deployment.server)
    valid, elapsed = finish(cache, "pre", warm, hit)  # allocate + wait, then check
    print(f"\n[redis killed] prefetch degrade (allocate + wait): {elapsed * 1000:.1f} ms")
    assert valid < hit.num_tokens
    assert valid == 0  # nothing of it was above Redis
    assert elapsed < STEP_BOUND
    stats = cache.stats()["redis"]
    assert stats.errors - errors_before >= 1
    # The engine computed the prompt: it is on the GPU now and hits there, exact.
    again, elapsed = timed_serve(cache, "again", warm)
    assert again.hit.tokens_per_tier()["gpu"] == again.valid_tokens == again.hit.num_tokens == 48
    assert elapsed < STEP_BOUND


@pytest.mark.redis
def test_stores_while_redis_is_dead_are_counted_as_errors_not_raised(deployment):
    cache = deployment.cache
    before = cache.stats()["redis"]
    kill(deployment.server)
    seeds = range(100, 106)
    steps = []
    for s in seeds:  # eager + write-through: every full chunk is sent to Redis at once
        served, elapsed = timed_serve(cache, f"outage{s}", prompt(s))
        assert served.valid_tokens == 0
        steps.append(elapsed)
    start = time.monotonic()
    cache.flush()  # every write attempt has failed and been counted by now
    flush_time = time.monotonic() - start
    print(
        f"\n[redis killed] serve latencies max {max(steps) * 1000:.1f} ms; "
        f"flush of failed writes {flush_time * 1000:.1f} ms"
    )
    assert max(steps) < STEP_BOUND
    after = cache.stats()["redis"]
    assert after.blocks_in == before.blocks_in  # nothing was stored
    lookups = len(seeds)  # one failed existence check each
    assert after.errors - before.errors > lookups  # ... and the failed writes on top


@pytest.mark.redis
def test_the_same_cache_hits_redis_again_after_a_restart(deployment):
    server, cache = deployment.server, deployment.cache
    kill(server)
    probe(cache, deployment.warm)  # fails: a dead connection in the pool, at least
    errors_during = cache.stats()["redis"].errors
    server.start()  # the same port; the restarted server is empty
    restarted = time.monotonic()
    fresh = prompt(7)
    hit = probe(cache, fresh)
    first_call = time.monotonic() - restarted
    assert redis_tokens(hit) == 0  # a clean miss, not an error
    assert cache.stats()["redis"].errors == errors_during
    in_before = cache.stats()["redis"].blocks_in
    serve(cache, "fresh", fresh)
    cache.flush()
    stored = time.monotonic() - restarted
    # Its three chunks, and the partial chunks of host victims its blocks evicted.
    assert cache.stats()["redis"].blocks_in - in_before >= PROMPT_BLOCKS
    chunk_keys = cache.manager.hasher.hash_blocks(fresh)[BLOCK_SIZE - 1 :: 4]
    assert redis_tier(cache).contains_many(chunk_keys) == [True] * 3
    push_down(cache, range(20, 28))
    again = serve(cache, "fresh-again", fresh)  # checks the loaded KV bit for bit
    found = time.monotonic() - restarted
    print(
        f"\n[redis restarted] first lookup {first_call * 1000:.1f} ms (no error); "
        f"chunks stored {stored * 1000:.1f} ms; found again {found * 1000:.1f} ms after restart"
    )
    assert first_call < STEP_BOUND
    assert redis_tokens(again.hit) == again.valid_tokens == PROMPT_BLOCKS * BLOCK_SIZE
    assert cache.stats()["redis"].errors == errors_during


@pytest.mark.redis
def test_chunks_whose_write_failed_during_an_outage_reach_redis_once_it_is_back(deployment):
    server, cache = deployment.server, deployment.cache
    kill(server)
    tokens = prompt(9)
    serve(cache, "during", tokens)  # its three full chunks are sent, and fail
    cache.flush()
    server.start()
    push_down(cache, range(40, 48))  # evicted from GPU and host with Redis back
    hit = probe(cache, tokens)
    print(f"\n[after outage] redis tokens of a prompt cached during it: {redis_tokens(hit)}")
    assert redis_tokens(hit) == PROMPT_BLOCKS * BLOCK_SIZE


def lookups_for(cache: TieredCache, tokens: list[int], seconds: float) -> list[float]:
    """Latencies of back-to-back lookups of ``tokens`` for ``seconds``."""
    times = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        times.append(timed_probe(cache, tokens)[1])
    return times


def count_timeouts(tier: RedisTier, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The nodes of each socket timeout ``tier`` pays from now on (reported to its
    breaker), in order."""
    paid: list[str] = []
    timed_out = tier.breaker.timed_out

    def counted(node: str, cause: BaseException) -> float:
        paid.append(node)
        return timed_out(node, cause)

    monkeypatch.setattr(tier.breaker, "timed_out", counted)
    return paid


@pytest.mark.redis
def test_a_hung_redis_costs_one_socket_timeout_per_backoff_period(deployment, monkeypatch):
    """The breaker (1 s, then 2 s): over 2.5 s of back-to-back lookups against a
    SIGSTOPped server, two pay the socket timeout (the first, and the probe at 1 s);
    every other one is a fast, counted miss."""
    cache, warm = deployment.cache, deployment.warm
    errors_before = cache.stats()["redis"].errors
    paid = count_timeouts(redis_tier(cache), monkeypatch)
    deployment.server.pause()
    try:
        times = lookups_for(cache, warm, 2.5)
    finally:
        deployment.server.resume()
    print(f"\n[redis hung] {len(times)} lookups in 2.5 s: {len(paid)} paid the socket timeout")
    assert len(times) > 50
    assert 1 <= len(paid) <= 2
    assert sorted(times)[len(times) // 2] < 0.05  # the rest skip the node
    assert cache.stats()["redis"].errors - errors_before == len(times)


@pytest.mark.redis
def test_a_hung_redis_is_used_again_after_sigcont_without_a_restart(deployment):
    cache, warm = deployment.cache, deployment.warm
    deployment.server.pause()
    try:
        assert redis_tokens(probe(cache, warm)) == 0  # times out: the breaker opens
    finally:
        deployment.server.resume()
    resumed = time.monotonic()
    wait_until(lambda: redis_tokens(probe(cache, warm)) == 48, 3.0, "a Redis hit after SIGCONT")
    print(f"\n[redis resumed] hits again {time.monotonic() - resumed:.2f} s after SIGCONT")
    served = serve(cache, "after", warm)  # checks the loaded KV bit for bit
    assert redis_tokens(served.hit) == served.valid_tokens == 48


@pytest.mark.redis
def test_an_outage_logs_one_warning_when_redis_goes_down_and_one_when_it_is_back(
    deployment, caplog
):
    server, cache = deployment.server, deployment.cache
    caplog.set_level(logging.WARNING, logger="kvtier")
    errors_before = cache.stats()["redis"].errors
    kill(server)
    for s in range(30):  # lookups and write-through stores, every one failing
        serve(cache, f"outage{s}", prompt(200 + s))
    cache.flush()
    failures = cache.stats()["redis"].errors - errors_before
    server.start()
    serve(cache, "back", prompt(300))
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    print(f"\n[redis killed] {failures} failed calls, {len(lines)} warnings: {lines}")
    assert failures >= 60
    assert len(lines) == 2
    assert "redis tier is down" in lines[0] and "Connection" in lines[0]
    assert f"redis tier is back; {failures} failed calls since it went down" in lines[1]


# --- a server that accepts connections and never answers ------------------------------


def silent_cache(port: int, gpu: int = 16, host: int = 16) -> TieredCache:
    url = f"redis://{LOCAL_HOST}:{port}/0"
    return make_cache({"url": url, "key_prefix": unique_prefix()}, gpu, host)


def test_lookups_against_a_silent_server_are_misses_within_the_socket_timeout(silent_server):
    cache = silent_cache(silent_server)
    try:
        times = []
        for s in range(3):
            served, elapsed = timed_serve(cache, f"r{s}", prompt(s))
            assert served.hit.num_tokens == served.valid_tokens == 0
            times.append(elapsed)
        print(
            f"\n[silent server] serve latencies: {', '.join(f'{t * 1000:.0f} ms' for t in times)}"
        )
        assert max(times) < SOCKET_TIMEOUT + 0.5
        assert cache.stats()["redis"].errors >= len(times)
    finally:
        cache.close()  # waits for the queued writes, each timing out


def test_loads_from_a_silent_server_are_misses_within_the_socket_timeout(silent_server):
    cache = silent_cache(silent_server)
    try:
        tokens = prompt(3)
        cache.lookup("load", tokens)
        hashes = cache.manager.request("load").hashes
        # The hit a lookup would have returned had the server answered it before going
        # silent: blocks 0-7 of the prompt as two chunks of 4 in Redis.
        chunks = (ChunkRef(hashes[3], 0, 4), ChunkRef(hashes[7], 4, 4))
        hit = PrefixHit(BLOCK_SIZE, spill=(SpillRun("redis", 0, 8, chunks),))
        errors_before = cache.stats()["redis"].errors
        valid, elapsed = finish(cache, "load", tokens, hit)
        print(f"\n[silent server] load degrade (allocate + wait): {elapsed * 1000:.0f} ms")
        assert valid == 0
        assert elapsed < SOCKET_TIMEOUT + 0.5
        assert cache.stats()["redis"].errors - errors_before >= 1
    finally:
        cache.close()


def test_a_host_hit_is_not_delayed_by_writes_queued_for_a_hung_redis(silent_server):
    cache = silent_cache(silent_server, gpu=64, host=512)
    try:
        tokens = prompt(1, blocks=40)
        serve(cache, "a", tokens)  # eager + write-through: 10 chunk writes queued
        for s in (2, 3):  # 20 more; each write waits socket_timeout on the silent server
            serve(cache, f"f{s}", prompt(s, blocks=40))
        hit = cache.lookup("a2", tokens)
        assert hit.tokens_per_tier()["cpu"] == 160  # left the GPU, still on host
        valid, elapsed = finish(cache, "a2", tokens, hit)
        print(f"\n[silent server] host hit allocate + wait: {elapsed * 1000:.0f} ms")
        assert valid == 160
        assert elapsed < STEP_BOUND
    finally:
        cache.close()


# --- Redis Cluster: one node hung -----------------------------------------------------


@dataclass
class ClusterDeployment:
    cluster: LocalCluster
    cache: TieredCache
    victim: RedisServer  # a primary that is not the startup node in the cache's config
    live: list[int]  # a prompt none of whose block keys lives on the victim
    mixed: list[int]  # a prompt with some block key on the victim


CLUSTER_SOCKET_TIMEOUT = 0.25


def cluster_state_ok(cluster: LocalCluster) -> bool:
    clients = list(cluster.node_clients())
    try:
        return all(b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO") for c in clients)
    finally:
        for c in clients:
            c.close()


@pytest.fixture
def cluster_deployment(cluster, cluster_admin) -> Iterator[ClusterDeployment]:
    victim = cluster.servers[2]
    prefix = unique_prefix("cluster")
    cache = make_cache(
        {
            "url": cluster.url,
            "cluster": True,
            "key_prefix": prefix,
            "socket_timeout": CLUSTER_SOCKET_TIMEOUT,
        }
    )
    tier = redis_tier(cache)
    try:

        def on_victim(tokens: list[int]) -> int:
            hashes = cache.manager.hasher.hash_blocks(tokens)[: (len(tokens) - 1) // BLOCK_SIZE]
            ports = [cluster_admin.get_node_from_key(tier.redis_key(h)).port for h in hashes]
            return sum(port == victim.port for port in ports)

        # 4-block prompts: one chunk each, four keys in a lookup's existence check.
        candidates = (prompt(s, blocks=4) for s in range(500))
        live = next(p for p in candidates if on_victim(p) == 0)
        mixed = next(p for p in candidates if on_victim(p) > 0)
        serve(cache, "live", live)
        serve(cache, "mixed", mixed)
        push_down(cache, range(8))
        assert redis_tokens(probe(cache, live)) == redis_tokens(probe(cache, mixed)) == 16
        yield ClusterDeployment(cluster, cache, victim, live, mixed)
    finally:
        if victim.proc is not None:
            victim.resume()  # SIGCONT: harmless when the test resumed it already
        cache.close()
        cluster.delete_prefix(prefix)
        # Leave the session cluster as it was found, for the tests after this one.
        wait_until(lambda: cluster_state_ok(cluster), 10.0, "cluster_state:ok")


def timed_probe(cache: TieredCache, tokens: list[int]) -> tuple[PrefixHit, float]:
    start = time.monotonic()
    hit = probe(cache, tokens)
    return hit, time.monotonic() - start


CLUSTER_BOUND = 2.0  # what RedisTier keeps a lookup on a hung node within, whichever call


@pytest.mark.redis
def test_a_hung_cluster_node_fails_only_the_lookups_that_touch_it(cluster_deployment):
    """What RedisTier does (its docstring): a batch fails as a whole when any node in it
    fails. So while one primary is hung, a prompt whose every block key lives on the
    other primaries still hits (and loads, exact); a prompt with any block key on the
    hung node is a miss within the bound, counted as an error, never raised; after the
    node resumes the same cache hits it again."""
    d = cluster_deployment
    cache = d.cache
    errors_before = cache.stats()["redis"].errors
    d.victim.pause()  # SIGSTOP: connections are accepted, nothing answers
    paused = time.monotonic()
    try:
        misses = [timed_probe(cache, d.mixed) for _ in range(3)]
        hit, live_time = timed_probe(cache, d.live)
        served, serve_time = timed_serve(cache, "live-load", d.live)  # exact
        assert time.monotonic() - paused < 4.0  # well inside cluster-node-timeout (5 s)
    finally:
        d.victim.resume()
    times = [t for _, t in misses]
    print(
        f"\n[cluster node hung] lookups touching it: "
        f"{', '.join(f'{t * 1000:.0f} ms' for t in times)} (misses); "
        f"lookup on live nodes {live_time * 1000:.0f} ms (hit); "
        f"serve from live nodes {serve_time * 1000:.0f} ms"
    )
    assert all(redis_tokens(miss) == 0 and miss.num_tokens == 0 for miss, _ in misses)
    assert times[0] < STEP_BOUND  # the first: one socket timeout on the pooled connection
    assert max(times) < CLUSTER_BOUND
    assert cache.stats()["redis"].errors - errors_before >= len(misses)
    assert redis_tokens(hit) == 16 and live_time < STEP_BOUND
    assert redis_tokens(served.hit) == served.valid_tokens == 16
    assert serve_time < STEP_BOUND

    wait_until(lambda: cluster_state_ok(d.cluster), 10.0, "cluster_state:ok after resume")
    resumed = time.monotonic()  # a hit again once the node's back-off has passed
    wait_until(lambda: redis_tokens(probe(cache, d.mixed)) == 16, 4.0, "a hit after resume")
    print(f"[cluster node resumed] hits again {time.monotonic() - resumed:.2f} s after resume")


@pytest.mark.redis
def test_every_lookup_touching_a_hung_cluster_node_costs_one_socket_timeout(cluster_deployment):
    d = cluster_deployment
    d.victim.pause()
    try:
        times = [timed_probe(d.cache, d.mixed)[1] for _ in range(3)]
    finally:
        d.victim.resume()
    print(
        f"\n[cluster node hung] repeated lookups: {', '.join(f'{t * 1000:.0f} ms' for t in times)}"
    )
    assert max(times) < 1.5 * CLUSTER_SOCKET_TIMEOUT + 0.05


@pytest.mark.redis
def test_a_hung_cluster_node_costs_one_timeout_per_backoff_and_is_used_after_sigcont(
    cluster_deployment, monkeypatch
):
    """Over 2.5 s of lookups touching a SIGSTOPped node, at most two pay the socket
    timeout; lookups on the live nodes keep hitting meanwhile; after SIGCONT the same
    cache hits the node again once its back-off has passed."""
    d = cluster_deployment
    paid = count_timeouts(redis_tier(d.cache), monkeypatch)
    d.victim.pause()
    try:
        times = lookups_for(d.cache, d.mixed, 2.5)
        live = probe(d.cache, d.live)
    finally:
        d.victim.resume()
    resumed = time.monotonic()
    print(
        f"\n[cluster node hung] {len(times)} lookups in 2.5 s: {len(paid)} paid the socket timeout"
    )
    assert len(times) > 20
    assert set(paid) == {f"{LOCAL_HOST}:{d.victim.port}"}  # the hung node, no live one
    assert len(paid) <= 2
    assert sorted(times)[len(times) // 2] < 0.05
    assert redis_tokens(live) == 16
    wait_until(
        lambda: redis_tokens(probe(d.cache, d.mixed)) == 16, 4.0, "a hit on the resumed node"
    )
    print(f"[cluster node resumed] hits again {time.monotonic() - resumed:.2f} s after SIGCONT")


# --- TLS ---------------------------------------------------------------------------------


def make_certs(workdir: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1, made with the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not on PATH; cannot make a test CA")
    workdir.mkdir(parents=True, exist_ok=True)
    p = {name: workdir / name for name in ("ca.key", "ca.pem", "server.key", "server.csr")}
    p["server.pem"] = workdir / "server.pem"
    ext = workdir / "server.ext"
    ext.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
        "authorityKeyIdentifier=keyid\n"
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (
        ["req", "-x509", *ec, "-keyout", p["ca.key"], "-out", p["ca.pem"]]
        + ["-days", "1", "-subj", "/CN=kvtier-test-ca"],
        ["req", *ec, "-keyout", p["server.key"], "-out", p["server.csr"], "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", p["server.csr"], "-CA", p["ca.pem"], "-CAkey", p["ca.key"]]
        + ["-CAcreateserial", "-out", p["server.pem"], "-days", "1", "-extfile", ext],
    ):
        subprocess.run(["openssl", *map(str, cmd)], check=True, capture_output=True, timeout=30)
    return p


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[int, str, Path]]:
    """redis-server on a TLS-only loopback port with a password; yields (port, pw, CA)."""
    binary = redis_server_binary()
    certs = make_certs(tmp_path / "certs")
    port, password = free_port(), "tls-" + unique_prefix()
    cmd = [binary, "--port", "0", "--tls-port", str(port), "--bind", LOCAL_HOST]
    cmd += ["--tls-cert-file", str(certs["server.pem"]), "--tls-key-file", str(certs["server.key"])]
    cmd += ["--tls-ca-cert-file", str(certs["ca.pem"]), "--tls-auth-clients", "no"]
    cmd += ["--requirepass", password, "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    client = redis.Redis(
        host=LOCAL_HOST,
        port=port,
        password=password,
        ssl=True,
        ssl_ca_certs=str(certs["ca.pem"]),
        socket_timeout=0.5,
        socket_connect_timeout=0.5,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                if "tls" in out.lower() and "support" in out.lower():
                    pytest.skip(f"this redis-server has no TLS support: {out.strip()[-300:]}")
                pytest.fail(f"redis-server with TLS exited: {out.strip()[-500:]}")
            try:
                if client.ping():
                    break
            except (redis.RedisError, OSError, ssl.SSLError):
                pass
            if time.monotonic() > deadline:
                pytest.fail("redis-server with TLS did not answer within 10 s")
            time.sleep(0.05)
        yield port, password, certs["ca.pem"]
    finally:
        client.close()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()


def tls_section(port: int, ca: Path) -> dict[str, Any]:
    return {
        "url": f"rediss://{LOCAL_HOST}:{port}/0",
        "password": "${KVTIER_TEST_REDIS_PASSWORD}",
        "ssl_ca_certs": str(ca),
        "key_prefix": unique_prefix("tls"),
        "socket_timeout": 2.0,  # a TLS handshake on a loaded machine
        "connect_timeout": 2.0,
    }


@pytest.mark.redis
def test_two_caches_share_chunks_over_tls_with_a_password_from_the_environment(
    tls_server, monkeypatch
):
    port, password, ca = tls_server
    monkeypatch.setenv("KVTIER_TEST_REDIS_PASSWORD", password)
    section = tls_section(port, ca)
    writer, reader = make_cache(section), make_cache(section)
    try:
        assert redis_tier(writer).client.connection_pool.connection_kwargs["password"] == password
        tokens = prompt(5)
        serve(writer, "w", tokens)
        writer.flush()  # eager + write-through: the full chunks are in Redis now
        assert writer.stats()["redis"].blocks_in == PROMPT_BLOCKS
        assert writer.stats()["redis"].errors == 0
        served = serve(reader, "r", tokens)  # checks the loaded KV bit for bit
        assert redis_tokens(served.hit) == served.valid_tokens == PROMPT_BLOCKS * BLOCK_SIZE
        assert reader.stats()["redis"].errors == 0
    finally:
        for cache in (writer, reader):
            redis_tier(cache).clear()
            cache.close()


@pytest.mark.redis
def test_a_tls_server_whose_certificate_is_not_trusted_is_counted_errors_not_hits(
    tls_server, monkeypatch, tmp_path
):
    port, password, _ = tls_server
    monkeypatch.setenv("KVTIER_TEST_REDIS_PASSWORD", password)
    other_ca = make_certs(tmp_path / "other-ca")["ca.pem"]  # did not sign the server's cert
    cache = make_cache(tls_section(port, other_ca))
    try:
        for i in range(2):
            served, elapsed = timed_serve(cache, f"r{i}", prompt(50 + i))
            assert served.hit.num_tokens == 0
            assert elapsed < STEP_BOUND
        cache.flush()
        stats = cache.stats()["redis"]
        assert stats.blocks_in == 0 and stats.errors >= 2
    finally:
        cache.close()
