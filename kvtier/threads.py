"""Where kvtier's own threads run: on any CPU the process may use.

A thread starts with the CPU affinity of the thread that starts it, and engines bind
their compute threads to cores (vLLM's CPU workers bind each worker's to its own). kvtier's
threads (I/O workers, spill writers, the encoder, the C copiers) move bytes and wait on
I/O; left on the engine thread's core they would take turns with it on that one core,
while the process may have others (measured under vLLM's CPU worker: a 16 MiB Redis read
took 30 ms on the worker's core, 5 ms unbound). So each one, as it starts, allows itself
every CPU; the kernel keeps it within what the process's cpuset allows.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress


def run_anywhere() -> None:
    """Let the calling thread run on any CPU the process's cpuset allows (Linux)."""
    if hasattr(os, "sched_setaffinity"):
        with suppress(OSError):
            os.sched_setaffinity(0, range(os.cpu_count() or 1))


def thread_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """``workers`` threads named ``name-<i>``, each free to run on any CPU."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=run_anywhere)
