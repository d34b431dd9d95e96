"""The ``kvtier`` command.

Exit codes: 0 success; 1 a tier could not be reached, or a confirmation was declined;
2 a bad config, argument or missing optional dependency (the message names it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

from kvtier import admin
from kvtier.cache import TieredCache
from kvtier.config import SPILL_TIERS, ConfigError, KVTierConfig, default_config, load_config
from kvtier.eviction import POLICIES, policies_of, with_policy
from kvtier.layout import KVLayout
from kvtier.namespaces import NamespaceRecord
from kvtier.plot import PlotUnavailable, plot_replay, pyplot
from kvtier.progress import progress
from kvtier.replay import optimal_hits, read_trace, replay, sized_to_shares
from kvtier.tiers.base import SpillTier, TierError
from kvtier.tracegen import WorkloadShape, generate, write_trace
from kvtier.workloads import ChatShape


class UsageError(Exception):
    """A command line that cannot be carried out; the message says why."""


@contextmanager
def _scratch_config(config: KVTierConfig, args: argparse.Namespace) -> Iterator[KVTierConfig]:
    """``config`` for one CLI run: its disk tier (if any) in a fresh scratch directory,
    so every run starts cold, unless ``--keep-cache``."""
    with tempfile.TemporaryDirectory(prefix="kvtier-") as scratch:
        disk = config.tiers.disk
        if disk is not None and not args.keep_cache:
            disk = replace(disk, path=f"{scratch}/lmdb")
            config = replace(config, tiers=replace(config.tiers, disk=disk))
        yield config


@contextmanager
def _open_cache(config: KVTierConfig, args: argparse.Namespace) -> Iterator[TieredCache]:
    """A cache for one CLI run, on a scratch disk tier (``_scratch_config``)."""
    with _scratch_config(config, args) as config, TieredCache(config, device=args.device) as cache:
        yield cache


def demo(args: argparse.Namespace) -> int:
    """Serve a multi-turn chat on a real (random-weight) Llama through every configured
    tier; compare each turn with a recompute (transformers) or with vLLM alone."""
    try:
        from kvtier import demo as hf_demo
    except ImportError as e:
        raise UsageError(
            f"kvtier demo needs transformers ({e}): pip install 'kvtier[hf]'"
        ) from None
    shape = ChatShape(args.conversations, args.turns)
    if args.engine == "vllm":
        try:
            import vllm  # noqa: F401 - only to say what is missing before any work
        except ImportError:
            raise UsageError("kvtier demo --engine vllm needs vLLM: pip install vllm") from None
        from kvtier import demo_vllm

        return demo_vllm.run(args.config, shape, args.json, args.plot)
    with _scratch_config(_config(args.config), args) as config:
        return hf_demo.run(config, shape, args.device, args.json, args.plot)


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def capacity_blocks(cache: TieredCache) -> int:
    """Blocks the cache's tiers hold together: GPU pool, host pool and disk tier (its
    capacity in blocks, ignoring chunk headers). Redis is not counted."""
    disk = cache.config.tiers.disk
    return (
        cache.gpu.num_blocks
        + (cache.host.num_blocks if cache.host else 0)
        + (disk.capacity // cache.layout.block_nbytes if disk else 0)
    )


def replay_trace(args: argparse.Namespace) -> int:
    """Replay a request trace through the configured tiers (sized by ``--shares``, evicting
    by ``--policy`` where given); print hit rates and latencies, and the hit rate of the
    offline optimum of the same total capacity."""
    config = load_config(args.config)
    if args.policy:
        config = with_policy(config, args.policy)
    if args.plot:
        pyplot()  # before the replay: a missing matplotlib should not cost a whole run
    try:
        requests = read_trace(args.trace, args.limit)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot replay {args.trace}: {e}") from None
    if args.shares:
        try:
            config = sized_to_shares(config, requests, args.shares)
        except ValueError as e:
            raise UsageError(f"--shares: {e}") from None
    with _open_cache(config, args) as cache:
        result = replay(cache, requests, lambda r: progress(r, desc="replaying"))
        stats = cache.stats()
        capacity = capacity_blocks(cache)
    served = [requests[i] for i in result.served]
    optimum = optimal_hits(served, capacity, cache.block_size) / max(result.prompt_blocks, 1)
    bs = config.layout.block_size if config.layout else 0
    print(
        f"replayed {result.requests} requests ({result.skipped} skipped: GPU pool full), "
        f"{result.prompt_blocks} prompt blocks of {bs} tokens"
    )
    print(f"{'tier':>6} {'hit blocks':>11} {'hit rate':>9} {'MiB in':>9} {'MiB out':>9}")
    for tier, s in stats.tiers.items():
        n = result.hit_blocks.get(tier, 0)
        print(
            f"{tier:>6} {n:>11} {n / max(result.prompt_blocks, 1):>9.1%} "
            f"{s.bytes_in / 2**20:>9.1f} {s.bytes_out / 2**20:>9.1f}"
        )
    print(
        f" total {sum(result.hit_blocks.values()):>11} {result.hit_rate:>9.1%}   "
        f"ceiling (unbounded cache) {result.ceiling:.1%}"
    )
    print(f"offline optimum (Belady, one cache of {capacity} blocks) {optimum:.1%}")
    policies = policies_of(config)
    print("eviction: " + ", ".join(f"{tier} {policy}" for tier, policy in policies.items()))
    for name, h in (("lookup", stats.lookup_latency), ("prefetch", stats.prefetch_latency)):
        if h.count:
            p50, p90, p99 = (h.percentile(q) * 1e3 for q in (50, 90, 99))
            print(f"{name} latency ms: p50 {p50:.2f}  p90 {p90:.2f}  p99 {p99:.2f}  (n={h.count})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "requests": result.requests,
                    "skipped": result.skipped,
                    "prompt_blocks": result.prompt_blocks,
                    "hit_blocks": result.hit_blocks,
                    "hit_rate": result.hit_rate,
                    "ceiling": result.ceiling,
                    "optimum": optimum,
                    "capacity_blocks": capacity,
                    "eviction": policies,
                    "samples": [asdict(s) for s in result.samples],
                    "stats": asdict(stats),
                },
                f,
            )
    if args.plot:
        title = f"kvtier replay: {Path(args.trace).name}, {result.requests} requests"
        plot_replay(result, args.plot, title)
        print(f"plot written to {args.plot}")
    return 0


def make_workload(args: argparse.Namespace) -> int:
    """Write a synthetic trace (chats, RAG, agent loops, one-offs) in Mooncake's format."""
    shape = WorkloadShape(duration_s=args.duration)
    lines = generate(shape, args.seed)
    try:
        write_trace(args.out, lines)
    except OSError as e:
        raise UsageError(f"cannot write {args.out}: {e}") from None
    distinct = len({h for line in lines for h in line["hash_ids"]})
    print(f"{len(lines)} requests, {distinct} distinct blocks of 512 tokens -> {args.out}")
    return 0


