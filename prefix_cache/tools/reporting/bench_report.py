"""The bench's results judged against `targets.METRICS`, and as text for a terminal.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

from prefix_cache.tools.reporting.harness import REPORT_WIDTH, format_table
from prefix_cache.tools.reporting.targets import METRICS, MetricSpec


@dataclass
class Metric:
    """A measured value (None: not measured, `reference` says why), what it was measured
    against, and how."""

    value: float | None
    reference: str
    note: str = ""


def metric_json(spec: MetricSpec, metric: Metric, device: str) -> dict[str, Any]:
    """A measured metric with its target; `pass` is None where the target does not apply."""
    return {"value": metric.value, "target": spec.target_on(device).text,
            "reference": metric.reference, "note": metric.note,
            "pass": judge(spec, metric.value, device)}


def judge(spec: MetricSpec, value: float | None, device: str) -> bool | None:
    target = spec.target_on(device)
    return target.met_by(value) if value is not None and target.applies_to(device) else None


def _value_text(spec: MetricSpec, metric: dict[str, Any] | None) -> str:
    if metric is None or metric["value"] is None:
        return "n/a"
    unit = spec.target.unit
    return f"{metric['value']:.0f} {unit}" if unit else f"{metric['value']:.3f}"


def _expected_miss(device: str, spec: MetricSpec, metric: dict[str, Any] | None) -> bool:
    """Whether `metric` is a miss the CPU backend makes by design (`MetricSpec.cpu_miss`)."""
    return (device == "cpu" and bool(spec.cpu_miss) and metric is not None
            and metric["pass"] is False and metric["value"] >= spec.cpu_floor)


def _result_text(device: str, spec: MetricSpec, metric: dict[str, Any] | None) -> str:
    if metric is None:
        return "not run"
    if metric["pass"] is not None:
        return "pass" if metric["pass"] else \
            "MISS, expected" if _expected_miss(device, spec, metric) else "MISS"
    if not spec.target_on(device).applies_to(device):
        return "GPU only"
    return "n/a"


def _footnotes(device: str, specs: Mapping[str, MetricSpec], result: dict[str, Any]) -> list[str]:
    """Why the rows a newcomer might take for failures are expected on this device."""
    notes = []
    if device != "cuda" and any(spec.target.gpu_only for spec in specs.values()):
        notes.append(f"GPU only: these targets hold on an NVIDIA GPU, where the cache's copies run "
                     f"beside the device's compute; on {device} the row is measured and shown, "
                     f"not judged.")
    if device == "cpu":
        notes += [f"Expected on CPU: {name}'s MISS; {spec.cpu_miss}."
                  for name, spec in specs.items()
                  if _expected_miss(device, spec, result["metrics"].get(name))]
    return [textwrap.fill(note, REPORT_WIDTH) for note in notes]


def report(result: dict[str, Any], specs: Mapping[str, MetricSpec] = METRICS,
           not_measured: str = "not measured by this version of the bench") -> str:
    """The run as text for a terminal: a header, one row per metric of `specs` with pass or
    MISS, and what makes a row expected on this device."""
    device = result["device"]
    header = textwrap.fill(f"device: {device}   machine: {result['machine']}", REPORT_WIDTH)
    rows = []
    for name, spec in specs.items():
        metric = result["metrics"].get(name)
        if metric is None:
            detail = not_measured
        else:
            detail = "; ".join(t for t in (metric["reference"], metric["note"]) if t)
        rows.append([name, _value_text(spec, metric), spec.target_on(device).text,
                     _result_text(device, spec, metric), detail])
    table = format_table(["metric", "value", "target", "result", "measured against; how"], rows)
    return "\n\n".join([header, table, *_footnotes(device, specs, result)])


def scaling_report(sweeps: dict[str, list[tuple[int, float, int]]]) -> str:
    """One small table per sweep of `scaling`."""
    return "\n\n".join(
        format_table([name if name == "pool blocks" else f"{name} per step",
                      "engine-thread µs", "host MiB"],
                     [[n, f"{us:.0f}", f"{nbytes / 2**20:.1f}"] for n, us, nbytes in points])
        for name, points in sweeps.items())
