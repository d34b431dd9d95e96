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


@dataclass(frozen=True)
class ChatShape:
    """The workload: conversations x turns, and the size of each message in tokens."""

    conversations: int = 4
    turns: int = 6
    system_tokens: int = 512
    user_tokens: int = 320
    reply_tokens: int = 32


class Chat:
    """The demo's workload as token ids: ``requests()`` yields ``(conversation, turn,
    prompt)`` turn by turn with the conversations interleaved; ``reply`` adds the
    answer to a prompt to its conversation before the next prompt is made. Ids start
    at 3 (0-2 are unk, bos and eos in ``kvtier.integrations.vllm_engine``'s tokenizer)."""

    def __init__(self, shape: ChatShape, vocab_size: int, seed: int = 0) -> None:
        self.shape = shape
        self._rng = random.Random(seed)
        self._vocab = vocab_size
        system = self._text(shape.system_tokens)
        self._history = [list(system) for _ in range(shape.conversations)]

    def __len__(self) -> int:
        return self.shape.conversations * self.shape.turns

    def requests(self) -> Iterator[tuple[int, int, list[int]]]:
        for turn in range(self.shape.turns):
            for conv in range(self.shape.conversations):
                yield conv, turn, self._history[conv] + self._text(self.shape.user_tokens)

    def reply(self, conversation: int, prompt: list[int], tokens: list[int]) -> None:
        self._history[conversation] = prompt + tokens

    def _text(self, n: int) -> list[int]:
        return [self._rng.randrange(3, self._vocab) for _ in range(n)]
