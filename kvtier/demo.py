"""``kvtier demo``: a real transformers Llama serving a multi-turn chat through kvtier.

No download and no server: the model is a small Llama built from a config with
seeded random weights (its id is a hash of those weights), prompts are token ids.
Several conversations share a system prompt; each turn sends the whole conversation
so far plus a new user message, and the model's own greedy reply joins the context.
Conversations take turns, so by the time one comes back its blocks have been evicted
from the GPU pool to host memory and on to disk: every tier gets to serve.

Each turn runs twice: through kvtier (``CachedLM.generate``) and as a plain
``model.generate`` that recomputes everything. The demo reports time to first token
for both and fails if any reply differs.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvtier.config import KVTierConfig
from kvtier.integrations.hf import CachedLM, recompute, weights_id
from kvtier.plot import plot_demo
from kvtier.progress import progress
from kvtier.workloads import Chat, ChatShape

# Big enough that a prefill of a few thousand tokens takes a measurable second on a
# 2-core CPU; its KV layout is the one configs/default.yaml describes.
DEMO_MODEL = LlamaConfig(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=16384,
)


@dataclass
class Turn:
    """One request as served through kvtier and as recomputed."""

    conversation: int
    turn: int
    prompt_tokens: int
    tokens_per_tier: dict[str, int]  # prompt tokens each tier supplied
    computed_tokens: int
    ttft_kvtier: float
    ttft_recompute: float
    same_output: bool

    @property
    def speedup(self) -> float:
        return self.ttft_recompute / self.ttft_kvtier


@dataclass
class DemoResult:
    """Every turn, the bytes each tier moved, and the model and tiers used."""

    model: str
    tiers: list[str]
    turns: list[Turn] = field(default_factory=list)
    bytes_moved: dict[str, dict[str, int]] = field(default_factory=dict)
    baseline: str = "recompute"  # what each turn is compared with

    @property
    def all_equal(self) -> bool:
        return all(t.same_output for t in self.turns)

    def hit_rate(self, tier: str) -> float:
        total = sum(t.prompt_tokens for t in self.turns)
        return sum(t.tokens_per_tier.get(tier, 0) for t in self.turns) / max(total, 1)

    def hit_turns(self) -> list[Turn]:
        return [t for t in self.turns if t.computed_tokens < t.prompt_tokens]


def build_model(seed: int = 0, device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """The demo's Llama with seeded random weights, in float32, in eval mode."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(DEMO_MODEL).to(device).eval()


def serve_chat(lm: CachedLM, shape: ChatShape, seed: int = 0) -> DemoResult:
    """Serve the chat through ``lm`` and recompute every turn; the per-turn record."""
    result = DemoResult(lm.model_id, [])
    recompute(lm.model, list(range(3, 67)), 2)  # warm-up: the first turn is not timed cold
    chat = Chat(shape, lm.model.config.vocab_size, seed)
    for conv, turn, prompt in progress(chat.requests(), len(chat), desc="serving"):
        got = lm.generate(prompt, shape.reply_tokens)
        base = recompute(lm.model, prompt, shape.reply_tokens)
        per_tier = got.hit.tokens_per_tier() if got.cached_tokens else {}
        result.turns.append(
            Turn(
                conv,
                turn,
                len(prompt),
                {k: v for k, v in per_tier.items() if v},
                len(prompt) - got.cached_tokens,
                got.ttft_seconds,
                base.ttft_seconds,
                got.tokens == base.tokens,
            )
        )
        chat.reply(conv, prompt, got.tokens)
    stats = lm.cache.stats()
    result.tiers = list(stats.tiers)
    result.bytes_moved = {
        name: {"in": s.bytes_in, "out": s.bytes_out} for name, s in stats.tiers.items()
    }
    return result


def print_report(result: DemoResult) -> None:
    """The per-turn table and the summary."""
    tiers = result.tiers
    head = f"{'conv':>4} {'turn':>4} {'prompt':>6}" + "".join(f" {t:>6}" for t in tiers)
    base = result.baseline
    print(head + f" {'computed':>8} {'TTFT kvtier':>11} {base:>10} {'speed-up':>8}  same")
    for t in result.turns:
        cols = "".join(f" {t.tokens_per_tier.get(tier, 0):>6}" for tier in tiers)
        print(
            f"{t.conversation:>4} {t.turn:>4} {t.prompt_tokens:>6}{cols} {t.computed_tokens:>8}"
            f" {t.ttft_kvtier * 1e3:>8.0f} ms {t.ttft_recompute * 1e3:>7.0f} ms"
            f" {t.speedup:>7.2f}x  {'yes' if t.same_output else 'NO'}"
        )
    print("\nprompt tokens served by each tier, and bytes it moved:")
    for tier in tiers:
        moved = result.bytes_moved.get(tier)
        print(
            f"  {tier:>6}: {result.hit_rate(tier):6.1%} of prompt tokens"
            + (f"   in {moved['in'] / 2**20:8.1f} MiB   out {moved['out'] / 2**20:8.1f} MiB"
               if moved else "")
        )  # fmt: skip
    hits = result.hit_turns()
    if hits:
        ours = sum(t.ttft_kvtier for t in hits)
        theirs = sum(t.ttft_recompute for t in hits)
        median = statistics.median(t.speedup for t in hits)
        print(
            f"\nTTFT on the {len(hits)} turns that hit: {ours:.2f} s with kvtier vs "
            f"{theirs:.2f} s {base} = {theirs / ours:.2f}x (median per turn {median:.2f}x)"
        )
    verdict = "equal" if result.all_equal else "DIFFERENT on some turns"
    print(f"replies with kvtier vs {base}: {verdict} ({len(result.turns)} turns, greedy)")


def write_json(result: DemoResult, path: str) -> None:
    data = asdict(result)
    data["hit_rate"] = {tier: result.hit_rate(tier) for tier in result.tiers}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def run(
    config: KVTierConfig,
    shape: ChatShape,
    device: str | None = None,
    json_out: str | None = None,
    plot_out: str | None = None,
) -> int:
    """The whole demo; 0 when every reply equals its recompute, 1 otherwise."""
    model = build_model(device=device or "cpu")
    with CachedLM(model, config, model_id=f"kvtier-demo/{weights_id(model)}") as lm:
        print(
            f"kvtier demo: {shape.conversations} conversations x {shape.turns} turns; "
            f"tiers {', '.join(lm.cache.stats().tiers)}; GPU pool {lm.cache.gpu.num_blocks} "
            f"blocks of {lm.layout.describe()}"
        )
        result = serve_chat(lm, shape)
    print_report(result)
    if json_out:
        write_json(result, json_out)
    if plot_out:
        plot_demo(result, plot_out)
    return 0 if result.all_equal else 1
