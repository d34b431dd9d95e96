"""Shared helpers for every script under ``benchmarks/`` (see BENCHMARKS.md).

A script builds its arguments with ``standard_args``, times each case with
``measure`` (or collects ``measure_samples`` over several rounds and ``summarize``s
them), wraps each figure in a ``Result`` and ends with ``print_table`` and, when
``--out`` is given, ``write_json``::

    from _report import Result, measure, print_table, standard_args, write_json

Scripts run as ``python benchmarks/NAME.py`` from the repo root, so this directory is
on ``sys.path`` and ``_report`` imports as a top-level module.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

TargetKind = Literal["ratio", "value"]


@dataclass
class Result:
    """One row of a benchmark's result: a case, its figure, its ceiling and its target.

    ``ratio`` is always ``value / ceiling`` (null without a ceiling): the fraction of
    the ceiling reached when higher is better (throughput), the multiple of the raw
    cost when lower is better (time).

    ``target_kind`` says which number ``target`` applies to, ``"ratio"`` or
    ``"value"``. Left as None it becomes ``"ratio"`` when there is a ceiling and
    ``"value"`` otherwise; it is always stored resolved, so the JSON says it.

    ``ok`` is computed, never given: ``x >= target`` when ``higher_is_better``, else
    ``x <= target``, where ``x`` is the number ``target_kind`` names; null when there
    is no target.
    """

    case: str
    metric: str
    unit: str
    value: float
    min: float | None = None
    max: float | None = None
    ceiling: float | None = None
    ceiling_what: str | None = None
    target: float | None = None
    target_kind: TargetKind | None = None
    higher_is_better: bool = True
    ratio: float | None = field(init=False, default=None)
    ok: bool | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.ceiling is not None:
            self.ratio = self.value / self.ceiling if self.ceiling else math.inf
        if self.target is None:
            self.target_kind = None
            self.ok = None
            return
        if self.target_kind is None:
            self.target_kind = "ratio" if self.ratio is not None else "value"
        if self.target_kind == "ratio":
            if self.ratio is None:
                raise ValueError(f"{self.case!r}: a ratio target needs a ceiling")
            x = self.ratio
        elif self.target_kind == "value":
            x = self.value
        else:
            raise ValueError(f"{self.case!r}: target_kind must be 'ratio' or 'value'")
        self.ok = bool(x >= self.target if self.higher_is_better else x <= self.target)

    def to_dict(self) -> dict[str, Any]:
        """The JSON row, keys in the order BENCHMARKS.md shows (plus ``target_kind``)."""
        d = asdict(self)
        keys = (
            "case", "metric", "unit", "value", "min", "max", "ceiling", "ceiling_what",
            "ratio", "target", "target_kind", "higher_is_better", "ok",
        )  # fmt: skip
        return {k: _json_number(d[k]) for k in keys}


def measure(
    fn: Callable[..., Any],
    repeats: int,
    warmup: int = 1,
    *,
    setup: Callable[[], Any] | None = None,
    number: int = 1,
) -> tuple[float, float, float]:
    """Seconds per call of ``fn``: (median, min, max) over ``repeats`` timed repetitions.

    See ``measure_samples`` for ``warmup``, ``setup`` and ``number``.
    """
    return summarize(measure_samples(fn, repeats, warmup, setup=setup, number=number))


def measure_samples(
    fn: Callable[..., Any],
    repeats: int,
    warmup: int = 1,
    *,
    setup: Callable[[], Any] | None = None,
    number: int = 1,
) -> list[float]:
    """The seconds per call of ``fn`` in each of ``repeats`` timed repetitions.

    ``warmup`` untimed repetitions run first. When ``setup`` is given it runs before
    every repetition, outside the timed region, and ``fn`` receives what it returns
    (use it to rebuild the state the operation consumes). Without ``setup`` each
    repetition times ``number`` back-to-back calls of ``fn()`` and divides. The
    garbage collector is off inside the timed region, as in ``timeit``.

    Collect samples of several cases in turns and ``summarize`` them at the end when
    the cases are to be compared with each other on a machine whose speed drifts.
    """
    if repeats < 1 or number < 1 or warmup < 0:
        raise ValueError("repeats and number must be >= 1, warmup >= 0")
    if setup is not None and number != 1:
        raise ValueError("number must be 1 when setup is given")
    times: list[float] = []
    for i in range(warmup + repeats):
        arg = setup() if setup is not None else None
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            if setup is not None:
                t0 = time.perf_counter()
                fn(arg)
                t1 = time.perf_counter()
            else:
                t0 = time.perf_counter()
                for _ in range(number):
                    fn()
                t1 = time.perf_counter()
        finally:
            if gc_was_enabled:
                gc.enable()
        if i >= warmup:
            times.append((t1 - t0) / number)
    return times


def summarize(samples: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``samples``."""
    return statistics.median(samples), min(samples), max(samples)


