"""kvtier's own threads run on any CPU the process may use, not only the core of the
thread that started them (an engine's compute thread may be bound to one)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and at least two CPUs to tell a bound thread from a free one",
)

# Bound to one CPU, as vLLM binds a CPU worker's main thread, then starts kvtier's
# threads (I/O workers, spill writers, encoder, both C copiers: the only threads here)
# and prints the CPUs each of the process's threads may run on, main thread first.
PROGRAM = """
import os, torch
from kvtier.cache import TieredCache
from kvtier.config import parse_config
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
layout = {"num_layers": 1, "block_size": 4, "num_kv_heads": 1, "head_dim": 4}
tiers = {"gpu": {"num_blocks": 4, "device": "cpu"}, "cpu": {"capacity": 4096},
         "disk": {"path": os.environ["DISK"], "capacity": "1MiB", "chunk_blocks": 1}}
cache = TieredCache(parse_config({"layout": layout, "tiers": tiers}))
cache.transfer.submit(lambda: None).result()
cache.spill._writers.submit(lambda: None).result()
cache.spill._encoder.submit(lambda: None).result()
for task in sorted(os.listdir("/proc/self/task"), key=int):
    with open(f"/proc/self/task/{task}/status") as f:
        cpus = next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list"))
    with open(f"/proc/self/task/{task}/comm") as f:
        print(f.read().strip(), cpus)
cache.close()
"""


def test_kvtiers_threads_are_not_bound_to_the_core_of_the_thread_that_started_them(tmp_path):
    env = {**os.environ, "DISK": str(tmp_path / "lmdb"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, check=True
    ).stdout
    (_, main), *others = [line.rsplit(" ", 1) for line in out.splitlines()]
    # I/O worker(s), spill writer, encoder, the transfer engine's and the codec's copiers
    assert len(others) >= 5, out
    assert all(cpus != main for _, cpus in others), out