def _config(path: str | None) -> KVTierConfig:
    return default_config() if path is None else load_config(path)


def tier_stats(args: argparse.Namespace) -> int:
    """Print what each configured spill tier holds (Redis per namespace) and what its
    namespaces are; 1 if a tier could not be reached."""
    config = _config(args.config)
    reports = admin.reports(config, admin.configured_tiers(config), args.namespace)
    if args.json:
        print(json.dumps([r.as_json() for r in reports], indent=2))
    elif not reports:
        print("no spill tiers are configured (tiers.disk, tiers.redis)")
    else:
        print(f"{'tier':>6} {'entries':>9} {'stored':>11} {'capacity':>11} {'used':>6}  where")
        for r in reports:
            if r.usage is None:
                print(f"{r.tier:>6}  unavailable: {r.error}")
                continue
            u = r.usage
            capacity = _size(u.capacity) if u.capacity else "unbounded"
            used = f"{u.nbytes / u.capacity:6.1%}" if u.capacity else f"{'-':>6}"
            print(
                f"{r.tier:>6} {u.entries:>9} {_size(u.nbytes):>11} {capacity:>11} {used}  {r.where}"
            )
        _print_records(reports)
    return 1 if any(r.error for r in reports) else 0


def _print_records(reports: Sequence[admin.TierReport]) -> None:
    """One line per namespace record of ``reports``: namespace, engine, shard, layout and
    the tiers that keep it."""
    records: dict[str, NamespaceRecord] = {}
    kept_in: dict[str, list[str]] = {}
    for r in reports:
        for record in r.records:
            records.setdefault(record.name, record)
            kept_in.setdefault(record.name, []).append(r.tier)
    if records:
        print("namespaces, as each engine shard recorded itself when it opened the tiers:")
    for name, rec in sorted(records.items()):
        print(
            f"  {rec.namespace}  {rec.engine}  shard {rec.shard}  {rec.layout.describe()}  "
            f"(in {', '.join(kept_in[name])})"
        )


# Why --namespace cannot pick out the disk tier's values.
_DISK_IS_ONE_STORE = (
    "the disk tier keeps every namespace's values in one store, under keys that do not "
    "name the namespace: inspect or clear it whole (without --namespace)"
)


