"""Spill tiers: stores of chunk values below the host pool (see ``base.SpillTier``)."""

from __future__ import annotations

import logging

from kvtier.config import KVTierConfig
from kvtier.hashing import namespace_root
from kvtier.layout import KVLayout
from kvtier.tiers.base import SpillTier, TierError

log = logging.getLogger(__name__)


def spill_namespace(config: KVTierConfig, layout: KVLayout) -> str:
    """The namespace of a cache's keys in shared spill tiers (Redis): 16 hex digits of
    its namespace root, so different models, layouts or salts never meet."""
    hashing = config.hashing
    root = namespace_root(config.model, layout.fingerprint, hashing.salt, hashing.algorithm)
    return root.hex()[:16]


def open_spill_tier(config: KVTierConfig, name: str, namespace: str) -> SpillTier:
    """The spill tier ``tiers.<name>`` of ``config`` (``TierError`` if it cannot be opened)."""
    from kvtier.tiers.lmdb import LMDBTier
    from kvtier.tiers.redis import RedisTier

    cfg = getattr(config.tiers, name)
    return LMDBTier.from_config(cfg) if name == "disk" else RedisTier.from_config(cfg, namespace)


def open_spill_tiers(config: KVTierConfig, namespace: str) -> tuple[list[SpillTier], list[str]]:
    """The configured spill tiers in spill order, and the names of those that could not
    be opened: left out with a warning, or, if ``required``, a ``TierError`` (after
    closing the ones already open)."""
    tiers: list[SpillTier] = []
    failed: list[str] = []
    for name in config.tiers.spill_order:
        cfg = getattr(config.tiers, name)
        try:
            tier = open_spill_tier(config, name, namespace)
        except TierError as e:
            if cfg.required:
                for opened in tiers:
                    opened.close()
                raise
            log.warning("kvtier: %s tier disabled, it could not be opened: %s", name, e)
            failed.append(name)
            continue
        tiers.append(tier)
    return tiers, failed
