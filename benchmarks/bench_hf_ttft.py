"""Time to first token through the native API (``CachedLM``) of a long shared-prefix
prompt: recompute vs a kvtier hit from each tier, each spill tier against its limit.

The model is kvtier's demo Llama (4 layers, hidden 512, 8 heads, 4 KV heads, float32;
random weights, no download) in transformers, served by ``CachedLM`` with a GPU pool
(here on the CPU) that holds one prompt. Every timed prompt is one long shared prefix
(whole 128-token chunks) plus a question of its own (one chunk), after an unrelated
prompt that pushes the prefix out of the GPU pool (and, below it, out of a host pool of
one prompt that takes each block as it is committed); TTFT is
``Generation.ttft_seconds`` (lookup to the first token chosen), ms.

- ``recompute``: ``model.generate`` without kvtier: the whole prompt is computed.
- ``host hit``: a host pool that holds the prefix.
- ``disk hit, steady state``: a host pool of one prompt over a write-through disk tier.
- ``disk hit, reopened``: the first request of a cache opened anew on that disk tier.
- ``redis hit``: as the steady disk case, through the real Redis at
  ``KVTIER_BENCH_REDIS`` (default redis://127.0.0.1:6379/0), under a key prefix of its
  own that is deleted afterwards; skipped when no server answers.

The limit of a spill hit is ``TTFT(host hit) + T(raw read)``, the raw read timed right
after each request on the same tier (see ``_ttft.py``); its ratio's target is 1.25.
Each reply must equal the recompute's (greedy), or the script fails; the breakdown
comes from kvtier's trace (``metrics.trace_path``).
"""

from __future__ import annotations

import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

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

from kvtier.config import parse_config
from kvtier.demo import DEMO_MODEL, build_model
from kvtier.integrations.hf import CachedLM, recompute
from kvtier.trace import phases, read_trace

BENCHMARK = "bench_hf_ttft"
BLOCK = 16  # tokens per kvtier block
CHUNK = 8  # blocks per spill value: 1 MiB of the demo Llama's float32 KV
# A spill tier stores whole chunks of a chain, so it holds a shared prefix only up to
# the last chunk boundary inside it: the prefix is a whole number of chunks, so that
# every tier can hold all of it and the cases differ only in where it comes from.
QUESTION_TOKENS = CHUNK * BLOCK
KV_PER_TOKEN = 8192
NEW_TOKENS = 4


