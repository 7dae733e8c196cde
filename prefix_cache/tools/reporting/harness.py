"""The benchmarks' shared harness: timing, a run's spread, the machine and commit measured, the
text table and the JSON file; the bench (`python -m prefix_cache bench`) and the pipeline bench
use it alike.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


#: Columns the printed report fits in.
REPORT_WIDTH = 100


def source_commit() -> str | None:
    """The commit of the checkout this package runs from (`-dirty` if changed), where it is
    one: results name the code they measured."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"],
                              cwd=Path(__file__).resolve().parent, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def machine(device: str) -> str:
    """The host, its CPUs, torch, and the GPU's name where `device` is cuda."""
    return (f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, torch "
            f"{torch.__version__}" + (f", {torch.cuda.get_device_name()}" if device == "cuda"
                                      else ""))


def timeit(fn: Callable[[], None], repeat: int) -> float:
    """Median seconds of `repeat` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timeit_interleaved(runs: dict[str, Callable[[], None]], repeat: int) -> dict[str, float]:
    """Median seconds of each of `runs` over `repeat` rounds after one warm-up round; each
    round calls every run once, starting one further along each time, so a host that slows
    for a while (another process, the kernel's memory scans) slows them alike."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeat + 1):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            start = time.perf_counter()
            runs[name]()
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _seconds(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paired_seconds(base: Callable[[], None], variant: Callable[[], None], pairs: int
                    ) -> list[tuple[float, float]]:
    """(`base`'s seconds, `variant`'s) per pair of runs made back to back, in alternating
    order: a drift of the machine's speed over seconds (a device's clocks as it heats, a
    host's load) moves both runs of a pair, not their ratio. Run each once first to warm
    up."""
    times = []
    for rep in range(pairs):
        if rep % 2 == 0:
            alone, with_variant = _seconds(base), _seconds(variant)
        else:
            with_variant, alone = _seconds(variant), _seconds(base)
        times.append((alone, with_variant))
    return times


def format_table(headers: list[str], rows: list[list[Any]], width: int = REPORT_WIDTH) -> str:
    """Left-aligned columns; the last one is wrapped so that every line fits in `width`."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    indent = sum(widths[:-1]) + 2 * (len(widths) - 1)
    widths[-1] = min(widths[-1], max(width - indent, 20))

    def lines(row: list[str]) -> list[str]:
        head = "  ".join(c.ljust(w) for c, w in zip(row[:-1], widths))
        wrapped = textwrap.wrap(row[-1], widths[-1]) or [""]
        first = f"{head}  {wrapped[0]}" if head else wrapped[0]
        return [first.rstrip()] + [" " * indent + more for more in wrapped[1:]]

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([*lines(headers), rule, *(line for r in cells for line in lines(r))])


def spread(values: list[float]) -> dict[str, Any]:
    """The median of `values`, its extremes, and every value."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values}


def write_json(path: str, result: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(result, indent=2))


def unwritable(file_path: str, option: str = "--json") -> str | None:
    """Why `file_path` (given as `option`) cannot be written, or None; leaves no file behind."""
    path = Path(file_path)
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        return f"{option} {file_path}: cannot write there ({exc.strerror})"
    if not existed:
        path.unlink()
    return None
