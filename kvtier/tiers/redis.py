"""The Redis tier: chunk values in Redis or Redis Cluster, through redis-py.

Key schema
    ``<key_prefix>:<namespace>:<hex of the 16-byte chunk key>`` as bytes, e.g.
    ``kvtier:3f9a0c1d2e4b5a69:9b1e...`` (``RedisTier.redis_key``). ``namespace`` is a
    short string the cache derives from the namespace root (``namespace_for(root)``:
    the first 8 bytes of the root as hex), so one Redis can hold several models or
    layouts side by side and ``clear()`` / ``keys()`` touch only one of them. Chunk
    keys are chained hashes that already include the root, so the namespace is for
    listing and clearing, not for correctness. Neither part may contain ``{`` or
    ``}``: a hash tag would pin every key to one cluster slot.

    Records (``put_record``: what each namespace is, ``kvtier.namespaces``) are the
    fields of one hash, ``<key_prefix>:records``, shared by every namespace under the
    prefix: one HSET to write one, one HGETALL to read them all. It has no expiry and
    no namespace walk (``keys``, ``clear``, ``usage``) sees it.

One key per chunk
    A value (msgpack header and block payload together, opaque to this tier) is one
    Redis string, written by one SET. A chunk is therefore either wholly present or
    absent, never half written, and expiry or eviction drops it whole. Nothing is
    ever pickled; values go to redis-py as bytes or memoryviews and come back as
    bytes. Large values are sent from the caller's buffer, without a copy and without
    the GIL (``_send_values_in_place``): redis-py packs commands with hiredis where
    it is installed, which copies every value twice while holding the GIL, and a spill
    writer that holds it for a 4 MiB value stalls the engine's own thread. For the
    same reason values are read (on a single server) into a buffer each thread
    reuses, not into a new ``bytes`` per value (``kvtier.tiers.redis_values``).

Round-trip budget (design rule 5)
    Every batch method is one pipeline (``transaction=False``) executed once:
    ``contains_many`` (EXISTS per key), ``sizes_many`` (STRLEN per key),
    ``get_many`` (GET, or GETEX refreshing the expiry when a ttl is set),
    ``put_many`` (SET ... PX ttl) and ``delete_many`` (UNLINK). On a single server
    that is one round trip, except a ``get_many`` of more than
    ``redis_values.ROUND_TRIP_BYTES`` of values, read in groups of about that many
    bytes (Redis builds a whole pipeline's replies before they drain, serving no
    other client meanwhile: see ``redis_values``); in cluster mode the cluster
    pipeline writes each node's share of the batch to that node's connection before
    reading any reply, so at most one round trip per node, all in flight together.
    ``round_trips`` counts pipeline executions (and SCAN pages), ``commands_sent``
    the commands in them, for tests and metrics. ``keys``, ``clear`` and ``usage``
    walk the namespace with SCAN (every primary in a cluster) and are for inspection
    and tooling, not hot paths.

    ``sizes_many`` is what every lookup asks (a 4k-token prompt: 256 keys), and
    redis-py spends ~15 µs of Python per pipelined command, building it and parsing
    its reply. On a single server it is therefore one command instead:
    ``EVAL`` of a read-only script (``_SIZES_SCRIPT``) that runs the STRLENs and
    returns them as one msgpack array. 256 keys: ~1 ms instead of ~4.4 ms, both
    one round trip. A server that cannot run it (Redis < 7, scripting disabled or
    denied by ACL, no ``cmsgpack``, fakeredis) answers the first try with an
    error; from then on that tier uses the pipeline, and that first call costs
    one round trip more. A cluster always uses the pipeline: a script's keys must
    share one slot.

TTL and eviction
    With ``ttl`` set, every write sets that expiry and every read hit refreshes it
    (GETEX), so chunks in use stay and unused ones age out. ``ttl=None`` writes
    keys without expiry. The tier has no capacity of its own (``usage().capacity``
    is None): Redis's ``maxmemory`` governs, so a deployment should set
    ``maxmemory`` with ``maxmemory-policy allkeys-lru`` (reads count as uses, as
    ``SpillTier`` requires) or rely on the ttl. Under ``noeviction`` a SET that hits
    the memory limit is skipped (not counted as stored), not an error.

Failure model (design rule 4)
    Every redis-py failure (connection refused, timeouts, ResponseError,
    ClusterDownError, cluster topology errors, OS errors) is raised as ``TierError``
    with the cause chained; nothing else escapes a tier method (an exception raised
    by the caller's ``sink`` propagates unchanged). Each call is bounded by the
    configured timeouts: connects give up after ``connect_timeout`` and replies
    after ``socket_timeout``. On one server a timeout is never retried and a
    broken connection is retried once on a fresh one (so a server restart is
    invisible to the first call after it); a cluster retries a failed connect
    once, after re-reading the topology. In cluster mode a batch that loses a
    node mid-way fails as a whole instead of taking redis-py's per-command
    fallback, which re-sends each of that node's keys on its own and so waits
    ``socket_timeout`` (twice) per key on a hung node (measured: 41 s for a batch
    of 256 keys over 3 nodes, against 0.3 s here); MOVED/ASK replies (resharding)
    re-run the batch once with redirections followed.

    A timeout opens the node's circuit breaker (``kvtier.tiers.breaker``): calls
    that need that node (the server, or a cluster node holding one of the batch's
    keys) fail at once with ``TierError`` for a back-off of 1 s, doubling while
    the node stays hung up to 30 s, then one call probes it. So a hung node
    costs at most one socket timeout per back-off period, and a node that
    answers again is used at once. A refused connection opens nothing (it costs
    no time): the next call simply tries again and redis-py reconnects, so a
    tier recovers on its own when its server returns, restarted or resumed.
    ``from_config`` does not connect for a single server; a cluster client reads
    the topology when built,
    and a failure there is a ``TierError``.

Threads
    One tier is shared by several I/O worker threads: the client's connection
    pool (a blocking pool of ``max_connections`` per server, waiting at most
    ``connect_timeout`` for a free connection) hands each pipeline its own
    connection, pipelines are built per call, and the counters are guarded by a
    lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import BlockingConnectionPool, ConnectionPool, PythonRespSerializer, parse_url
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    OutOfMemoryError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.retry import Retry

from kvtier.tiers.base import Buffer, SpillTier, TierError, TierUsage, ValueSink
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.redis_values import read_values, reads_sockets

if TYPE_CHECKING:
    from kvtier.config import RedisTierConfig

__all__ = ["RedisTier", "namespace_for"]

log = logging.getLogger(__name__)

# redis-py's own cutoff: packed pieces longer than this are sent as separate buffers.
_BUFFER_CUTOFF = 6000

# What a tier call can raise from redis-py, its sockets or its cluster machinery.
_REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)
# Cluster replies that mean "the topology moved": worth one re-run with redirections.
_REDIRECTS: tuple[type[BaseException], ...] = (
    MovedError,
    AskError,
    TryAgainError,
    ClusterDownError,
)
_HEALTH_CHECK_INTERVAL = 30.0  # seconds idle before a pooled connection is PINGed
_SCAN_COUNT = 1000  # SCAN page size hint
_GLOB_SPECIAL = frozenset(b"*?[]\\")
# STRLEN of every key, as one msgpack array (see "Round-trip budget"). ``no-writes``
# lets Redis run it on a replica and at maxmemory, like the STRLENs themselves.
_SIZES_SCRIPT = """#!lua flags=no-writes
local sizes = {}
for i, key in ipairs(KEYS) do sizes[i] = redis.call('STRLEN', key) end
return cmsgpack.pack(sizes)
"""

_SERVER = "server"  # the breaker's node name for a single server

Client = redis.Redis | RedisCluster


def namespace_for(root: bytes) -> str:
    """The key namespace for a namespace root (model, layout, salt): 16 hex digits."""
    return bytes(root[:8]).hex()


def _glob_escape(prefix: bytes) -> bytes:
    """``prefix`` with SCAN MATCH's special characters escaped."""
    out = bytearray()
    for byte in prefix:
        if byte in _GLOB_SPECIAL:
            out.append(0x5C)  # backslash
        out.append(byte)
    return bytes(out)


