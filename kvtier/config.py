"""YAML -> frozen dataclasses, with validation errors that name the key.

A config is read in three steps: the YAML document is loaded, ``${VAR}`` and
``${VAR:-default}`` are expanded in every string value (never in keys), and each
section is read into its dataclass by a small ``_Section`` reader that rejects
unknown keys and checks every value's type and range. Any problem raises
``ConfigError`` naming the dotted key path, the offending value and what was
expected. Every field has a default, so ``parse_config({})`` is valid.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

import torch
import yaml

from kvtier.layout import DTYPES, KVLayout

HashAlgorithm = Literal["xxh3_128", "sha256"]
EngineReset = Literal["new_keys", "keep"]
HostWritePolicy = Literal["on_evict", "eager"]
SpillWritePolicy = Literal["write_back", "write_through"]
CertReqs = Literal["required", "optional", "none"]
EvictionPolicy = Literal["lru", "reuse"]  # kvtier.eviction describes them

SPILL_TIERS: tuple[str, ...] = ("disk", "redis")  # also the default spill order
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class ConfigError(ValueError):
    """A config that cannot be used; the only exception a bad config raises.

    ``path`` is the dotted key path (``tiers.disk.chunk_blocks``; ``""`` for a
    problem with the whole file), ``value`` the offending value, ``source`` the
    file (or ``"<dict>"``) it came from. ``str(e)`` reads ``source: path: detail``.
    """

    def __init__(self, path: str, value: object, detail: str, source: str | None = None) -> None:
        self.path = path
        self.value = value
        self.detail = detail
        self.source = source
        super().__init__(": ".join(part for part in (source, path, detail) if part))

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, object, str, str | None]]:
        return (ConfigError, (self.path, self.value, self.detail, self.source))

    def with_source(self, source: str) -> ConfigError:
        return ConfigError(self.path, self.value, self.detail, source)


@dataclass(frozen=True)
class HashingConfig:
    """How block hashes are computed. Changing ``algorithm`` or ``salt`` changes every
    key. ``on_engine_reset``: what an engine's reset of its connector does (vLLM's
    ``reset_prefix_cache(reset_connector=True)``, which it sends after a weight update,
    and on sleep and ``pause_generation(clear_cache=True)`` alike): ``new_keys`` moves to
    a new key space, so nothing stored before is read again; ``keep`` changes nothing,
    for deployments whose resets never change the weights (sleep to share a GPU)."""

    algorithm: HashAlgorithm = "xxh3_128"
    salt: str = ""
    on_engine_reset: EngineReset = "new_keys"


@dataclass(frozen=True)
class GPUTierConfig:
    """The device block pool, sized by ``num_blocks`` or by ``capacity`` bytes.

    At most one of the two may be set; with neither, ``num_blocks`` is 1024.
    ``device`` is ``"auto"`` or a torch device string (checked for syntax only).
    ``eviction`` orders its free queue (``kvtier.eviction``; ``reuse`` gained nothing
    measurable in the GPU pool, below which the host pool and disk keep what it drops).
    """

    num_blocks: int | None = None
    capacity: int | None = None
    device: str = "auto"
    eviction: EvictionPolicy = "lru"

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.capacity is not None:
            raise ConfigError(
                "tiers.gpu",
                {"num_blocks": self.num_blocks, "capacity": self.capacity},
                "expected exactly one of num_blocks or capacity, got both "
                f"(num_blocks={self.num_blocks!r}, capacity={self.capacity!r})",
            )
        if self.num_blocks is None and self.capacity is None:
            object.__setattr__(self, "num_blocks", 1024)

    def resolve_num_blocks(self, layout: KVLayout) -> int:
        """Blocks in the pool: ``num_blocks``, or as many blocks as fit in ``capacity``."""
        if self.num_blocks is not None:
            return self.num_blocks
        blocks = (self.capacity or 0) // layout.block_nbytes
        if blocks < 1:
            raise ConfigError(
                "tiers.gpu.capacity",
                self.capacity,
                f"expected room for at least one {layout.block_nbytes} B block "
                f"({layout.describe()}), got {self.capacity!r} B",
            )
        return blocks


@dataclass(frozen=True)
class CPUTierConfig:
    """The host slab. ``pin_memory=None`` pins when CUDA is available.

    ``write_policy``: ``on_evict`` copies a block down when the GPU pool evicts it;
    ``eager`` copies every committed block at once. ``eviction``: ``kvtier.eviction``.
    ``stage_share``: connector mode (vLLM) reads a waiting request's spill-tier hit
    into the host pool before the engine schedules it; blocks so staged and not yet
    loaded take at most this share of the pool (0 turns staging off).
    """

    capacity: int = 4 * GiB
    pin_memory: bool | None = None
    write_policy: HostWritePolicy = "on_evict"
    eviction: EvictionPolicy = "reuse"
    stage_share: float = 0.5


@dataclass(frozen=True)
class DiskTierConfig:
    """The LMDB tier. ``path`` is kept as written; use ``resolved_path`` to open it.

    ``required=True`` makes a failure to open it a start-up error instead of a
    warning and a disabled tier. ``eviction``: ``kvtier.eviction``.
    """

    path: str = "~/.cache/kvtier/lmdb"
    capacity: int = 16 * GiB
    chunk_blocks: int = 16
    write_policy: SpillWritePolicy = "write_back"
    required: bool = False
    eviction: EvictionPolicy = "reuse"

    @property
    def resolved_path(self) -> Path:
        """``path`` with ``$VARS`` and ``~`` expanded."""
        return Path(os.path.expanduser(os.path.expandvars(self.path)))


@dataclass(frozen=True)
class RedisTierConfig:
    """The Redis tier. Durations are seconds; ``ttl=None`` means no expiry.

    ``cluster`` is ``False``, ``True`` (discover from ``url``) or a tuple of
    ``"host:port"`` startup nodes. ``required`` as for ``DiskTierConfig``.
    """

    url: str = "redis://127.0.0.1:6379/0"
    password: str | None = None
    username: str | None = None
    cluster: bool | tuple[str, ...] = False
    chunk_blocks: int = 32
    ttl: float | None = 86400.0
    key_prefix: str = "kvtier"
    socket_timeout: float = 0.25
    connect_timeout: float = 1.0
    max_connections: int = 16
    write_policy: SpillWritePolicy = "write_through"
    required: bool = False
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: CertReqs = "required"


@dataclass(frozen=True)
class TiersConfig:
    """The tier hierarchy: GPU always; CPU, disk and Redis when configured (not None).

    ``spill_order`` names every configured spill tier exactly once; left empty it
    becomes the configured ones in ``SPILL_TIERS`` order (disk before redis).
    """

    gpu: GPUTierConfig = field(default_factory=GPUTierConfig)
    cpu: CPUTierConfig | None = None
    disk: DiskTierConfig | None = None
    redis: RedisTierConfig | None = None
    spill_order: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        configured = tuple(name for name in SPILL_TIERS if getattr(self, name) is not None)
        if not self.spill_order:
            object.__setattr__(self, "spill_order", configured)
            return
        expected = "each configured spill tier once: " + (
            ", ".join(map(repr, configured)) or "none configured"
        )
        for i, name in enumerate(self.spill_order):
            if name not in SPILL_TIERS:
                problem = f"unknown tier {name!r}"
            elif name not in configured:
                problem = f"tier {name!r} is not configured (no tiers.{name} section)"
            elif name in self.spill_order[:i]:
                problem = f"tier {name!r} is listed twice"
            else:
                continue
            raise ConfigError("tiers.spill_order", name, f"{problem}; expected {expected}")
        for name in configured:
            if name not in self.spill_order:
                raise ConfigError(
                    "tiers.spill_order",
                    self.spill_order,
                    f"configured tier {name!r} is missing from {list(self.spill_order)!r}; "
                    f"expected {expected}",
                )


@dataclass(frozen=True)
class TransferConfig:
    """The copy engine: I/O worker threads, and whether hits are prefetched."""

    io_threads: int = 2
    prefetch: bool = True


@dataclass(frozen=True)
class MetricsConfig:
    """``prometheus_port`` (1..65535) serves ``/metrics`` over HTTP on
    ``prometheus_host`` (an IP address or host name; loopback unless set); None
    disables it. ``trace_path`` names a file every process of the cache appends a JSON
    line to for each step of each hit (``kvtier.trace``); None disables it."""

    prometheus_port: int | None = None
    prometheus_host: str = "127.0.0.1"
    trace_path: str | None = None


@dataclass(frozen=True)
class KVTierConfig:
    """A whole kvtier config. ``model`` is part of the namespace root; ``layout``
    may be None when an engine integration supplies it."""

    model: str = "default"
    layout: KVLayout | None = None
    hashing: HashingConfig = field(default_factory=HashingConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> KVTierConfig:
        """Same as ``load_config(path)``."""
        return load_config(path)


# --- loading -----------------------------------------------------------------------

_DEFAULT_DISK_PATH = "${KVTIER_CACHE_DIR:-~/.cache/kvtier}/lmdb"


def default_config() -> KVTierConfig:
    """The config shipped as ``configs/default.yaml``, built in code (equal to loading it)."""
    return KVTierConfig(
        model="default",
        layout=KVLayout(
            num_layers=4,
            kv_factor=2,
            block_size=16,
            num_kv_heads=4,
            head_dim=64,
            dtype=torch.float32,
        ),
        tiers=TiersConfig(
            gpu=GPUTierConfig(num_blocks=256, device="auto"),
            cpu=CPUTierConfig(capacity=32 * MiB),
            disk=DiskTierConfig(
                path=str(_interpolate(_DEFAULT_DISK_PATH, "tiers.disk.path")),
                capacity=2 * GiB,
                chunk_blocks=16,
            ),
        ),
    )


def load_config(path: str | os.PathLike[str]) -> KVTierConfig:
    """Read a YAML config file. An empty file gives the all-defaults config."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(
            "", source, f"cannot read config file: {e.strerror or e}", source
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError("", source, f"config file is not UTF-8 text: {e}", source) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or e
        raise ConfigError("", source, f"invalid YAML{where}: {problem}", source) from None
    return parse_config({} if data is None else data, source)