class Bench:
    """The model and the prompts every case of one prompt size shares."""

    def __init__(self, n_tokens: int, repeats: int, work: Path) -> None:
        self.work = work
        self.model = build_model()
        vocab = DEMO_MODEL.vocab_size
        self.asked = prompts(n_tokens - QUESTION_TOKENS, QUESTION_TOKENS, repeats + 1, vocab, 0)
        self.others = prompts(n_tokens - QUESTION_TOKENS, QUESTION_TOKENS, repeats + 1, vocab, 1)
        self.prompt_blocks = -(-(n_tokens + NEW_TOKENS) // BLOCK) + 1
        self.trace = work / "trace.jsonl"
        self.expected = [recompute(self.model, p, NEW_TOKENS) for p in self.asked]

    def lm(self, tiers: dict) -> CachedLM:
        """``CachedLM`` with a GPU pool of one prompt over ``tiers``."""
        layout = {"block_size": BLOCK}
        gpu = {"num_blocks": self.prompt_blocks, "device": "cpu"}
        doc = {"model": "bench", "layout": _layout(layout), "tiers": {"gpu": gpu, **tiers},
               "metrics": {"trace_path": str(self.trace)}}  # fmt: skip
        return CachedLM(self.model, parse_config(doc), model_id="bench-demo-llama")

    def timed(self, lm: CachedLM, i: int, case: str, raw: RawReader | None) -> Sample:
        """Timed prompt ``i`` after the unrelated one, checked against the recompute."""
        lm.generate(self.others[i], 1)
        lm.cache.flush()  # steady state: the spill writes it caused have landed
        sent = time.time()
        out = lm.generate(self.asked[i], NEW_TOKENS)
        if out.tokens != self.expected[i].tokens:
            raise SystemExit(f"{case}: output {out.tokens} != recompute's")
        tier = case.split()[0]
        hit = out.hit.tokens_per_tier() if out.hit else {}
        if hit.get(tier, 0) < 0.5 * (len(self.asked[i]) - QUESTION_TOKENS):
            raise SystemExit(f"{case}: the prefix did not come from {tier}: {hit}")
        events = self._events(sent, sent + out.ttft_seconds)
        loaded = sum(e["blocks"].get(tier, 0) for e in events if e["event"] == "load")
        raw_seconds = raw.seconds(-(-loaded // CHUNK)) if raw is not None else None
        return Sample(out.ttft_seconds, phases(events, sent, sent + out.ttft_seconds), raw_seconds)

    def _events(self, start: float, end: float) -> list[dict]:
        window = [e for e in read_trace(self.trace) if start <= e["t"] <= end]
        req = next(e["req"] for e in window if e["event"] == "lookup")
        return [e for e in window if e["req"] == req]


def _layout(overrides: dict) -> dict:
    """The demo Llama's KV layout (what ``CachedLM`` derives from the model)."""
    heads = DEMO_MODEL.num_key_value_heads
    head_dim = DEMO_MODEL.hidden_size // DEMO_MODEL.num_attention_heads
    layout = {"num_layers": DEMO_MODEL.num_hidden_layers, "num_kv_heads": heads,
              "head_dim": head_dim, "dtype": "float32"}  # fmt: skip
    return {**layout, **overrides}


def run_size(
    n_tokens: int, repeats: int, redis_url: str | None
) -> tuple[list[Result], dict[str, dict[str, float]]]:
    """Every case at one prompt size: the result rows and each case's median phases."""
    bench = Bench(n_tokens, repeats, Path(tempfile.mkdtemp(prefix="kvtier-bench-hf-")))
    one_prompt = bench.prompt_blocks * BLOCK * KV_PER_TOKEN
    # Copied down at commit, as vLLM's connector saves: the unrelated prompt's blocks then
    # push the prefix out of a host pool of one prompt, onto the spill tier.
    small_host = {"capacity": one_prompt, "write_policy": "eager"}
    disk_path = bench.work / "lmdb"
    disk = {"path": str(disk_path), "capacity": "1GiB", "chunk_blocks": CHUNK,
            "write_policy": "write_through"}  # fmt: skip
    key_prefix = f"kvtier-bench-{uuid.uuid4().hex[:8]}"
    redis_tier = {"url": redis_url, "key_prefix": key_prefix, "chunk_blocks": CHUNK,
                  "required": True, "write_policy": "write_through"}  # fmt: skip
    timed = range(1, repeats + 1)  # prompt 0 stores the prefix

    def steady(case: str, tiers: dict, raw: RawReader | None) -> Callable[[], list[Sample]]:
        def run() -> list[Sample]:
            with bench.lm(tiers) as lm:
                lm.generate(bench.asked[0], NEW_TOKENS)
                return [bench.timed(lm, i, case, raw) for i in timed]

        return run

    def reopened() -> list[Sample]:
        tiers = {"cpu": small_host, "disk": disk}
        out = []
        for i in timed:
            with bench.lm(tiers) as lm:
                lm.generate(bench.asked[0], NEW_TOKENS)
            with bench.lm(tiers) as lm:
                out.append(bench.timed(lm, i, "disk hit, reopened", RawReader(disk_path)))
        return out

    def recomputed() -> list[Sample]:
        return [Sample(bench.expected[i].ttft_seconds, {}, None) for i in timed]

    plans: list[Plan] = [
        ("recompute", recomputed),
        ("host hit", steady("cpu hit", {"cpu": {"capacity": 2 * one_prompt}}, None)),
        ("disk hit, steady state",
         steady("disk hit", {"cpu": small_host, "disk": disk},
                RawReader(disk_path))),
        ("disk hit, reopened", reopened),
    ]  # fmt: skip
    if redis_url is not None:
        tiers = {"cpu": small_host, "redis": redis_tier}
        raw_redis = RawReader(url=redis_url, prefix=key_prefix)
        plans.append(("redis hit", steady("redis hit", tiers, raw_redis)))
    return run_plans(plans, n_tokens, redis_url, key_prefix)


def main() -> int:
    parser = ttft_args(__doc__.split("\n")[0])
    args = parser.parse_args()
    sizes, repeats = sizes_and_repeats(args)
    redis_url = bench_redis_url()
    title = f"CachedLM TTFT, demo Llama float32, {repeats} timed prompt(s) per case"
    return measure_sizes(
        BENCHMARK, title, sizes, lambda n: run_size(n, repeats, redis_url), args.out
    )


if __name__ == "__main__":
    raise SystemExit(main())