def machine_info(device: object | None = None) -> dict[str, Any]:
    """CPU model, core count, torch version and the device the benchmark ran on.

    ``device`` (a string or ``torch.device``) names it; None means the accelerator
    when one is present, else ``"cpu"``. A CUDA device gets its product name appended.
    """
    try:
        import torch

        torch_version = torch.__version__
        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a dependency
        torch, torch_version, has_cuda = None, None, False
    dev = str(device) if device is not None else ("cuda" if has_cuda else "cpu")
    if dev.startswith("cuda") and has_cuda and torch is not None:
        dev = f"{dev} ({torch.cuda.get_device_name(torch.device(dev))})"
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "torch": torch_version, "device": dev}


def print_table(results: Sequence[Result], title: str | None = None) -> None:
    """Print the results as aligned columns, then how many targets were met."""
    headers = ("case", "value", "unit", "min", "max", "ceiling", "ratio", "target", "ok")
    rows = [
        (
            r.case,
            _fmt(r.value),
            r.unit,
            _fmt(r.min),
            _fmt(r.max),
            _fmt(r.ceiling),
            _fmt(r.ratio),
            _fmt_target(r),
            "-" if r.ok is None else ("yes" if r.ok else "NO"),
        )
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    left = {0, 2}  # text columns

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    if title:
        print(title)
    print(line(headers))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(line(row))
    judged = [r for r in results if r.ok is not None]
    if judged:
        print(f"targets met: {sum(bool(r.ok) for r in judged)}/{len(judged)}")
    ceilings = sorted({r.ceiling_what for r in results if r.ceiling_what})
    for what in ceilings:
        print(f"ceiling: {what}")


def report_cpu_run(
    benchmark: str,
    quick: bool,
    details: str,
    results: Sequence[Result],
    out: str | None,
    load_before: float,
) -> None:
    """Print a CPU benchmark's headline (the machine, ``details``, the load average
    before the run and now) and its table; write its JSON to ``out`` when given."""
    machine = machine_info("cpu")
    print(
        f"{benchmark}{' --quick' if quick else ''}: {machine['cpu']}, {machine['cores']} "
        f"cores, torch {machine['torch']}; {details}; load average {load_before:.2f} "
        f"before, {os.getloadavg()[0]:.2f} after"
    )
    print_table(results)
    if out:
        write_json(out, benchmark, results, machine)


def write_json(
    path: str | os.PathLike[str],
    benchmark_name: str,
    results: Sequence[Result],
    machine: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write ``{"benchmark", "machine", "results"}`` to ``path`` (parents created), and
    the keys of ``extra`` (a benchmark's details beyond its rows, e.g. a breakdown)."""
    doc = {
        "benchmark": benchmark_name,
        "machine": machine if machine is not None else machine_info(),
        "results": [r.to_dict() for r in results],
        **(extra or {}),
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False) + "\n")


def standard_args(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes (add more, then parse)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="reduced run (fewer repetitions/sizes) that finishes in under 60 s on 2 cores",
    )
    parser.add_argument("--out", metavar="FILE.json", help="write the results as JSON here")
    return parser


# ------------------------------------------------------------------ internals
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _json_number(x: Any) -> Any:
    """Non-finite floats become null (JSON has no inf/nan)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return str(x)
    a = abs(x)
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _fmt_target(r: Result) -> str:
    if r.target is None:
        return "-"
    op = ">=" if r.higher_is_better else "<="
    return f"{r.target_kind} {op} {r.target:g}"
