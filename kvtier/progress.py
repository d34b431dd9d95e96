"""A dependency-free progress bar on stderr for long CLI and benchmark runs."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

T = TypeVar("T")


def progress(
    items: Iterable[T],
    total: int | None = None,
    desc: str = "",
    stream: TextIO | None = None,
    enabled: bool | None = None,
) -> Iterator[T]:
    """Yield ``items`` while redrawing ``desc [#####.....] i/total elapsed`` on one line.

    Draws only when ``stream`` is a terminal unless ``enabled`` is given, at most
    ten times a second, and ends with a newline.
    """
    stream = stream or sys.stderr
    if enabled is None:
        enabled = stream.isatty()
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    if not enabled:
        yield from items
        return
    start = last = time.monotonic()
    i = 0

    def draw() -> None:
        elapsed = time.monotonic() - start
        if total:
            filled = int(30 * i / total)
            bar = "#" * filled + "." * (30 - filled)
            stream.write(f"\r{desc} [{bar}] {i}/{total} {elapsed:6.1f}s")
        else:
            stream.write(f"\r{desc} {i} {elapsed:6.1f}s")
        stream.flush()

    for i, item in enumerate(items, 1):  # noqa: B007 - i is read by draw()
        yield item
        now = time.monotonic()
        if now - last >= 0.1:
            last = now
            draw()
    draw()
    stream.write("\n")
    stream.flush()