def inspect_tier(args: argparse.Namespace) -> int:
    """List the first chunks of one spill tier (Redis: of each namespace, or of
    ``--namespace``): key, blocks, position, bytes, check."""
    config = _config(args.config)
    [name] = admin.configured_tiers(config, [args.tier])
    bad = 0
    if name == "disk":
        if args.namespace:
            raise UsageError(f"--namespace: {_DISK_IS_ONE_STORE}")
        with admin.open_tier(config, name) as tier:
            if tier is None:
                print(f"{name}: no store at {admin.where(config, name)} yet")
                return 0
            namespaces = admin.store_namespaces(config, tier)
            layouts = [layout for ns in namespaces for layout in ns.layouts]
            bad = _list_chunks(tier, f"{name} ({admin.where(config, name)})", layouts, args.limit)
    else:
        namespaces = admin.tier_namespaces(config, name)
        admin.check_namespace(args.namespace, namespaces)
        if not namespaces:
            print(f"{name}: no namespace is recorded at {admin.where(config, name)}")
        for ns in namespaces:
            if args.namespace in (None, ns.name):
                with admin.open_tier(config, name, ns.name) as tier:
                    title = f"{name} ({admin.where(config, name, ns.name)})"
                    bad += _list_chunks(tier, title, ns.layouts, args.limit)
    if bad:
        print(f"{bad} bad values (a cache that reads one deletes it and counts it as rejected)")
    return 0


def _list_chunks(tier: SpillTier, title: str, layouts: Sequence[KVLayout], limit: int) -> int:
    """Print ``tier``'s first ``limit`` chunks, each checked against the one of ``layouts``
    its header names; returns how many are bad."""
    usage = tier.usage()
    print(
        f"{title}: {usage.entries} chunks, {_size(usage.nbytes)}; "
        f"the first {min(limit, usage.entries)}:"
    )
    if not usage.entries:
        return 0
    print(f"{'key':<32} {'blocks':>6} {'first':>7} {'bytes':>11}  check")
    bad = 0
    with admin.codecs_for(layouts) as codecs:
        for c in admin.list_chunks(tier, codecs, limit):
            blocks = "-" if c.num_blocks is None else c.num_blocks
            first = "-" if c.first_position is None else c.first_position
            bad += c.problem is not None
            check = c.problem or "ok"
            print(f"{c.key:<32} {blocks:>6} {first:>7} {_size(c.nbytes):>11}  {check}")
    return bad


