"""kvtier's own threads: named ``kvtier-...`` at the OS level, run on any CPU the process
may use, start no threads of their own, and leave the engine's threads as they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="needs Linux (thread affinity, /proc)"
)

# An engine: its main thread bound to one CPU, as vLLM binds a CPU worker's, and torch's
# intra-op threads (OpenMP) bound to CPUs too. It lists its threads, runs requests
# through a cache with GPU, CPU and disk tiers that offload, spill and load back (MiBs:
# copies large enough for torch to run them in parallel), lists the threads again once
# each of kvtier's pools (one thread each here) has run a task, then again after close.
PROGRAM = """
import json, os, random, time, torch
from kvtier.cache import TieredCache
from kvtier.config import parse_config

def threads():
    listed = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                listed[tid] = [f.read().strip(), sorted(os.sched_getaffinity(int(tid)))]
        except OSError:  # it has just exited
            pass
    return listed

def engine():
    torch.ones(1 << 20).add_(1)  # a parallel op: the main thread's OpenMP team is up
    return {"main_cpus": sorted(os.sched_getaffinity(0)), "threads": threads(),
            "torch_threads": [torch.get_num_threads(), torch.get_num_interop_threads()]}

def serve(cache, req, tokens):
    hit = cache.lookup(req, tokens)
    cache.allocate(req, len(tokens) - hit.num_tokens, hit)
    while not cache.ready(req):  # the engine works meanwhile: an I/O worker loads the hit
        time.sleep(0.001)
    cache.wait(req)
    cache.commit(req, tokens)
    cache.free(req)
    return hit

def prompt(seed):
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(6 * 16 + 1)]

os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
torch.set_num_threads(2)  # as vLLM's CPU worker sets its own
if torch.cuda.is_available():  # a GPU engine has its CUDA context (and its threads) first
    torch.zeros(1, device="cuda")
before = engine()
layout = {"num_layers": 2, "block_size": 16, "num_kv_heads": 4, "head_dim": 64,
          "dtype": "float32"}  # 64 KiB a block
tiers = {"gpu": {"num_blocks": 8, "device": "cpu"}, "cpu": {"capacity": "512KiB"},
         "disk": {"path": os.environ["DISK"], "capacity": "8MiB", "chunk_blocks": 4}}
config = {"layout": layout, "tiers": tiers, "transfer": {"io_threads": 1}}
cache = TieredCache(parse_config(config))
serve(cache, "a", prompt(0))
for seed in range(1, 5):
    serve(cache, f"filler{seed}", prompt(seed))
cache.flush()
assert serve(cache, "again", prompt(0)).tokens_per_tier()["disk"] > 0
for pool in (cache.transfer, cache.spill._writers, cache.spill._encoder):
    pool.submit(lambda: None).result()  # its thread is set up: it has run a task
cache.host.wait_filled()  # the host pool's fill thread too
during = threads()
cache.close()
print(json.dumps({"before": before, "during": during, "after": engine()}))
"""

# kvtier's threads in that cache: I/O worker, spill writer, encoder, the transfer
# engine's and the chunk codec's copiers, and the host pool's fill where the slab is
# pageable (with CUDA it is pinned, and pinning populates it).
KVTIER_THREADS = sorted(
    ["kvtier-codec", "kvtier-copy", "kvtier-encode_0", "kvtier-io_0", "kvtier-spill_0"]
    + ([] if torch.cuda.is_available() else ["kvtier-fill"])
)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    disk = tmp_path_factory.mktemp("threads") / "lmdb"
    env = {
        **os.environ,
        "DISK": str(disk),
        "OMP_PROC_BIND": "close",
        "OMP_PLACES": "threads",
    }
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return json.loads(out)


def kvtiers_threads(run: dict) -> list[list]:
    """``[comm, cpus]`` of each thread that appeared while the cache was open."""
    before = run["before"]["threads"]
    return [thread for tid, thread in run["during"].items() if tid not in before]


@pytest.mark.skipif(
    hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs to tell a bound thread from a free one",
)
def test_kvtiers_threads_are_not_bound_to_the_core_of_the_thread_that_started_them(run):
    main = run["before"]["main_cpus"]
    # nor bound by OpenMP: under OMP_PROC_BIND a thread that starts a team is bound to a CPU
    assert all(cpus != main for _, cpus in kvtiers_threads(run)), run


def test_kvtiers_threads_are_named_kvtier_at_the_os_level(run):
    assert all(comm.startswith("kvtier-") for comm, _ in kvtiers_threads(run)), run


def test_torch_ops_on_kvtiers_threads_start_no_threads(run):
    # A thread takes the OS name of the one that starts it: an OpenMP team started by
    # one of kvtier's threads would repeat its name.
    assert sorted(comm for comm, _ in kvtiers_threads(run)) == KVTIER_THREADS, run


def test_the_engines_threads_their_number_binding_and_torchs_thread_counts_are_unchanged(run):
    before, after = run["before"], run["after"]
    engine = before["threads"]
    assert {tid: run["during"].get(tid) for tid in engine} == engine
    # kvtier's threads are joined on close; one may not have left /proc yet
    assert {t: v for t, v in after["threads"].items() if not v[0].startswith("kvtier-")} == engine
    assert after["main_cpus"] == before["main_cpus"]
    assert after["torch_threads"] == before["torch_threads"]
