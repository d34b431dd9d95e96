"""A per-node circuit breaker: skip a remote node that timed out, for a growing while.

A hung server accepts connections and never answers, so every call to it costs a
full socket timeout. After a timeout the node is *open*: calls that need it are
skipped (the caller turns that into a fast, counted miss) for a back-off of ``base``
seconds, doubling with each further timeout up to ``cap``. When the back-off has
passed, exactly one call is let through as the probe (the others are still skipped
until it ends); a node that answers, or fails fast (connection refused), is closed
again at once. So a node costs at most one timeout per back-off period, whatever the
number of calls or threads, and recovery needs no restart.

Only timeouts open a node: a refused connection costs nothing, and retrying it on
every call is what makes a restarted server usable at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["CircuitBreaker"]


@dataclass
class _Open:
    """A node that timed out: consecutive timeouts, when to probe, the last timeout,
    a probe under way."""

    timeouts: int
    retry_at: float
    cause: BaseException
    probing: bool = False


class CircuitBreaker:
    """Which nodes to skip after a timeout (see the module docstring). Thread-safe."""

    def __init__(
        self, base: float = 1.0, cap: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not 0 < base <= cap:
            raise ValueError(f"expected 0 < base <= cap, got base={base!r}, cap={cap!r}")
        self.base = base
        self.cap = cap
        self._clock = clock
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()

    def blocked(self, nodes: Iterable[str]) -> str | None:
        """The first of ``nodes`` to skip now, or None: then the call may go ahead, and
        it is the probe of every node in ``nodes`` whose back-off has passed (it must
        report each of them to ``answered`` or ``timed_out``)."""
        if not self._open:  # the common case, no lock
            return None
        with self._lock:
            now = self._clock()
            due = []
            for node in nodes:
                state = self._open.get(node)
                if state is None:
                    continue
                if state.probing or now < state.retry_at:
                    return node
                due.append(state)
            for state in due:
                state.probing = True
            return None

    def answered(self, node: str) -> None:
        """``node`` answered (or failed fast): close it."""
        if self._open:
            with self._lock:
                self._open.pop(node, None)

    def timed_out(self, node: str, cause: BaseException) -> float:
        """``node`` timed out with ``cause``: open it (again) and return its back-off in
        seconds."""
        with self._lock:
            state = self._open.get(node)
            timeouts = 1 if state is None else state.timeouts + 1
            backoff = min(self.cap, self.base * 2 ** (timeouts - 1))
            self._open[node] = _Open(timeouts, self._clock() + backoff, cause)
            return backoff

    def cause(self, node: str) -> BaseException | None:
        """The timeout that opened ``node``; None if it is closed."""
        with self._lock:
            state = self._open.get(node)
            return None if state is None else state.cause

    def open_nodes(self) -> list[str]:
        """The nodes open now (skipped, or waiting for their probe)."""
        with self._lock:
            return sorted(self._open)
