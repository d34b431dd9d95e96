"""A minimal KV-cache-aware router: each prompt goes to the vLLM replica that holds the
longest prefix of it, weighing GPU over host memory over disk over Redis.

Every replica runs vLLM's OpenAI server with kvtier's connector and KV events on
(README, "Routing by what every replica holds"); the router subscribes to every
replica's events (``kvtier.events``), and for each prompt picks a replica and sends
the request there over HTTP:

    python examples/route_by_prefix.py \\
        --replica http://10.0.0.1:8000=tcp://10.0.0.1:5557 \\
        --replica http://10.0.0.2:8000=tcp://10.0.0.2:5557 \\
        --prompt-file turn1.json --prompt-file turn2.json

A prompt file holds token ids (a JSON list). A ZMQ subscriber sees only what is
published after it joined: the router listens ``--listen`` seconds before each prompt.
Blocks in Redis (locality REMOTE) count for every replica: a prefix held only there
goes to the first replica of those that score the same.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from collections.abc import Sequence

from kvtier.events import PrefixMatch, Subscriber, choose, read_prompt


class Router:
    """Replicas by their KV event endpoint, each with its server's URL."""

    def __init__(self, replicas: dict[str, str]) -> None:
        self.urls = replicas
        self.subscriber = Subscriber(list(replicas))

    def pick(self, prompt: Sequence[int], listen: float) -> tuple[PrefixMatch, list[PrefixMatch]]:
        """The replica for ``prompt`` after ``listen`` seconds of events, and every
        replica's match."""
        self.subscriber.poll(listen)
        matches = self.subscriber.fleet.match(prompt)
        return choose(matches), matches

    def send(self, endpoint: str, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """A greedy completion of ``prompt`` by the replica of ``endpoint``: its tokens."""
        url = self.urls[endpoint]
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
            model = json.load(response)["data"][0]["id"]
        body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens,
                "temperature": 0.0, "return_token_ids": True}  # fmt: skip
        request = urllib.request.Request(
            f"{url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.load(response)["choices"][0].get("token_ids") or []

    def close(self) -> None:
        self.subscriber.close()


def _replica(text: str) -> tuple[str, str]:
    url, sep, endpoint = text.partition("=")
    if not sep or not url.startswith("http") or not endpoint.startswith("tcp://"):
        raise argparse.ArgumentTypeError(f"expected HTTP_URL=tcp://HOST:PORT, got {text!r}")
    return endpoint, url.rstrip("/")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replica", type=_replica, action="append", required=True,
                        metavar="HTTP_URL=EVENTS_ENDPOINT")  # fmt: skip
    parser.add_argument("--prompt-file", action="append", required=True)
    parser.add_argument("--listen", type=float, default=1.0, help="seconds of events first")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args(argv)

    router = Router(dict(args.replica))
    try:
        for path in args.prompt_file:
            prompt = read_prompt(path)
            best, matches = router.pick(prompt, args.listen)
            for m in matches:
                tiers = ", ".join(f"{t} {n}" for t, n in m.blocks_per_tier().items()) or "none"
                print(f"{path}: {m.replica} holds {m.num_blocks} leading blocks ({tiers})")
            tokens = router.send(best.replica, prompt, args.max_tokens)
            print(f"{path}: routed to {router.urls[best.replica]}; reply {tokens}", flush=True)
    finally:
        router.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