def parse_config(data: Mapping[str, Any], source: str = "<dict>") -> KVTierConfig:
    """Validate an already-loaded document (``${VAR}`` is expanded here)."""
    try:
        return _read_config(_Section(_interpolate_tree(data, ""), "", KVTierConfig))
    except ConfigError as e:
        raise e.with_source(source) from None


# --- environment interpolation -----------------------------------------------------

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class _EnvStr(str):
    """A string produced by interpolation: int and bool fields read it as a YAML scalar."""


def _interpolate(value: str, path: str) -> str:
    """Expand ``${VAR}`` (must be set) and ``${VAR:-default}`` (default if unset or empty)."""

    def expand(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        current = os.environ.get(name)
        if default is not None:
            return current or default
        if current is None:
            raise ConfigError(
                path,
                value,
                f"environment variable {name} is not set (in {value!r}); "
                f"expected it to be set, or a default as ${{{name}:-default}}",
            )
        return current

    return _EnvStr(_VAR.sub(expand, value)) if _VAR.search(value) else value


def _interpolate_tree(data: Any, path: str) -> Any:
    if isinstance(data, str):
        return _interpolate(data, path)
    if isinstance(data, Mapping):
        return {key: _interpolate_tree(value, _join(path, key)) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_interpolate_tree(value, f"{path}[{i}]") for i, value in enumerate(data)]
    return data


# --- the section reader ------------------------------------------------------------

T = TypeVar("T")
Parser = Callable[[Any, str], T]  # (value, dotted path) -> parsed value, or ConfigError


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _expected(path: str, value: object, expected: str) -> ConfigError:
    kind = "str" if isinstance(value, str) else type(value).__name__
    return ConfigError(path, value, f"expected {expected}, got {value!r} ({kind})")


class _Section:
    """One mapping of the document, read into the dataclass ``cls``.

    Its keys must be field names of ``cls``; null means an empty mapping.
    """

    def __init__(self, data: object, path: str, cls: type) -> None:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise _expected(path, data, "a mapping")
        valid = sorted(f.name for f in fields(cls))
        for key in data:
            if key not in valid:
                close = difflib.get_close_matches(str(key), valid, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ConfigError(
                    _join(path, key),
                    data[key],
                    f"unknown key; {hint}valid keys: {', '.join(valid)}",
                )
        self.data: Mapping[str, Any] = data
        self.path = path

    def has(self, key: str) -> bool:
        return key in self.data

    def get(self, key: str, parse: Parser[T], default: T) -> T:
        """The parsed value of ``key``, or ``default`` (not parsed) when it is absent."""
        return parse(self.data[key], _join(self.path, key)) if key in self.data else default

    def require(self, key: str, parse: Parser[T]) -> T:
        if key not in self.data:
            raise ConfigError(_join(self.path, key), None, "required key is missing")
        return parse(self.data[key], _join(self.path, key))

    def section(self, key: str, cls: type) -> _Section:
        """The sub-mapping ``key`` (empty when absent or null)."""
        return _Section(self.data.get(key), _join(self.path, key), cls)


# --- value parsers -----------------------------------------------------------------


def _scalar(value: Any) -> Any:
    """An interpolated string as the YAML scalar it spells ('8' -> 8); others unchanged."""
    if isinstance(value, _EnvStr):
        try:
            loaded = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        if isinstance(loaded, (bool, int, float)):
            return loaded
    return value


def _int_in(low: int, high: int | None, expected: str) -> Parser[int]:
    def parse(value: Any, path: str) -> int:
        value = _scalar(value)
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < low
            or (high is not None and value > high)
        ):
            raise _expected(path, value, expected)
        return value

    return parse


_positive_int = _int_in(1, None, "a positive int")
_port = _int_in(1, 65535, "a port number in 1..65535")
_kv_factor = _int_in(1, 2, "1 (joint latent, MLA) or 2 (separate K and V)")


def _fraction(value: Any, path: str) -> float:
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise _expected(path, value, "a number from 0 to 1")
    return float(value)


def _bool(value: Any, path: str) -> bool:
    value = _scalar(value)
    if not isinstance(value, bool):
        raise _expected(path, value, "true or false")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise _expected(path, value, "a string")
    return str(value)


def _name(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _expected(path, value, "a non-empty string")
    return str(value)


def _choice(options: tuple[str, ...]) -> Parser[Any]:
    def parse(value: Any, path: str) -> str:
        if not isinstance(value, str) or value not in options:
            raise _expected(path, value, "one of " + ", ".join(map(repr, options)))
        return str(value)

    return parse


_eviction = _choice(get_args(EvictionPolicy))


def _optional(parse: Parser[T]) -> Parser[T | None]:
    """``parse``, but null or an empty string (e.g. ``${VAR:-}``) means None."""
    return lambda value, path: None if value is None or value == "" else parse(value, path)


def _tuple_of(item: Parser[T], expected: str) -> Parser[tuple[T, ...]]:
    def parse(value: Any, path: str) -> tuple[T, ...]:
        if not isinstance(value, (list, tuple)):
            raise _expected(path, value, expected)
        return tuple(item(v, f"{path}[{i}]") for i, v in enumerate(value))

    return parse


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)", re.IGNORECASE | re.ASCII)
_SIZE_UNITS = {"": 1, "b": 1} | {
    unit: base**power
    for power, prefix in enumerate("kmgt", 1)
    for unit, base in ((f"{prefix}b", 1000), (f"{prefix}ib", 1024))
}
_SIZE_EXPECTED = (
    "a positive whole number of bytes: an int, or a string like '512MiB' or '1.5GB' "
    "(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
)


def parse_size(value: Any, path: str = "") -> int:
    """Bytes from a positive int or a string such as ``"4GiB"``, ``"1.5GB"``, ``"1024"``.

    KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024 (any case).
    """
    nbytes: Fraction | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        nbytes = Fraction(value)
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value.strip())):
        unit = _SIZE_UNITS.get(m.group(2).lower())
        nbytes = None if unit is None else Fraction(m.group(1)) * unit
    if nbytes is None or nbytes <= 0 or nbytes.denominator != 1:
        raise _expected(path, value, _SIZE_EXPECTED)
    return int(nbytes)


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|)", re.IGNORECASE | re.ASCII)
_DURATION_UNITS = {"ms": Fraction(1, 1000), "s": 1, "": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION_EXPECTED = (
    "a positive duration: seconds as a number, or a string like '200ms', '30s', '5m', '2h', '1d'"
)


def parse_duration(value: Any, path: str = "") -> float:
    """Seconds from a positive number or a string such as ``"200ms"``, ``"1.5s"``, ``"1d"``."""
    seconds: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.fullmatch(value.strip())):
        seconds = float(Fraction(m.group(1)) * _DURATION_UNITS[m.group(2).lower()])
    if seconds is None or seconds <= 0:
        raise _expected(path, value, _DURATION_EXPECTED)
    return seconds


