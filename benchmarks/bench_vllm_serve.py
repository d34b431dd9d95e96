"""Serving benchmark with vLLM's own client: vLLM alone, with kvtier, and with a connector
that does nothing, on traffic that reuses prefixes and traffic that does not.

Every server is vLLM's OpenAI-compatible server as the README starts it
(``kvtier.integrations.vllm_server``), on kvtier's demo Llama (random weights, float32),
vLLM's defaults but for the machine's flags (``--gpu-memory-utilization 0.3``) and a
small KV pool (``--num-gpu-blocks-override 48``: a few prompts' worth, as on a busy GPU),
and with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``, the setting the README gives for vLLM's CPU
build on a small machine (``--vllm-default-cores`` leaves it unset):

- ``alone``: no connector.
- ``alone again``: the same, on ``random`` only, started apart from ``alone`` in each
  repeat: how far two servers of the same build differ within one run, the noise
  floor of every ratio to vLLM alone (not in ``--quick``).
- ``noop``: a connector whose every hook does nothing (``_noop_connector.py``): what
  having any connector configured costs vLLM, apart from kvtier's work.
- ``kvtier``: ``configs/vllm.yaml`` as shipped (host pool, disk, Redis), its disk and
  Redis key prefix new for every server.
- ``kvtier disk`` / ``kvtier redis``: the same with a host pool smaller than the
  workload's prefixes (``KVTIER_CPU_CAPACITY``), so hits come from the disk tier, or,
  with the disk tier left out of the config, from Redis.
- ``..., no staging``: the same without staging a waiting request's hit into the host
  pool (``KVTIER_STAGE_SHARE=0``).
- ``... restarted``: a server that served the workload's prime prompts, then restarted
  on the same tiers, so the prefixes are on disk (or only in Redis) and nowhere else;
  it serves a few other prompts of the same shape before the timed run (a warm engine).

The client is vLLM's own (``vllm.benchmarks.serve``, the code behind ``vllm bench
serve``), greedy (``--temperature 0``), in this process. Workloads:

- ``random``: prompts that share nothing (vLLM's ``random`` dataset).
- ``shared``: 8 long prefixes (2k tokens), each behind 12 questions (6 with
  ``--quick``), in random order (``prefix_repetition``): more prefixes than vLLM's
  pool holds. A prefix's first request is a miss with or without kvtier, as is one
  sent while the first still computes it.
- ``chat``: multi-turn chats from kvtier's workload generator (``kvtier.tracegen``,
  chats only), replayed at their arrival times (vLLM's ``timed_trace`` dataset): turns
  whose prompts grow by every earlier message and reply, behind shared system prompts.
- ``spill``: a prime (untimed) computes 12 prefixes of 2k tokens, three times what
  the host pool of ``kvtier disk`` / ``kvtier redis`` holds, so most of them live on
  disk or only in Redis; then questions on them arrive at once, more in flight than
  vLLM's pool holds, so requests queue and their hits come from disk or Redis. Every
  server is also compared with ``kvtier``, whose host pool holds every prefix: the
  most any staging could give.
- ``spill 8k``: the same at 8k-token prefixes, on servers of their own (``... 8k``:
  vLLM's pool and model length for such prompts, a host pool of four such prefixes).
  (Not in ``--quick``.)
- ``burst``: eight requests at once on eight 2k-token prefixes that an earlier run
  (the prime, untimed) stored: in the host pool (``kvtier``, the prime ending with
  prompts that push them out of vLLM's pool), on disk or only in Redis (restarted).
  Most of them wait in vLLM's queue. (Not in ``--quick``: it restarts servers.)

Each repeat starts every server once (in an order that alternates between repeats),
with fresh tiers, and runs its workloads on it (``--quick``: one repeat, fewer
prompts, no ``no staging`` servers, the spill workload on disk only). A row is the
median over the repeats; its ratio is to vLLM alone's median in the same run. Each
target's ratio is also given per repeat, against the reference started in the same
repeat (a few minutes apart): these machines' speed drifts by more than some targets
between one run and the next, and the spread of the per-repeat ratios shows how far a
ratio of medians can be trusted.
Replies are compared with vLLM alone's of the same repeat, prompt by prompt (greedy,
so they should be equal).

The hook table gives what each of kvtier's connector hooks costs per engine step, read
from the counters the connector reports to vLLM's ``/metrics``
(``vllm:kvtier_hook_calls_total`` / ``vllm:kvtier_hook_seconds_total``; the scheduler's
hooks run in vLLM's engine-core process, the workers' in each worker's,
``get_kv_connector_stats`` in both; the counters arrive once a second, so a run's
figures may take in up to a second of steps before or after it). Beside it, each kvtier
server's blocks that vLLM recomputed because kvtier reported them not loaded
(``vllm:kvtier_load_error_blocks_total``): a failed load costs its request a recompute,
which a mean TTFT alone does not tell apart from a slow read.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import re
import statistics
import tempfile
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from _report import Result, machine_info, print_table, standard_args, summarize, write_json
from _ttft import bench_redis_url, delete_prefix

from kvtier.demo import DEMO_MODEL
from kvtier.integrations.vllm_engine import save_model
from kvtier.integrations.vllm_metrics import HOOKS, SCHEDULER_HOOKS, STATS_HOOK, WORKER_HOOKS
from kvtier.integrations.vllm_server import SMALL_MACHINE_CORES, VLLMServer, kv_transfer_config
from kvtier.progress import progress
from kvtier.tracegen import WorkloadShape, generate, write_trace

BENCHMARK = "bench_vllm_serve"
LOAD_ERRORS = "vllm:kvtier_load_error_blocks_total"  # vLLM's counter, any labels
ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "vllm.yaml"
DTYPE = "float32"  # bf16 matmuls are several times slower on CPUs without AMX
POOL_BLOCKS = 48  # vLLM's own KV pool: 48 blocks of 128 tokens
MAX_MODEL_LEN = (POOL_BLOCKS - 1) * 128  # one block of the pool is vLLM's own
LONG_POOL_BLOCKS = 200  # the 8k servers' pool: three 8k-token prompts
LONG_MODEL_LEN = 65 * 128  # an 8k-token prefix, its question and its reply


def server_args(pool_blocks: int, max_model_len: int) -> list[str]:
    """The machine's flags, and vLLM's pool and model length."""
    return ["--dtype", DTYPE, "--gpu-memory-utilization", "0.3",
            "--num-gpu-blocks-override", str(pool_blocks),
            "--max-model-len", str(max_model_len)]  # fmt: skip


SMALL_HOST = "64MiB"  # 4 prefixes of 2048 tokens of the demo Llama (8 KiB per token)
LONG_HOST = "256MiB"  # 4 prefixes of 8192 tokens
TRACE_TOKENS = 128  # tokens per hash id of the chat trace (its ids name 512-token blocks)
CHAT_OUTPUT = 32  # tokens per reply in the chat workload
CHAT_TIME_SCALE = 1 / 20  # the chat trace replayed 20 times faster than it was drawn
BURST = 8  # requests in the burst, each on a prefix of its own
QUESTION = 24  # tokens after the prefix in the spill and burst workloads' prompts
QUESTION_IDS = itertools.count(1 << 31)  # trace ids of those questions, each its own
SPILL_CONCURRENCY = 6  # requests in flight in the spill workloads
SPILL_8K = ("alone 8k", "kvtier 8k", "kvtier disk 8k", "kvtier disk 8k, no staging",
            "kvtier redis 8k", "kvtier redis 8k, no staging")  # fmt: skip

# Client metrics: (vllm.benchmarks.serve's key, label, higher is better)
METRICS = [
    ("mean_ttft_ms", "TTFT mean", False),
    ("median_ttft_ms", "TTFT median", False),
    ("p99_ttft_ms", "TTFT p99", False),
    ("median_itl_ms", "ITL median", False),
    ("p99_itl_ms", "ITL p99", False),
    ("median_tpot_ms", "TPOT median", False),
    ("p99_tpot_ms", "TPOT p99", False),
    ("output_throughput", "output tok/s", True),
]
UNITS = {"output_throughput": "tok/s"}
CEILINGS = {"alone": "vLLM alone", "alone 8k": "vLLM alone",
            "noop": "vLLM with a connector doing nothing",
            "kvtier": "kvtier, the prefixes in its host pool",
            "kvtier 8k": "kvtier, the prefixes in its host pool"}  # fmt: skip


@dataclass(frozen=True)
class Workload:
    """One run of vLLM's client: its arguments, the servers it runs on, and the client
    arguments of untimed runs before it, if any: ``prime`` stores its prefixes (on a
    ``restarted`` server, before the restart), ``warm`` runs on a restarted server
    before the workload, on prefixes of its own, so that the engine has served traffic
    of the workload's shape since it started, as a server in use has."""

    name: str
    args: list[str]
    servers: tuple[str, ...]
    prime: list[str] | None = None
    warm: list[str] | None = None
    ceiling: str | None = None  # a server every other one is also compared with

    @property
    def alone(self) -> str:
        """The server without a connector that the others are compared with."""
        return self.servers[0]


