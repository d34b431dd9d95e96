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


def gemma3_config(layer_types: list[str]):
    """A tiny random Gemma 3 text model: sliding windows of 64 tokens (2 blocks) beside
    full attention, one layer each of ``layer_types``."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=64,
        layer_types=layer_types,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Gemma 3 with three sliding-window layers before a full-attention one (as the real
    ones interleave them): four KV cache groups under vLLM's hybrid KV cache manager."""
    pytest.importorskip("vllm")
    from kvtier.integrations.vllm_engine import save_model

    layers = ["sliding_attention"] * 3 + ["full_attention"]
    return save_model(tmp_path_factory.mktemp("tiny-gemma3"), gemma3_config(layers))


@pytest.fixture(scope="session")
def tiny_qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen3-Next: three gated-delta-net (linear attention) layers before a
    full-attention one, MoE (vLLM's Qwen3-Next needs one), linear heads 128 wide."""
    pytest.importorskip("vllm")
    from transformers import Qwen3NextConfig

    from kvtier.integrations.vllm_engine import save_model

    config = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    return save_model(tmp_path_factory.mktemp("tiny-qwen3-next"), config)
