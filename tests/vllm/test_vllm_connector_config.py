"""KVTierConnector's kv_connector_extra_config: a YAML path or an inline document."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
from kvtier.config import ConfigError  # noqa: E402
from kvtier.integrations.vllm import load_connector_config  # noqa: E402

pytestmark = pytest.mark.vllm

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_the_config_key_names_a_yaml_file():
    config = load_connector_config({"config": str(CONFIGS / "vllm.yaml")})
    assert config.tiers.cpu is not None and config.layout is None


def test_the_kvtier_key_holds_the_document_inline():
    config = load_connector_config({"kvtier": {"tiers": {"cpu": {"capacity": "1MiB"}}}})
    assert config.tiers.cpu.capacity == 1 << 20


def test_both_keys_at_once_are_refused():
    with pytest.raises(ValueError, match="either 'config' or 'kvtier'"):
        load_connector_config({"config": "a.yaml", "kvtier": {}})


def test_neither_key_says_what_is_needed():
    with pytest.raises(ValueError, match="needs 'config'"):
        load_connector_config({})


def test_a_bad_inline_document_names_its_key_path():
    where = r"kv_connector_extra_config\.kvtier: tiers\.cpu\.capacity"
    with pytest.raises(ConfigError, match=where):
        load_connector_config({"kvtier": {"tiers": {"cpu": {"capacity": -1}}}})
