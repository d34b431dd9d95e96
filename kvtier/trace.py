"""Timelines of hits: where the time of each load goes, across an engine's processes.

With ``metrics.trace_path`` set, every process of a cache (under vLLM the scheduler's
and each worker's; in native mode the engine's one) appends a JSON line to that file
for each step of each hit::

    {"t": 1764067200.123456, "pid": 4242, "event": "lookup", "req": "cmpl-1", ...}

``t`` is wall-clock seconds, so that lines from different processes on one machine
fall on one timeline. Each line is a single ``write`` to a file opened for appending:
lines of different processes and threads never interleave. A trace never fails a
request: a write that fails is skipped.

Events, with their fields besides ``t``, ``pid``, ``event`` and ``req``:

- ``lookup`` (scheduler, or the engine in native mode): ``seconds`` it took and the
  hit's ``blocks`` per tier; ``t`` is when it started.
- ``load_planned`` (scheduler): the hit was pinned to engine blocks; ``asynchronous``.
- ``load`` (the process that loaded, once it is settled): ``shard``, ``blocks``,
  ``valid`` (leading blocks that loaded), and the time of each step it went through:
  ``pinned``, ``run`` (an I/O worker took it; spill loads only), ``read`` (the spill
  tiers' values are read, checked and in host slots), ``copied`` (in the engine's KV),
  with ``read_seconds`` per tier (the tiers' own get calls).
- ``stage_planned`` (scheduler): a waiting request's spill-tier hit is to be read into
  the host pools ahead of its load (connector mode); ``blocks``.
- ``stage`` (worker, once settled): as ``load``, for a stage (no engine blocks, so
  nothing is copied up): its blocks are in the host pool from ``read`` on.
- ``lookup`` with ``waiting``: the scheduler asked the engine to come back once the
  request's stage is over (no lookup was made).
- ``load_reported`` (worker): the engine was told the async load is over.
- ``load_over`` (scheduler): every worker has reported it.
- ``compute`` (scheduler): the engine computes the request's first tokens after its
  load (``tokens`` of them this step).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class LoadTimes:
    """Wall-clock times of one load's steps (see ``load`` above); None: not reached."""

    pinned: float = field(default_factory=time.time)
    run: float | None = None
    read: float | None = None
    copied: float | None = None


class Trace:
    """The trace file at ``path`` (``$VARS`` and ``~`` expanded), open for appending; with
    ``path`` None, nothing: ``event`` returns at once and the trace is false."""

    def __init__(self, path: str | None) -> None:
        self._fd: int | None = None
        if path is not None:
            path = os.path.expanduser(os.path.expandvars(path))
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __bool__(self) -> bool:
        return self._fd is not None

    def event(self, event: str, req: object, t: float | None = None, **fields: Any) -> None:
        """Append one line: ``event`` of request ``req`` at ``t`` (now if None)."""
        if self._fd is None:
            return
        record = {"t": time.time() if t is None else t, "pid": os.getpid(), "event": event}
        line = json.dumps({**record, "req": str(req), **fields}) + "\n"
        with suppress(OSError):  # a full disk, a closed file: the trace is best effort
            os.write(self._fd, line.encode())

    def load(
        self,
        req: object,
        shard: str,
        blocks: dict[str, int],
        valid: int,
        times: LoadTimes,
        read_seconds: dict[str, float],
        event: str = "load",
    ) -> None:
        """The ``load`` (or ``stage``) event of a settled load; a copy not seen end
        (queued on a stream or the copier) counts as copied now."""
        self.event(
            event,
            req,
            shard=shard,
            blocks=blocks,
            valid=valid,
            pinned=times.pinned,
            run=times.run,
            read=times.read,
            copied=times.copied or time.time(),
            read_seconds=read_seconds,
        )

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event in the trace file at ``path``, in time order."""
    with open(path) as f:
        events = [json.loads(line) for line in f if line.strip()]
    return sorted(events, key=lambda e: e["t"])


def phases(events: list[dict[str, Any]], sent: float, first_token: float) -> dict[str, float]:
    """Where the time to first token of one request went, in seconds, from its trace
    ``events`` (one request's, any process's) and the client's wall-clock times of
    sending it and of receiving its first token. The phases tile that time:

    - ``to lookup``: the engine's intake (HTTP, tokenizing, queueing) until the lookup;
    - ``lookup``;
    - ``to load``: the scheduler's step and its metadata reaching the worker(s);
    - ``I/O queue``, ``tier read`` (the tiers' get calls), ``checks + scatter`` (values
      checked and copied into host slots) and ``copy up`` (into the engine's KV): the
      slowest shard's;
    - ``to engine``: an async load's end until every worker has reported it;
    - ``to compute``: until the engine schedules the request's compute;
    - ``compute``: the engine's forward of the rest of the prompt, until the first token.
    """
    by = {}
    for e in events:
        by.setdefault(e["event"], []).append(e)
    lookup = by["lookup"][-1]
    looked = lookup["t"] + lookup["seconds"]
    loads = by.get("load", [])
    out = {"to lookup": lookup["t"] - sent, "lookup": lookup["seconds"]}
    if not loads:  # a miss: the engine computed the whole prompt
        out["compute"] = first_token - looked
        return out
    out["to load"] = min(e["pinned"] for e in loads) - looked
    spill = [e for e in loads if e["run"] is not None]
    if spill:
        reads = [sum(e["read_seconds"].values()) for e in spill]
        out["I/O queue"] = max(e["run"] - e["pinned"] for e in spill)
        out["tier read"] = max(reads)
        out["checks + scatter"] = max(e["read"] - e["run"] - r for e, r in zip(spill, reads))
    out["copy up"] = max(e["copied"] - (e["read"] or e["pinned"]) for e in loads)
    loaded = max(e["copied"] for e in loads)
    if "load_over" in by:  # asynchronous: the engine learns of it, then schedules it
        told = by["load_over"][0]["t"]
        scheduled = by["compute"][0]["t"]
        out["to engine"] = told - loaded
        out["to compute"] = scheduled - told
        out["compute"] = first_token - scheduled
    else:  # loaded within the step that computes the rest
        out["compute"] = first_token - loaded
    return out
