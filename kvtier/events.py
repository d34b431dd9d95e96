"""What every replica holds, from vLLM's KV events: the consumer a router keeps.

vLLM publishes its GPU prefix cache as KV events (``--kv-events-config``: a ZMQ PUB
socket of msgpack ``KVEventBatch`` frames ``[topic, seq, payload]``, each batch
``[ts, events, dp_rank]``, each event a map tagged ``type``: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``). With kvtier's connector the same stream also
carries kvtier's tiers (``kvtier.integrations.vllm_events``), one ``medium`` each, with
``locality`` and ``ownership`` as vLLM 0.32 defines them:

=========  ==========  ==========  ==============  ==================================
tier       medium      locality    ownership       who can load it
=========  ==========  ==========  ==============  ==================================
``gpu``    ``GPU``     (none)      (none)          that replica (vLLM's own events)
``cpu``    ``CPU``     ``LOCAL``   ``kvtier:cpu``  that replica (kvtier's host pool)
``disk``   ``STORAGE`` ``LOCAL``   ``kvtier:disk`` that replica (and any sharing its disk)
``redis``  ``STORAGE`` ``REMOTE``  ``kvtier:redis`` every replica sharing the Redis
=========  ==========  ==========  ==============  ==================================

A block is named by vLLM's block hash; a ``BlockStored`` gives a chain of blocks with
the parent hash of its first one and the token ids of all of them, so a consumer finds
a prompt's blocks by walking (parent hash, block tokens) from the root, without
knowing how vLLM hashes. ``ReplicaView`` keeps one replica's blocks per tier;
``Fleet`` keeps every replica's, pools the ``REMOTE`` blocks (any replica may load
them) and answers, for a prompt, how many leading blocks each replica holds in which
tier; ``choose`` picks the replica a router should send it to. ``Subscriber`` reads
the streams. Nothing here needs vLLM; payloads are msgpack (never pickle).

Invariants. Events are idempotent per (block, tier): a store of a held block or a
removal of an absent one changes nothing (vLLM announces reused GPU blocks again).
``AllBlocksCleared`` is vLLM's GPU pool reset: it clears the ``gpu`` tier only, since
kvtier announces the removal of its own blocks itself. A block no tier holds is
forgotten.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

# Tiers from the best source of a block to the worst: a router prefers the first.
TIER_RANK: tuple[str, ...] = ("gpu", "cpu", "disk", "redis")
# How much one leading block held in a tier is worth to a router (a GPU block costs
# nothing to reuse, a Redis block a network read): the score of a replica is the sum
# over its held leading blocks.
TIER_WEIGHT: dict[str, float] = {"gpu": 1.0, "cpu": 0.75, "disk": 0.5, "redis": 0.25}


@dataclass(frozen=True)
class Medium:
    """How a kvtier tier appears in a KV event (vLLM 0.32's fields)."""

    medium: str
    locality: str | None
    ownership: str | None

    @property
    def remote(self) -> bool:
        """Loadable by every replica that shares the store, not only the publisher."""
        return self.locality == "REMOTE"


# kvtier's tiers in KV events (module docstring).
TIER_MEDIA: dict[str, Medium] = {
    "cpu": Medium("CPU", "LOCAL", "kvtier:cpu"),
    "disk": Medium("STORAGE", "LOCAL", "kvtier:disk"),
    "redis": Medium("STORAGE", "REMOTE", "kvtier:redis"),
}


def medium_of(tier: str) -> Medium:
    """The medium kvtier's tier ``tier`` publishes as (an unknown spill tier: local
    storage, owned by its name)."""
    return TIER_MEDIA.get(tier, Medium("STORAGE", "LOCAL", f"kvtier:{tier}"))


def tier_of(medium: str | None, locality: str | None, ownership: str | None) -> str:
    """The tier an event's medium names: kvtier's by its ownership, vLLM's GPU pool,
    or another publisher's CPU / local storage (``disk``) / remote storage (``redis``)."""
    if ownership and ownership.startswith("kvtier:"):
        return ownership.removeprefix("kvtier:")
    if medium is None or medium.upper() == "GPU":
        return "gpu"
    if medium.upper() == "CPU":
        return "cpu"
    return "redis" if locality == "REMOTE" else "disk"


def tier_rank(tier: str) -> int:
    """``tier``'s place in ``TIER_RANK`` (unknown tiers after all of them)."""
    return TIER_RANK.index(tier) if tier in TIER_RANK else len(TIER_RANK)


@dataclass
class _Block:
    """One block a view knows: where it hangs in the token trie, and its tiers."""

    parent: Any
    tokens: tuple[int, ...]
    tiers: set[str] = field(default_factory=set)


@dataclass
class ReplicaView:
    """One replica's blocks (or the pooled remote ones), per tier, as its events said.

    ``children`` maps (parent hash, block tokens) to the block's hash (None: the root),
    ``blocks`` each hash to its place and tiers; entries live while some tier holds
    the block."""

    children: dict[tuple[Any, tuple[int, ...]], Any] = field(default_factory=dict)
    blocks: dict[Any, _Block] = field(default_factory=dict)
    block_size: int = 0  # the last BlockStored's (one engine, one block size)

    def stored(self, tier: str, hashes: Sequence[Any], parent: Any, tokens: Sequence[int],
               block_size: int) -> None:  # fmt: skip
        """Blocks ``hashes`` (a chain after ``parent``; ``block_size`` tokens each of
        ``tokens``) are held in ``tier``."""
        self.block_size = block_size
        for i, h in enumerate(hashes):
            block = self.blocks.get(h)
            if block is None:
                chunk = tuple(tokens[i * block_size : (i + 1) * block_size])
                block = self.blocks[h] = _Block(parent, chunk)
                self.children[(parent, chunk)] = h
            block.tiers.add(tier)
            parent = h

    def removed(self, tier: str, hashes: Iterable[Any]) -> None:
        """Blocks ``hashes`` are no longer held in ``tier``."""
        for h in hashes:
            block = self.blocks.get(h)
            if block is not None:
                block.tiers.discard(tier)
                if not block.tiers:
                    self._forget(h, block)

    def cleared(self, tier: str) -> None:
        """``tier`` holds nothing any more."""
        self.removed(tier, [h for h, b in self.blocks.items() if tier in b.tiers])

    def blocks_per_tier(self) -> dict[str, int]:
        """How many blocks each tier holds."""
        out: dict[str, int] = {}
        for block in self.blocks.values():
            for tier in block.tiers:
                out[tier] = out.get(tier, 0) + 1
        return dict(sorted(out.items(), key=lambda item: tier_rank(item[0])))

    def _forget(self, h: Any, block: _Block) -> None:
        del self.blocks[h]
        if self.children.get((block.parent, block.tokens)) == h:
            del self.children[(block.parent, block.tokens)]


@dataclass(frozen=True)
class PrefixMatch:
    """A prompt's leading blocks one replica holds: the best tier of each, in order."""

    replica: str
    tiers: tuple[str, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)

    def blocks_per_tier(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for tier in self.tiers:
            out[tier] = out.get(tier, 0) + 1
        return out

    @property
    def score(self) -> float:
        """The sum of ``TIER_WEIGHT`` over the held leading blocks."""
        return sum(TIER_WEIGHT.get(t, 0.0) for t in self.tiers)


class Fleet:
    """Every replica's view, by name (its event endpoint), and the pooled ``REMOTE``
    blocks that any replica sharing the store can load."""

    def __init__(self, replicas: Iterable[str]) -> None:
        self.views: dict[str, ReplicaView] = {name: ReplicaView() for name in replicas}
        self.remote = ReplicaView()
        self.batches = 0  # event batches applied
        self.last_seq: dict[str, int] = {}  # per replica, the last batch's sequence number

    def apply(self, replica: str, events: Iterable[Mapping[str, Any]]) -> None:
        """Apply one batch of ``replica``'s decoded events (maps tagged ``type``)."""
        view = self.views[replica]
        for event in events:
            kind = event.get("type")
            if kind == "AllBlocksCleared":
                view.cleared("gpu")
                continue
            tier = tier_of(event.get("medium"), event.get("locality"), event.get("ownership"))
            target = self.remote if event.get("locality") == "REMOTE" else view
            if kind == "BlockStored":
                target.stored(tier, event["block_hashes"], event.get("parent_block_hash"),
                              event["token_ids"], event["block_size"])  # fmt: skip
            elif kind == "BlockRemoved":
                target.removed(tier, event["block_hashes"])
        self.batches += 1

    def match(self, token_ids: Sequence[int]) -> list[PrefixMatch]:
        """For each replica, the leading full blocks of ``token_ids`` it can serve, and
        from which tier (the best one holding each; pooled remote blocks count for
        every replica); it stops at the first block no tier of it holds."""
        return [self._match(name, view, token_ids) for name, view in self.views.items()]

    def _match(self, name: str, view: ReplicaView, token_ids: Sequence[int]) -> PrefixMatch:
        size = view.block_size or self.remote.block_size
        tiers: list[str] = []
        parent: Any = None
        if not size:  # nothing heard yet
            return PrefixMatch(name, ())
        for start in range(0, len(token_ids) - size + 1, size):
            chunk = tuple(token_ids[start : start + size])
            h = view.children.get((parent, chunk), self.remote.children.get((parent, chunk)))
            held = {t for source in (view, self.remote) if h in source.blocks
                    for t in source.blocks[h].tiers}  # fmt: skip
            if not held:
                break
            tiers.append(min(held, key=tier_rank))
            parent = h
        return PrefixMatch(name, tuple(tiers))


def choose(matches: Sequence[PrefixMatch]) -> PrefixMatch:
    """The replica to send a prompt to: the highest score (longest held prefix, each
    block weighed by its tier: GPU over host over disk over Redis); ties go to the
    first replica."""
    if not matches:
        raise ValueError("choose: no replicas")
    return max(matches, key=lambda m: m.score)  # max keeps the first of equals


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """A ``KVEventBatch`` payload as (timestamp, events); ``ValueError`` if it is not one."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        ts, events = batch[0], batch[1]
    except Exception as e:
        raise ValueError(f"not a KV event batch: {e}") from e
    if not isinstance(events, list):
        raise ValueError("not a KV event batch: events is not a list")
    return float(ts), [e for e in events if isinstance(e, dict)]


class Subscriber:
    """ZMQ SUB sockets on replicas' KV event endpoints, feeding a ``Fleet``.

    ``endpoints`` are the publishers' addresses as a client connects to them
    (``tcp://host:5557``); each is also the replica's name in the fleet."""

    def __init__(self, endpoints: Sequence[str], topic: str = "") -> None:
        import zmq  # pyzmq: vLLM's dependency, needed only to subscribe

        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self.fleet = Fleet(endpoints)
        self._sockets: dict[Any, str] = {}
        self._poller = zmq.Poller()
        for endpoint in endpoints:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt_string(zmq.SUBSCRIBE, topic)
            sock.connect(endpoint)
            self._sockets[sock] = endpoint
            self._poller.register(sock, zmq.POLLIN)

    def poll(self, timeout: float) -> list[tuple[str, list[dict[str, Any]]]]:
        """Apply every batch that arrives within ``timeout`` seconds (at least those
        already waiting); returns them as (replica, events), in arrival order."""
        out = []
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            ready = dict(self._poller.poll(int(left * 1000)))
            if not ready:
                return out
            for sock in ready:
                while True:
                    try:
                        frames = sock.recv_multipart(self._zmq.NOBLOCK)
                    except self._zmq.Again:
                        break
                    replica = self._sockets[sock]
                    _, events = decode_batch(frames[-1])
                    self.fleet.last_seq[replica] = int.from_bytes(frames[-2], "big", signed=True)
                    self.fleet.apply(replica, events)
                    out.append((replica, events))
            if time.monotonic() >= deadline:
                return out

    def close(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)


def read_prompt(path: str | Path) -> list[int]:
    """Token ids from a file: a JSON list, or integers separated by whitespace or commas."""
    text = Path(path).read_text()
    try:
        ids = json.loads(text)
    except ValueError:
        ids = text.replace(",", " ").split()
    try:
        return [int(i) for i in ids]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a list of token ids: {e}") from e


def summary(fleet: Fleet, prompt: Sequence[int] | None) -> dict[str, Any]:
    """The router's view as plain data: per replica its blocks per tier, and with a
    ``prompt`` the leading blocks it serves per tier, and the replica ``choose`` picks."""
    out: dict[str, Any] = {
        "replicas": {name: {"blocks": v.blocks_per_tier()} for name, v in fleet.views.items()},
        "remote": fleet.remote.blocks_per_tier(),
    }
    if prompt is not None:
        matches = fleet.match(prompt)
        for m in matches:
            out["replicas"][m.replica]["prompt"] = {
                "leading_blocks": m.num_blocks,
                "per_tier": m.blocks_per_tier(),
                "score": m.score,
            }
        out["route"] = choose(matches).replica
    return out


def describe(replica: str, event: Mapping[str, Any]) -> str:
    """One event as a line: replica, kind, tier, how many blocks."""
    kind = event.get("type", "?")
    if kind == "AllBlocksCleared":
        return f"{replica} AllBlocksCleared"
    tier = tier_of(event.get("medium"), event.get("locality"), event.get("ownership"))
    return f"{replica} {kind} {tier} {len(event.get('block_hashes', []))} blocks"


def watch(endpoints: Sequence[str], seconds: float | None, prompt: Sequence[int] | None,
          as_json: bool = False, topic: str = "") -> int:  # fmt: skip
    """``kvtier events``: follow the replicas' streams for ``seconds`` (None: until
    Ctrl-C), printing each event (not ``as_json``), then the view (``summary``)."""
    sub = Subscriber(endpoints, topic)
    deadline = None if seconds is None else time.monotonic() + seconds
    try:
        while deadline is None or time.monotonic() < deadline:
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            batches = sub.poll(max(0.0, left))
            lines = [] if as_json else [describe(r, e) for r, events in batches for e in events]
            for line in lines:
                print(line, flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
    view = summary(sub.fleet, prompt)
    if as_json:
        print(json.dumps(view, indent=2))
        return 0
    for name, replica in view["replicas"].items():
        tiers = ", ".join(f"{t} {n}" for t, n in replica["blocks"].items()) or "nothing"
        print(f"{name}: holds {tiers}")
        if "prompt" in replica:
            p = replica["prompt"]
            tiers = ", ".join(f"{t} {n}" for t, n in p["per_tier"].items())
            print(f"  prompt: {p['leading_blocks']} leading blocks ({tiers or 'none'})")
    if view["remote"]:
        tiers = ", ".join(f"{t} {n}" for t, n in view["remote"].items())
        print(f"remote, for every replica: {tiers}")
    if "route" in view:
        print(f"route the prompt to: {view['route']}")
    return 0
