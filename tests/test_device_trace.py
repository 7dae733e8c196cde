"""The device side of torch profiler traces (`tools/device_trace.py`), on small synthetic Chrome
traces shaped as torch writes them with CUDA activity."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest

from prefix_cache.tools.profiling import device_trace
from prefix_cache.tools.profiling.device_trace import DeviceWork, compare_table, device_work


def device(ts: float, dur: float, name: str, cat: str) -> dict[str, Any]:
    return {"ph": "X", "pid": 0, "tid": 7, "ts": ts, "dur": dur, "name": name, "cat": cat}


H2D, D2H = "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)"


def step_trace_events() -> list[dict[str, Any]]:
    """A step's device work and the host calls around it (which are not the device's)."""
    return [
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 500, "name": "aten::mm", "cat": "cpu_op"},
        {"ph": "i", "pid": 0, "tid": 7, "ts": 5, "name": "marker", "cat": "kernel"},  # no span
        device(0, 10, H2D, "gpu_memcpy"),
        device(5, 10, H2D, "gpu_memcpy"),       # overlaps the first: 15 µs of input copies
        device(20, 100, "ampere_bf16_gemm", "kernel"),
        device(120, 30, "scatter_rows_kernel", "kernel"),  # the cache's zero-copy save
        device(10, 20, D2H, "gpu_memcpy"),      # 5 µs of it beside the inputs
        device(200, 4, "Memset (Device)", "gpu_memset"),
        device(210, 6, "Memcpy DtoD (Device -> Device)", "gpu_memcpy"),
    ]


def test_device_events_are_counted_by_kind_and_the_cache_s_kernels_apart() -> None:
    work = device_work(step_trace_events())
    assert work.counts == {"HtoD": 2, "DtoH": 1, "kernel": 1, "cache kernel": 1, "memset": 1,
                           "DtoD": 1}
    assert work.busy_us == {"HtoD": 20.0, "DtoH": 20.0, "kernel": 100.0, "cache kernel": 30.0,
                            "memset": 4.0, "DtoD": 6.0}
    # the two input copies cover 0-15 µs once; the save's copy runs 10-30 µs: 5 µs together
    assert work.d2h_during_h2d_us == 5.0 and not work.empty


@pytest.mark.parametrize("d2h, h2d, together", [
    ([(0, 10)], [(10, 20)], 0.0),                           # touching: never at once
    ([(0, 100)], [(10, 20), (30, 40), (90, 120)], 30.0),    # one save over three inputs
    ([(0, 10), (20, 30), (40, 50)], [(5, 45)], 20.0),       # three saves over one input
    ([(0, 10), (5, 15)], [(0, 15), (2, 3)], 15.0),          # overlaps within each kind
])
def test_copies_at_once_is_the_time_both_directions_ran(d2h, h2d, together) -> None:
    events = [device(a, b - a, D2H, "gpu_memcpy") for a, b in d2h]
    events += [device(a, b - a, H2D, "gpu_memcpy") for a, b in h2d]
    assert device_work(events).d2h_during_h2d_us == together


def test_a_trace_without_device_activity_is_empty() -> None:
    work = device_work([{"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 5, "name": "aten::add",
                         "cat": "cpu_op"}])
    assert work.empty and work == DeviceWork()


def test_the_table_puts_engines_side_by_side_kind_by_kind() -> None:
    table = compare_table({"plain": device_work(step_trace_events()[:5]),
                           "cache": device_work(step_trace_events())})
    header, rule, *lines = table.splitlines()
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line) for line in lines)}
    assert re.split(r"\s{2,}", header) == ["device work in the traced steps", "plain", "cache"]
    assert rows == {
        "kernels, the step's": ["1 for 100 µs", "1 for 100 µs"],
        "kernels, the cache's": ["0 for 0 µs", "1 for 30 µs"],
        "memsets": ["0 for 0 µs", "1 for 4 µs"],
        "host-to-device copies": ["2 for 20 µs", "2 for 20 µs"],
        "device-to-host copies": ["0 for 0 µs", "1 for 20 µs"],
        "device-to-device copies": ["0 for 0 µs", "1 for 6 µs"],
        "device-to-host copies during host-to-device ones": ["0 µs", "5 µs"]}


def test_the_command_reads_plain_and_gzipped_traces(tmp_path: Path, capsys) -> None:
    plain, cache = tmp_path / "plain.json", tmp_path / "cache.json.gz"
    plain.write_text(json.dumps({"traceEvents": step_trace_events()[:3]}))
    with gzip.open(cache, "wt") as f:
        json.dump({"traceEvents": step_trace_events()}, f)
    device_trace.main([str(plain), str(cache)])
    out = capsys.readouterr().out
    assert "plain.json" in out.splitlines()[0] and "cache.json.gz" in out.splitlines()[0]
    assert "device-to-host copies during host-to-device ones" in out
