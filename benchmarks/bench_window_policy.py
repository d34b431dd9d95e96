"""What a sliding-window model's blocks should keep below vLLM: hit rate against bytes.

A model with sliding-window layers beside full-attention ones (Gemma 3, gpt-oss) needs,
at a hit that ends at position p, every full-attention layer's KV of positions 0..p but
only the window before p of the sliding-window layers. Ways to store it:

- ``every block``: each position holds every layer, so a hit can end at any position
  any request stored;
- ``prompt ends``: each position holds its full-attention layers, and a sliding-window
  layer's KV is stored only as the window before chosen ends: each request's last full
  block and the last block a repeat of it can hit;
- ``+ where prompts part`` (kvtier's): also the position where the request's lookup
  found the stored positions running on past the last window held (where prompts
  diverge: the next request sharing that prefix hits there). kvtier keeps one at a
  reply's end too; the trace has no replies.

A hit ends at the last position of the held chain that has a window.

This models both policies over the Mooncake trace (``../shared/traces``), in whole trace
blocks of 512 tokens (the trace's prompts share and diverge only there), one LRU store of
a given capacity per run (a hit's blocks are touched tail first, so that a chain's tail
goes before its head), and counts bytes as tokens x layers. It measures no speed: the
hit rate (prompt tokens hit / prompt tokens) of each policy at each capacity, as a ratio
to the ceiling, the hit rate of an unbounded store of every block (any cache's best), and
the bytes each policy stores with no bound.

    python benchmarks/bench_window_policy.py [--quick] [--out FILE.json] [--plot FILE.png]
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from _report import Result, print_table, standard_args, write_json

from kvtier.plot import pyplot
from kvtier.replay import TRACE_BLOCK, TraceRequest, distinct_blocks, read_trace

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
CAPACITIES = (0.05, 0.1, 0.2, 0.4, None)  # of every block's unbounded footprint; None: unbounded
POLICIES = ("every block", "prompt ends", "+ where prompts part")


@dataclass(frozen=True)
class WindowedModel:
    """Layers of a model: ``full`` full-attention ones, ``windowed`` with a window of
    ``window`` tokens."""

    name: str
    full: int
    windowed: int
    window: int

    def position_cost(self, policy: str) -> int:
        """Bytes (token-layers) of one stored trace block."""
        layers = self.full + (self.windowed if policy == "every block" else 0)
        return TRACE_BLOCK * layers

    def window_cost(self, end: int) -> int:
        """Bytes (token-layers) of the window before trace block ``end`` (exclusive)."""
        return self.windowed * min(self.window, end * TRACE_BLOCK)


MODELS = (
    WindowedModel("Gemma 3 (5 window : 1 full, 1024 tokens)", 1, 5, 1024),
    WindowedModel("gpt-oss (1 window : 1 full, 128 tokens)", 1, 1, 128),
)


class Store:
    """An LRU store of items of given sizes, bounded by ``capacity`` (None: unbounded)."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.items: OrderedDict[object, int] = OrderedDict()
        self.nbytes = 0

    def __contains__(self, key: object) -> bool:
        return key in self.items

    def touch(self, keys: Iterable[object]) -> None:
        for key in keys:
            self.items.move_to_end(key)

    def put(self, key: object, nbytes: int) -> None:
        if key in self.items:
            self.items.move_to_end(key)
            return
        self.items[key] = nbytes
        self.nbytes += nbytes
        while self.capacity is not None and self.nbytes > self.capacity:
            self.nbytes -= self.items.popitem(last=False)[1]


def replay(
    requests: list[TraceRequest], model: WindowedModel, policy: str, capacity: int | None
) -> tuple[float, int]:
    """(hit rate, bytes held at the end) of ``policy`` over ``requests``."""
    store = Store(capacity)
    hit_tokens = prompt_tokens = 0
    for req in requests:
        ids = req.hash_ids
        full = req.input_length // TRACE_BLOCK  # trace blocks the request stores
        limit = (req.input_length - 1) // TRACE_BLOCK  # never the block of its last token
        held = 0
        while held < min(limit, len(ids)) and ids[held] in store:
            held += 1
        hit = held
        if policy != "every block":
            while hit and ("window", ids[hit - 1]) not in store:
                hit -= 1
        store.touch([("window", ids[hit - 1])] if policy != "every block" and hit else [])
        store.touch(reversed(ids[:hit]))  # the head last: a chain's tail goes first
        hit_tokens += hit * TRACE_BLOCK
        prompt_tokens += req.input_length
        for t in range(full):
            store.put(ids[t], model.position_cost(policy))
        ends = {full, limit} - {0} if policy != "every block" else set()
        if policy == "+ where prompts part" and held > hit:
            ends.add(held)  # where the stored chain ends: the next one sharing it hits there
        for end in sorted(ends):
            store.put(("window", ids[end - 1]), model.window_cost(end))
    return hit_tokens / prompt_tokens, store.nbytes


def main() -> None:
    parser = standard_args(__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(TRACE), help="a Mooncake-format JSONL trace")
    parser.add_argument("--plot", metavar="FILE.png", help="plot hit rate against store size")
    args = parser.parse_args()
    requests = read_trace(args.trace, limit=800 if args.quick else None)
    results: list[Result] = []
    curves: dict[tuple[str, str], list[float]] = {}  # (model, policy): hit rate per capacity
    for model in MODELS:
        # A store's size: a share of the KV of every distinct trace block in every layer.
        footprint = distinct_blocks(requests) * model.position_cost("every block")
        ceiling, _ = replay(requests, model, "every block", None)
        for share in CAPACITIES:
            capacity = None if share is None else int(share * footprint)
            where = "unbounded" if share is None else f"{share:.0%} of all blocks"
            for policy in POLICIES:
                print(f"{model.name}, {where}, {policy} ...", file=sys.stderr)
                rate, nbytes = replay(requests, model, policy, capacity)
                curves.setdefault((model.name, policy), []).append(rate)
                case = f"{model.name}: {policy}, store {where}"
                results.append(
                    Result(
                        case,
                        "hit rate",
                        "fraction",
                        rate,
                        ceiling=ceiling,
                        ceiling_what="every block, unbounded",
                    )  # fmt: skip
                )
                if share is None:
                    results.append(
                        Result(
                            f"{model.name}: {policy}, bytes stored unbounded",
                            "bytes",
                            "of all blocks",
                            nbytes / footprint,
                            higher_is_better=False,
                        )  # fmt: skip
                    )
    print_table(results, "Sliding-window storage policies over the Mooncake trace (a model)")
    if args.out:
        write_json(args.out, "bench_window_policy", results, extra={"requests": len(requests)})
    if args.plot:
        plot(curves, args.plot)


def plot(curves: dict[tuple[str, str], list[float]], path: str) -> None:
    """Hit rate against store size, a panel per model and a line per policy."""
    plt = pyplot()
    models = list(dict.fromkeys(model for model, _ in curves))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), sharey=True)
    shares = [share * 100 for share in CAPACITIES if share is not None]
    for ax, model in zip(axes, models):
        for policy in POLICIES:
            *bounded, unbounded = curves[model, policy]
            line = ax.plot(shares, bounded, marker="o", label=policy)[0]
            ax.axhline(unbounded, color=line.get_color(), linestyle=":", linewidth=1)
        ax.set(title=model, xlabel="store size, % of all blocks' KV (dotted: unbounded)")
    axes[0].set_ylabel("prompt tokens hit")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
