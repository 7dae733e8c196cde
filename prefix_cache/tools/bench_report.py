"""The bench's results judged against `targets.METRICS`, and as text for a terminal.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

from prefix_cache.tools.harness import REPORT_WIDTH, format_table
from prefix_cache.tools.targets import METRICS


@dataclass
class Metric:
    value: float | None
    reference: str
    note: str = ""


def metric_json(name: str, metric: Metric, device: str) -> dict[str, Any]:
    """A measured metric with its target; `pass` is None where the target does not apply."""
    return {"value": metric.value, "target": METRICS[name].target_on(device).text,
            "reference": metric.reference, "note": metric.note,
            "pass": judge(name, metric.value, device)}


def judge(name: str, value: float | None, device: str) -> bool | None:
    target = METRICS[name].target_on(device)
    return target.met_by(value) if value is not None and target.applies_to(device) else None


def _value_text(name: str, metric: dict[str, Any] | None) -> str:
    if metric is None or metric["value"] is None:
        return "n/a"
    unit = METRICS[name].target.unit
    return f"{metric['value']:.0f} {unit}" if unit else f"{metric['value']:.3f}"


def _result_text(device: str, name: str, metric: dict[str, Any] | None) -> str:
    if metric is None:
        return "not run"
    if metric["pass"] is not None:
        return "pass" if metric["pass"] else "MISS"
    if not METRICS[name].target_on(device).applies_to(device):
        return "GPU only"
    return "n/a"


def report(result: dict[str, Any]) -> str:
    """The run as text for a terminal: a header, then one row per metric with pass or MISS."""
    device = result["device"]
    header = textwrap.fill(f"device: {device}   machine: {result['machine']}", REPORT_WIDTH)
    rows = []
    for name in METRICS:
        metric = result["metrics"].get(name)
        if metric is None:
            detail = "not measured by this version of the bench"
        else:
            detail = "; ".join(t for t in (metric["reference"], metric["note"]) if t)
        rows.append([name, _value_text(name, metric),
                     METRICS[name].target_on(device).text, _result_text(device, name, metric),
                     detail])
    table = format_table(["metric", "value", "target", "result", "measured against; how"], rows)
    parts = [header, table]
    if device != "cuda":
        parts.append("Targets marked (GPU) hold on an NVIDIA GPU; on this device they are shown, "
                     "not judged.")
    return "\n\n".join(parts)


def scaling_report(sweeps: dict[str, list[tuple[int, float, int]]]) -> str:
    """One small table per sweep of `scaling`."""
    return "\n\n".join(
        format_table([name if name == "pool blocks" else f"{name} per step",
                      "engine-thread µs", "host MiB"],
                     [[n, f"{us:.0f}", f"{nbytes / 2**20:.1f}"] for n, us, nbytes in points])
        for name, points in sweeps.items())