@dataclass(frozen=True)
class ServerSpec:
    """How a server of the benchmark is started (see the module docstring)."""

    connector: str | None = None  # None, "noop" or "kvtier"
    redis_only: bool = False  # kvtier's config without its disk tier
    small_host: bool = False
    staging: bool = True
    restarted: bool = False  # served the workloads' primes, then restarted on its tiers
    long: bool = False  # vLLM's pool and model length for 8k-token prompts


SERVERS = {
    "alone": ServerSpec(),
    "alone again": ServerSpec(),
    "noop": ServerSpec("noop"),
    "kvtier": ServerSpec("kvtier"),
    "kvtier disk": ServerSpec("kvtier", small_host=True),
    "kvtier disk, no staging": ServerSpec("kvtier", small_host=True, staging=False),
    "kvtier redis": ServerSpec("kvtier", redis_only=True, small_host=True),
    "kvtier redis, no staging": ServerSpec("kvtier", True, True, staging=False),
    "alone 8k": ServerSpec(long=True),
    "kvtier 8k": ServerSpec("kvtier", long=True),
    "kvtier disk 8k": ServerSpec("kvtier", small_host=True, long=True),
    "kvtier disk 8k, no staging": ServerSpec("kvtier", small_host=True, staging=False, long=True),
    "kvtier redis 8k": ServerSpec("kvtier", True, True, long=True),
    "kvtier redis 8k, no staging": ServerSpec("kvtier", True, True, staging=False, long=True),
    "kvtier restarted": ServerSpec("kvtier", restarted=True),
    "kvtier restarted, no staging": ServerSpec("kvtier", staging=False, restarted=True),
    "kvtier redis restarted": ServerSpec("kvtier", redis_only=True, restarted=True),
    "kvtier redis restarted, no staging": ServerSpec(
        "kvtier", redis_only=True, staging=False, restarted=True
    ),
}


