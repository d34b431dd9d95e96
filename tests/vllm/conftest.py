"""Fixtures of the vLLM end-to-end tests: a tiny random Llama, and engines in subprocesses.

No model hub: the model is built with ``transformers`` from a fixed seed and saved with
a word-level tokenizer built with ``tokenizers``; prompts are token ids. Every engine
runs in its own process (``engine_proc.py``), so a test can start a second engine that
shares only a disk or Redis tier with the first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENGINE = Path(__file__).with_name("engine_proc.py")
VOCAB = 512


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer random Llama (2 KV heads of 32: 16 KiB per 32-token block in bf16)."""
    pytest.importorskip("vllm")
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="w0", bos_token="w1", eos_token="w2"
    ).save_pretrained(path)
    return str(path)


def run_engine(tmp_path: Path, name: str, spec: dict) -> dict:
    """Run one engine process on ``spec`` (see engine_proc.py) and return its report."""
    spec_path, out_path = tmp_path / f"{name}.spec.json", tmp_path / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        [sys.executable, str(ENGINE), str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    if proc.returncode != 0:
        raise AssertionError(f"engine {name} failed:\n{proc.stderr[-6000:]}")
    return json.loads(out_path.read_text())
