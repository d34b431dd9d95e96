"""``kvtier demo --engine vllm``: the demo's multi-turn chat served by vLLM with kvtier.

The same workload as ``kvtier.demo`` (conversations sharing a system prompt, taking
turns, the model's greedy replies joining the context) on the same random-weight
Llama, served by vLLM twice, each in a process of its own: alone, and with kvtier's
connector. vLLM's own KV pool is kept small (``VLLM_BLOCKS`` blocks), as on a busy
server, so that by the time a conversation comes back vLLM has evicted much of it;
what vLLM still holds counts as the ``vllm`` tier, what the connector loads as
kvtier's ``cpu`` / ``disk`` / ``redis``. Each turn's TTFT is compared with vLLM
alone, and every reply must be the same.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml

from kvtier.demo import DEMO_MODEL, DemoResult, Turn, print_report, write_json
from kvtier.integrations.vllm_engine import BLOCK_SIZE, EngineSpec, run_engine, save_model
from kvtier.plot import plot_demo
from kvtier.workloads import ChatShape

VLLM_BLOCKS = 160  # vLLM's own KV pool: 5120 tokens, two conversations at the end
MAX_MODEL_LEN = 4096  # the chat's longest prompt and reply fit (6 turns: 2624 tokens)
DTYPE = "float32"


def default_tiers(scratch: Path) -> dict[str, Any]:
    """A host pool of 128 vLLM blocks (32 MiB) over LMDB in ``scratch``: no server."""
    return {
        "tiers": {
            "cpu": {"capacity": "32MiB"},
            "disk": {"path": str(scratch / "lmdb"), "capacity": "1GiB", "chunk_blocks": 4},
        }
    }


def run(
    config_path: str | None,
    shape: ChatShape,
    json_out: str | None = None,
    plot_out: str | None = None,
) -> int:
    """The whole demo through vLLM; 0 when every reply equals vLLM alone's, 1 otherwise.
    ``config_path``: a kvtier YAML for the connector (default: ``default_tiers``)."""
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-demo-") as tmp:
        scratch = Path(tmp)
        kvtier = default_tiers(scratch)
        if config_path is not None:
            kvtier = yaml.safe_load(Path(config_path).read_text())
        model = save_model(scratch / "model", DEMO_MODEL, DTYPE)
        print(
            f"kvtier demo (vLLM): {shape.conversations} conversations x {shape.turns} turns; "
            f"vLLM's own pool {VLLM_BLOCKS} blocks of {BLOCK_SIZE} tokens; kvtier tiers "
            f"{', '.join(kvtier['tiers'])}; running vLLM alone, then with kvtier"
        )
        alone, cached = (
            run_engine(
                EngineSpec(
                    model,
                    chat=shape,
                    max_tokens=shape.reply_tokens,
                    kvtier=tiers,
                    dtype=DTYPE,
                    num_blocks=VLLM_BLOCKS,
                    max_model_len=MAX_MODEL_LEN,
                ),
                scratch,
            )
            for tiers in (None, kvtier)
        )
    names = ["vllm", *(t for t in ("cpu", "disk", "redis") if t in kvtier["tiers"])]
    result = DemoResult(f"vllm:{DEMO_MODEL.model_type}-demo", names, baseline="vLLM alone")
    order = [(t, c) for t in range(shape.turns) for c in range(shape.conversations)]
    for (turn, conv), ours, theirs in zip(order, cached.requests, alone.requests, strict=True):
        per_tier = ours.tokens_per_tier
        result.turns.append(
            Turn(
                conv,
                turn,
                ours.prompt_tokens,
                per_tier,
                ours.prompt_tokens - ours.num_cached_tokens,
                ours.ttft,
                theirs.ttft,
                ours.tokens == theirs.tokens,
            )
        )
    result.bytes_moved = {
        t: {"in": s.get("bytes_in", 0), "out": s.get("bytes_out", 0)}
        for t, s in cached.tiers.items()
        if t in names
    }
    print_report(result)
    if cached.load_errors:
        print(f"blocks that failed to load (recomputed by vLLM): {cached.load_errors}")
    if json_out:
        write_json(result, json_out)
    if plot_out:
        plot_demo(result, plot_out)
    return 0 if result.all_equal else 1