def _device(value: Any, path: str) -> str:
    if value == "auto":
        return "auto"
    try:
        if isinstance(value, str):
            return str(torch.device(value))
    except (RuntimeError, ValueError):
        pass
    raise _expected(path, value, "'auto' or a torch device such as 'cpu', 'cuda', 'cuda:1', 'mps'")


def _redis_url(value: Any, path: str) -> str:
    scheme, sep, _ = value.partition("://") if isinstance(value, str) else ("", "", "")
    if not sep or scheme.lower() not in ("redis", "rediss", "unix"):
        raise _expected(path, value, "a URL starting with redis://, rediss:// or unix://")
    return str(value)


_HOST_PORT = re.compile(r"(\[[^\]\s]+\]|[^:\s\[\]]+):(\d{1,5})", re.ASCII)


def _host_port(value: Any, path: str) -> str:
    m = _HOST_PORT.fullmatch(value) if isinstance(value, str) else None
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        raise _expected(path, value, "a 'host:port' address with a port in 1..65535")
    return str(value)


_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*", re.ASCII)


def _host(value: Any, path: str) -> str:
    """An IP address (v4 or v6, without brackets) or a DNS host name."""
    if isinstance(value, str):
        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            if _HOSTNAME.fullmatch(value):
                return str(value)
    raise _expected(path, value, "an IP address or a host name, e.g. '127.0.0.1' or '0.0.0.0'")


