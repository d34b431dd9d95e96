"""KVTierConnector's kv_connector_extra_config (a YAML path or an inline document), and
KVTierConnector as a child of vLLM's MultiConnector."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
from kvtier.config import ConfigError  # noqa: E402
from kvtier.integrations.vllm import load_connector_config, omp_cpus  # noqa: E402
from kvtier.integrations.vllm_metrics import FAULTS, KVTierStats  # noqa: E402

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


@pytest.mark.parametrize(
    "environ",
    [
        {"OMP_PLACES": "{0,2,3}", "OMP_PROC_BIND": "true"},
        {"GOMP_CPU_AFFINITY": "0 2-3"},
        {"KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,2,3]"},
    ],
    ids=["omp", "gomp", "iomp"],
)
def test_the_cpus_vllm_binds_a_workers_compute_threads_to_are_read_from_its_variables(environ):
    assert omp_cpus(environ) == {0, 2, 3}


@pytest.mark.parametrize(
    "environ", [{}, {"OMP_PLACES": "{0,1}"}, {"OMP_PLACES": "cores", "OMP_PROC_BIND": "true"}]
)
def test_compute_threads_vllm_did_not_bind_to_cpus_have_no_binding(environ):
    assert omp_cpus(environ) is None


def test_multiconnector_rebuilds_kvtiers_stats_by_its_class_name():
    """In the API server MultiConnector rebuilds each child's stats (as shipped from the
    engine: a plain dict) through vLLM's connector registry: kvtier is registered there
    (``vllm_metrics.register_connector``), or its first stats would end the server."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    stats = MultiConnector.build_kv_connector_stats({"KVTierConnector": {FAULTS: 1}})
    assert isinstance(stats["KVTierConnector"], KVTierStats)
    assert stats["KVTierConnector"].data == {FAULTS: 1}
