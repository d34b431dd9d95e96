"""Serve a transformers causal LM with kvtier as its prefix cache.

One request, as ``CachedLM`` runs it::

    hit   = cache.lookup(...)            # the prompt's cached prefix, across tiers
    table = cache.allocate(...)          # GPU blocks; starts the prefetch from below
    valid = cache.wait(...)              # tokens whose KV is now in cache.kv[table]
    past  = DynamicCache of those blocks # the model's own cache class, every layer
    model(prompt[valid:], past)          # only the uncached suffix is computed
    cache.kv[table[valid/bs:]] = past    # newly full blocks go back into the GPU pool,
    cache.commit(...); cache.free(...)   # from where they are evicted to host, disk, Redis

The layout comes from the model's config (layers, KV heads, head dim, dtype); only
``layout.block_size`` is taken from the YAML. Blocks are namespaced by a model id:
``model_id`` if given, else the model's ``name_or_path`` — a model built in code
has none and must be named, since two models with the same shapes must never share
KV.

Supported: decoder-only models with full attention whose cache is a list of
per-layer key/value tensors ``[batch, kv_heads, tokens, head_dim]`` (Llama, Qwen2,
Mistral without a sliding window, ... incl. GQA), batch size 1, any dtype kvtier
stores. A failed load below the GPU only shortens the hit: the model computes more.

Threads: a ``CachedLM`` runs one request at a time; the ``TieredCache`` under it is
shared safely with other users.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from os import PathLike

import torch
import xxhash
from transformers import DynamicCache, GenerationConfig, PreTrainedModel

from kvtier.cache import PrefixHit, TieredCache
from kvtier.config import KVTierConfig, load_config
from kvtier.layout import KVLayout

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16


def layout_for(model: PreTrainedModel, block_size: int = DEFAULT_BLOCK_SIZE) -> KVLayout:
    """The KV layout of ``model``'s cache: its layers, KV heads, head dim and dtype.

    Raises ``ValueError`` for a model whose KV kvtier cannot hold as full blocks
    (sliding-window attention, keys and values of different widths).
    """
    cfg = model.config.get_text_config()
    kinds = set(getattr(cfg, "layer_types", None) or ())
    if getattr(cfg, "sliding_window", None) or kinds - {"full_attention"}:
        raise ValueError(
            f"{type(model).__name__} uses sliding-window or non-attention layers "
            f"({sorted(kinds) or 'sliding_window'}); kvtier caches full-attention KV only"
        )
    if getattr(cfg, "kv_lora_rank", None):
        raise ValueError(f"{type(model).__name__} uses latent attention (MLA); not supported")
    heads = cfg.num_attention_heads
    return KVLayout(
        num_layers=cfg.num_hidden_layers,
        kv_factor=2,
        block_size=block_size,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        dtype=model.dtype,
    )


@dataclass(frozen=True)
class Prefill:
    """A prompt run through the cache: the logits of the tokens the model computed
    (``prompt[cached_tokens:]``), and what the cache supplied."""

    logits: torch.Tensor  # [len(prompt) - cached_tokens, vocab]
    hit: PrefixHit
    cached_tokens: int  # leading tokens whose KV came from kvtier (<= the hit after a fault)


@dataclass(frozen=True)
class Generation:
    """A generated reply, what the cache supplied, and its time to first token."""

    tokens: list[int]  # the new tokens only
    hit: PrefixHit | None  # None for a run without kvtier (``recompute``)
    cached_tokens: int
    ttft_seconds: float  # lookup start -> first new token chosen
    seconds: float  # lookup start -> last new token chosen (write-back not included)


class _FirstTokenClock:
    """A ``generate`` streamer that notes when the first new token arrives.

    ``generate`` puts the prompt first, then each new token.
    """

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


@dataclass
class _Request:
    """One request in flight: its blocks, the cached prefix as the model's cache
    (``start`` tokens of it), and how many token slots it has allocated."""

    req_id: int
    hit: PrefixHit
    table: list[int]
    past: DynamicCache
    start: int
    slots: int


def recompute(
    model: PreTrainedModel,
    token_ids: Sequence[int],
    max_new_tokens: int,
    generation_config: GenerationConfig | None = None,
) -> Generation:
    """Plain ``model.generate`` without kvtier, timed like ``CachedLM.generate``: the
    baseline a cached run is compared with."""
    t0 = time.perf_counter()
    past = DynamicCache()
    tokens, ttft, seconds = _generate(model, token_ids, past, max_new_tokens, generation_config, t0)
    return Generation(tokens, None, 0, ttft, seconds)


def weights_id(model: PreTrainedModel) -> str:
    """A model id from the weights themselves (xxh3-128 of every parameter's bytes),
    for models that have no name, e.g. built or fine-tuned in code."""
    h = xxhash.xxh3_128()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return f"{model.config.model_type}-{h.hexdigest()}"


def _generate(
    model: PreTrainedModel,
    token_ids: Sequence[int],
    past: DynamicCache,
    max_new_tokens: int,
    generation_config: GenerationConfig | None,
    t0: float,
) -> tuple[list[int], float, float]:
    """``model.generate`` continuing from ``past`` (the prompt's first tokens): the new
    tokens, seconds from ``t0`` to the first of them and to the last."""
    gen = copy.deepcopy(generation_config or model.generation_config)
    gen.max_new_tokens, gen.max_length = max_new_tokens, None
    if gen.pad_token_id is None:  # one sequence, no padding: silences a warning
        gen.pad_token_id = 0
    clock = _FirstTokenClock()
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=model.device)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=past,
            generation_config=gen,
            streamer=clock,
        )
    seconds = time.perf_counter() - t0
    first = clock.first_token_at
    return out[0, len(token_ids) :].tolist(), (first or t0 + seconds) - t0, seconds


class CachedLM:
    """A transformers causal LM whose prompts are served from kvtier's tiers.

    Every full block the model computes (prompt and reply) is committed to the cache,
    so a later prompt that extends this one (the next chat turn) or shares its prefix
    (a system prompt) computes only what is new.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: KVTierConfig | str | PathLike[str],
        model_id: str | None = None,
    ) -> None:
        config = config if isinstance(config, KVTierConfig) else load_config(config)
        model_id = model_id or model.config.name_or_path
        if not model_id:
            raise ValueError(
                "the model has no name_or_path: pass model_id= (models with the same "
                "shapes but other weights must never share KV)"
            )
        block_size = config.layout.block_size if config.layout else DEFAULT_BLOCK_SIZE
        layout = layout_for(model, block_size)
        if config.layout is not None and config.layout != layout:
            log.warning(
                "kvtier: the config's layout (%s) is not the model's; using the model's (%s)",
                config.layout.describe(),
                layout.describe(),
            )
        self.model = model
        self.model_id = model_id
        self.layout = layout
        self.cache = TieredCache(replace(config, model=model_id), layout, model.device)
        self._ids = itertools.count()

    def prefill(self, token_ids: Sequence[int]) -> Prefill:
        """Run the prompt, computing only what the cache does not hold; commit its blocks."""
        req = self._begin(token_ids)
        try:
            with torch.no_grad():
                out = self.model(
                    input_ids=self._tensor(token_ids[req.start :]),
                    past_key_values=req.past,
                    use_cache=True,
                )
            self._store(req, token_ids)
        finally:
            self.cache.free(req.req_id)
        return Prefill(out.logits[0], req.hit, req.start)

    def generate(
        self,
        token_ids: Sequence[int],
        max_new_tokens: int,
        generation_config: GenerationConfig | None = None,
    ) -> Generation:
        """``model.generate`` on a prompt whose cached prefix is not recomputed.

        ``generation_config`` defaults to the model's own (greedy unless it samples).
        The prompt's and the reply's full blocks are committed afterwards.
        """
        t0 = time.perf_counter()
        req = self._begin(token_ids)
        try:
            tokens, ttft, seconds = _generate(
                self.model, token_ids, req.past, max_new_tokens, generation_config, t0
            )
            # The last new token was never fed back, so its KV is not in ``past``.
            self._store(req, [*token_ids, *tokens][: req.past.get_seq_length()])
        finally:
            self.cache.free(req.req_id)
        return Generation(tokens, req.hit, req.start, ttft, seconds)

    def close(self) -> None:
        self.cache.close()

    def __enter__(self) -> CachedLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _tensor(self, token_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor([list(token_ids)], dtype=torch.long, device=self.model.device)

    def _begin(self, token_ids: Sequence[int]) -> _Request:
        """Look up, allocate and wait; the cached prefix becomes the model's cache."""
        if len(token_ids) == 0:
            raise ValueError("the prompt is empty")
        req_id = next(self._ids)
        hit = self.cache.lookup(req_id, token_ids)
        table = self.cache.allocate(req_id, len(token_ids) - hit.num_tokens, hit)
        if table is None:  # the GPU pool is full of running requests: compute it all
            log.warning("kvtier: GPU pool full; prompt of %d tokens not cached", len(token_ids))
            return _Request(req_id, hit, [], DynamicCache(), 0, 0)
        start = self.cache.wait(req_id)
        past = self._assemble(table[: start // self.layout.block_size])
        return _Request(req_id, hit, table, past, start, len(token_ids))

    def _assemble(self, blocks: list[int]) -> DynamicCache:
        """The KV of ``blocks`` as a DynamicCache: one gather, one reshape per tensor."""
        past = DynamicCache()
        if not blocks:
            return past
        lay = self.layout
        kv = self.cache.kv[torch.tensor(blocks, device=self.cache.kv.device)]
        # [blocks, layers, 2, block_size, heads, dim] -> [layers, 2, heads, tokens, dim]
        kv = kv.permute(1, 2, 4, 0, 3, 5).reshape(
            lay.num_layers, 2, lay.num_kv_heads, len(blocks) * lay.block_size, lay.head_dim
        )
        for layer in range(lay.num_layers):
            past.update(kv[layer, 0].unsqueeze(0), kv[layer, 1].unsqueeze(0), layer)
        return past

    def _store(self, req: _Request, token_ids: Sequence[int]) -> None:
        """Copy the newly full blocks of ``token_ids`` (their KV is in ``req.past``) into
        the request's GPU blocks and commit them. Blocks before ``req.start`` came from
        the cache and hold their KV already."""
        if not req.table:
            return
        grew = len(token_ids) - req.slots  # the reply's tokens beyond the prompt's slots
        if grew > 0 and self.cache.allocate(req.req_id, grew) is None:
            token_ids = token_ids[: req.slots]  # no room: keep what fits
        table = self.cache.block_ids(req.req_id)
        lay, bs = self.layout, self.layout.block_size
        lo, hi = req.start // bs, len(token_ids) // bs
        if hi > lo:
            span = slice(lo * bs, hi * bs)
            kv = torch.stack(
                [
                    torch.stack((ly.keys[0, :, span], ly.values[0, :, span]))
                    for ly in req.past.layers
                ]
            )  # [layers, 2, heads, tokens, dim]
            blocks = kv.reshape(
                lay.num_layers, 2, lay.num_kv_heads, hi - lo, bs, lay.head_dim
            ).permute(3, 0, 1, 4, 2, 5)  # [blocks, layers, 2, block_size, heads, dim]
            dst = torch.tensor(table[lo:hi], device=self.cache.kv.device)
            self.cache.kv[dst] = blocks.to(self.cache.kv.dtype)
        self.cache.commit(req.req_id, token_ids[: hi * bs])
