"""What the device ran in a traced window, from a torch profiler Chrome trace (CUDA activity).

Issue 30 asks of a profile whether the cache's device-to-host copies compete with the step's own
host-to-device inputs. A trace answers it: its device events (category `kernel`, `gpu_memset`,
`gpu_memcpy`; a copy's direction is in its name, `Memcpy HtoD (Pinned -> Device)`) give, per
kind, how many ran and for how long, and the time in which a device-to-host copy and a
host-to-device one ran at once. The cache's own kernels (`CACHE_KERNELS`: its zero-copy scatter
into mapped host rows) are counted apart from the step's.

    python -m prefix_cache.tools.profiling.device_trace PLAIN.json[.gz] CACHE.json[.gz]

`pipeline_bench --profile` prints the same table for its two engines' traces.
"""

from __future__ import annotations

import argparse
import bisect
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefix_cache.tools.reporting.harness import format_table
from prefix_cache.tools.profiling.step_trace import read_trace

#: Names of the kernels the cache launches (`devices/cuda/scatter.py`'s Triton kernel).
CACHE_KERNELS = ("scatter_rows_kernel",)
#: Copy directions, as torch's profiler names a `gpu_memcpy` event.
DIRECTIONS = ("HtoD", "DtoH", "DtoD", "PtoP")
#: The kinds in the order the table shows them, each with its label there.
KIND_LABELS = {"kernel": "kernels, the step's", "cache kernel": "kernels, the cache's",
               "memset": "memsets", "HtoD": "host-to-device copies",
               "DtoH": "device-to-host copies", "DtoD": "device-to-device copies",
               "PtoP": "peer-to-peer copies"}

Span = tuple[float, float]


@dataclass(frozen=True)
class DeviceWork:
    """A trace's device events by kind (`KIND_LABELS`): how many, their summed µs; and the µs
    in which a device-to-host copy ran while a host-to-device one did."""

    counts: dict[str, int] = field(default_factory=dict)
    busy_us: dict[str, float] = field(default_factory=dict)
    d2h_during_h2d_us: float = 0.0

    @property
    def empty(self) -> bool:
        """No device activity (a CPU run, or a trace without CUDA activity)."""
        return not self.counts


def device_kind(event: dict[str, Any]) -> str | None:
    """The kind of a complete ("X") event that ran on the device; None for anything else."""
    if event.get("ph") != "X":
        return None
    category = event.get("cat")
    if category == "kernel":
        return "cache kernel" if event["name"].startswith(CACHE_KERNELS) else "kernel"
    if category == "gpu_memset":
        return "memset"
    if category == "gpu_memcpy":
        return next((d for d in DIRECTIONS if d in event["name"]), "copy, other")
    return None


def device_work(events: Iterable[dict[str, Any]]) -> DeviceWork:
    """The device work of one trace's events (`step_trace.read_trace`)."""
    counts: Counter[str] = Counter()
    busy: Counter[str] = Counter()
    spans: dict[str, list[Span]] = {"HtoD": [], "DtoH": []}
    for event in events:
        kind = device_kind(event)
        if kind is None:
            continue
        counts[kind] += 1
        busy[kind] += event["dur"]
        if kind in spans:
            spans[kind].append((event["ts"], event["ts"] + event["dur"]))
    return DeviceWork(dict(counts), {k: float(v) for k, v in busy.items()},
                      _together_us(merged_spans(spans["DtoH"]), merged_spans(spans["HtoD"])))


def merged_spans(spans: list[Span]) -> list[Span]:
    """`spans` merged into disjoint spans, in order."""
    merged: list[Span] = []
    for begin, end in sorted(spans):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((begin, end))
    return merged


def _together_us(a: list[Span], b: list[Span]) -> float:
    """The time covered by both of two lists of disjoint, ordered spans."""
    ends = [end for _, end in b]
    together = 0.0
    for begin, end in a:
        i = bisect.bisect_right(ends, begin)  # the first of b that ends after `begin`
        while i < len(b) and b[i][0] < end:
            together += min(end, b[i][1]) - max(begin, b[i][0])
            i += 1
    return together


def compare_table(works: dict[str, DeviceWork]) -> str:
    """The engines' device work side by side: per kind, count and summed time; then the
    device-to-host copies' time beside host-to-device ones."""
    kinds = [k for k in KIND_LABELS if any(k in w.counts for w in works.values())]
    kinds += sorted({k for w in works.values() for k in w.counts} - set(kinds))
    rows = [[KIND_LABELS.get(kind, kind),
             *(f"{w.counts.get(kind, 0):,} for {_time(w.busy_us.get(kind, 0.0))}"
               for w in works.values())] for kind in kinds]
    rows.append(["device-to-host copies during host-to-device ones",
                 *(_time(w.d2h_during_h2d_us) for w in works.values())])
    return format_table(["device work in the traced steps", *works], rows)


def _time(us: float) -> str:
    return f"{us / 1000:,.1f} ms" if us >= 1000 else f"{us:,.0f} µs"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m prefix_cache.tools.profiling.device_trace",
        description="The device work of torch profiler Chrome traces, side by side.")
    parser.add_argument("traces", nargs="+", type=Path, metavar="TRACE",
                        help="a Chrome trace (.json or .json.gz); its file name heads its column")
    args = parser.parse_args(argv)
    print(compare_table({path.name: device_work(read_trace(path)) for path in args.traces}))


if __name__ == "__main__":
    main()
