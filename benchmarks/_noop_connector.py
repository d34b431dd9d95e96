"""A vLLM KV connector that does nothing: every hook returns at once, nothing is found,
loaded or saved. ``bench_vllm_serve.py`` starts vLLM with it to tell what having any
connector configured costs the engine from what kvtier's own work costs.

Loaded by vLLM as ``kv_connector_module_path`` (``_noop_connector``, with this
directory on ``PYTHONPATH``), ``kv_connector`` ``NoOpConnector``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NoOpConnector(KVConnectorBase_V1):
    """Every hook of vLLM's connector interface, doing nothing."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