@dataclass(frozen=True)
class Target:
    """A condition a row must meet: ``server``'s ``metric`` on ``workload`` against
    ``against``'s, as a ratio ``<=`` (or ``>=`` when higher is better) ``ratio``."""

    workload: str
    server: str
    metric: str
    ratio: float
    against: str = "alone"

    @property
    def case(self) -> tuple[str, str, str]:
        return self.workload, self.server, self.metric


# The conditions the serving issue set: kvtier costs nothing on traffic that does not
# reuse, gains 3x on TTFT where it does, and adds nothing to what any connector costs.
TARGETS = [
    Target("random", "kvtier", "median_itl_ms", 1.03),
    Target("random", "kvtier", "output_throughput", 0.97),
    Target("shared", "kvtier", "mean_ttft_ms", 1 / 3),
    Target("shared", "kvtier", "median_itl_ms", 1.05),
    *(Target(w, "kvtier", "median_itl_ms", 1.03, "noop") for w in ("random", "shared", "chat")),
    *(Target("spill", s, "median_itl_ms", 1.03, "noop") for s in ("kvtier disk", "kvtier redis")),
    # Staging: queued requests' disk and Redis hits are host hits by the time they run.
    Target("burst", "kvtier restarted", "mean_ttft_ms", 1.2, "kvtier"),
    Target("burst", "kvtier redis restarted", "mean_ttft_ms", 1.5, "kvtier"),
    *(
        Target(w, s, "mean_ttft_ms", 1 / 1.3, f"{s}, no staging")
        for w, s in (
            ("spill", "kvtier disk"),
            ("spill", "kvtier redis"),
            ("spill 8k", "kvtier disk 8k"),
            ("spill 8k", "kvtier redis 8k"),
        )
    ),  # fmt: skip
]

