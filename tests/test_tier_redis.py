"""RedisTier against fakeredis, the local Redis server and a throwaway 3-node cluster.

Backends: ``fake`` (fakeredis, always runs), ``real`` (127.0.0.1:6379), ``cluster``
(three ``redis-server`` processes this module starts). A missing server skips the
``real``/``cluster`` tests, or fails them when ``KVTIER_REQUIRE_REDIS=1``. Every test
uses its own key prefix and deletes what it wrote.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.connection
from redis_servers import (
    LOCAL_HOST,
    LOCAL_URL,
    Backend,
    LocalCluster,
    RedisServer,
    config_tier,
    fake_tcp_server,
    free_port,
    make_backend,
    unique_prefix,
)
from tier_contract import TierContract, make_key, read_all

from kvtier.config import ConfigError, RedisTierConfig, parse_config
from kvtier.tiers import redis_values
from kvtier.tiers.base import TierError
from kvtier.tiers.redis import RedisTier, namespace_for

# --- the SpillTier contract on every backend ---------------------------------------


class TestFakeRedisContract(TierContract):
    @pytest.fixture
    def tier(self, request: pytest.FixtureRequest) -> Iterator[RedisTier]:
        b = make_backend("fake", request)
        yield b.tier(ttl=None)
        b.finish()


@pytest.mark.redis
class TestRealRedisContract(TierContract):
    @pytest.fixture
    def tier(self, request: pytest.FixtureRequest) -> Iterator[RedisTier]:
        b = make_backend("real", request)
        yield b.tier(ttl=600.0)  # the GETEX read path
        b.finish()


@pytest.mark.redis
class TestRedisClusterContract(TierContract):
    @pytest.fixture
    def tier(self, request: pytest.FixtureRequest) -> Iterator[RedisTier]:
        b = make_backend("cluster", request)
        yield b.tier(ttl=600.0)
        b.finish()


# --- values, keys, expiry ----------------------------------------------------------


def test_binary_values_round_trip_from_any_buffer(backend: Backend) -> None:
    tier = backend.tier()
    keys = [make_key("bin", i) for i in range(5)]
    raw = bytes(range(256)) * 64
    halfwords = array("H", range(1000))  # a memoryview with format "H", not bytes
    items = [
        (keys[0], raw),
        (keys[1], bytearray(raw)),
        (keys[2], memoryview(raw)[7:4000]),
        (keys[3], memoryview(halfwords)),
        (keys[4], b"\x00\r\n$-1\r\n*3\r\n"),  # RESP framing inside a value
    ]
    assert tier.put_many(items) == 5
    found, got = read_all(tier, keys)
    assert found == [True] * 5
    assert got == {0: raw, 1: raw, 2: raw[7:4000], 3: halfwords.tobytes(), 4: items[4][1]}


@pytest.mark.redis
@pytest.mark.parametrize("kind", ["real", "cluster"])
def test_a_large_value_is_sent_from_the_callers_buffer(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """Not copied into a packed command (hiredis's packer copies it twice, holding the
    GIL): the socket sends the caller's buffer itself, on every node of a cluster."""
    backend = make_backend(kind, request)
    tier = backend.tier()
    value = bytearray(b"kv" * (1 << 20))
    key = make_key("in-place")
    tier.put_many([(key, value)])
    client = tier.client
    nodes = [client]
    if tier.is_cluster:  # the nodes it found, and one made as for a node found later
        manager = client.nodes_manager
        first = client.get_nodes()[0]
        later = manager.create_redis_node(first.host, first.port, **manager.connection_kwargs)
        nodes = [n.redis_connection for n in client.get_nodes()] + [later]
    for node in nodes:
        connection = node.connection_pool.get_connection()
        try:
            packed = connection.pack_commands([("SET", tier.redis_key(key), memoryview(value))])
        finally:
            node.connection_pool.release(connection)
        assert [p.obj for p in packed if isinstance(p, memoryview)] == [value]
    if tier.is_cluster:
        later.close()
    assert read_all(tier, [key]) == ([True], {0: bytes(value)})
    backend.finish()