def _cluster(value: Any, path: str) -> bool | tuple[str, ...]:
    value = _scalar(value)
    if isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and value:
        return _tuple_of(_host_port, "")(value, path)
    raise _expected(path, value, "true, false or a non-empty list of 'host:port' startup nodes")


# --- sections ----------------------------------------------------------------------


def _read_config(sec: _Section) -> KVTierConfig:
    has_layout = sec.data.get("layout") is not None  # absent or null: supplied later
    return KVTierConfig(
        model=sec.get("model", _name, KVTierConfig.model),
        layout=_read_layout(sec.section("layout", KVLayout)) if has_layout else None,
        hashing=_read_hashing(sec.section("hashing", HashingConfig)),
        tiers=_read_tiers(sec.section("tiers", TiersConfig)),
        transfer=_read_transfer(sec.section("transfer", TransferConfig)),
        metrics=_read_metrics(sec.section("metrics", MetricsConfig)),
    )


def _read_metrics(sec: _Section) -> MetricsConfig:
    d = MetricsConfig()
    return MetricsConfig(
        prometheus_port=sec.get("prometheus_port", _optional(_port), d.prometheus_port),
        prometheus_host=sec.get("prometheus_host", _host, d.prometheus_host),
        trace_path=sec.get("trace_path", _optional(_name), d.trace_path),
    )


