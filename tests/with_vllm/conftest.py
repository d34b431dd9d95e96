"""Fixtures of the vLLM end-to-end tests: a tiny random Llama saved for vLLM.

No model hub: ``save_model`` writes the model from a fixed seed with a word-level
tokenizer; prompts are token ids. Every engine runs in its own process
(``kvtier.integrations.vllm_engine.run_engine``), so a test can start a second engine
that shares only a disk or Redis tier with the first.
"""

from __future__ import annotations

import pytest

VOCAB = 512


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer random Llama (2 KV heads of 32: 16 KiB per 32-token block in bf16)."""
    pytest.importorskip("vllm")
    from transformers import LlamaConfig

    from kvtier.integrations.vllm_engine import save_model

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
    )
    return save_model(tmp_path_factory.mktemp("tiny-llama"), config, "bfloat16")