def _as_bytes_view(value: Buffer) -> bytes | memoryview:
    """A value redis-py can send as is: bytes, or a flat byte memoryview (no copy)."""
    if isinstance(value, bytes):
        return value
    view = memoryview(value)
    if view.ndim != 1 or view.format not in ("B", "b", "c"):
        view = view.cast("B")
    return view


def _packer(encoder: Any) -> PythonRespSerializer:
    """redis-py's pure-Python command packer: it passes a value longer than
    ``_BUFFER_CUTOFF`` through as the caller's buffer, which the socket then sends
    without a copy (and without the GIL)."""
    return PythonRespSerializer(_BUFFER_CUTOFF, encoder.encode)


def _send_values_in_place(pools: Iterable[ConnectionPool]) -> None:
    """Make ``pools``' connections pack with ``_packer`` (the module docstring says
    why); connections made before are closed and dropped, made again on first use."""
    for pool in pools:
        pool.connection_kwargs["command_packer"] = _packer(pool.get_encoder())
        pool.disconnect()
        pool.reset()


def _is_timeout(e: BaseException | None) -> bool:
    """Whether ``e`` (or an exception it was raised from) is a socket timeout."""
    for _ in range(8):  # a cause chain is short; never loop on a cycle
        if e is None:
            return False
        if isinstance(e, (redis.TimeoutError, TimeoutError)):
            return True
        e = e.__cause__ or e.__context__
    return False