def _read_hashing(sec: _Section) -> HashingConfig:
    d = HashingConfig()
    return HashingConfig(
        algorithm=sec.get("algorithm", _choice(get_args(HashAlgorithm)), d.algorithm),
        salt=sec.get("salt", _str, d.salt),
        on_engine_reset=sec.get(
            "on_engine_reset", _choice(get_args(EngineReset)), d.on_engine_reset
        ),
    )


def _read_transfer(sec: _Section) -> TransferConfig:
    d = TransferConfig()
    return TransferConfig(
        io_threads=sec.get("io_threads", _positive_int, d.io_threads),
        prefetch=sec.get("prefetch", _bool, d.prefetch),
    )


def _read_layout(sec: _Section) -> KVLayout:
    return KVLayout(
        num_layers=sec.require("num_layers", _positive_int),
        kv_factor=sec.get("kv_factor", _kv_factor, 2),
        block_size=sec.get("block_size", _positive_int, 16),
        num_kv_heads=sec.require("num_kv_heads", _positive_int),
        head_dim=sec.require("head_dim", _positive_int),
        dtype=DTYPES[sec.get("dtype", _choice(tuple(DTYPES)), "float16")],
    )


def _read_tiers(sec: _Section) -> TiersConfig:
    gpu = sec.section("gpu", GPUTierConfig)
    return TiersConfig(
        gpu=GPUTierConfig(
            num_blocks=gpu.get("num_blocks", _optional(_positive_int), None),
            capacity=gpu.get("capacity", _optional(parse_size), None),
            device=gpu.get("device", _device, "auto"),
            eviction=gpu.get("eviction", _eviction, GPUTierConfig.eviction),
        ),
        cpu=_read_cpu(sec.section("cpu", CPUTierConfig)) if sec.has("cpu") else None,
        disk=_read_disk(sec.section("disk", DiskTierConfig)) if sec.has("disk") else None,
        redis=_read_redis(sec.section("redis", RedisTierConfig)) if sec.has("redis") else None,
        spill_order=sec.get("spill_order", _tuple_of(_str, "a list of tier names"), ()),
    )


