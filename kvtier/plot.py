"""Plots of kvtier runs (optional extra ``plot``: matplotlib, imported only when used)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from kvtier.replay import ReplayResult

# Tier colours, fixed so that every plot reads the same way.
TIER_COLORS = {"gpu": "#2b8a3e", "cpu": "#1971c2", "disk": "#e8590c", "redis": "#c2255c"}


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