def test_key_schema_is_prefix_namespace_hex(backend: Backend) -> None:
    tier = backend.tier(namespace=namespace_for(b"\xab" * 16))
    key = make_key("schema")
    tier.put_many([(key, b"payload")])
    expected = f"{tier.key_prefix}:{'ab' * 8}:{key.hex()}".encode()
    assert tier.redis_key(key) == expected
    assert backend.admin.get(expected) == b"payload"  # one key, header and payload together
    assert list(tier.keys()) == [key]


def test_ttl_is_set_on_write_and_refreshed_on_read(backend: Backend) -> None:
    tier = backend.tier(ttl=30.0)
    keys = [make_key("ttl", i) for i in range(4)]
    tier.put_many([(k, b"v") for k in keys])
    for k in keys:
        assert 0 < backend.admin.ttl(tier.redis_key(k)) <= 30
    backend.admin.pexpire(tier.redis_key(keys[0]), 2000)
    assert read_all(tier, [keys[0]])[0] == [True]
    assert backend.admin.pttl(tier.redis_key(keys[0])) > 2000  # GETEX pushed it back
    tier.contains_many(keys)  # EXISTS does not refresh
    tier.sizes_many(keys)  # nor does STRLEN
    assert 0 < backend.admin.ttl(tier.redis_key(keys[1])) <= 30


def test_no_ttl_means_no_expiry(backend: Backend) -> None:
    tier = backend.tier(ttl=None)
    k = make_key("forever")
    tier.put_many([(k, b"v")])
    read_all(tier, [k])
    assert backend.admin.ttl(tier.redis_key(k)) == -1


def test_key_prefixes_and_namespaces_are_isolated(backend: Backend) -> None:
    a = backend.tier(key_prefix=unique_prefix("iso-a"))
    b = backend.tier(key_prefix=unique_prefix("iso-b"))
    other_ns = backend.tier(key_prefix=a.key_prefix, namespace="other")
    k = make_key("iso")
    a.put_many([(k, b"from a")])
    for tier in (b, other_ns):
        assert tier.contains_many([k]) == [False]
        assert read_all(tier, [k]) == ([False], {})
        assert list(tier.keys()) == []
        assert tier.usage().entries == 0
        assert tier.clear() == 0
        assert tier.delete_many([k]) == 0
    assert read_all(a, [k]) == ([True], {0: b"from a"})


def test_glob_characters_in_the_prefix_match_literally(backend: Backend) -> None:
    base = unique_prefix("glob")
    star = backend.tier(key_prefix=base + "*[x]?")
    plain = backend.tier(key_prefix=base + "a[x]b")  # matched by the unescaped pattern
    plain.put_many([(make_key("plain"), b"p")])
    star.put_many([(make_key("star"), b"s")])
    assert list(star.keys()) == [make_key("star")]
    assert star.clear() == 1
    assert list(plain.keys()) == [make_key("plain")]


def test_response_errors_are_tier_errors(backend: Backend) -> None:
    tier = backend.tier()
    k = make_key("wrongtype")
    backend.admin.hset(tier.redis_key(k), "field", "value")  # not a string value
    for call in (read_all, RedisTier.sizes_many):
        with pytest.raises(TierError) as err:
            call(tier, [make_key("fine"), k])
        assert isinstance(err.value.__cause__, redis.ResponseError)


