"""A synthetic request trace in Mooncake's format (``kvtier.replay`` reads it): the
prompts of a mix of sessions that share prefixes the way served traffic does.

- chat: conversations behind one of a few system prompts; each turn's prompt is the
  system prompt, every earlier message and reply, and a new message.
- rag: one shared instruction, one document of a corpus whose popularity is Zipf
  distributed, and a fresh question.
- agent: an agent loop: its agent type's long system prompt, a task, and a scratchpad
  that grows by a thought and a tool result per step.
- oneoff: a prompt seen once, half of them behind a short generic system prompt.

Sessions of each kind start as a Poisson process over ``duration_s``; a session's
later requests follow its own think or tool times. Each 512-token block is named by
the id of the block before it and by what it holds, so equal ids at position i mean
equal prefixes up to block i, as in Mooncake's trace. Deterministic for a seed.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier.replay import TRACE_BLOCK

# (segment id, tokens): a run of text that prompts share or not as a whole
Segment = tuple[int, int]
# what a session asks next: (prompt, output tokens, seconds until its next request)
Step = tuple[list[Segment], int, float]


@dataclass(frozen=True)
class WorkloadShape:
    """Sessions per second of each kind, for how long they start, and the shared
    content they draw on."""

    duration_s: float = 600.0
    chat_rate: float = 1.05
    rag_rate: float = 1.35
    agent_rate: float = 0.15
    oneoff_rate: float = 1.05
    documents: int = 3000
    zipf_s: float = 1.0
    agent_types: int = 6
    chat_systems: int = 8


class _World:
    """The shared content (system prompts, documents, agent types) and fresh segments."""

    def __init__(self, shape: WorkloadShape, rng: random.Random) -> None:
        self.rng = rng
        self._ids = itertools.count()
        self.chat_systems = [self.text(1200, 0.6, 200, 6000) for _ in range(shape.chat_systems)]
        self.rag_instruction = (next(self._ids), 700)
        self.documents = [self.text(5000, 0.6, 800, 30000) for _ in range(shape.documents)]
        weights = [1 / (i + 1) ** shape.zipf_s for i in range(shape.documents)]
        rng.shuffle(weights)
        self._popularity = list(itertools.accumulate(weights))
        self.agents = [self.text(8000, 0.4, 3000, 20000) for _ in range(shape.agent_types)]
        self.generic_system = (next(self._ids), 300)

    def text(self, median: float, sigma: float, low: int, high: int) -> Segment:
        """A new segment of lognormally distributed length, within [low, high] tokens."""
        tokens = self.rng.lognormvariate(math.log(median), sigma)
        return next(self._ids), int(min(high, max(low, tokens)))

    def document(self) -> Segment:
        """A document of the corpus, drawn by its popularity."""
        x = self.rng.random() * self._popularity[-1]
        return self.documents[min(bisect_left(self._popularity, x), len(self.documents) - 1)]


def _chat(world: _World) -> Iterator[Step]:
    rng = world.rng
    history = [rng.choice(world.chat_systems)]
    for _ in range(1 + int(rng.expovariate(1 / 4))):
        message = world.text(150, 1.0, 5, 8000)
        reply = world.text(300, 0.8, 10, 3000)
        yield [*history, message], reply[1], 5 + rng.expovariate(1 / 45)
        history += [message, reply]


def _rag(world: _World) -> Iterator[Step]:
    question = world.text(80, 0.7, 10, 1000)
    yield [world.rag_instruction, world.document(), question], world.text(200, 0.7, 10, 2000)[1], 0


def _agent(world: _World) -> Iterator[Step]:
    rng = world.rng
    agent = rng.choices(world.agents, [1 / (i + 1) for i in range(len(world.agents))])[0]
    scratchpad = [agent, world.text(300, 0.8, 20, 4000)]
    for _ in range(rng.randint(4, 30)):
        thought = world.text(150, 0.6, 10, 1500)
        yield list(scratchpad), thought[1], 2 + rng.expovariate(1 / 6)
        scratchpad += [thought, world.text(600, 1.0, 20, 8000)]


def _oneoff(world: _World) -> Iterator[Step]:
    body = world.text(1500, 1.1, 20, 60000)
    prompt = [world.generic_system, body] if world.rng.random() < 0.5 else [body]
    yield prompt, world.text(200, 0.8, 5, 2000)[1], 0


_SESSIONS = {"chat": _chat, "rag": _rag, "agent": _agent, "oneoff": _oneoff}


class _BlockNames:
    """Chained ids of 512-token blocks: a block's id names its content and its parent."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = {}

    def chain(self, prompt: list[Segment]) -> list[int]:
        ids: list[int] = []
        pieces: list[tuple[int, int, int]] = []  # (segment, first token, end token)
        filled = 0
        for segment, tokens in prompt:
            start = 0
            while start < tokens:
                take = min(tokens - start, TRACE_BLOCK - filled)
                pieces.append((segment, start, start + take))
                start += take
                filled += take
                if filled == TRACE_BLOCK:
                    ids.append(self._name(ids, pieces))
                    pieces, filled = [], 0
        if pieces:
            ids.append(self._name(ids, pieces))
        return ids

    def _name(self, ids: list[int], pieces: list[tuple[int, int, int]]) -> int:
        key = (ids[-1] if ids else -1, tuple(pieces))
        return self._ids.setdefault(key, len(self._ids))


def generate(shape: WorkloadShape, seed: int = 0) -> list[dict[str, object]]:
    """The trace's lines (``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids``), in arrival order."""
    rng = random.Random(seed)
    world = _World(shape, rng)
    names = _BlockNames()
    order = itertools.count()
    due: list[tuple[float, int, Iterator[Step]]] = []
    for kind, rate in (
        ("chat", shape.chat_rate),
        ("rag", shape.rag_rate),
        ("agent", shape.agent_rate),
        ("oneoff", shape.oneoff_rate),
    ):
        t = rng.expovariate(rate) if rate > 0 else math.inf  # a rate of 0: none of that kind
        while t < shape.duration_s:
            heapq.heappush(due, (t, next(order), _SESSIONS[kind](world)))
            t += rng.expovariate(rate)
    lines = []
    while due:
        t, _, session = heapq.heappop(due)
        step = next(session, None)
        if step is None or t >= shape.duration_s:
            continue
        prompt, output, wait = step
        lines.append(
            {
                "timestamp": int(t * 1000),
                "input_length": sum(tokens for _, tokens in prompt),
                "output_length": output,
                "hash_ids": names.chain(prompt),
            }
        )
        heapq.heappush(due, (t + wait, next(order), session))
    return lines


def write_trace(path: str | Path, lines: list[dict[str, object]]) -> None:
    """The lines as JSON, one per line (Mooncake's format)."""
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
