"""`python -m prefix_cache bench --quick` on this machine: every metric of SPEC §8, one table, JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_quick_bench_reports_every_metric_with_its_target_and_reference(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "prefix_cache", "bench", "--device", "cpu",
                          "--quick", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "metric" in run.stdout and "target" in run.stdout
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["machine"]
    assert sorted(result["metrics"]) == [f"M{i}" for i in range(1, 8)]
    for name, metric in result["metrics"].items():
        assert metric["target"] and metric["reference"], name
        assert metric["value"] is None or metric["value"] >= 0, name
    assert result["metrics"]["M7"]["value"] is None  # no device compute on CPU: null, with why
    assert result["metrics"]["M4"]["value"] == 0.0  # the hidden pool is allocated at init
    assert result["metrics"]["M6"]["value"] <= 1.05
