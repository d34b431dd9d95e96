"""Time to first token in vLLM's server of a long shared-prefix prompt: recompute vs a
kvtier hit from each tier.

Every server is vLLM's OpenAI-compatible server as users run it
(``kvtier.integrations.vllm_server``: engine core and worker in processes of their
own), on kvtier's demo Llama (4 layers, hidden 512, 8 heads, 4 KV heads, float32;
random weights, no download), whose prefill of a few thousand tokens is clearly
measurable on a CPU. Every timed prompt is one long shared prefix plus a question of
its own; TTFT is measured by the HTTP client, from sending the request to the first
streamed token, ms. vLLM's own KV pool holds one prompt, and an unrelated prompt that
fills it runs before each timed one, so the prefix is never in vLLM's own cache.

- ``recompute``: vLLM without the connector and without its prefix cache: the whole
  prompt is computed. The ceiling the other cases are compared with
  (ratio = TTFT with kvtier / TTFT recomputing).
- ``host hit``: a host pool that holds the prefix.
- ``disk hit, steady state``: a host pool of one prompt over a write-through disk
  tier: the unrelated prompt pushes the prefix out of host memory, so it comes from disk.
- ``disk hit, new process``: the first request of a restarted server.
- ``redis hit``: as the steady disk case, through the real Redis at
  ``KVTIER_BENCH_REDIS`` (default redis://127.0.0.1:6379/0), under a key prefix of its
  own that is deleted afterwards; skipped when no server answers.

Each timed request is checked with vLLM's own counters (``/metrics``): its prefix must
have come from kvtier (90% of it at least), most of it from the tier the case names,
and its output must equal the recompute's (greedy), or the script fails.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import yaml
from _report import Result, machine_info, print_table, standard_args, summarize, write_json

from kvtier.demo import DEMO_MODEL
from kvtier.integrations.vllm_engine import save_model
from kvtier.integrations.vllm_server import VLLMServer
from kvtier.progress import progress

BENCHMARK = "bench_vllm_ttft"
QUESTION_TOKENS = 24
BLOCK = 128  # vLLM's default block size on CPU
KV_PER_TOKEN = 8192  # the demo Llama's KV bytes per token in float32
DTYPE = "float32"  # bf16 matmuls are several times slower on CPUs without AMX
SOURCE = {"cpu": "host", "disk": "disk", "redis": "external_unspecified"}
SETTLE_SECONDS = 0.5


def prompts(prefix_tokens: int, count: int, seed: int) -> list[list[int]]:
    """``count`` prompts: one shared prefix, then a question each."""
    rng = random.Random(seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(200, DEMO_MODEL.vocab_size) for _ in range(n)]

    prefix = text(prefix_tokens)
    return [prefix + text(QUESTION_TOKENS) for _ in range(count)]


class Bench:
    """The model, the server flags and the prompts every case shares."""

    def __init__(self, n_tokens: int, repeats: int, work: Path) -> None:
        self.work = work
        self.model = save_model(work / "model", DEMO_MODEL, DTYPE)
        self.asked = prompts(n_tokens - QUESTION_TOKENS, repeats + 1, seed=0)
        blocks = -(-(n_tokens + BLOCK) // BLOCK)
        # Unrelated prompts that fill vLLM's whole pool (one block of it is vLLM's own).
        self.others = prompts(blocks * BLOCK - 1 - QUESTION_TOKENS, len(self.asked), seed=1)
        self.args = ["--dtype", DTYPE, "--gpu-memory-utilization", "0.3",
                     "--max-model-len", str(blocks * BLOCK),
                     "--num-gpu-blocks-override", str(blocks + 1)]  # fmt: skip
        self.prompt_bytes = blocks * BLOCK * KV_PER_TOKEN
        self.expected: list[list[int]] = []
        self._logs = 0

    def server(self, tiers: dict | None, args: tuple[str, ...] = ()) -> VLLMServer:
        config = None
        if tiers is not None:
            config = self.work / "kvtier.yaml"
            config.write_text(yaml.safe_dump({"tiers": tiers}))
        self._logs += 1
        log = self.work / f"vllm-{self._logs}.log"
        return VLLMServer(self.model, config, [*self.args, *args], log_path=log)

    def timed(self, server: VLLMServer, i: int, tier: str | None, case: str) -> float:
        """TTFT (ms) of timed prompt ``i`` after the unrelated one, checked."""
        server.complete(self.others[i], max_tokens=1)
        # Steady state: the spill writes the unrelated prompt's evictions caused have
        # landed (the scheduler finds what the tiers hold, not what is still queued).
        time.sleep(SETTLE_SECONDS)
        before = server.cached_tokens()
        reply = server.complete(self.asked[i], max_tokens=4)
        after = server.cached_tokens()
        if tier is None:
            self.expected.append(reply.tokens)
        else:
            got = {s: after[s] - before[s] for s in after}
            prefix = len(self.asked[i]) - QUESTION_TOKENS
            from_kvtier = sum(got[s] for s in SOURCE.values())
            if from_kvtier < 0.9 * prefix or got[SOURCE[tier]] < 0.5 * prefix:
                raise SystemExit(f"{case}: the prefix did not come from {tier}: {got}")
            if reply.tokens != self.expected[i - 1]:
                raise SystemExit(f"{case}: output {reply.tokens} != recompute's")
        return reply.ttft * 1e3


def main() -> int:
    parser = standard_args(__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, help="default 4096 (2048 with --quick)")
    parser.add_argument("--repeats", type=int, help="timed prompts per case (default 3; 1 quick)")
    parser.add_argument(
        "--only", nargs="+", metavar="TIER", choices=("host", "disk", "redis"),
        help="run only these cases (and the recompute they are compared with)",
    )  # fmt: skip
    args = parser.parse_args()
    n_tokens = args.prompt_tokens or (2048 if args.quick else 4096)
    repeats = args.repeats or (1 if args.quick else 3)
    bench = Bench(n_tokens, repeats, Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-")))
    host = f"{2 * bench.prompt_bytes >> 20}MiB"
    one_prompt = f"{bench.prompt_bytes >> 20}MiB"
    # One block per value: a vLLM block of the demo Llama is 1 MiB already.
    disk = {"path": str(bench.work / "lmdb"), "capacity": "1GiB", "chunk_blocks": 1,
            "write_policy": "write_through"}  # fmt: skip
    redis_url = os.environ.get("KVTIER_BENCH_REDIS", "redis://127.0.0.1:6379/0")
    key_prefix = f"kvtier-bench-{uuid.uuid4().hex[:8]}"
    redis = {"url": redis_url, "key_prefix": key_prefix, "chunk_blocks": 1, "required": True,
             "write_policy": "write_through"}  # fmt: skip
    timed = range(1, repeats + 1)  # prompt 0 stores the prefix

    def steady(tier: str | None, tiers: dict | None, *flags: str) -> Callable[[], list[float]]:
        def run() -> list[float]:
            with bench.server(tiers, flags) as server:
                server.complete(bench.asked[0], max_tokens=4)
                return [bench.timed(server, i, tier, tier or "recompute") for i in timed]

        return run

    def restarted() -> list[float]:
        tiers = {"cpu": {"capacity": host}, "disk": disk}
        with bench.server(tiers) as server:
            server.complete(bench.asked[0], max_tokens=4)
        out = []
        for i in timed:
            with bench.server(tiers) as server:
                out.append(bench.timed(server, i, "disk", "disk hit, new process"))
        return out

    plans: list[tuple[str, Callable[[], list[float]]]] = [
        ("recompute", steady(None, None, "--no-enable-prefix-caching")),
        ("host hit", steady("cpu", {"cpu": {"capacity": host}})),
        ("disk hit, steady state",
         steady("disk", {"cpu": {"capacity": one_prompt}, "disk": disk})),
        ("disk hit, new process", restarted),
        ("redis hit", steady("redis", {"cpu": {"capacity": one_prompt}, "redis": redis})),
    ]  # fmt: skip
    if args.only:
        plans = [p for p in plans if p[0] == "recompute" or p[0].split()[0] in args.only]
    use_redis = any(p[0].startswith("redis") for p in plans) and redis_reachable(redis_url)
    if not use_redis and plans[-1][0].startswith("redis"):
        print(f"note: no Redis at {redis_url}: the redis case is skipped", file=sys.stderr)
        plans.pop()
    ttft: dict[str, list[float]] = {}
    try:
        for case, run in progress(plans, desc="cases"):
            ttft[case] = run()
    finally:
        if use_redis:
            delete_prefix(redis_url, key_prefix)

    base = summarize(ttft["recompute"])
    results = [
        Result(f"recompute {n_tokens}-token prompt", "time to first token", "ms", *base,
               higher_is_better=False)
    ]  # fmt: skip
    for case, _ in plans[1:]:
        results.append(
            Result(
                f"{case} {n_tokens}-token prompt",
                "time to first token",
                "ms",
                *summarize(ttft[case]),
                ceiling=base[0],
                ceiling_what="TTFT recomputing the same prompt (vLLM server, no connector)",
                higher_is_better=False,
            )
        )
    print(f"vLLM server TTFT, demo Llama {DTYPE}, {n_tokens}-token prompts, {repeats} timed each")
    print_table(results)
    for r in results[1:]:
        print(f"speed-up {r.case}: {1 / r.ratio:.1f}x")
    if args.out:
        write_json(args.out, BENCHMARK, results, machine_info())
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