def test_values_of_any_size_are_read_whole_beside_absent_keys(backend: Backend) -> None:
    tier = backend.tier()
    sizes = [0, 1, 65_533, 1 << 20, 3 * (1 << 20) + 7]  # past the first read buffer, twice
    values = {make_key(f"v{n}"): bytes(range(256)) * (n // 256) + b"x" * (n % 256) for n in sizes}
    tier.put_many(list(values.items()))
    keys = [k for key in values for k in (key, make_key(f"absent {len(values[key])}"))]
    present, got = read_all(tier, keys)
    assert present == [True, False] * len(values)
    assert got == {2 * i: v for i, v in enumerate(values.values())}


def test_an_error_reply_amid_values_leaves_the_connection_in_step(backend: Backend) -> None:
    tier = backend.tier()
    fine, wrong = make_key("fine"), make_key("wrongtype")
    tier.put_many([(fine, b"value")])
    backend.admin.hset(tier.redis_key(wrong), "field", "value")
    with pytest.raises(TierError):
        read_all(tier, [fine, wrong, fine])
    assert read_all(tier, [fine]) == ([True], {0: b"value"})  # every reply was read


def test_a_sink_that_raises_propagates_and_the_next_read_is_whole(backend: Backend) -> None:
    tier = backend.tier()
    keys = [make_key(f"k{i}") for i in range(3)]
    tier.put_many([(k, bytes([i]) * 100_000) for i, k in enumerate(keys)])

    def sink(i: int, value: memoryview) -> None:
        raise KeyError(i)

    with pytest.raises(KeyError):
        tier.get_many(keys, sink)  # replies left unread: its connection is dropped
    present, got = read_all(tier, keys)
    assert present == [True] * 3
    assert got == {i: bytes([i]) * 100_000 for i in range(3)}


def test_a_closed_tier_raises_tier_error(backend: Backend) -> None:
    tier = backend.tier()
    tier.close()
    for call in (
        lambda: tier.contains_many([make_key("x")]),
        lambda: tier.get_many([make_key("x")], lambda i, v: None),
        lambda: tier.put_many([(make_key("x"), b"v")]),
        lambda: tier.delete_many([make_key("x")]),
        lambda: list(tier.keys()),
        tier.usage,
        tier.clear,
    ):
        with pytest.raises(TierError):
            call()


# --- the round-trip budget (design rule 5) -----------------------------------------


@pytest.fixture
def socket_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per write of packed commands to any Redis socket (real backends)."""
    writes: list[int] = []
    original = redis.connection.AbstractConnection.send_packed_command

    def counted(self: Any, command: Any, check_health: bool = True) -> None:
        writes.append(1)
        original(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
    return writes


def test_a_batch_of_256_keys_is_one_round_trip(backend: Backend, socket_writes: list[int]) -> None:
    tier = backend.tier(ttl=60.0)
    keys = [make_key("rt", i) for i in range(256)]
    tier.put_many([(k, b"v%d" % i) for i, k in enumerate(keys[::2])])
    tier.contains_many(keys)  # warm every connection (handshakes are not batches)
    tier.get_many(keys[:1], lambda i, v: None)  # and what the tier knows of its values
    nodes = 1
    if backend.kind == "cluster":
        nodes = len({tier.client.get_node_from_key(tier.redis_key(k)).name for k in keys})
        slots = {tier.client.keyslot(tier.redis_key(k)) for k in keys}
        assert nodes > 1 and len(slots) > 100  # the batch really spans the cluster

    calls: list[Callable[[], object]] = [
        lambda: tier.contains_many(keys),
        lambda: tier.get_many(keys, lambda i, v: None),
        lambda: tier.put_many([(k, b"w") for k in keys]),
        lambda: tier.delete_many(keys),
    ]
    for call in calls:
        before, sent, writes = tier.round_trips, tier.commands_sent, len(socket_writes)
        call()
        assert tier.round_trips == before + 1
        assert tier.commands_sent == sent + 256
        if backend.kind != "fake":  # what actually went over the sockets
            assert len(socket_writes) - writes == nodes


def test_values_larger_than_a_round_trip_are_read_in_groups_on_a_single_server(
    backend: Backend, socket_writes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend.kind != "real":
        pytest.skip("fakeredis and the cluster pipeline read every value in one round trip")
    monkeypatch.setattr(redis_values, "ROUND_TRIP_BYTES", 2 << 20)
    tier = backend.tier()
    keys = [make_key("big", i) for i in range(6)]
    tier.put_many([(k, bytes([i]) * (1 << 20)) for i, k in enumerate(keys)])
    writes = len(socket_writes)
    present, got = read_all(tier, [*keys[:3], make_key("absent"), *keys[3:]])

    assert present == [True] * 3 + [False] + [True] * 3
    assert got == {i + (i > 2): bytes([i]) * (1 << 20) for i in range(6)}
    assert len(socket_writes) - writes == 1 + 3  # one value to learn its size, then 2 MiB each
    writes = len(socket_writes)
    read_all(tier, keys)  # the tier knows its values' size now
    assert len(socket_writes) - writes == 3


def test_a_value_a_server_sends_as_a_simple_string_is_read_as_it_is() -> None:
    """fakeredis's TCP server answers a GET of a value without CR or LF with a simple
    string (``+...``), where Redis sends a bulk string; read either way, it is the value."""
    plain, framed = bytes(range(14, 256)), b"a\r\nb" * 1000
    with fake_tcp_server() as url:
        tier = config_tier(url=url)(unique_prefix(), "ns", None, 1)
        try:
            tier.put_many([(make_key("plain"), plain), (make_key("framed"), framed)])
            present, got = read_all(tier, [make_key("plain"), make_key("framed")])
        finally:
            tier.close()
    assert present == [True, True]
    assert got == {0: plain, 1: framed}


def test_sizes_of_256_keys_are_one_round_trip_and_one_command_on_a_single_server(
    backend: Backend, socket_writes: list[int]
) -> None:
    tier = backend.tier()
    keys = [make_key("sz", i) for i in range(256)]
    tier.put_many([(k, b"v" * (i + 1)) for i, k in enumerate(keys[::2])])
    tier.sizes_many(keys[:1])  # warm the connections; learns whether the server runs scripts
    before, sent, writes = tier.round_trips, tier.commands_sent, len(socket_writes)
    assert tier.sizes_many(keys) == [0 if i % 2 else i // 2 + 1 for i in range(256)]
    assert tier.round_trips == before + 1
    # fakeredis runs no scripts and a cluster's keys span slots: one STRLEN per key there.
    assert tier.commands_sent == sent + (1 if backend.kind == "real" else 256)
    if backend.kind == "real":
        assert len(socket_writes) - writes == 1


def test_sizes_fall_back_to_a_pipeline_on_a_server_without_scripting(
    request: pytest.FixtureRequest,
) -> None:
    b = make_backend("fake", request)  # fakeredis has no EVAL without lupa
    tier = b.tier()
    keys = [make_key("nosc", i) for i in range(8)]
    tier.put_many([(keys[0], b"abc")])
    assert tier.sizes_many(keys) == [3] + [0] * 7
    assert tier.round_trips == 3  # the put, the refused script, the pipeline
    assert tier.sizes_many(keys) == [3] + [0] * 7
    assert tier.round_trips == 4 and tier.commands_sent == 1 + 1 + 8 + 8
    b.finish()


@pytest.mark.redis
def test_sizes_fall_back_to_a_pipeline_when_the_acl_denies_scripts(real_client: Any) -> None:
    user, password = f"kvtest-{unique_prefix()}", "kvtest-pw"
    real_client.acl_setuser(
        user, enabled=True, passwords=[f"+{password}"], keys=["*"], categories=["+@all"],
        commands=["-eval", "-evalsha", "-eval_ro", "-evalsha_ro"],
    )  # fmt: skip
    prefix = unique_prefix()
    tier = config_tier(url=LOCAL_URL, username=user, password=password)(prefix, "ns", None, 4)
    try:
        keys = [make_key("acl", i) for i in range(8)]
        tier.put_many([(keys[1], b"abcd")])
        before = tier.round_trips
        assert tier.sizes_many(keys) == [0, 4] + [0] * 6
        assert tier.round_trips == before + 2  # the refused script, then the pipeline
        assert tier.sizes_many(keys) == [0, 4] + [0] * 6
        assert tier.round_trips == before + 3
    finally:
        tier.clear()
        tier.close()
        real_client.acl_deluser(user)


def test_counters_are_exact_under_threads(backend: Backend) -> None:
    tier = backend.tier()
    keys = [make_key("ctr", i) for i in range(16)]
    tier.put_many([(k, b"v") for k in keys])
    before = tier.round_trips

    def work() -> None:
        for _ in range(50):
            tier.contains_many(keys)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tier.round_trips == before + 200


# --- failures degrade within the timeouts (design rule 4) --------------------------


def _all_calls(tier: RedisTier) -> list[Callable[[], object]]:
    keys = [make_key("f", i) for i in range(32)]
    return [
        lambda: tier.contains_many(keys),
        lambda: tier.get_many(keys, lambda i, v: None),
        lambda: tier.put_many([(k, b"v" * 1000) for k in keys]),
        lambda: tier.delete_many(keys),
        lambda: list(tier.keys()),
        tier.usage,
        tier.clear,
    ]


def _assert_fails_within(call: Callable[[], object], seconds: float) -> TierError:
    start = time.monotonic()
    with pytest.raises(TierError) as err:
        call()
    elapsed = time.monotonic() - start
    assert elapsed < seconds, f"took {elapsed:.2f}s to fail"
    assert err.value.__cause__ is not None
    return err.value


def test_a_dead_server_fails_fast() -> None:
    port = free_port()  # nothing listens here
    cfg = RedisTierConfig(
        url=f"redis://{LOCAL_HOST}:{port}/0", connect_timeout=0.5, key_prefix=unique_prefix()
    )
    tier = RedisTier.from_config(cfg, "ns")  # does not connect yet
    try:
        for call in _all_calls(tier):
            error = _assert_fails_within(call, 2.0)
            assert isinstance(error.__cause__, redis.ConnectionError)
    finally:
        tier.close()


def test_a_server_that_never_answers_fails_within_the_socket_timeout(silent_server: int) -> None:
    cfg = RedisTierConfig(
        url=f"redis://{LOCAL_HOST}:{silent_server}/0",
        socket_timeout=0.3,
        connect_timeout=0.5,
        key_prefix=unique_prefix(),
    )
    tier = RedisTier.from_config(cfg, "ns")
    try:
        for call in _all_calls(tier)[:4]:
            error = _assert_fails_within(call, 2.0)
            assert isinstance(error.__cause__, redis.TimeoutError)
    finally:
        tier.close()


@pytest.mark.redis
def test_the_same_tier_recovers_when_its_server_comes_back(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()
    try:
        cfg = RedisTierConfig(
            url=server.url,
            ttl=None,
            socket_timeout=0.5,
            connect_timeout=0.5,
            key_prefix=unique_prefix(),
        )
        tier = RedisTier.from_config(cfg, "ns")
        k = make_key("restart")
        assert tier.put_many([(k, b"before")]) == 1
        server.stop()
        for call in _all_calls(tier):
            _assert_fails_within(call, 2.0)
        server.start()  # same port; nothing was persisted
        # The pooled connections are stale; the first call reconnects on its own.
        assert read_all(tier, [k]) == ([False], {})
        assert tier.contains_many([k]) == [False]
        assert tier.put_many([(k, b"after")]) == 1
        assert read_all(tier, [k]) == ([True], {0: b"after"})
        tier.close()
    finally:
        server.stop()


@pytest.mark.redis
def test_a_hung_cluster_node_fails_the_batch_once_not_per_key(
    cluster: LocalCluster, request: pytest.FixtureRequest
) -> None:
    b = Backend(
        "cluster",
        None,
        config_tier(url=cluster.url, cluster=True, socket_timeout=0.25, connect_timeout=0.5),
        cluster.delete_prefix,
    )
    request.addfinalizer(b.finish)
    tier = b.tier()
    keys = [make_key("hung", i) for i in range(256)]
    assert tier.put_many([(k, b"v") for k in keys]) == 256
    victim = cluster.servers[1]
    victim.pause()  # accepts connections (kernel backlog), answers nothing
    try:
        # redis-py's own fallback would retry each of ~85 keys on that node in turn.
        _assert_fails_within(lambda: tier.contains_many(keys), 2.0)
        _assert_fails_within(lambda: tier.get_many(keys, lambda i, v: None), 2.0)
    finally:
        victim.resume()
    time.sleep(tier.breaker.base)  # the node's back-off (kvtier.tiers.breaker)
    assert tier.contains_many(keys) == [True] * 256


# --- from_config -------------------------------------------------------------------


@pytest.mark.redis
def test_from_config_takes_the_password_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with RedisServer(tmp_path, args=["--requirepass", "s3cret-pw"]) as server:
        monkeypatch.setenv("KVTIER_TEST_REDIS_PASSWORD", "s3cret-pw")
        prefix = unique_prefix()

        def tier_for(**section: Any) -> RedisTier:
            cfg = parse_config({"tiers": {"redis": {"key_prefix": prefix, **section}}})
            assert cfg.tiers.redis is not None
            return RedisTier.from_config(cfg.tiers.redis, "ns")

        url = f"redis://{LOCAL_HOST}:{server.port}/0"
        # The config's password wins over the one in the URL.
        good = tier_for(
            url=f"redis://:wrong@{LOCAL_HOST}:{server.port}/0",
            password="${KVTIER_TEST_REDIS_PASSWORD}",
        )
        assert good.put_many([(make_key("pw"), b"v")]) == 1
        assert good.contains_many([make_key("pw")]) == [True]
        good.close()
        for bad in (tier_for(url=url), tier_for(url=url, password="nope")):
            error = _assert_fails_within(lambda t=bad: t.contains_many([make_key("pw")]), 2.0)
            assert isinstance(error.__cause__, redis.RedisError)
            bad.close()


def test_from_config_on_a_unix_socket_stores_and_reads(tmp_path: Path) -> None:
    socket = tmp_path / "redis.sock"
    with RedisServer(tmp_path, args=["--unixsocket", str(socket)]):
        cfg = RedisTierConfig(url=f"unix://{socket}", key_prefix=unique_prefix())
        tier = RedisTier.from_config(cfg, "ns")
        try:
            value = bytes(range(256)) * 64
            assert tier.put_many([(make_key("unix"), value)]) == 1
            assert read_all(tier, [make_key("unix")]) == ([True], {0: value})
        finally:
            tier.close()


@pytest.mark.redis
def test_from_config_cluster_with_startup_nodes(cluster: LocalCluster) -> None:
    cfg = RedisTierConfig(
        url="redis://unused.invalid:1", cluster=cluster.addresses, key_prefix=unique_prefix()
    )
    tier = RedisTier.from_config(cfg, "ns")
    try:
        assert tier.is_cluster
        assert tier.put_many([(make_key("nodes"), b"v")]) == 1
        assert tier.clear() == 1
    finally:
        tier.close()
        cluster.delete_prefix(cfg.key_prefix)


def test_from_config_rejects_a_unix_socket_cluster() -> None:
    with pytest.raises(ConfigError, match="cluster"):
        RedisTier.from_config(RedisTierConfig(url="unix:///tmp/redis.sock", cluster=True), "ns")


def test_from_config_cluster_down_is_a_tier_error() -> None:
    port = free_port()
    cfg = RedisTierConfig(url=f"redis://{LOCAL_HOST}:{port}", cluster=True, connect_timeout=0.5)
    start = time.monotonic()
    with pytest.raises(TierError):
        RedisTier.from_config(cfg, "ns")
    assert time.monotonic() - start < 2.0
