"""Plots of kvtier runs (optional extra ``plot``: matplotlib, imported only when used)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from kvtier.replay import ReplayResult

if TYPE_CHECKING:  # the demo needs transformers; plotting a result of it does not
    from kvtier.demo import DemoResult

# Tier colours, fixed so that every plot reads the same way ("vllm": vLLM's own pool,
# the GPU tier of connector mode).
TIER_COLORS = {
    "gpu": "#2b8a3e",
    "vllm": "#2b8a3e",
    "cpu": "#1971c2",
    "disk": "#e8590c",
    "redis": "#c2255c",
}


class PlotUnavailable(RuntimeError):
    """Plotting was asked for, but matplotlib is not installed."""


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (files only, no display).

    ``PlotUnavailable`` says how to install it when matplotlib is missing.
    """
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(
            "plotting needs matplotlib, which is not installed: pip install 'kvtier[plot]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_replay(result: ReplayResult, path: str | Path, title: str, windows: int = 60) -> None:
    """Write a PNG of a replay's block hit rate over time: the share served by each
    tier, stacked, per time window, with the unbounded-cache ceiling as a line."""
    plt = pyplot()
    w = result.windows(windows)
    tiers = [t for t in w.per_tier if any(w.per_tier[t])]
    # Steps are drawn from each window's start; one more point closes the last window.
    x = [*w.start_s, w.start_s[-1] + w.width_s] if w.start_s else []

    def percent(rates: list[float]) -> list[float]:
        return [100 * r for r in rates + rates[-1:]]

    fig, ax = plt.subplots(figsize=(10, 5), dpi=120)
    try:
        ax.stackplot(
            x,
            [percent(w.per_tier[t]) for t in tiers],
            labels=[
                f"{t} ({result.hit_blocks[t] / max(result.prompt_blocks, 1):.1%})" for t in tiers
            ],
            colors=[TIER_COLORS.get(t) for t in tiers],
            alpha=0.85,
            step="post",
        )
        ax.step(
            x,
            percent(w.ceiling),
            where="post",
            color="black",
            linewidth=1.5,
            label=f"ceiling, unbounded cache ({result.ceiling:.1%})",
        )
        ax.set_xlabel("trace time (s)")
        ax.set_ylabel("prompt blocks hit (%)")
        ax.set_ylim(0, 100)
        ax.set_xlim(left=0)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize="small")
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def plot_demo(result: DemoResult, path: str | Path) -> None:
    """Write a PNG of ``kvtier demo``: time to first token per turn with and without
    kvtier, above the prompt tokens each tier supplied (and those computed)."""
    plt = pyplot()
    turns = result.turns
    x = range(len(turns))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), dpi=110, sharex=True)
    try:
        top.plot(
            x, [t.ttft_recompute * 1e3 for t in turns], "o-", color="#868e96", label=result.baseline
        )
        top.plot(x, [t.ttft_kvtier * 1e3 for t in turns], "o-", color="#2b8a3e", label="kvtier")
        top.set_ylabel("time to first token (ms)")
        top.set_title("kvtier demo: multi-turn chat on a random-weight Llama")
        top.legend()
        base = [0] * len(turns)
        for tier in [*result.tiers, "computed"]:
            values = [
                t.computed_tokens if tier == "computed" else t.tokens_per_tier.get(tier, 0)
                for t in turns
            ]
            bottom.bar(x, values, bottom=base, label=tier, color=TIER_COLORS.get(tier, "#adb5bd"))
            base = [b + v for b, v in zip(base, values)]
        bottom.set_ylabel("prompt tokens")
        bottom.set_xlabel("request (conversations interleaved, turn by turn)")
        bottom.legend(ncol=len(result.tiers) + 1)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