def clear_tiers(args: argparse.Namespace) -> int:
    """Delete every value of the configured spill tiers (or of ``--tier``; in Redis, of
    each recorded namespace, or of ``--namespace`` only), after asking. The namespace
    records stay."""
    config = _config(args.config)
    names = admin.configured_tiers(config, [args.tier] if args.tier else None)
    if not names:
        print("no spill tiers are configured (tiers.disk, tiers.redis): nothing to clear")
        return 0
    if args.namespace and args.tier == "disk":
        raise UsageError(f"--namespace: {_DISK_IS_ONE_STORE}")
    targets: list[tuple[str, str | None]] = []  # (tier, Redis namespace)
    for name in names:
        if name == "disk":
            if args.namespace:
                print(f"disk: kept: {_DISK_IS_ONE_STORE}")
            else:
                targets.append((name, None))
            continue
        namespaces = admin.tier_namespaces(config, name)
        admin.check_namespace(args.namespace, namespaces)
        if not namespaces:
            print(f"{name}: no namespace is recorded at {admin.where(config, name)}")
        targets += [(name, ns.name) for ns in namespaces if args.namespace in (None, ns.name)]
    if not targets:
        return 0
    where = "; ".join(f"{n} at {admin.where(config, n, ns)}" for n, ns in targets)
    if not args.yes:
        if not sys.stdin.isatty():
            raise UsageError("clear: stdin is not a terminal to confirm on; pass --yes")
        answer = input(f"Delete every kvtier value in {where}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
    for name, namespace in targets:
        with admin.open_tier(config, name, namespace) as tier:
            removed = tier.clear() if tier is not None else 0
        of = f" of namespace {namespace}" if namespace else ""
        print(f"{name}: deleted {removed} values{of}")
    return 0


def watch_events(args: argparse.Namespace) -> int:
    """Follow vLLM replicas' KV event streams and keep a router's view of them
    (``kvtier.events``): per replica the blocks per tier, and for ``--prompt-file`` how
    many leading blocks each replica serves from which tier."""
    from kvtier import events

    try:
        prompt = events.read_prompt(args.prompt_file) if args.prompt_file else None
    except (OSError, ValueError) as e:
        raise UsageError(f"--prompt-file: {e}") from e
    try:
        return events.watch(args.endpoints, args.seconds, prompt, args.json, args.topic)
    except ImportError as e:
        raise UsageError(f"events: needs pyzmq (vLLM installs it): {e}") from e


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "demo", help="a Llama serving a multi-turn chat through every tier, vs recompute"
    )
    p.add_argument("--config", help="YAML config (default: the embedded default)")
    p.add_argument(
        "--engine",
        choices=["hf", "vllm"],
        default="hf",
        help="transformers on kvtier's native API (default), or vLLM with kvtier's connector",
    )
    p.add_argument("--conversations", type=_positive_int, default=4)
    p.add_argument("--turns", type=_positive_int, default=6)
    p.add_argument("--device", help="torch device of the model and the GPU tier (default: cpu)")
    p.add_argument("--json", metavar="OUT.json", help="write every turn and the summary here")
    p.add_argument("--plot", metavar="OUT.png", help="draw TTFT and tokens per tier per turn")
    p.add_argument(
        "--keep-cache",
        action="store_true",
        help="use the configured disk path instead of a fresh scratch directory",
    )
    p.set_defaults(func=demo)
    r = sub.add_parser("replay", help="replay a request trace (Mooncake JSONL format)")
    r.add_argument("trace", help="JSONL trace: timestamp, input_length, hash_ids per line")
    r.add_argument("--config", default="configs/replay.yaml", help="YAML config")
    r.add_argument("--limit", type=int, help="replay only the first N requests")
    r.add_argument("--json", help="write the result as JSON here")
    r.add_argument("--device", help="torch device of the GPU tier (default: from the config)")
    r.add_argument("--keep-cache", action="store_true", help="use the configured disk path")
    r.add_argument("--plot", metavar="OUT.png", help="draw the hit rate over time here")
    r.add_argument(
        "--policy",
        choices=POLICIES,
        help="evict by this policy in every tier (default: each tier's configured one)",
    )
    r.add_argument(
        "--shares",
        type=_shares,
        metavar="GPU,HOST[,DISK]",
        help="size the GPU pool, host pool and disk tier as percentages of the trace's "
        "distinct blocks (without DISK: no disk tier), e.g. 0.5,5,30",
    )
    r.set_defaults(func=replay_trace)
    w = sub.add_parser(
        "workload",
        help="write a synthetic trace (chats, RAG, agent loops, one-offs) to replay",
    )
    w.add_argument("out", help="JSONL trace to write (Mooncake's format)")
    w.add_argument("--seed", type=int, default=0, help="the same seed writes the same trace")
    w.add_argument(
        "--duration",
        type=_positive_float,
        default=WorkloadShape.duration_s,
        help=f"seconds during which sessions start (default {WorkloadShape.duration_s:g})",
    )
    w.set_defaults(func=make_workload)
    config_help = "YAML config (default: the embedded default)"
    namespace_help = "only this key namespace (as stats lists them; default: every one)"
    s = sub.add_parser("stats", help="what each configured spill tier holds")
    s.add_argument("--config", help=config_help)
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.add_argument("--namespace", help=namespace_help)
    s.set_defaults(func=tier_stats)
    i = sub.add_parser(
        "inspect",
        help="list a spill tier's chunks and check each (reading counts as a use)",
    )
    i.add_argument("--config", help=config_help)
    i.add_argument("--tier", required=True, choices=SPILL_TIERS)
    i.add_argument("--limit", type=_positive_int, default=20, help="chunks to show (default 20)")
    i.add_argument("--namespace", help=f"Redis: {namespace_help}")
    i.set_defaults(func=inspect_tier)
    c = sub.add_parser("clear", help="delete every value in the configured spill tiers")
    c.add_argument("--config", help=config_help)
    c.add_argument("--tier", choices=SPILL_TIERS, help="only this tier (default: all)")
    c.add_argument("--namespace", help=f"Redis: {namespace_help}")
    c.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    c.set_defaults(func=clear_tiers)
    e = sub.add_parser(
        "events", help="follow vLLM replicas' KV events: blocks per tier, a prompt's hits"
    )
    e.add_argument(
        "endpoints",
        nargs="+",
        metavar="ENDPOINT",
        help="a replica's --kv-events-config endpoint as a client reaches it (tcp://host:port)",
    )
    e.add_argument("--prompt-file", help="token ids (a JSON list, or separated by spaces)")
    e.add_argument(
        "--seconds", type=_positive_float, help="stop after this long (default: at Ctrl-C)"
    )
    e.add_argument("--json", action="store_true", help="print only the final view, as JSON")
    e.add_argument("--topic", default="", help="the publisher's topic (default: all)")
    e.set_defaults(func=watch_events)
    return parser


def _shares(text: str) -> tuple[float, ...]:
    try:
        shares = tuple(float(part) for part in text.split(","))
    except ValueError:
        shares = ()
    if len(shares) not in (2, 3) or not all(0 < s <= 100 for s in shares):
        raise argparse.ArgumentTypeError(
            f"expected 2 or 3 percentages in (0, 100] joined by commas, got {text!r}"
        )
    return shares


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"kvtier: config error: {e}", file=sys.stderr)
        return 2
    except (UsageError, PlotUnavailable, admin.UnknownNamespace) as e:
        print(f"kvtier: {e}", file=sys.stderr)
        return 2
    except TierError as e:
        print(f"kvtier: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