# Figures held against each other per repeat with no target: two servers of vLLM alone.
FLOOR = [("random", "alone again", metric, "alone")
         for metric in ("median_itl_ms", "output_throughput")]  # fmt: skip


@dataclass
class Run:
    """What one server did on one workload in one repeat."""

    metrics: dict[str, float]
    texts: list[str]
    hooks: dict[str, tuple[float, float]] = field(default_factory=dict)  # calls, seconds
    load_errors: float = 0.0  # blocks kvtier reported not loaded (vLLM recomputed them)


def workloads(quick: bool, work: Path) -> list[Workload]:
    """The workloads, smaller with ``quick``."""
    n = 1 if quick else 2
    kvtier = ("alone", "noop", "kvtier")
    unshared_servers = kvtier if quick else (*kvtier, "alone again")
    spill_servers = ("alone", "noop", "kvtier", "kvtier disk")  # --quick: spill to disk only
    if not quick:
        spill_servers += ("kvtier redis", "kvtier disk, no staging", "kvtier redis, no staging")
    chat = work / "chat.jsonl"
    lines = generate(WorkloadShape(duration_s=300, chat_rate=0.2, rag_rate=0, agent_rate=0,
                                   oneoff_rate=0), seed=0)  # fmt: skip
    for line in lines:  # replies short enough for a CPU, prompts within the model's length
        line["output_length"] = min(line["output_length"], CHAT_OUTPUT)
    fits = [x for x in lines if len(x["hash_ids"]) * TRACE_TOKENS + CHAT_OUTPUT <= MAX_MODEL_LEN]
    write_trace(chat, fits)

    def prefixes(num: int, per: int, output: int, length: int = 2048) -> list[str]:
        return (
            f"--dataset-name prefix_repetition --prefix-repetition-prefix-len {length} "
            f"--prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes {num} "
            f"--prefix-repetition-output-len {output} --num-prompts {num * per}"
        ).split()

    unshared = "--dataset-name random --random-input-len 256 --random-output-len 128"
    trace = f"--dataset-name timed_trace --dataset-path {chat}"
    trace += f" --timed-trace-chunk-hash-size {TRACE_TOKENS}"
    trace += f" --timed-trace-sec-multiplier {CHAT_TIME_SCALE / 1000}"  # the trace's ms, sped up
    spill_2k = spill(work, "spill", prefix_ids(1 << 29, 12, 16), 2 * n, spill_servers, "kvtier")
    not_quick = [] if quick else [
        spill(work, "spill 8k", prefix_ids(3 << 29, 8, 64), 2, SPILL_8K, "kvtier 8k"),
        burst(work),
    ]  # fmt: skip
    return [
        Workload(
            "random",
            f"{unshared} --num-prompts {12 * n} --max-concurrency 2".split(),
            unshared_servers,
        ),
        Workload("shared", [*prefixes(8, 6 * n, 32), "--max-concurrency", "2"], kvtier),
        Workload("chat", f"{trace} --num-prompts {24 * n} --max-concurrency 2".split(), kvtier),
        spill_2k,
        *not_quick,
    ]


def prefix_ids(first: int, count: int, runs: int) -> list[list[int]]:
    """``count`` prefixes of ``runs`` ids each (a 128-token run of tokens per id), from
    ``first`` on: ids of their own (the chat trace's tokens are drawn from ids too)."""
    return [list(range(first + runs * i, first + runs * (i + 1))) for i in range(count)]


