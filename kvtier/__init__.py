"""kvtier: a tiered prefix cache for the KV cache of LLM serving engines.

The engine-facing entry point is ``kvtier.cache.TieredCache``; ``docs/architecture.md``
maps the modules.
"""

__version__ = "0.1.0"
