"""``KVTierConnector`` with every other call of each of kvtier's steps raising.

Loaded by vLLM as the connector module (``kv_connector_module_path``) in each of its
processes; importing it patches kvtier's scheduler index and worker cache there. Used
by ``test_vllm_server.py`` to show that no failure inside kvtier reaches the engine.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

from kvtier.connector import ConnectorCache, ConnectorIndex
from kvtier.integrations.vllm import KVTierConnector

__all__ = ["KVTierConnector"]

STEPS = {
    ConnectorIndex: ("lookup", "apply"),
    ConnectorCache: ("pin", "load", "save", "finished_loads", "take_report"),
}


class InjectedFault(RuntimeError):
    pass


def _every_other_call_raises(method: Callable) -> Callable:
    calls = itertools.count()

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if next(calls) % 2:
            raise InjectedFault(f"{method.__qualname__}: injected")
        return method(*args, **kwargs)

    return wrapper


for cls, names in STEPS.items():
    for name in names:
        setattr(cls, name, _every_other_call_raises(getattr(cls, name)))
