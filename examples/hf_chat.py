"""A multi-turn chat with a transformers model, kvtier as its prefix cache.

Each turn sends the whole conversation so far; kvtier hands back the KV of what the
model has seen before (from the GPU pool, host memory or disk), so the model only
computes the new message.

    python examples/hf_chat.py                         # kvtier demo's random-weight Llama
    python examples/hf_chat.py --model ./my-llama      # a local model dir with its tokenizer

Without ``--model`` the text is encoded as UTF-8 bytes (the random model's replies are
noise; what matters is what kvtier served).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace

from kvtier.config import load_config

USER_MESSAGES = [
    "Hello! I am planning a trip to the mountains next month.",
    "What should I pack for three days of hiking in changing weather?",
    "And which of those can I leave behind if my bag is too heavy?",
    "Thanks. Can you summarise the whole plan in a few lines?",
]


def load(model_path: str | None):
    """(model, model id, encode, decode): a local model and its tokenizer, or the demo
    model with a UTF-8 byte "tokenizer"."""
    if model_path is None:
        from kvtier.demo import build_model
        from kvtier.integrations.hf import weights_id

        model = build_model()
        return (
            model,
            weights_id(model),
            lambda text: list(text.encode()),
            lambda ids: bytes(i % 256 for i in ids).decode(errors="replace"),
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    return model, model_path, tokenizer.encode, tokenizer.decode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a local transformers model directory")
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--turns", type=int, default=len(USER_MESSAGES))
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    from kvtier.integrations.hf import CachedLM

    model, model_id, encode, decode = load(args.model)
    config = load_config(args.config)
    with tempfile.TemporaryDirectory() as scratch:
        if config.tiers.disk is not None:  # start cold: a fresh disk tier
            disk = replace(config.tiers.disk, path=f"{scratch}/lmdb")
            config = replace(config, tiers=replace(config.tiers, disk=disk))
        with CachedLM(model, config, model_id=model_id) as lm:
            context: list[int] = []
            for turn in range(args.turns):
                message = USER_MESSAGES[turn % len(USER_MESSAGES)]
                context += encode(f"\nUser: {message}\nAssistant:")
                reply = lm.generate(context, args.max_new_tokens)
                context += reply.tokens
                served = ", ".join(
                    f"{tier} {n}" for tier, n in reply.hit.tokens_per_tier().items() if n
                )
                print(f"[turn {turn}] user: {message}")
                print(f"[turn {turn}] assistant: {decode(reply.tokens)!r}")
                print(
                    f"[turn {turn}] prompt {len(context) - len(reply.tokens)} tokens, "
                    f"cached {reply.cached_tokens} ({served or 'none'}), "
                    f"time to first token {reply.ttft_seconds * 1e3:.0f} ms"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