def trace(work: Path, name: str, prompts: list[list[int]], output: int) -> list[str]:
    """Client arguments that send ``prompts`` (prefix ids), each with a question of its
    own (``QUESTION`` tokens), all at once, asking for ``output`` tokens each (vLLM's
    ``timed_trace`` dataset)."""
    path = work / f"{name.replace(' ', '-')}.jsonl"
    write_trace(path, [{"timestamp": 0, "input_length": len(ids) * TRACE_TOKENS + QUESTION,
                        "output_length": output, "hash_ids": [*ids, next(QUESTION_IDS)]}
                       for ids in prompts])  # fmt: skip
    return (f"--dataset-name timed_trace --dataset-path {path} --timed-trace-chunk-hash-size "
            f"{TRACE_TOKENS} --num-prompts {len(prompts)}").split()  # fmt: skip


def spill(
    work: Path,
    name: str,
    prefixes: list[list[int]],
    per: int,
    servers: tuple[str, ...],
    ceiling: str,
) -> Workload:
    """A ``spill`` workload: a prime computes each of ``prefixes`` once (more than the
    host pool of the ``kvtier disk`` / ``redis`` servers holds, so most of them live on
    disk or only in Redis), then ``per`` questions on each, in random order, arrive at
    once, ``SPILL_CONCURRENCY`` in flight: more than vLLM's pool holds, so requests queue."""
    prime = [*trace(work, f"{name} prime", prefixes, 1), "--max-concurrency", "1"]
    order = random.Random(0).sample(prefixes * per, len(prefixes) * per)
    timed = [*trace(work, name, order, 16), "--max-concurrency", str(SPILL_CONCURRENCY)]
    return Workload(name, timed, servers, prime, ceiling=ceiling)


def burst(work: Path) -> Workload:
    """The ``burst`` workload: its prime and its burst (``BURST`` 2k-token prefixes, a
    question each, all at once)."""
    prefixes = prefix_ids(1 << 30, BURST + 3, 16)
    # The prime ends with 3 prompts that fill vLLM's pool (48 blocks): the burst's
    # prefixes are then only in kvtier's tiers. A restarted server is warmed with those 3.
    prime = [*trace(work, "burst prime", prefixes, 4), "--max-concurrency", "1"]
    warm = [*trace(work, "burst warm", prefixes[BURST:], 4), "--max-concurrency", "2"]
    servers = ("alone", "kvtier", "kvtier restarted", "kvtier restarted, no staging",
               "kvtier redis restarted", "kvtier redis restarted, no staging")  # fmt: skip
    return Workload("burst", trace(work, "burst", prefixes[:BURST], 4), servers, prime, warm)


