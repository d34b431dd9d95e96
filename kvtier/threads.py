"""kvtier's own threads: named ``kvtier-...`` at the OS level, free to run on any CPU,
running torch ops on themselves alone; the engine's threads are left as they are.

Every thread kvtier starts (I/O workers ``kvtier-io_<i>``, the vLLM connector's stager
``kvtier-stage_0``, spill writers ``kvtier-spill_<i>``, the encoder ``kvtier-encode_0``,
the C copiers ``kvtier-copy`` and ``kvtier-codec``, a pageable host pool's
``kvtier-fill``, the metrics server's ``kvtier-prom_0``, ``process_cpus``'s short-lived
``kvtier-cpus``) sets itself up as it starts (``init_thread``; the C threads in C, the
metrics server's threads inherit it):

- Its OS name (Linux comm, seen in ``top -H`` and ``/proc/<pid>/task/*/comm``) starts
  with ``kvtier-``; Python's thread names are not OS names.
- It allows itself every CPU the process's cpuset allows. A thread starts with the
  affinity of the thread that starts it, and engines bind their compute threads to
  cores (vLLM's CPU workers bind each worker's to its own). kvtier's threads move bytes
  and wait on I/O; left on the engine thread's core they would take turns with it on
  that one core while the process may have others (measured under vLLM's CPU worker: a
  16 MiB Redis read took 30 ms on the worker's core, 5 ms unbound).
- A torch op on it runs on it alone. Under OpenMP a thread that runs a parallel op
  (a copy of a few blocks is one) starts a team of its own, as large as its own OpenMP
  thread count, which torch sets to the process's intra-op count on the thread's first
  op: threads added to the engine's, bound under ``OMP_PROC_BIND`` to the engine's
  CPUs along with the kvtier thread itself. So it sets its own count (a per-thread
  setting) to 1, never torch's process-wide one (``torch.set_num_threads``). The C
  copiers and the metrics server run no torch op.
- Background work that no request waits for (``kvtier-fill``: a host pool faulting in
  its slots ahead of use, ``host_pool.py``) runs at idle priority, Linux's
  ``SCHED_IDLE`` (nice 19 where that is refused), set on that thread alone, so it runs
  only on CPU time the engine leaves. Such a thread must never wait for the GIL (one
  that does makes the engine's thread wait until it is scheduled), so it is a C
  thread.

kvtier never changes the engine's threads, their number, their CPU binding or torch's
thread counts (``tests/test_threads.py``).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress

import torch

_PR_SET_NAME = 15  # <linux/prctl.h>
_process = ctypes.CDLL(None)  # the symbols loaded globally: libc, torch's OpenMP runtime


def init_thread(name: str) -> None:
    """Set up the calling thread, just started by kvtier, as the module docstring says:
    OS name ``name`` (its first 15 bytes), any CPU, torch ops on it alone."""
    if sys.platform == "linux":
        _process.prctl(_PR_SET_NAME, name.encode()[:15])
    if hasattr(os, "sched_setaffinity"):
        with suppress(OSError):
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
    omp_set_num_threads = getattr(_process, "omp_set_num_threads", None)
    if omp_set_num_threads is not None:  # torch runs its parallel ops with OpenMP
        torch.get_num_threads()  # torch's per-thread setup, now: on the first op it sets the count
        omp_set_num_threads(1)


def thread_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """``workers`` kvtier threads named ``name_<i>`` (Python and OS names)."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=_init_pool_thread)


def _init_pool_thread() -> None:
    init_thread(threading.current_thread().name)


def process_cpus() -> set[int]:
    """The CPUs the process's cpuset allows, whatever the calling thread is bound to
    (asked by a short-lived kvtier thread that allows itself all of them; Linux)."""
    cpus: list[set[int]] = []

    def ask() -> None:
        init_thread("kvtier-cpus")
        cpus.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=ask, name="kvtier-cpus")
    thread.start()
    thread.join()
    return cpus[0]
