"""One vLLM engine serving token-id prompts, with or without kvtier's connector.

``examples/vllm_offline.py`` and ``kvtier demo --engine vllm`` drive vLLM's offline
``LLM`` through this module:

    report = run_engine(EngineSpec(model_dir, prompts=[...], kvtier={...}), workdir)

Every engine runs in a process of its own (``python -m kvtier.integrations.vllm_engine
SPEC.json OUT.json``), with vLLM's defaults: its engine core and worker are processes
of their own too. vLLM keeps process-wide state, and two engines that share nothing
but a disk or Redis tier is exactly what a second process shows.

Per request the report gives the output tokens (greedy), vLLM's ``num_cached_tokens``
(its own prefix cache plus what the connector loaded), the time to first token as
vLLM measured it, and the prompt tokens each source supplied (vLLM's counters:
``vllm`` for its own cache, kvtier's ``cpu`` / ``disk`` / ``redis``); with the
connector also kvtier's per-tier counters, as vLLM's metrics carry them.

No model hub: ``save_model`` writes a seeded random model and a word-level tokenizer
(token ``i`` is the word ``w<i>``) to a directory vLLM loads like any checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from kvtier.workloads import Chat, ChatShape

BLOCK_SIZE = 32  # tokens per vLLM block (on CPU a multiple of 32)


def save_model(
    path: str | Path, config: PretrainedConfig, dtype: str = "bfloat16", seed: int = 0
) -> str:
    """Write a causal LM of ``config`` (a Llama, a Gemma 3, ...: its model type picks
    the class) with seeded random weights, and a word-level tokenizer over its
    vocabulary, to ``path``; returns ``path`` as a string."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    vocab = {f"w{i}": i for i in range(config.vocab_size)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="w0", bos_token="w1", eos_token="w2"
    )
    tokenizer.save_pretrained(path)
    return str(path)


@dataclass
class EngineSpec:
    """What one engine process does: ``prompts`` one after the other, or a ``chat``
    (conversations taking turns, each turn's prompt the conversation so far plus a new
    message, the engine's own reply joining it). ``kvtier`` is a kvtier config document
    (None: no connector). ``reset_between`` drops vLLM's own prefix cache before every
    request, so that a hit can only come from kvtier."""

    model: str
    prompts: list[list[int]] = field(default_factory=list)
    chat: ChatShape | None = None
    max_tokens: int = 8
    kvtier: dict[str, Any] | None = None
    reset_between: bool = False
    dtype: str = "bfloat16"
    max_model_len: int | None = None  # None: the model's own
    num_blocks: int | None = None  # vLLM's own KV blocks (None: as many as fit)
    seed: int = 0
    mamba_ssm_cache_dtype: str = "auto"  # vLLM's --mamba-ssm-cache-dtype


@dataclass
class RequestReport:
    """One request as the engine served it."""

    prompt_tokens: int
    tokens: list[int]
    num_cached_tokens: int
    ttft: float
    tokens_per_tier: dict[str, int] = field(default_factory=dict)  # not computed, by source


@dataclass
class EngineReport:
    """Every request, and with the connector kvtier's counters at the end, summed over
    its workers: ``tiers[tier][counter]`` and ``load_errors`` (blocks vLLM recomputed)."""

    requests: list[RequestReport]
    load_errors: int = 0
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    # vLLM kept its hybrid KV cache manager on (a connector that does not support it
    # turns it off, and a model with several kinds of attention layer is then cached as
    # one group of full attention).
    hybrid_kv_cache_manager: bool = False


def run_engine(spec: EngineSpec, workdir: str | Path, timeout: float = 600) -> EngineReport:
    """Run ``spec`` in a new process and return its report; ``RuntimeError`` with the
    end of the engine's stderr when it fails."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(suffix=".json", prefix="engine-spec-", dir=workdir)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(spec), f)
    spec_path, out_path = Path(name), Path(name.replace("engine-spec-", "engine-out-"))
    # vLLM's default sha256 block hashes are stable anyway; a pinned seed keeps any
    # Python-hash-dependent choice equal across the processes being compared.
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", __name__, str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM engine failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    data = json.loads(out_path.read_text())
    data["requests"] = [RequestReport(**r) for r in data["requests"]]
    return EngineReport(**data)


# vLLM's sources of cached prompt tokens, as kvtier's demo names them.
SOURCES = {"device": "vllm", "host": "cpu", "disk": "disk", "external_unspecified": "redis"}


def _serve(spec: EngineSpec) -> EngineReport:
    """Run ``spec`` in this process (the engine process's body)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if spec.kvtier is not None:
        transfer = KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"kvtier": spec.kvtier},
        )
    llm = LLM(
        model=spec.model,
        block_size=BLOCK_SIZE,
        max_model_len=spec.max_model_len,
        num_gpu_blocks_override=spec.num_blocks,
        dtype=spec.dtype,
        enforce_eager=True,
        seed=spec.seed,
        kv_transfer_config=transfer,
        disable_log_stats=False,  # per-request metrics: the time to first token
        mamba_ssm_cache_dtype=spec.mamba_ssm_cache_dtype,
    )
    params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0)
    scheduler_config = llm.llm_engine.vllm_config.scheduler_config
    report = EngineReport(
        [], hybrid_kv_cache_manager=not scheduler_config.disable_hybrid_kv_cache_manager
    )

    def serve(prompt: list[int]) -> list[int]:
        if spec.reset_between:
            assert llm.reset_prefix_cache()
        before = _cached_by_source(llm)
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        after = _cached_by_source(llm)
        tokens = list(out.outputs[0].token_ids)
        report.requests.append(
            RequestReport(
                len(prompt),
                tokens,
                out.num_cached_tokens,
                out.metrics.first_token_latency,
                {t: n - before.get(t, 0) for t, n in after.items() if n > before.get(t, 0)},
            )
        )
        return tokens

    for prompt in spec.prompts:
        serve(prompt)
    if spec.chat is not None:
        chat = Chat(spec.chat, llm.llm_engine.model_config.get_vocab_size(), spec.seed)
        for conv, _, prompt in chat.requests():
            chat.reply(conv, prompt, serve(prompt))
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:kvtier_")
        if name == m.name or not m.value:
            continue
        if "tier" in m.labels:
            report.tiers.setdefault(m.labels["tier"], {})[name] = int(m.value)
        elif name == "load_error_blocks":
            report.load_errors = int(m.value)
    return report


def _cached_by_source(llm: Any) -> dict[str, int]:
    """Prompt tokens not computed so far, by source (named as in ``SOURCES``)."""
    return {
        SOURCES.get(m.labels["source"], m.labels["source"]): int(m.value)
        for m in llm.get_metrics()
        if m.name == "vllm:prompt_tokens_cached_by_source"
    }


def main(spec_path: str, out_path: str) -> None:
    data = json.loads(Path(spec_path).read_text())
    if data.get("chat") is not None:
        data["chat"] = ChatShape(**data["chat"])
    report = _serve(EngineSpec(**data))
    Path(out_path).write_text(json.dumps(asdict(report)))


if __name__ == "__main__":
    main(*sys.argv[1:])