class Servers:
    """Starts each server of the benchmark by name, each kvtier one on fresh tiers."""

    def __init__(self, work: Path, redis_url: str | None, default_cores: bool) -> None:
        self.work = work
        self.redis_url = redis_url
        self.env = {} if default_cores else dict(SMALL_MACHINE_CORES)
        self.model = save_model(work / "model", DEMO_MODEL, DTYPE)
        doc = yaml.safe_load(CONFIG.read_text())  # ${VARS} stay, the cache expands them
        del doc["tiers"]["disk"]
        doc["tiers"]["spill_order"] = ["redis"]
        self.redis_only = work / "vllm-redis-only.yaml"
        self.redis_only.write_text(yaml.safe_dump(doc))
        self.prefixes: list[str] = []
        self._started = 0

    def names(self, workloads: list[Workload]) -> list[str]:
        """Every server some workload runs on (Redis ones only with a Redis)."""
        names = list(dict.fromkeys(s for w in workloads for s in w.servers))
        return [s for s in names if not SERVERS[s].redis_only or self.redis_url]

    def tiers(self) -> dict[str, str]:
        """The environment of a kvtier server's own tiers: a new disk directory and
        Redis key prefix."""
        self.prefixes.append(f"kvtier-bench-serve-{uuid.uuid4().hex[:8]}")
        cache = self.work / f"cache-{len(self.prefixes)}"
        return {"KVTIER_CACHE_DIR": str(cache), "KVTIER_REDIS_PREFIX": self.prefixes[-1]}

    @contextlib.contextmanager
    def start(self, name: str, tiers: dict[str, str]) -> Iterator[VLLMServer]:
        """Server ``name`` (``SERVERS``); a kvtier one on ``tiers``."""
        spec = SERVERS[name]
        self._started += 1
        env = dict(self.env)
        args = (
            server_args(LONG_POOL_BLOCKS, LONG_MODEL_LEN)
            if spec.long
            else server_args(POOL_BLOCKS, MAX_MODEL_LEN)
        )
        config = None
        if spec.connector == "noop":
            env["PYTHONPATH"] = str(Path(__file__).parent)
            transfer = kv_transfer_config(CONFIG, "_noop_connector", "NoOpConnector")
            args += ["--kv-transfer-config", transfer]
        elif spec.connector == "kvtier":
            config = self.redis_only if spec.redis_only else CONFIG
            env |= tiers
            if self.redis_url:
                env["KVTIER_REDIS_URL"] = self.redis_url
            if spec.small_host:
                env["KVTIER_CPU_CAPACITY"] = LONG_HOST if spec.long else SMALL_HOST
            if not spec.staging:
                env["KVTIER_STAGE_SHARE"] = "0"
        log = self.work / f"vllm-{self._started}-{name.replace(' ', '-').replace(',', '')}.log"
        with VLLMServer(self.model, config, args, env=env, log_path=log) as server:
            yield server

    def clean(self) -> None:
        """Delete the Redis keys the kvtier servers wrote."""
        for prefix in self.prefixes if self.redis_url else ():
            delete_prefix(self.redis_url, prefix)


def drive(server: VLLMServer, workload: Workload, log: Path, args: list[str] | None = None) -> Run:
    """Run vLLM's serving client on ``server`` (its output goes to ``log``): the
    workload, or client ``args`` of its (its prime, its warm-up)."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--base-url", server.url, "--model", server.model, "--temperature", "0",
        "--seed", "0", "--save-detailed", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        *(args or workload.args),
    ])  # fmt: skip
    before = server.metrics()
    with open(log, "a") as out, contextlib.redirect_stdout(out):
        result = serve(args)
    after = server.metrics()
    if result["completed"] != len(result["generated_texts"]) or result["completed"] == 0:
        raise SystemExit(f"{workload.name}: {result['completed']} requests completed; see {log}")
    metrics = {key: float(result[key]) for key, _, _ in METRICS}
    errors = sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith(LOAD_ERRORS))
    return Run(metrics, list(result["generated_texts"]), hook_costs(before, after), errors)


def hook_costs(before: dict[str, float], after: dict[str, float]) -> dict[str, tuple[float, float]]:
    """Per hook: (calls, seconds) between two reads of vLLM's ``/metrics``."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, value in after.items():
        found = re.match(r'vllm:kvtier_hook_(calls|seconds)_total\{.*hook="([^"]+)"', name)
        if found:
            what, hook = found.groups()
            out[hook][what == "seconds"] += value - before.get(name, 0.0)
    return {hook: (calls, seconds) for hook, (calls, seconds) in out.items()}


def run(args: Any) -> tuple[list[Result], dict[str, Any]]:
    """Every repeat of every server on its workloads; the rows and the details."""
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-serve-"))
    redis_url = bench_redis_url()
    servers = Servers(work, redis_url, args.vllm_default_cores)
    plan = [w for w in workloads(args.quick, work) if w.name in (args.workloads or [w.name])]
    names = servers.names(plan)
    repeats = args.repeats or (1 if args.quick else 3)
    runs: dict[tuple[str, str], list[Run]] = defaultdict(list)
    order = [(r, names if r % 2 == 0 else names[::-1]) for r in range(repeats)]
    steps = [(r, name) for r, names_r in order for name in names_r]
    try:
        for r, name in progress(steps, desc="servers"):
            mine = [w for w in plan if name in w.servers]
            log, tiers = work / f"client-{r}.log", servers.tiers()
            if SERVERS[name].restarted:
                with servers.start(name, tiers) as server:
                    for workload in (w for w in mine if w.prime):
                        drive(server, workload, log, workload.prime)
            with servers.start(name, tiers) as server:
                for workload in mine:
                    before = workload.warm if SERVERS[name].restarted else workload.prime
                    if before:
                        drive(server, workload, log, before)
                    runs[workload.name, name].append(drive(server, workload, log))
    finally:
        servers.clean()
    print(f"work directory (server logs, client output): {work}")
    return rows(plan, names, runs), details(plan, names, runs)


