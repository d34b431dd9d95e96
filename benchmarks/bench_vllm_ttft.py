"""Time to first token in vLLM's server of a long shared-prefix prompt: recompute vs a
kvtier hit from each tier, each spill tier against its physical limit.

Every server is vLLM's OpenAI-compatible server as users run it
(``kvtier.integrations.vllm_server``: engine core and worker in processes of their
own, ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` as the README says for a small machine), on
kvtier's demo Llama (4 layers, hidden 512, 8 heads, 4 KV heads, float32; random
weights, no download), whose prefill of a few thousand tokens is clearly measurable on
a CPU. Every timed prompt is one long shared prefix plus a question of
its own; TTFT is measured by the HTTP client, from sending the request to the first
streamed token, ms. vLLM's own KV pool holds one prompt, and an unrelated prompt that
fills it runs before each timed one, so the prefix is never in vLLM's own cache.

- ``recompute``: vLLM without the connector and without its prefix cache: the whole
  prompt is computed.
- ``host hit``: a host pool that holds the prefix.
- ``disk hit, steady state``: a host pool of one prompt over a write-through disk
  tier: the unrelated prompt pushes the prefix out of host memory, so it comes from disk.
- ``disk hit, new process``: the first request of a restarted server.
- ``redis hit``: as the steady disk case, through the real Redis at
  ``KVTIER_BENCH_REDIS`` (default redis://127.0.0.1:6379/0), under a key prefix of its
  own that is deleted afterwards; skipped when no server answers.

The limit of a spill tier's hit is ``TTFT(host hit) + T(raw read)``: what the host hit
costs, plus reading the prefix's bytes from the tier at its raw speed, measured in the
same run right after each timed request (an lmdb read transaction of ``get`` with
``buffers=True``, or one redis-py pipeline of ``GET``, of as many stored values of the
same size as the hit read, each copied into a staging buffer). A spill hit's ratio is
its TTFT over that limit (target: at most 1.25). Host hits are compared with the
recompute.

Where each hit's time goes is read off kvtier's trace (``metrics.trace_path``, see
``kvtier.trace``): the breakdown table gives each phase's median, ms.

Each timed request is checked with vLLM's own counters (``/metrics``): its prefix must
have come from kvtier (90% of it at least), most of it from the tier the case names,
and its output must equal the recompute's (greedy), or the script fails.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import yaml
from _report import Result
from _ttft import (
    Plan,
    RawReader,
    Sample,
    bench_redis_url,
    measure_sizes,
    prompts,
    run_plans,
    sizes_and_repeats,
    ttft_args,
)

from kvtier.demo import DEMO_MODEL
from kvtier.integrations.vllm_engine import save_model
from kvtier.integrations.vllm_server import SMALL_MACHINE_CORES, VLLMServer
from kvtier.trace import phases, read_trace

BENCHMARK = "bench_vllm_ttft"
QUESTION_TOKENS = 24
BLOCK = 128  # vLLM's default block size on CPU
KV_PER_TOKEN = 8192  # the demo Llama's KV bytes per token in float32
DTYPE = "float32"  # bf16 matmuls are several times slower on CPUs without AMX
SOURCE = {"cpu": "host", "disk": "disk", "redis": "external_unspecified"}
SETTLE_SECONDS = 0.5


class Bench:
    """The model, the server flags and the prompts every case of one prompt size shares."""

    def __init__(self, n_tokens: int, repeats: int, work: Path) -> None:
        self.n_tokens = n_tokens
        self.work = work
        self.model = save_model(work / "model", DEMO_MODEL, DTYPE)
        vocab = DEMO_MODEL.vocab_size
        self.asked = prompts(n_tokens - QUESTION_TOKENS, QUESTION_TOKENS, repeats + 1, vocab, 0)
        blocks = -(-(n_tokens + BLOCK) // BLOCK)
        # Unrelated prompts that fill vLLM's whole pool (one block of it is vLLM's own).
        others = blocks * BLOCK - 1 - QUESTION_TOKENS
        self.others = prompts(others, QUESTION_TOKENS, len(self.asked), vocab, 1)
        self.args = ["--dtype", DTYPE, "--gpu-memory-utilization", "0.3",
                     "--max-model-len", str(blocks * BLOCK),
                     "--num-gpu-blocks-override", str(blocks + 1)]  # fmt: skip
        self.prompt_bytes = blocks * BLOCK * KV_PER_TOKEN
        self.trace = work / "trace.jsonl"
        self.expected: list[list[int]] = []
        self._logs = 0

    def server(self, tiers: dict | None, args: tuple[str, ...] = ()) -> VLLMServer:
        config = None
        if tiers is not None:
            config = self.work / "kvtier.yaml"
            doc = {"tiers": tiers, "metrics": {"trace_path": str(self.trace)}}
            config.write_text(yaml.safe_dump(doc))
        self._logs += 1
        log = self.work / f"vllm-{self._logs}.log"
        env = SMALL_MACHINE_CORES  # the README's setting for vLLM's CPU build
        return VLLMServer(self.model, config, [*self.args, *args], env=env, log_path=log)

    def timed(
        self, server: VLLMServer, i: int, tier: str | None, case: str, raw: RawReader | None
    ) -> Sample:
        """Timed prompt ``i`` after the unrelated one, checked."""
        server.complete(self.others[i], max_tokens=1)
        # Steady state: the spill writes the unrelated prompt's evictions caused have
        # landed (the scheduler finds what the tiers hold, not what is still queued).
        time.sleep(SETTLE_SECONDS)
        before = server.cached_tokens()
        sent = time.time()
        reply = server.complete(self.asked[i], max_tokens=4)
        after = server.cached_tokens()
        if tier is None:
            self.expected.append(reply.tokens)
            return Sample(reply.ttft, {}, None)
        got = {s: after[s] - before[s] for s in after}
        prefix = len(self.asked[i]) - QUESTION_TOKENS
        from_kvtier = sum(got[s] for s in SOURCE.values())
        if from_kvtier < 0.9 * prefix or got[SOURCE[tier]] < 0.5 * prefix:
            raise SystemExit(f"{case}: the prefix did not come from {tier}: {got}")
        if reply.tokens != self.expected[i - 1]:
            raise SystemExit(f"{case}: output {reply.tokens} != recompute's")
        events = self._events(sent, sent + reply.ttft)
        blocks = max(sum(e["blocks"].values()) for e in events if e["event"] == "load")
        raw_seconds = raw.seconds(blocks) if raw is not None else None
        return Sample(reply.ttft, phases(events, sent, sent + reply.ttft), raw_seconds)

    def _events(self, start: float, end: float) -> list[dict]:
        """The trace events of the request the client sent at ``start``."""
        window = [e for e in read_trace(self.trace) if start <= e["t"] <= end]
        req = next(e["req"] for e in window if e["event"] == "lookup")
        return [e for e in window if e["req"] == req]


def run_size(
    n_tokens: int, repeats: int, only: list[str] | None, redis_url: str | None
) -> tuple[list[Result], dict[str, dict[str, float]]]:
    """Every case at one prompt size: the result rows and each case's median phases."""
    bench = Bench(n_tokens, repeats, Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-")))
    host = f"{2 * bench.prompt_bytes >> 20}MiB"
    one_prompt = f"{bench.prompt_bytes >> 20}MiB"
    # One block per value: a vLLM block of the demo Llama is 1 MiB already.
    disk_path = bench.work / "lmdb"
    disk = {"path": str(disk_path), "capacity": "1GiB", "chunk_blocks": 1,
            "write_policy": "write_through"}  # fmt: skip
    key_prefix = f"kvtier-bench-{uuid.uuid4().hex[:8]}"
    redis_tier = {"url": redis_url, "key_prefix": key_prefix, "chunk_blocks": 1,
                  "required": True, "write_policy": "write_through"}  # fmt: skip
    timed = range(1, repeats + 1)  # prompt 0 stores the prefix

    def steady(
        tier: str | None, tiers: dict | None, raw: RawReader | None, *flags: str
    ) -> Callable[[], list[Sample]]:
        def run() -> list[Sample]:
            with bench.server(tiers, flags) as server:
                server.complete(bench.asked[0], max_tokens=4)
                return [bench.timed(server, i, tier, tier or "recompute", raw) for i in timed]

        return run

    def restarted() -> list[Sample]:
        tiers = {"cpu": {"capacity": host}, "disk": disk}
        with bench.server(tiers) as server:
            server.complete(bench.asked[0], max_tokens=4)
        out = []
        for i in timed:
            with bench.server(tiers) as server:
                raw = RawReader(disk_path)
                out.append(bench.timed(server, i, "disk", "disk hit, new process", raw))
        return out

    plans: list[Plan] = [
        ("recompute", steady(None, None, None, "--no-enable-prefix-caching")),
        ("host hit", steady("cpu", {"cpu": {"capacity": host}}, None)),
        ("disk hit, steady state",
         steady("disk", {"cpu": {"capacity": one_prompt}, "disk": disk}, RawReader(disk_path))),
        ("disk hit, new process", restarted),
    ]  # fmt: skip
    if redis_url is not None:
        raw_redis = RawReader(url=redis_url, prefix=key_prefix)
        tiers = {"cpu": {"capacity": one_prompt}, "redis": redis_tier}
        plans.append(("redis hit", steady("redis", tiers, raw_redis)))
    if only:
        plans = [p for p in plans if p[0] in ("recompute", "host hit") or p[0].split()[0] in only]
    return run_plans(plans, n_tokens, redis_url, key_prefix)


def main() -> int:
    parser = ttft_args(__doc__.split("\n")[0])
    parser.add_argument(
        "--only", nargs="+", metavar="TIER", choices=("disk", "redis"),
        help="run only these spill cases (and the recompute and host hit they are judged by)",
    )  # fmt: skip
    args = parser.parse_args()
    sizes, repeats = sizes_and_repeats(args)
    redis_url = bench_redis_url()
    title = f"vLLM server TTFT, demo Llama {DTYPE}, {repeats} timed prompt(s) per case"
    return measure_sizes(
        BENCHMARK, title, sizes, lambda n: run_size(n, repeats, args.only, redis_url), args.out
    )


if __name__ == "__main__":
    raise SystemExit(main())
