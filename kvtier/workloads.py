"""Synthetic request streams with shared prefixes, for the demo, tests and benchmarks."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ChatRequest:
    """One turn of one conversation: the whole prompt so far and the reply to generate."""

    conversation: int
    turn: int
    prompt: list[int]
    reply: list[int]

    @property
    def req_id(self) -> str:
        return f"c{self.conversation}t{self.turn}"


def multi_turn_chat(
    conversations: int,
    turns: int,
    system_tokens: int = 256,
    user_tokens: int = 96,
    reply_tokens: int = 48,
    vocab_size: int = 32000,
    seed: int = 0,
) -> Iterator[ChatRequest]:
    """Chats sharing one system prompt, turns interleaved across conversations.

    Turn t of a conversation sends the system prompt, every earlier user message and
    reply, and a new user message; so each prompt extends that conversation's
    previous prompt plus reply. Deterministic for a given seed.
    """
    rng = random.Random(seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    system = text(system_tokens)
    history = [list(system) for _ in range(conversations)]
    for turn in range(turns):
        for conv in range(conversations):
            prompt = history[conv] + text(user_tokens)
            reply = text(reply_tokens)
            history[conv] = prompt + reply
            yield ChatRequest(conv, turn, prompt, reply)
