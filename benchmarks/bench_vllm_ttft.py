"""Time to first token in vLLM of a long shared-prefix prompt: recompute vs a kvtier hit.

The model is kvtier's demo Llama (4 layers, hidden 512, 8 heads, 4 KV heads, float32;
random weights, no download), whose prefill of a few thousand tokens is clearly
measurable on a CPU. Every prompt is one long shared prefix plus a short question of
its own. Cases, TTFT as vLLM measures it (``RequestOutput.metrics``), ms:

- ``recompute N-token prompt``: vLLM without the connector, its own prefix cache
  dropped before each prompt: the whole prompt is computed. This is the ceiling the
  other cases are compared with (ratio = TTFT with kvtier / TTFT recomputing).
- ``host hit N-token prompt``: vLLM with the connector over a host pool that holds the
  prefix; vLLM's prefix cache is dropped before each prompt, so the prefix comes from
  kvtier's host memory.
- ``disk hit N-token prompt``: a writer engine stores the prefix on an LMDB disk tier;
  then each repetition is a new engine process that finds it there (its first request
  after a warm-up), as a restarted server would.
- ``redis hit N-token prompt``: the same through the real Redis at
  ``KVTIER_BENCH_REDIS`` (default redis://127.0.0.1:6379/0), under a key prefix of its
  own that is deleted afterwards; skipped when no server answers.

Every engine runs in its own process (``kvtier.integrations.vllm_engine``) and serves
a short unrelated warm-up prompt first. Each timed request is checked: its prefix
must have come from the tier the case names, and its output must equal the
recompute's (greedy), or the script fails.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from _report import Result, machine_info, print_table, standard_args, summarize, write_json

from kvtier.demo import DEMO_MODEL
from kvtier.integrations.vllm_engine import (
    BLOCK_SIZE,
    EngineReport,
    EngineSpec,
    RequestReport,
    run_engine,
    save_model,
)
from kvtier.progress import progress

BENCHMARK = "bench_vllm_ttft"
QUESTION_TOKENS = 24
DTYPE = "float32"  # bf16 matmuls are several times slower on CPUs without AMX
WARMUP = list(range(3, 3 + 4 * BLOCK_SIZE))  # shares no block with the prompts


def prompts(prefix_tokens: int, count: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts: one shared prefix, then a question each."""
    rng = random.Random(seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(200, DEMO_MODEL.vocab_size) for _ in range(n)]

    prefix = text(prefix_tokens)
    return [prefix + text(QUESTION_TOKENS) for _ in range(count)]


def timed(report: EngineReport, first: int = 1) -> list[RequestReport]:
    """The requests after the warm-up (and after the first ``first - 1`` prompts)."""
    return report.requests[first:]


def check(
    case: str, served: list[RequestReport], tier: str | None, expected: list[list[int]]
) -> None:
    """Fail unless every request's prefix came from ``tier`` (90% of the prompt at least:
    a write-through tier holds whole chunks only) and its output is the recompute's."""
    for r, tokens in zip(served, expected, strict=True):
        from_tier = r.blocks_per_tier.get(tier, 0) * BLOCK_SIZE if tier else 0
        if tier and from_tier < 0.9 * r.prompt_tokens:
            raise SystemExit(f"{case}: the prefix did not come from {tier}: {r}")
        if r.tokens != tokens:
            raise SystemExit(f"{case}: output {r.tokens} differs from recompute's {tokens}")


def main() -> int:
    parser = standard_args(__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, help="default 4096 (2048 with --quick)")
    parser.add_argument("--repeats", type=int, help="timed prompts per case (default 3; 1 quick)")
    args = parser.parse_args()
    n_tokens = args.prompt_tokens or (2048 if args.quick else 4096)
    repeats = args.repeats or (1 if args.quick else 3)
    prefix = n_tokens - QUESTION_TOKENS
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    model = save_model(work / "model", DEMO_MODEL, DTYPE)
    asked = prompts(prefix, repeats + 1)  # the first one stores the prefix

    def spec(batch: list[list[int]], kvtier: dict[str, Any] | None) -> EngineSpec:
        return EngineSpec(
            model, [WARMUP, *batch], max_tokens=4, kvtier=kvtier, reset_between=True, dtype=DTYPE
        )

    capacity = f"{max(64, 4 * n_tokens * 8192 >> 20)}MiB"  # 8 KiB of KV per token, 4x
    # Write-through: the writer's host pool keeps the prefix, the tier gets it at once.
    disk = {"path": str(work / "lmdb"), "capacity": "1GiB", "chunk_blocks": 4,
            "write_policy": "write_through"}  # fmt: skip
    redis_url = os.environ.get("KVTIER_BENCH_REDIS", "redis://127.0.0.1:6379/0")
    key_prefix = f"kvtier-bench-{uuid.uuid4().hex[:8]}"
    redis = {"url": redis_url, "key_prefix": key_prefix, "chunk_blocks": 4, "required": True,
             "write_policy": "write_through"}  # fmt: skip
    plans = [
        ("recompute", None, None),
        ("host hit", "cpu", {"tiers": {"cpu": {"capacity": capacity}}}),
        ("disk hit", "disk", {"tiers": {"cpu": {"capacity": capacity}, "disk": disk}}),
        ("redis hit", "redis", {"tiers": {"cpu": {"capacity": capacity}, "redis": redis}}),
    ]
    use_redis = redis_reachable(redis_url)
    if not use_redis:
        print(f"note: no Redis at {redis_url}: the redis case is skipped", file=sys.stderr)
        plans.pop()
    served: dict[str, list[RequestReport]] = {}
    try:
        for case, tier, kvtier in progress(plans, desc="engines"):
            if tier in (None, "cpu"):  # one engine serves every prompt
                report = run_engine(spec(asked, kvtier), work)
                served[case] = timed(report, first=2)
            else:  # a writer, then a new engine per repetition
                run_engine(spec(asked[:1], kvtier), work)
                served[case] = [timed(run_engine(spec([p], kvtier), work))[0] for p in asked[1:]]
            check(case, served[case], tier, [r.tokens for r in served.get("recompute", [])])
    finally:
        if use_redis:
            delete_prefix(redis_url, key_prefix)

    base = summarize([r.ttft * 1e3 for r in served["recompute"]])
    results = [
        Result(f"recompute {n_tokens}-token prompt", "time to first token", "ms", *base,
               higher_is_better=False)
    ]  # fmt: skip
    for case, _, _ in plans[1:]:
        ms = summarize([r.ttft * 1e3 for r in served[case]])
        results.append(
            Result(
                f"{case} {n_tokens}-token prompt",
                "time to first token",
                "ms",
                *ms,
                ceiling=base[0],
                ceiling_what="TTFT recomputing the same prompt (vLLM, no connector)",
                higher_is_better=False,
            )
        )
    machine = machine_info()
    print(f"vLLM TTFT, demo Llama {DTYPE}, {n_tokens}-token prompts, {repeats} timed each")
    print_table(results)
    for r in results[1:]:
        print(f"speed-up {r.case}: {1 / r.ratio:.1f}x")
    if args.out:
        write_json(args.out, BENCHMARK, results, machine)
    return 0


def redis_reachable(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def delete_prefix(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)


if __name__ == "__main__":
    raise SystemExit(main())
