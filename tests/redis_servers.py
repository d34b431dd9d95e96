"""Redis servers for tests: the shared local server, throwaway servers, a 3-node cluster.

``unavailable(reason)`` skips a test that needs Redis, or fails it when the
environment sets ``KVTIER_REQUIRE_REDIS=1`` (CI does, so a missing server can never
turn the Redis tests into silent skips there).

``RedisServer`` runs one ``redis-server`` process on a free loopback port in a
scratch directory (nothing persisted) and stops it by pid; it can be stopped and
started again on the same port. ``LocalCluster`` runs three cluster-enabled servers
and joins them with ``redis-cli --cluster create``. ``fake_tcp_server`` serves
fakeredis over TCP (a RESP server that is not Redis). ``Backend`` builds ``RedisTier``s
on one of them (or fakeredis) and deletes their keys afterwards; the fixtures built
on all this live in ``conftest.py``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis

from kvtier.config import RedisTierConfig
from kvtier.tiers.redis import RedisTier

LOCAL_HOST = "127.0.0.1"
LOCAL_PORT = 6379
REQUIRE_ENV = "KVTIER_REQUIRE_REDIS"


def redis_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def unavailable(reason: str) -> None:
    """Skip the test, or fail it when ``KVTIER_REQUIRE_REDIS=1``."""
    if redis_required():
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1 makes this an error, not a skip)", pytrace=False)
    pytest.skip(f"{reason} (set {REQUIRE_ENV}=1 to make this an error)")


def redis_server_binary() -> str:
    """Path of ``redis-server`` (and ``redis-cli`` beside it), or skip/fail."""
    server = shutil.which("redis-server")
    if server is None or shutil.which("redis-cli") is None:
        unavailable("redis-server / redis-cli are not on PATH")
    assert server is not None
    return server


def unique_prefix(tag: str = "kvtest") -> str:
    """A key prefix no other test run uses."""
    return f"{tag}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def delete_prefix(client: redis.Redis, prefix: str) -> int:
    """Delete every key starting with ``prefix`` on one server; returns how many.

    One UNLINK per key (in pipelines), so it works on a cluster node too, where a
    multi-key command must stay within one slot.
    """
    removed = 0
    batch: list[bytes] = []

    def flush() -> int:
        pipe = client.pipeline(transaction=False)
        for key in batch:
            pipe.unlink(key)
        n = sum(pipe.execute())
        batch.clear()
        return n

    for key in client.scan_iter(match=prefix + "*", count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            removed += flush()
    if batch:
        removed += flush()
    return removed


def local_client(timeout: float = 0.5) -> redis.Redis | None:
    """A client for the shared server on 127.0.0.1:6379, or None if none answers."""
    client = redis.Redis(
        host=LOCAL_HOST,
        port=LOCAL_PORT,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
    )
    try:
        client.ping()
    except (redis.RedisError, OSError):
        client.close()
        return None
    return client


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((LOCAL_HOST, port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A loopback port nothing listens on (and port+10000 too, for a cluster bus)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((LOCAL_HOST, 0))
            port = s.getsockname()[1]
        if cluster_bus and (port + 10000 > 65535 or not _port_free(port + 10000)):
            continue
        return port
    raise RuntimeError("no free loopback port found")


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def fake_tcp_server() -> Iterator[str]:
    """fakeredis served over TCP on a loopback port, for as long as the block runs: its
    URL. A RESP server that is not Redis, read through real sockets."""
    server = fakeredis.TcpFakeServer((LOCAL_HOST, free_port()), server_type="redis")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"redis://{LOCAL_HOST}:{server.server_address[1]}/0"
    finally:
        server.shutdown()
        server.server_close()


class RedisServer:
    """One ``redis-server`` process on a loopback port, in its own scratch directory."""

    def __init__(self, workdir: Path, port: int | None = None, args: Sequence[str] = ()) -> None:
        self.binary = redis_server_binary()
        self.port = port if port is not None else free_port()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.password: str | None = None
        if "--requirepass" in self.args:
            self.password = self.args[self.args.index("--requirepass") + 1]

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def url(self) -> str:
        return f"redis://{LOCAL_HOST}:{self.port}/0"

    def client(self, timeout: float = 1.0) -> redis.Redis:
        return redis.Redis(
            host=LOCAL_HOST,
            port=self.port,
            password=self.password,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
        )

    def start(self, timeout: float = 10.0) -> RedisServer:
        assert self.proc is None, "already running"
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            LOCAL_HOST,
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            str(self.workdir / f"redis-{self.port}.log"),
            *self.args,
        ]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        probe = self.client(timeout=0.5)
        try:

            def up() -> bool:
                if self.proc is not None and self.proc.poll() is not None:
                    err = (
                        self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                    )
                    raise RuntimeError(f"redis-server on port {self.port} exited: {err.strip()}")
                return bool(probe.ping())

            wait_until(up, timeout, f"redis-server on port {self.port}")
        except BaseException:
            self.stop()
            raise
        finally:
            probe.close()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate the process by its pid (SIGKILL if it lingers) and reap it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)  # in case a test paused it
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if proc.stderr is not None:
            proc.stderr.close()

    def pause(self) -> None:
        """SIGSTOP: the kernel still accepts connections, nothing answers."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalCluster:
    """Three cluster-enabled primaries on free loopback ports, no replicas."""

    def __init__(self, workdir: Path, size: int = 3) -> None:
        redis_server_binary()
        self.workdir = Path(workdir)
        self.servers: list[RedisServer] = []
        ports: list[int] = []
        while len(ports) < size:
            port = free_port(cluster_bus=True)
            if port not in ports and port + 10000 not in ports:
                ports.append(port)
        for port in ports:
            self.servers.append(
                RedisServer(
                    self.workdir,
                    port=port,
                    args=[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(self.workdir / f"nodes-{port}.conf"),
                        "--cluster-node-timeout",
                        "5000",
                    ],
                )
            )

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(f"{LOCAL_HOST}:{s.port}" for s in self.servers)

    @property
    def url(self) -> str:
        return f"redis://{LOCAL_HOST}:{self.servers[0].port}"

    def start(self, timeout: float = 30.0) -> LocalCluster:
        try:
            for server in self.servers:
                server.start()
            create = subprocess.run(
                ["redis-cli", "--cluster", "create", *self.addresses]
                + ["--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True,
                timeout=timeout,
                check=False,
            )
            if create.returncode != 0:
                raise RuntimeError(
                    "redis-cli --cluster create failed: "
                    + (create.stdout + create.stderr).decode(errors="replace")
                )
            clients = [s.client() for s in self.servers]
            try:
                wait_until(
                    lambda: all(
                        b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO") for c in clients
                    ),
                    timeout,
                    "cluster_state:ok on every node",
                )
            finally:
                for c in clients:
                    c.close()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def node_clients(self) -> Iterator[redis.Redis]:
        for server in self.servers:
            yield server.client()

    def delete_prefix(self, prefix: str) -> int:
        removed = 0
        for client in self.node_clients():
            try:
                removed += delete_prefix(client, prefix)
            finally:
                client.close()
        return removed


LOCAL_URL = f"redis://{LOCAL_HOST}:6379/0"


class Backend:
    """Builds tiers on one store and removes every key they wrote afterwards."""

    def __init__(
        self,
        kind: str,
        admin: Any,
        build: Callable[[str, str, float | None, int], RedisTier],
        purge: Callable[[str], object],
    ) -> None:
        self.kind = kind
        self.admin = admin  # a plain client on the same store, for inspection
        self._build = build
        self._purge = purge
        self._tiers: list[RedisTier] = []
        self._prefixes: set[str] = set()

    def tier(
        self,
        ttl: float | None = None,
        key_prefix: str | None = None,
        namespace: str = "ns",
        chunk_blocks: int = 4,
    ) -> RedisTier:
        prefix = key_prefix or unique_prefix()
        self._prefixes.add(prefix)
        tier = self._build(prefix, namespace, ttl, chunk_blocks)
        self._tiers.append(tier)
        return tier

    def finish(self) -> None:
        for tier in self._tiers:
            tier.close()
        for prefix in self._prefixes:
            self._purge(prefix)


def config_tier(**fields: Any) -> Callable[[str, str, float | None, int], RedisTier]:
    def build(prefix: str, namespace: str, ttl: float | None, chunk_blocks: int) -> RedisTier:
        cfg = RedisTierConfig(key_prefix=prefix, ttl=ttl, chunk_blocks=chunk_blocks, **fields)
        return RedisTier.from_config(cfg, namespace)

    return build


def make_backend(kind: str, request: pytest.FixtureRequest) -> Backend:
    if kind == "fake":
        server = fakeredis.FakeServer()
        admin = fakeredis.FakeRedis(server=server)
        return Backend(
            "fake",
            admin,
            lambda prefix, ns, ttl, chunk_blocks: RedisTier(
                fakeredis.FakeRedis(server=server), ns, chunk_blocks, ttl, key_prefix=prefix
            ),
            lambda prefix: None,
        )
    if kind == "real":
        admin = request.getfixturevalue("real_client")
        return Backend("real", admin, config_tier(url=LOCAL_URL), lambda p: delete_prefix(admin, p))
    c = request.getfixturevalue("cluster")
    return Backend(
        "cluster",
        request.getfixturevalue("cluster_admin"),
        config_tier(url=c.url, cluster=True),
        c.delete_prefix,
    )