def _read_cpu(sec: _Section) -> CPUTierConfig:
    d = CPUTierConfig()
    return CPUTierConfig(
        capacity=sec.get("capacity", parse_size, d.capacity),
        pin_memory=sec.get("pin_memory", _optional(_bool), d.pin_memory),
        write_policy=sec.get("write_policy", _choice(get_args(HostWritePolicy)), d.write_policy),
        eviction=sec.get("eviction", _eviction, d.eviction),
        stage_share=sec.get("stage_share", _fraction, d.stage_share),
    )


def _read_disk(sec: _Section) -> DiskTierConfig:
    d = DiskTierConfig()
    return DiskTierConfig(
        path=sec.get("path", _name, d.path),
        capacity=sec.get("capacity", parse_size, d.capacity),
        chunk_blocks=sec.get("chunk_blocks", _positive_int, d.chunk_blocks),
        write_policy=sec.get("write_policy", _choice(get_args(SpillWritePolicy)), d.write_policy),
        required=sec.get("required", _bool, d.required),
        eviction=sec.get("eviction", _eviction, d.eviction),
    )


def _read_redis(sec: _Section) -> RedisTierConfig:
    d = RedisTierConfig()
    return RedisTierConfig(
        url=sec.get("url", _redis_url, d.url),
        password=sec.get("password", _optional(_str), d.password),
        username=sec.get("username", _optional(_str), d.username),
        cluster=sec.get("cluster", _cluster, d.cluster),
        chunk_blocks=sec.get("chunk_blocks", _positive_int, d.chunk_blocks),
        ttl=sec.get("ttl", _optional(parse_duration), d.ttl),
        key_prefix=sec.get("key_prefix", _name, d.key_prefix),
        socket_timeout=sec.get("socket_timeout", parse_duration, d.socket_timeout),
        connect_timeout=sec.get("connect_timeout", parse_duration, d.connect_timeout),
        max_connections=sec.get("max_connections", _positive_int, d.max_connections),
        write_policy=sec.get("write_policy", _choice(get_args(SpillWritePolicy)), d.write_policy),
        required=sec.get("required", _bool, d.required),
        ssl_ca_certs=sec.get("ssl_ca_certs", _optional(_str), d.ssl_ca_certs),
        ssl_certfile=sec.get("ssl_certfile", _optional(_str), d.ssl_certfile),
        ssl_keyfile=sec.get("ssl_keyfile", _optional(_str), d.ssl_keyfile),
        ssl_cert_reqs=sec.get("ssl_cert_reqs", _choice(get_args(CertReqs)), d.ssl_cert_reqs),
    )