def _ttl_ms(ttl: float | None) -> int | None:
    if ttl is None:
        return None
    if not ttl > 0:
        raise ValueError(f"ttl must be positive seconds or None, got {ttl!r}")
    return max(1, round(ttl * 1000))


def _pipeline_queue(pipe: Any) -> list[Any]:
    """The queued commands of a cluster pipeline (redis-py 6+ strategy, or older)."""
    strategy = getattr(pipe, "_execution_strategy", None)
    if strategy is not None:
        return list(strategy.command_queue)
    return list(pipe.command_stack)


class RedisTier(SpillTier):
    """Chunk values in Redis (one server or a cluster); see the module docstring."""

    def __init__(
        self,
        client: redis.Redis | RedisCluster,
        namespace: str,
        chunk_blocks: int,
        ttl: float | None,
        key_prefix: str = "kvtier",
        name: str = "redis",
        breaker: CircuitBreaker | None = None,
    ) -> None:
        if chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks!r}")
        for what, text in (("key_prefix", key_prefix), ("namespace", namespace)):
            if "{" in text or "}" in text:
                raise ValueError(f"{what} must not contain '{{' or '}}' (a hash tag): {text!r}")
        self.client = client
        self.name = name
        self.chunk_blocks = chunk_blocks
        self.ttl = ttl
        self.namespace = namespace
        self.key_prefix = key_prefix
        self.is_cluster = isinstance(client, RedisCluster)
        self.round_trips = 0
        self.commands_sent = 0
        self._ttl_ms = _ttl_ms(ttl)
        self._prefix = f"{key_prefix}:{namespace}:".encode()
        self._match = _glob_escape(self._prefix) + b"*"
        self._records = f"{key_prefix}:records".encode()
        self._lock = threading.Lock()
        self._closed = False
        self._sizes_by_script = not self.is_cluster  # until the server refuses the script
        self._in_place = not self.is_cluster and reads_sockets(client.connection_pool)
        self._value_size = 0  # the largest value read in place so far (read_values' groups)
        self.breaker = breaker if breaker is not None else CircuitBreaker()

    # --- construction ---------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: RedisTierConfig, namespace: str) -> RedisTier:
        """A tier with its own client built from ``cfg`` (see the module docstring).

        A password or username in ``cfg`` overrides the one in the URL. Raises
        ``ConfigError`` for a URL that cannot work in the chosen mode, and
        ``TierError`` when a cluster's topology cannot be read.
        """
        from kvtier.config import ConfigError

        scheme = cfg.url.partition("://")[0].lower()
        try:
            opts: dict[str, Any] = parse_url(cfg.url)
        except ValueError as e:
            raise ConfigError("tiers.redis.url", cfg.url, f"invalid Redis URL: {e}") from None
        opts.update(
            socket_timeout=cfg.socket_timeout,
            socket_connect_timeout=cfg.connect_timeout,
            socket_read_size=1 << 20,
            retry_on_timeout=False,
            max_connections=cfg.max_connections,
            connection_pool_class=BlockingConnectionPool,
            timeout=cfg.connect_timeout,  # longest wait for a free pooled connection
        )
        if scheme != "unix":  # a TCP option: a Unix socket connection takes no such argument
            opts["socket_keepalive"] = True
        if cfg.password is not None:
            opts["password"] = cfg.password
        if cfg.username is not None:
            opts["username"] = cfg.username
        ssl = scheme == "rediss"
        if ssl:
            opts.update(
                ssl_ca_certs=cfg.ssl_ca_certs,
                ssl_certfile=cfg.ssl_certfile,
                ssl_keyfile=cfg.ssl_keyfile,
                ssl_cert_reqs=cfg.ssl_cert_reqs,
            )
        client: Client
        if cfg.cluster is False:
            opts.pop("connection_pool_class")
            # One retry, on a broken connection only (a stale pooled socket after a
            # server restart); a timeout is never retried, so a call is bounded.
            opts["retry"] = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
            opts["health_check_interval"] = _HEALTH_CHECK_INTERVAL
            pool = BlockingConnectionPool(**opts)
            _send_values_in_place([pool])
            client = redis.Redis(connection_pool=pool)
        else:
            if scheme == "unix":
                raise ConfigError(
                    "tiers.redis.url",
                    cfg.url,
                    "expected a redis:// or rediss:// URL in cluster mode, got a unix socket",
                )
            if opts.pop("db", 0) not in (0, None):
                raise ConfigError("tiers.redis.url", cfg.url, "expected database 0 in cluster mode")
            host, port = opts.pop("host", "127.0.0.1"), int(opts.pop("port", 6379))
            opts.pop("connection_class", None)
            # The cluster builds each node's pool from the startup URL's scheme (TLS or
            # not) and these options; credentials stay out of the URL so that ours win.
            addresses = list(cfg.cluster) if isinstance(cfg.cluster, tuple) else []
            if addresses:
                first = addresses.pop(0)
            else:
                first = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            nodes = []
            for address in addresses:
                node_host, _, node_port = address.rpartition(":")
                nodes.append(ClusterNode(node_host.strip("[]"), int(node_port)))
            try:
                client = RedisCluster(
                    url=f"{scheme}://{first}",
                    startup_nodes=nodes,
                    # No retry: each attempt at a hung node costs a socket timeout, and the
                    # tier re-runs a batch itself only on a redirection.
                    retry=Retry(NoBackoff(), 0),
                    **opts,
                )
            except _REDIS_ERRORS as e:
                raise TierError(f"cannot reach Redis Cluster at {cfg.url}: {e}") from e
            # The cluster takes no packer option: give it to the pools of the nodes it
            # found, and to those it makes for nodes it finds later (started from a URL,
            # it builds each node's pool from these options).
            nodes_manager = client.nodes_manager
            nodes_manager.connection_kwargs["command_packer"] = _packer(client.get_encoder())
            _send_values_in_place(n.redis_connection.connection_pool for n in client.get_nodes())
        return cls(
            client,
            namespace=namespace,
            chunk_blocks=cfg.chunk_blocks,
            ttl=cfg.ttl,
            key_prefix=cfg.key_prefix,
        )

    # --- keys -----------------------------------------------------------------------

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key that holds chunk ``key``."""
        return self._prefix + key.hex().encode()

    def _chunk_key(self, redis_key: bytes) -> bytes | None:
        """The chunk key named by a Redis key of this namespace; None if malformed."""
        if not redis_key.startswith(self._prefix):
            return None
        try:
            return bytes.fromhex(redis_key[len(self._prefix) :].decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None

    # --- batches --------------------------------------------------------------------

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            self._check_open()
            return []
        results = self._batch(lambda pipe: [pipe.exists(self.redis_key(k)) for k in keys])
        return [bool(r) for r in results]

    def sizes_many(self, keys: Sequence[bytes]) -> list[int]:
        if not keys:
            self._check_open()
            return []
        redis_keys = [self.redis_key(k) for k in keys]
        if self._sizes_by_script:
            sizes = self._script_sizes(redis_keys)
            if sizes is not None:
                return sizes
        results = self._batch(lambda pipe: [pipe.strlen(k) for k in redis_keys])
        return [int(r) for r in results]

    def get_many(self, keys: Sequence[bytes], sink: ValueSink) -> list[bool]:
        if not keys:
            self._check_open()
            return []
        ttl_ms = self._ttl_ms
        if ttl_ms is None:
            commands = [("GET", self.redis_key(k)) for k in keys]
        else:
            commands = [("GETEX", self.redis_key(k), "PX", ttl_ms) for k in keys]
        if self._in_place:  # read without the GIL (``redis_values``)
            self._check_open()
            results = self._on_server(lambda: self._read_values(commands, sink), len(keys))
            return [r is True for r in self._check_results(results)]
        results = self._batch(lambda pipe: [pipe.execute_command(*c) for c in commands])
        present = [False] * len(keys)
        for i, value in enumerate(results):
            if value is not None:
                present[i] = True
                sink(i, memoryview(value))
        return present

    def _read_values(
        self, commands: list[tuple[Any, ...]], sink: ValueSink
    ) -> list[bool | ResponseError]:
        """``read_values`` on a pooled connection, expecting values as large as the
        largest this tier has read; a broken one (the server restarted) is replaced
        once, as redis-py's own retry does, unless a value was delivered (the failed
        call has disconnected it: the retry connects afresh)."""
        pool = self.client.connection_pool
        conn = pool.get_connection()
        delivered = False

        def deliver(i: int, value: memoryview) -> None:
            nonlocal delivered
            delivered = True
            self._value_size = max(self._value_size, value.nbytes)  # a hint: races are fine
            sink(i, value)

        try:
            try:
                return read_values(conn, commands, deliver, self._value_size)
            except redis.ConnectionError:
                if delivered:
                    raise
                return read_values(conn, commands, deliver, self._value_size)
        finally:
            pool.release(conn)

    def put_many(self, items: Sequence[tuple[bytes, Buffer]], only_new: bool = False) -> int:
        if not items:
            self._check_open()
            return 0
        ttl_ms = self._ttl_ms
        results = self._batch(
            lambda pipe: [
                pipe.set(self.redis_key(k), _as_bytes_view(v), px=ttl_ms, nx=only_new)
                for k, v in items
            ],
            skip=(OutOfMemoryError,),
        )
        return sum(1 for r in results if r is True)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        if not keys:
            self._check_open()
            return 0
        results = self._batch(lambda pipe: [pipe.unlink(self.redis_key(k)) for k in keys])
        return sum(int(r) for r in results)

    # --- namespace walks --------------------------------------------------------------

    def keys(self) -> Iterator[bytes]:
        for page, _ in self._scan():
            for redis_key in page:
                key = self._chunk_key(redis_key)
                if key is not None:
                    yield key

    def clear(self) -> int:
        removed = 0
        for page, node in self._scan():
            if page:
                results = self._node_batch(node, lambda pipe, p=page: [pipe.unlink(k) for k in p])
                removed += sum(int(r) for r in results)
        return removed

    def usage(self) -> TierUsage:
        entries = nbytes = 0
        for page, node in self._scan():
            if page:
                results = self._node_batch(node, lambda pipe, p=page: [pipe.strlen(k) for k in p])
                entries += len(results)
                nbytes += sum(int(r) for r in results)
        return TierUsage(entries=entries, nbytes=nbytes, capacity=None)

    def put_record(self, name: str, value: bytes) -> None:
        self._batch(lambda pipe: [pipe.hset(self._records, name, value)])

    def records(self) -> dict[str, bytes]:
        [fields] = self._batch(lambda pipe: [pipe.hgetall(self._records)])
        return {bytes(k).decode(errors="replace"): bytes(v) for k, v in fields.items()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.client.close()
            if not self.is_cluster:
                self.client.connection_pool.disconnect()
        except _REDIS_ERRORS:
            pass

    def __repr__(self) -> str:
        kind = "cluster" if self.is_cluster else "single"
        return f"RedisTier({self.name!r}, {kind}, prefix={self._prefix.decode()!r})"

    # --- plumbing ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"{self!r} is closed")

    def _count(self, round_trips: int, commands: int) -> None:
        with self._lock:
            self.round_trips += round_trips
            self.commands_sent += commands

    def _fail(self, e: BaseException) -> TierError:
        return TierError(f"{self!r}: {type(e).__name__}: {e}")

    def _batch(
        self,
        fill: Callable[[Any], Sequence[Any]],
        skip: tuple[type[BaseException], ...] = (),
    ) -> list[Any]:
        """Run the commands ``fill`` queues as one pipeline; per-command results.

        Results that are instances of ``skip`` come back as None; any other error
        raises ``TierError``, as does a node skipped by the breaker.
        """
        self._check_open()
        if self.is_cluster:
            try:
                results = self._cluster_batch(fill)
            except _REDIS_ERRORS as e:
                raise self._fail(e) from e
        else:
            pipe = self.client.pipeline(transaction=False)
            n = len(fill(pipe))
            results = self._on_server(lambda: pipe.execute(raise_on_error=False), n)
        return self._check_results(results, skip)

    def _on_server(self, call: Callable[[], Any], commands: int) -> Any:
        """``call()`` (one round trip of ``commands`` to the single server), through the
        breaker; a redis-py error is raised as ``TierError``."""
        if self.breaker.blocked((_SERVER,)) is not None:
            raise self._skipped(_SERVER)
        self._count(1, commands)
        try:
            result = call()
        except _REDIS_ERRORS as e:
            self._report(_SERVER, e)
            raise self._fail(e) from e
        self.breaker.answered(_SERVER)
        return result

    def _report(self, node: str, error: BaseException | None) -> None:
        """Tell the breaker how ``node``'s part of a call ended (None: it answered)."""
        if error is not None and _is_timeout(error):
            backoff = self.breaker.timed_out(node, error)
            log.debug("kvtier: %r: %s timed out; skipped for %.0f s", self, node, backoff)
        else:
            self.breaker.answered(node)

    def _skipped(self, node: str) -> TierError:
        """The error of a call skipped because ``node`` is open, caused by its timeout."""
        error = TierError(f"{self!r}: {node} timed out before; skipped until it is probed again")
        error.__cause__ = self.breaker.cause(node)
        return error

    def _script_sizes(self, redis_keys: list[bytes]) -> list[int] | None:
        """STRLEN of each key through ``_SIZES_SCRIPT`` (one command); None, and the
        pipeline from then on, when the server answers that it cannot run it. A key
        that holds no string is a ``TierError``, as in the pipeline."""
        self._check_open()
        try:
            packed = self._on_server(
                lambda: self.client.eval(_SIZES_SCRIPT, len(redis_keys), *redis_keys), 1
            )
        except TierError as e:
            cause = e.__cause__
            if not isinstance(cause, ResponseError) or str(cause).startswith("WRONGTYPE"):
                raise
            self._sizes_by_script = False
            log.info(
                "kvtier: %r asks sizes with a pipeline: the server cannot run a script (%s)",
                self,
                cause,
            )
            return None
        sizes = msgpack.unpackb(packed) if isinstance(packed, bytes) else None
        if not isinstance(sizes, list) or len(sizes) != len(redis_keys):
            raise TierError(f"{self!r}: the sizes script returned {packed!r:.80}")
        return sizes

    def _check_results(
        self, results: list[Any], skip: tuple[type[BaseException], ...] = ()
    ) -> list[Any]:
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                if skip and isinstance(r, skip):
                    results[i] = None
                else:
                    raise self._fail(r) from r
        return results

    def _cluster_batch(self, fill: Callable[[Any], Sequence[Any]]) -> list[Any]:
        """One cluster pipeline, failing whole when a node fails (see the docstring).

        redis-py's own fallback re-sends every failed command on its own, which on a
        hung node would wait ``socket_timeout`` once per key; here a lost node fails
        the batch at once, and only redirections (live nodes) are followed, by one
        re-run of the batch.
        """
        client: RedisCluster = self.client  # type: ignore[assignment]
        pipe = client.pipeline(transaction=False)
        n = len(fill(pipe))
        stack = _pipeline_queue(pipe)
        # Every command here names one key (its first argument): the node that holds it.
        nodes = [client.get_node_from_key(c.args[1]).name for c in stack]
        batch_nodes = list(dict.fromkeys(nodes))
        hung = self.breaker.blocked(batch_nodes)
        if hung is not None:
            pipe.reset()
            raise self._skipped(hung)
        self._count(1, n)
        try:
            results = pipe.send_cluster_commands(
                stack, raise_on_error=False, allow_redirections=False
            )
        except _REDIS_ERRORS as e:
            # Raised when a node's connection cannot be set up: the message may name
            # it; if not, blame the nodes being probed (their connections were dropped
            # when they timed out), else all of the batch's.
            text = " ".join(str(x) for x in (e, e.__cause__, e.__context__) if x is not None)
            probed = set(self.breaker.open_nodes())
            named = (
                [node for node in batch_nodes if node in text]
                or [node for node in batch_nodes if node in probed]
                or batch_nodes
            )
            for node in batch_nodes:
                self._report(node, e if node in named else None)
            raise
        finally:
            pipe.reset()
        for node in batch_nodes:
            failed = (r for r, at in zip(results, nodes) if at == node)
            self._report(node, next((r for r in failed if isinstance(r, BaseException)), None))
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and all(isinstance(r, _REDIRECTS) for r in errors):
            pipe = self.client.pipeline(transaction=False)
            fill(pipe)
            self._count(1, n)
            results = pipe.execute(raise_on_error=False)
        return results

    def _scan_targets(self) -> list[tuple[redis.Redis, Any]]:
        """(client to SCAN, node) for the server or every cluster primary."""
        if not self.is_cluster:
            return [(self.client, None)]
        client: RedisCluster = self.client  # type: ignore[assignment]
        return [(client.get_redis_connection(node), node) for node in client.get_primaries()]

    def _scan(self) -> Iterator[tuple[list[bytes], Any]]:
        """Pages of this namespace's Redis keys, with the node that holds them.

        SCAN may return a key twice (while Redis rehashes); each is yielded once.
        """
        self._check_open()
        try:
            targets = self._scan_targets()
        except _REDIS_ERRORS as e:
            raise self._fail(e) from e
        for node_client, node in targets:
            seen: set[bytes] = set()
            cursor: int = 0
            while True:
                try:
                    self._count(1, 1)
                    cursor, page = node_client.scan(cursor, match=self._match, count=_SCAN_COUNT)
                except _REDIS_ERRORS as e:
                    raise self._fail(e) from e
                fresh = [k for k in map(bytes, page) if k not in seen]
                seen.update(fresh)
                yield fresh, node
                if not cursor:
                    break

    def _node_batch(self, node: Any, fill: Callable[[Any], Sequence[Any]]) -> list[Any]:
        """One pipeline to the server (or to one cluster node, for keys it holds)."""
        if node is None:
            return self._batch(fill)
        self._check_open()
        try:
            node_client = self.client.get_redis_connection(node)  # type: ignore[union-attr]
            pipe = node_client.pipeline(transaction=False)
            n = len(fill(pipe))
            self._count(1, n)
            results = pipe.execute(raise_on_error=False)
        except _REDIS_ERRORS as e:
            raise self._fail(e) from e
        return self._check_results(results)
