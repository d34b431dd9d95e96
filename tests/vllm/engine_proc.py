"""One vLLM engine in its own process, for the end-to-end tests (run as a script).

    python tests/vllm/engine_proc.py SPEC.json OUT.json

SPEC: ``model`` (a directory), ``prompts`` (lists of token ids, generated one after the
other, greedy), ``max_tokens``, ``kvtier`` (a kvtier config document; absent: no
connector), ``reset_between`` (drop vLLM's own prefix cache between prompts, so hits
can only come from kvtier). OUT: per prompt the output token ids and vLLM's
``num_cached_tokens``; with the connector also its ``load_errors`` (blocks reported
failed) and kvtier's per-tier stats after every write has landed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

BLOCK_SIZE = 32


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    transfer = None
    if spec.get("kvtier") is not None:
        transfer = KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"kvtier": spec["kvtier"]},
        )
    llm = LLM(
        model=spec["model"],
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        dtype="bfloat16",
        enforce_eager=True,
        seed=0,
        kv_transfer_config=transfer,
    )
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0)
    results = []
    for prompt in spec["prompts"]:
        if spec.get("reset_between"):
            assert llm.reset_prefix_cache()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        results.append(
            {"tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens}
        )
    report: dict = {"results": results}
    if transfer is not None:
        connector = get_kv_transfer_group()
        connector.cache.flush()
        report["load_errors"] = connector.num_load_errors
        stats = connector.cache.stats()
        report["tiers"] = {
            name: {k: v for k, v in dataclasses.asdict(s).items() if isinstance(v, int)}
            for name, s in stats.tiers.items()
        }
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