def rows(plan: list[Workload], names: list[str], runs: dict) -> list[Result]:
    """One row per workload, server and metric: the median over the repeats, as a ratio
    to vLLM alone's (or to the target's reference where a target names another)."""
    out = []
    for workload in plan:
        ran = [s for s in workload.servers if s in names]
        for name in ran:
            for key, label, higher in METRICS:
                mine = [run.metrics[key] for run in runs[workload.name, name]]
                case = (workload.name, name, key)
                targets = {t.against: t.ratio for t in TARGETS if t.case == case}
                refs = (workload.alone, workload.ceiling, *targets)
                against = [a for a in refs if a != name and a in ran]
                if name == workload.alone:
                    out.append(Result(f"{workload.name}: {name} {label}", label,
                                      UNITS.get(key, "ms"), *summarize(mine),
                                      higher_is_better=higher))  # fmt: skip
                for other in dict.fromkeys(against):
                    theirs = [run.metrics[key] for run in runs[workload.name, other]]
                    out.append(Result(
                        f"{workload.name}: {name} {label}, vs {other}", label,
                        UNITS.get(key, "ms"), *summarize(mine),
                        ceiling=statistics.median(theirs), ceiling_what=CEILINGS.get(other, other),
                        target=targets.get(other), higher_is_better=higher,
                    ))  # fmt: skip
    return out


def details(plan: list[Workload], names: list[str], runs: dict) -> dict[str, Any]:
    """Replies equal to vLLM alone's, hook costs per step, each target's ratio per
    repeat, and every run's figures."""
    replies: dict[str, dict[str, list[int]]] = {}
    hooks: dict[str, dict[str, dict[str, float]]] = {}
    errors: dict[str, float] = {}
    for workload in plan:
        alone = runs[workload.name, workload.alone]
        for name in (s for s in workload.servers if s in names and s != workload.alone):
            mine = runs[workload.name, name]
            equal = sum(a == b for x, y in zip(alone, mine) for a, b in zip(x.texts, y.texts))
            total = sum(len(x.texts) for x in mine)
            replies.setdefault(workload.name, {})[name] = [equal, total]
            if name.startswith("kvtier"):
                hooks[f"{workload.name}: {name}"] = per_step(mine)
                errors[f"{workload.name}: {name}"] = sum(r.load_errors for r in mine)
        if len(alone) > 1:  # the same server twice: how far batching alone moves replies
            first, *others = alone
            same = sum(a == b for x in others for a, b in zip(first.texts, x.texts))
            replies[workload.name]["alone, repeat vs repeat"] = [
                same, sum(len(x.texts) for x in others)]  # fmt: skip
    figures = {f"{w} | {s}": [r.metrics for r in got] for (w, s), got in runs.items()}
    return {"replies_equal": replies, "hook_us_per_step": hooks, "load_error_blocks": errors,
            "target_ratio_per_repeat": paired_ratios(runs), "runs": figures}  # fmt: skip


def paired_ratios(runs: dict) -> dict[str, list[float]]:
    """Each target's (and ``FLOOR``'s) ratio in each repeat: the server's figure over the
    figure of the server it is held against, started in the same repeat."""
    out: dict[str, list[float]] = {}
    cases = [(t.workload, t.server, t.metric, t.against) for t in TARGETS] + FLOOR
    for workload, server, metric, against in cases:
        mine, theirs = runs.get((workload, server)), runs.get((workload, against))
        if mine and theirs:
            case = f"{workload}: {server} {metric} vs {against}"
            out[case] = [a.metrics[metric] / b.metrics[metric] for a, b in zip(mine, theirs)]
    return out


