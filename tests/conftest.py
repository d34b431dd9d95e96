"""Shared fixtures: Redis backends (fakeredis, the local server, a throwaway cluster).

A missing server skips the ``real``/``cluster`` cases, or fails them when
``KVTIER_REQUIRE_REDIS=1`` (CI). Every backend deletes the keys its tiers wrote.
Likewise a vLLM that does not import skips the vLLM tests, or fails the session at
collection when ``KVTIER_REQUIRE_VLLM=1`` (CI).
"""

from __future__ import annotations

import importlib
import os
import socket
import threading
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import RedisCluster
from redis_servers import (
    LOCAL_HOST,
    LOCAL_URL,
    Backend,
    LocalCluster,
    local_client,
    make_backend,
    unavailable,
)

# --- vLLM required ----------------------------------------------------------------

REQUIRE_VLLM_ENV = "KVTIER_REQUIRE_VLLM"
# What the vLLM tests import or skip on (``pytest.importorskip``).
VLLM_MODULES = ("vllm", "vllm.distributed.kv_events")


def pytest_collection(session: pytest.Session) -> None:
    """With ``KVTIER_REQUIRE_VLLM=1``, a vLLM that does not import ends the session
    before any test is collected (a usage error naming the cause), instead of letting
    the vLLM tests skip themselves. Without it (``make test VLLM=``) they skip."""
    if os.environ.get(REQUIRE_VLLM_ENV, "") in ("", "0"):
        return
    for module in VLLM_MODULES:
        try:
            importlib.import_module(module)
        except Exception as e:  # a broken install raises more than ImportError
            raise pytest.UsageError(
                f"{REQUIRE_VLLM_ENV}=1 but `import {module}` fails ({type(e).__name__}: {e}):"
                f" install vLLM with `make vllm`, or unset {REQUIRE_VLLM_ENV} to let the"
                " vLLM tests skip"
            ) from e


# --- session resources -------------------------------------------------------------


@pytest.fixture(scope="session")
def real_client() -> Iterator[redis.Redis]:
    client = local_client()
    if client is None:
        unavailable(f"no Redis server answers at {LOCAL_URL}")
    assert client is not None
    yield client
    client.close()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        c.start()
    except (RuntimeError, OSError) as e:
        unavailable(f"cannot start a local Redis Cluster: {e}")
    yield c
    c.stop()


@pytest.fixture(scope="session")
def cluster_admin(cluster: LocalCluster) -> Iterator[RedisCluster]:
    client = RedisCluster(host=LOCAL_HOST, port=cluster.servers[0].port)
    yield client
    client.close()


# --- backends ----------------------------------------------------------------------


BACKENDS = [
    "fake",
    pytest.param("real", marks=pytest.mark.redis),
    pytest.param("cluster", marks=pytest.mark.redis),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    b = make_backend(request.param, request)
    yield b
    b.finish()


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A loopback port that accepts connections and never answers; yields the port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((LOCAL_HOST, 0))
    listener.listen(64)
    listener.settimeout(0.05)
    stop = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:  # the accept timeout, or the listener closed
                continue
            held.append(conn)  # read nothing, answer nothing

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=2)
        for conn in held:
            conn.close()
        listener.close()
