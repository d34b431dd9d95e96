"""Tests for kvtier.config: shipped configs, parsing tables, interpolation, errors."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.config import (
    ConfigError,
    CPUTierConfig,
    DiskTierConfig,
    GPUTierConfig,
    KVTierConfig,
    RedisTierConfig,
    TiersConfig,
    default_config,
    load_config,
    parse_config,
    parse_duration,
    parse_size,
)
from kvtier.layout import KVLayout

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
TINY = KVLayout(
    num_layers=2, kv_factor=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVTIER_CACHE_DIR", "KVTIER_REDIS_URL", "KVTIER_REDIS_PASSWORD"):
        monkeypatch.delenv(name, raising=False)


def config_error(data: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value


def assert_names(error: ConfigError, *parts: str) -> None:
    for part in parts:
        assert part in str(error), f"{part!r} not in {str(error)!r}"


def disk(**values: Any) -> dict[str, Any]:
    return {"tiers": {"disk": values}}


def redis(**values: Any) -> dict[str, Any]:
    return {"tiers": {"redis": values}}


# --- shipped configs ---------------------------------------------------------------


# Configs for an engine that supplies the KV layout itself (vLLM's connector).
ENGINE_LAYOUT = {"vllm.yaml"}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_config_loads(path: Path) -> None:
    config = load_config(path)
    assert isinstance(config, KVTierConfig)
    assert (config.layout is None) == (path.name in ENGINE_LAYOUT)


def test_the_vllm_config_leaves_the_layout_to_vllm_and_stages_in_host_memory() -> None:
    config = load_config(CONFIGS / "vllm.yaml")
    assert config.layout is None
    assert config.tiers.cpu is not None and config.tiers.disk is not None


def test_shipped_configs_exist() -> None:
    names = {p.name for p in CONFIGS.glob("*.yaml")}
    assert {"default.yaml", "redis.yaml", "tiny.yaml"} <= names


def test_default_yaml_equals_default_config() -> None:
    assert load_config(CONFIGS / "default.yaml") == default_config()


def test_default_yaml_equals_default_config_with_cache_dir_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", "/srv/kv")
    config = load_config(CONFIGS / "default.yaml")
    assert config == default_config()
    assert config.tiers.disk is not None
    assert config.tiers.disk.path == "/srv/kv/lmdb"


def test_redis_yaml_has_redis_after_disk_and_no_password() -> None:
    tiers = load_config(CONFIGS / "redis.yaml").tiers
    assert tiers.redis is not None
    assert tiers.spill_order == ("disk", "redis")
    assert tiers.redis.password is None
    assert tiers.redis.ttl == 86400.0
    assert tiers.redis.chunk_blocks == 32


def test_redis_yaml_reads_url_and_password_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_REDIS_URL", "rediss://cache.example:6380/1")
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", "s3cret")
    redis_tier = load_config(CONFIGS / "redis.yaml").tiers.redis
    assert redis_tier is not None
    assert redis_tier.url == "rediss://cache.example:6380/1"
    assert redis_tier.password == "s3cret"


def test_tiny_yaml_values() -> None:
    config = load_config(CONFIGS / "tiny.yaml")
    assert config.layout == TINY
    assert config.tiers.gpu == GPUTierConfig(num_blocks=16, device="cpu")
    assert config.tiers.cpu == CPUTierConfig(capacity=64 * KiB)
    assert config.tiers.disk == DiskTierConfig(
        path="/tmp/kvtier-tiny/lmdb", capacity=16 * MiB, chunk_blocks=4
    )


def test_from_yaml_equals_load_config() -> None:
    assert KVTierConfig.from_yaml(CONFIGS / "tiny.yaml") == load_config(CONFIGS / "tiny.yaml")


# --- defaults and structure --------------------------------------------------------


def test_empty_dict_gives_defaults() -> None:
    config = parse_config({})
    assert config == KVTierConfig()
    assert config.layout is None
    assert config.tiers.gpu.num_blocks == 1024
    assert (config.tiers.cpu, config.tiers.disk, config.tiers.redis) == (None, None, None)
    assert config.tiers.spill_order == ()


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    assert load_config(path) == KVTierConfig()


def test_null_tier_section_means_enabled_with_defaults() -> None:
    tiers = parse_config({"tiers": {"cpu": None, "disk": None, "redis": None}}).tiers
    assert tiers.cpu == CPUTierConfig()
    assert tiers.disk == DiskTierConfig()
    assert tiers.redis == RedisTierConfig()


def test_null_layout_means_supplied_later() -> None:
    assert parse_config({"layout": None}).layout is None


def test_spill_order_defaults_to_disk_before_redis() -> None:
    tiers = parse_config({"tiers": {"redis": None, "disk": None}}).tiers
    assert tiers.spill_order == ("disk", "redis")


def test_spill_order_can_put_redis_first() -> None:
    data = {"tiers": {"redis": None, "disk": None, "spill_order": ["redis", "disk"]}}
    assert parse_config(data).tiers.spill_order == ("redis", "disk")


def test_redis_cluster_startup_nodes_parse_to_tuple() -> None:
    data = redis(cluster=["10.0.0.1:7000", "node-b:7001", "[::1]:7002"])
    redis_tier = parse_config(data).tiers.redis
    assert redis_tier is not None
    assert redis_tier.cluster == ("10.0.0.1:7000", "node-b:7001", "[::1]:7002")


def test_redis_null_ttl_means_no_expiry() -> None:
    redis_tier = parse_config(redis(ttl=None)).tiers.redis
    assert redis_tier is not None
    assert redis_tier.ttl is None


def test_gpu_device_is_normalised_and_auto_kept() -> None:
    assert parse_config({"tiers": {"gpu": {"device": "cuda:1"}}}).tiers.gpu.device == "cuda:1"
    assert parse_config({"tiers": {"gpu": {"device": "auto"}}}).tiers.gpu.device == "auto"


def test_disk_resolved_path_expands_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/home/kv")
    assert DiskTierConfig(path="~/cache/lmdb").resolved_path == Path("/home/kv/cache/lmdb")
    assert DiskTierConfig(path="~/cache/lmdb").path == "~/cache/lmdb"


@pytest.mark.parametrize(
    "instance",
    [
        default_config(),
        default_config().hashing,
        default_config().tiers,
        default_config().tiers.gpu,
        CPUTierConfig(),
        DiskTierConfig(),
        RedisTierConfig(),
        default_config().transfer,
        default_config().metrics,
    ],
    ids=lambda c: type(c).__name__,
)
def test_config_dataclasses_are_frozen(instance: object) -> None:
    name = dataclasses.fields(instance)[0].name  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(instance, name, None)


def test_gpu_resolve_num_blocks_from_capacity() -> None:
    gpu = parse_config({"tiers": {"gpu": {"capacity": "1MiB"}}}).tiers.gpu
    assert gpu.num_blocks is None
    assert gpu.resolve_num_blocks(TINY) == MiB // TINY.block_nbytes == 1024


def test_gpu_resolve_num_blocks_returns_num_blocks() -> None:
    assert GPUTierConfig(num_blocks=7).resolve_num_blocks(TINY) == 7


def test_gpu_resolve_num_blocks_rejects_capacity_below_one_block() -> None:
    with pytest.raises(ValueError, match=r"tiers\.gpu\.capacity"):
        GPUTierConfig(capacity=TINY.block_nbytes - 1).resolve_num_blocks(TINY)


# --- size and duration parsing -----------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1024, 1024),
        ("1024", 1024),
        ("1024B", 1024),
        ("100KB", 100_000),
        ("64KiB", 64 * KiB),
        ("512MiB", 512 * MiB),
        ("512mib", 512 * MiB),
        ("4GiB", 4 * GiB),
        ("1.5GB", 1_500_000_000),
        ("2 TB", 2 * 10**12),
        ("1TiB", 1 << 40),
        ("0.5KiB", 512),
    ],
)
def test_parse_size(value: Any, expected: int) -> None:
    assert parse_size(value, "x") == expected


@pytest.mark.parametrize(
    "value", [0, -1, "0", "0MiB", "-1MiB", "1.5B", "4GiBs", "4 gigs", "abc", "", True, 1.5, None]
)
def test_parse_size_rejects(value: Any) -> None:
    with pytest.raises(ConfigError, match="expected a positive whole number of bytes") as info:
        parse_size(value, "tiers.cpu.capacity")
    assert info.value.path == "tiers.cpu.capacity"
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("200ms", 0.2),
        ("30s", 30.0),
        ("5m", 300.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("1.5s", 1.5),
        ("30", 30.0),
        ("250MS", 0.25),
        (2, 2.0),
        (0.25, 0.25),
    ],
)
def test_parse_duration(value: Any, expected: float) -> None:
    assert parse_duration(value, "x") == expected


@pytest.mark.parametrize(
    "value", [0, -1, "0s", "-5s", "5 minutes", "1w", "abc", "", True, None, float("inf")]
)
def test_parse_duration_rejects(value: Any) -> None:
    with pytest.raises(ConfigError, match="expected a positive duration") as info:
        parse_duration(value, "tiers.redis.ttl")
    assert info.value.path == "tiers.redis.ttl"


@pytest.mark.parametrize(("value", "expected"), [(0, 0.0), (0.5, 0.5), (1, 1.0)])
def test_the_stage_share_is_a_fraction_of_the_host_pool(value: Any, expected: float) -> None:
    cpu = parse_config({"tiers": {"cpu": {"stage_share": value}}}).tiers.cpu
    assert cpu is not None and cpu.stage_share == expected


@pytest.mark.parametrize("value", [-0.1, 1.5, "half", True, None])
def test_a_stage_share_outside_0_to_1_names_its_key(value: Any) -> None:
    with pytest.raises(ConfigError, match="expected a number from 0 to 1") as info:
        parse_config({"tiers": {"cpu": {"stage_share": value}}})
    assert info.value.path == "tiers.cpu.stage_share"


# --- environment interpolation -----------------------------------------------------


def test_env_var_is_substituted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_SIZE", "1GiB")
    cpu = parse_config({"tiers": {"cpu": {"capacity": "${KVTIER_TEST_SIZE}"}}}).tiers.cpu
    assert cpu is not None
    assert cpu.capacity == GiB


def test_env_default_used_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_TEST_SIZE", raising=False)
    cpu = parse_config({"tiers": {"cpu": {"capacity": "${KVTIER_TEST_SIZE:-4GiB}"}}}).tiers.cpu
    assert cpu is not None
    assert cpu.capacity == 4 * GiB


def test_env_default_used_when_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_SIZE", "")
    cpu = parse_config({"tiers": {"cpu": {"capacity": "${KVTIER_TEST_SIZE:-4GiB}"}}}).tiers.cpu
    assert cpu is not None
    assert cpu.capacity == 4 * GiB


def test_env_value_overrides_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_SIZE", "8MiB")
    cpu = parse_config({"tiers": {"cpu": {"capacity": "${KVTIER_TEST_SIZE:-4GiB}"}}}).tiers.cpu
    assert cpu is not None
    assert cpu.capacity == 8 * MiB


def test_env_vars_substituted_inside_a_string(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_DIR", "/data")
    data = disk(path="${KVTIER_TEST_DIR}/kv/${KVTIER_TEST_NAME:-main}.lmdb")
    disk_tier = parse_config(data).tiers.disk
    assert disk_tier is not None
    assert disk_tier.path == "/data/kv/main.lmdb"
    assert type(disk_tier.path) is str


def test_env_var_fills_int_and_bool_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_BLOCKS", "64")
    monkeypatch.setenv("KVTIER_TEST_PREFETCH", "false")
    data = {
        "tiers": {"gpu": {"num_blocks": "${KVTIER_TEST_BLOCKS}"}},
        "transfer": {"prefetch": "${KVTIER_TEST_PREFETCH}"},
    }
    config = parse_config(data)
    assert config.tiers.gpu.num_blocks == 64
    assert config.transfer.prefetch is False


def test_empty_env_default_gives_none_for_optional_field() -> None:
    redis_tier = parse_config(redis(password="${KVTIER_REDIS_PASSWORD:-}")).tiers.redis
    assert redis_tier is not None
    assert redis_tier.password is None


def test_env_interpolation_never_applies_to_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_KEY", "model")
    error = config_error({"${KVTIER_TEST_KEY}": "x"})
    assert_names(error, "${KVTIER_TEST_KEY}: unknown key")


def test_unset_env_var_without_default_names_key_and_var(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVTIER_TEST_UNSET", raising=False)
    error = config_error(disk(path="${KVTIER_TEST_UNSET}/lmdb"))
    assert error.path == "tiers.disk.path"
    assert_names(error, "tiers.disk.path", "KVTIER_TEST_UNSET", "'${KVTIER_TEST_UNSET}/lmdb'")


def test_unset_env_var_in_list_names_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_TEST_UNSET", raising=False)
    error = config_error(redis(cluster=["a:1", "${KVTIER_TEST_UNSET}"]))
    assert_names(error, "tiers.redis.cluster[1]", "KVTIER_TEST_UNSET")


# --- errors ------------------------------------------------------------------------


def test_config_error_is_value_error_with_path_and_value() -> None:
    error = config_error({"tiers": {"gpu": {"num_blocks": "abc"}}})
    assert isinstance(error, ValueError)
    assert error.path == "tiers.gpu.num_blocks"
    assert error.value == "abc"


def test_config_error_survives_pickle() -> None:
    error = config_error({"tiers": {"gpu": {"num_blocks": "abc"}}})
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.path, copy.value) == (str(error), error.path, error.value)


def test_error_unknown_top_level_key_suggests_nearest() -> None:
    error = config_error({"tier": {}})
    assert error.path == "tier"
    assert_names(error, "tier: unknown key", "did you mean 'tiers'?", "valid keys:")


def test_error_unknown_nested_key_suggests_nearest() -> None:
    error = config_error(disk(chunk_blcks=8))
    assert error.path == "tiers.disk.chunk_blcks"
    assert_names(
        error,
        "tiers.disk.chunk_blcks: unknown key; did you mean 'chunk_blocks'?",
        "valid keys: capacity, chunk_blocks, eviction, path, required, write_policy",
    )


def test_error_wrong_type() -> None:
    error = config_error({"tiers": {"gpu": {"num_blocks": "abc"}}})
    assert_names(error, "tiers.gpu.num_blocks: expected a positive int, got 'abc' (str)")


def test_error_negative_size() -> None:
    error = config_error({"tiers": {"cpu": {"capacity": -5}}})
    assert_names(error, "tiers.cpu.capacity", "-5", "expected a positive whole number of bytes")


def test_error_zero_size() -> None:
    error = config_error(disk(capacity="0MiB"))
    assert_names(error, "tiers.disk.capacity", "'0MiB'", "expected a positive whole number")


def test_error_bad_size_unit() -> None:
    error = config_error(disk(capacity="4GB/s"))
    assert_names(error, "tiers.disk.capacity", "'4GB/s'", "units B, KB, MB, GB, TB, KiB")


@pytest.mark.parametrize("value", [0, -1, 2.5, "8", True])
def test_error_chunk_blocks_not_a_positive_int(value: Any) -> None:
    error = config_error(disk(chunk_blocks=value))
    assert error.value == value
    assert_names(error, f"tiers.disk.chunk_blocks: expected a positive int, got {value!r}")


def test_error_bool_field_rejects_string() -> None:
    error = config_error({"transfer": {"prefetch": "yes"}})
    assert_names(error, "transfer.prefetch", "'yes'", "expected true or false")


def test_error_unknown_dtype_lists_valid_names() -> None:
    layout = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float64"}
    error = config_error({"layout": layout})
    assert_names(error, "layout.dtype", "'float64'", "'bfloat16'", "'float16'", "'float32'")


def test_error_layout_missing_required_key() -> None:
    error = config_error({"layout": {"num_layers": 2, "num_kv_heads": 2}})
    assert_names(error, "layout.head_dim: required key is missing")


def test_error_layout_kv_factor_out_of_range() -> None:
    layout = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "kv_factor": 3}
    assert_names(config_error({"layout": layout}), "layout.kv_factor", "3", "expected 1")


def test_error_unknown_hashing_algorithm() -> None:
    error = config_error({"hashing": {"algorithm": "md5"}})
    assert_names(error, "hashing.algorithm", "'md5'", "one of 'xxh3_128', 'sha256'")


def test_error_unknown_engine_reset() -> None:
    error = config_error({"hashing": {"on_engine_reset": "drop"}})
    assert_names(error, "hashing.on_engine_reset", "'drop'", "one of 'new_keys', 'keep'")


@pytest.mark.parametrize("tier", ["gpu", "cpu", "disk"])
def test_error_unknown_eviction_policy_names_the_tiers_key(tier: str) -> None:
    error = config_error({"tiers": {tier: {"eviction": "lfu"}}})
    assert error.value == "lfu"
    assert_names(error, f"tiers.{tier}.eviction", "'lfu'", "one of 'lru', 'reuse'")


def test_the_gpu_pool_evicts_by_lru_and_the_host_pool_and_disk_by_reuse_by_default() -> None:
    tiers = parse_config({"tiers": {"cpu": {}, "disk": {}}}).tiers
    assert (tiers.gpu.eviction, tiers.cpu.eviction, tiers.disk.eviction) == (
        "lru",
        "reuse",
        "reuse",
    )


@pytest.mark.parametrize("tier", ["gpu", "cpu", "disk"])
def test_each_tier_that_evicts_takes_its_own_eviction_policy(tier: str) -> None:
    sections = {"gpu": {"eviction": "reuse"}, "cpu": {"eviction": "reuse"}, "disk": {}}
    sections[tier] = {"eviction": "lru"}
    tiers = parse_config({"tiers": sections}).tiers
    policies = {name: getattr(tiers, name).eviction for name in sections}
    assert policies == {name: "lru" if name == tier else "reuse" for name in sections}


def test_error_unknown_write_policy() -> None:
    error = config_error(disk(write_policy="sometimes"))
    assert_names(error, "tiers.disk.write_policy", "'sometimes'", "'write_back', 'write_through'")


def test_error_bad_redis_url_scheme() -> None:
    error = config_error(redis(url="http://localhost:6379"))
    assert_names(
        error, "tiers.redis.url", "'http://localhost:6379'", "redis://, rediss:// or unix://"
    )


def test_error_bad_duration() -> None:
    error = config_error(redis(ttl="5 minutes"))
    assert_names(error, "tiers.redis.ttl", "'5 minutes'", "expected a positive duration")


def test_error_bad_cluster_node() -> None:
    error = config_error(redis(cluster=["10.0.0.1:7000", "10.0.0.2"]))
    assert_names(error, "tiers.redis.cluster[1]", "'10.0.0.2'", "'host:port'")


def test_error_bad_device() -> None:
    error = config_error({"tiers": {"gpu": {"device": "gpu0"}}})
    assert_names(error, "tiers.gpu.device", "'gpu0'", "torch device")


def test_error_port_out_of_range() -> None:
    error = config_error({"metrics": {"prometheus_port": 70000}})
    assert_names(error, "metrics.prometheus_port", "70000", "1..65535")


def test_metrics_are_served_on_loopback_unless_a_host_is_given() -> None:
    assert parse_config({"metrics": {"prometheus_port": 9100}}).metrics.prometheus_host == (
        "127.0.0.1"
    )
    for host in ("0.0.0.0", "::1", "metrics.internal"):
        config = parse_config({"metrics": {"prometheus_host": host}})
        assert config.metrics.prometheus_host == host


@pytest.mark.parametrize("host", ["", "bad host", "-x.example", "[::1]", 8080])
def test_error_metrics_host_not_an_address(host: object) -> None:
    error = config_error({"metrics": {"prometheus_host": host}})
    assert_names(error, "metrics.prometheus_host", repr(host), "an IP address or a host name")


def test_error_spill_order_names_unconfigured_tier() -> None:
    error = config_error({"tiers": {"disk": None, "spill_order": ["disk", "redis"]}})
    assert error.path == "tiers.spill_order"
    assert error.value == "redis"
    assert_names(error, "tiers.spill_order", "'redis' is not configured", "expected each")


def test_error_spill_order_names_unknown_tier() -> None:
    error = config_error({"tiers": {"disk": None, "spill_order": ["ssd"]}})
    assert_names(error, "tiers.spill_order", "unknown tier 'ssd'", "'disk'")


def test_error_spill_order_duplicate() -> None:
    error = config_error({"tiers": {"disk": None, "spill_order": ["disk", "disk"]}})
    assert_names(error, "tiers.spill_order", "'disk' is listed twice")


def test_error_spill_order_missing_configured_tier() -> None:
    error = config_error({"tiers": {"disk": None, "redis": None, "spill_order": ["redis"]}})
    assert_names(error, "tiers.spill_order", "'disk' is missing", "['redis']")


def test_error_gpu_num_blocks_and_capacity_both_set() -> None:
    error = config_error({"tiers": {"gpu": {"num_blocks": 16, "capacity": "1MiB"}}})
    assert error.path == "tiers.gpu"
    assert_names(error, "tiers.gpu", "exactly one of num_blocks or capacity", "num_blocks=16")


def test_error_section_not_a_mapping() -> None:
    error = config_error({"tiers": 5})
    assert error.path == "tiers"
    assert_names(error, "tiers: expected a mapping, got 5 (int)")


def test_error_nested_section_not_a_mapping() -> None:
    assert_names(config_error({"tiers": {"disk": ["x"]}}), "tiers.disk: expected a mapping")


def test_error_message_names_source() -> None:
    with pytest.raises(ConfigError, match=r"^app\.yaml: tiers: expected a mapping"):
        parse_config({"tiers": 5}, source="app.yaml")


def test_error_top_level_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert_names(info.value, str(path), "expected a mapping", "['a', 'b']")


def test_error_missing_file_names_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert_names(info.value, str(path), "cannot read config file", "No such file")


def test_error_invalid_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("tiers:\n  gpu: {num_blocks: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert_names(info.value, str(path), "invalid YAML at line")


def test_error_in_file_names_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("tiers:\n  disk:\n    chunk_blcks: 8\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert_names(info.value, f"{path}: tiers.disk.chunk_blcks: unknown key")


def test_error_spill_order_checked_on_direct_construction() -> None:
    with pytest.raises(ConfigError, match=r"tiers\.spill_order"):
        TiersConfig(spill_order=("disk",))


def test_the_trace_is_off_unless_a_path_is_given() -> None:
    assert parse_config({}).metrics.trace_path is None
    assert parse_config({"metrics": {"trace_path": ""}}).metrics.trace_path is None
    assert parse_config({"metrics": {"trace_path": "/tmp/t.jsonl"}}).metrics.trace_path == (
        "/tmp/t.jsonl"
    )


def test_error_trace_path_not_a_string() -> None:
    assert_names(config_error({"metrics": {"trace_path": 7}}), "metrics.trace_path", "7")