def per_step(runs: list[Run]) -> dict[str, float]:
    """Each hook's µs per engine step (a step: one ``build_connector_meta`` call),
    summed over the runs, each side's total, and the total of every hook (``STATS_HOOK``
    runs on both sides: it is in neither side's total)."""
    calls: dict[str, float] = defaultdict(float)
    seconds: dict[str, float] = defaultdict(float)
    for run in runs:
        for hook, (n, s) in run.hooks.items():
            calls[hook] += n
            seconds[hook] += s
    steps = calls.get("build_connector_meta") or 1.0
    out = {hook: seconds[hook] / steps * 1e6 for hook in HOOKS}
    out["scheduler total"] = sum(out[h] for h in SCHEDULER_HOOKS)
    out["worker total"] = sum(out[h] for h in WORKER_HOOKS)
    out["total"] = sum(out[h] for h in HOOKS)
    out["steps"] = steps
    return out


def print_details(details: dict[str, Any]) -> None:
    """The replies compared and the hook costs, as tables."""
    print("\ngreedy replies equal to vLLM alone's (same repeat), equal/compared:")
    for workload, by_server in details["replies_equal"].items():
        cells = ", ".join(f"{s} {e}/{n}" for s, (e, n) in by_server.items())
        print(f"  {workload}: {cells}")
    print("\nblocks vLLM recomputed after a kvtier load error, over the repeats:")
    for case, blocks in details["load_error_blocks"].items():
        print(f"  {case}: {blocks:.0f}")
    print("\neach target's ratio per repeat, to the reference of the same repeat")
    print("(alone again vs alone: two servers of vLLM alone, the noise floor):")
    for case, ratios in details["target_ratio_per_repeat"].items():
        print(f"  {case}: " + " ".join(f"{r:.3f}" for r in ratios))
    hooks = details["hook_us_per_step"]
    if not hooks:
        return
    print("\nkvtier connector hooks, µs per engine step (side: S scheduler, W worker, SW both):")
    columns = list(hooks)
    names = [*SCHEDULER_HOOKS, "scheduler total", *WORKER_HOOKS, "worker total", STATS_HOOK,
             "total", "steps"]  # fmt: skip
    sides = {**dict.fromkeys(SCHEDULER_HOOKS, "S"), **dict.fromkeys(WORKER_HOOKS, "W"),
             STATS_HOOK: "SW"}  # fmt: skip
    width = max(map(len, names)) + 5
    cols = [max(10, len(c)) + 2 for c in columns]
    print(" " * width + "".join(f"{c:>{w}}" for c, w in zip(columns, cols)))
    for name in names:
        cells = "".join(f"{hooks[c][name]:>{w}.1f}" for c, w in zip(columns, cols))
        print(f"{sides.get(name, ''):<3}{name:<{width - 3}}{cells}")


def main() -> int:
    parser = standard_args(__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, help="times each server runs (default 3; 1 quick)")
    parser.add_argument("--workloads", nargs="+", metavar="NAME",
                        help="run only these workloads (random shared chat spill 'spill 8k' "
                        "burst; default: all)")  # fmt: skip
    parser.add_argument(
        "--vllm-default-cores", action="store_true",
        help="leave VLLM_CPU_NUM_OF_RESERVED_CPU unset (vLLM's own core reservation)",
    )  # fmt: skip
    args = parser.parse_args()
    results, extra = run(args)
    cores = "vLLM's default" if args.vllm_default_cores else "VLLM_CPU_NUM_OF_RESERVED_CPU=1"
    print(f"vLLM serving, demo Llama {DTYPE}, vLLM's client (greedy), cores: {cores}")
    print_table(results)
    print_details(extra)
    if args.out:
        write_json(args.out, BENCHMARK, results, machine_info(), {"cores": cores, **extra})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
