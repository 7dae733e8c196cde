"""`python -m prefix_cache bench --quick` on this machine: every metric, one table, JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prefix_cache.tools.reporting.targets import METRICS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_quick_bench_judges_every_metric_against_its_target(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "prefix_cache", "bench", "--device", "cpu",
                          "--quick", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert max(map(len, lines)) <= 100
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["machine"]
    assert sorted(result["metrics"]) == sorted(METRICS)
    for name, metric in result["metrics"].items():
        target = METRICS[name].target_on("cpu")
        assert metric["target"] == target.text and metric["reference"], name
        assert metric["value"] is None or metric["value"] >= 0, name
        if target.gpu_only or metric["value"] is None:
            assert metric["pass"] is None, name  # shown, not judged, on CPU
        else:
            assert metric["pass"] == target.met_by(metric["value"]), name
        (row,) = [line for line in lines if line.startswith(f"{name} ")]
        verdict = {True: "pass", False: "MISS"}.get(metric["pass"])
        assert (verdict or ("GPU only" if target.gpu_only else "n/a")) in row, row
    assert result["metrics"]["M7"]["value"] is None  # no device compute on CPU: null, with why
    m4 = result["metrics"]["M4"]
    assert m4["value"] == 0 and "200 mixed steps after warm-up: 0 pinned" in m4["reference"]
    assert 0.9 <= result["metrics"]["M6"]["value"] <= 1.05  # measured, not exactly 1
    assert result["metrics"]["M2p"]["value"] > 0


@pytest.mark.parametrize("whole_entries", [False, True], ids=["rows-each-step", "whole-entries"])
def test_m5s_loop_runs_either_save_path_and_reads_every_row_back(whole_entries: bool) -> None:
    """`benchmarks/m5_paths.py` times both: each loop with the cache runs to the end (the whole
    entries' read-back finds every position of the prompt written) and gives one ratio a pair."""
    from prefix_cache import devices
    from prefix_cache.tools.metrics.overhead import step_loop
    backend = devices.get_backend("cpu")
    try:
        ratios, off = step_loop(backend, 64, torch.float32, 8, 2, whole_entries=whole_entries)
    finally:
        backend.close()
    assert len(ratios) == 2 and all(r > 0 for r in ratios) and off > 0


def test_the_streaming_step_cost_bench_runs_both_stages_and_checks_every_entry(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`benchmarks/stream_step_cost.py`, M9c's comparison without vLLM, runs on a CPU machine:
    both stages' entries arrive whole (it raises where a request's rows fall short) and it
    prints the engine thread's steps with each and their ratio."""
    from benchmarks import stream_step_cost
    monkeypatch.setattr(sys, "argv", ["stream_step_cost", "--rounds", "1", "--prompt", "16",
                                      "--decode", "6", "--forward-python-us", "20",
                                      "--forward-ops", "5"])
    stream_step_cost.main()
    out = capsys.readouterr().out
    assert "engine thread: a decode step, streaming" in out
    assert re.search(r"M9c's ratio\)\s+\d+\.\d{3}", out), out
