"""`bench --plot`: the scaling sweep as a PNG where matplotlib is installed, a one-line reason
before any measurement where it is not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from prefix_cache.tools.reporting.plot import plot_scaling, unplottable

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_quick_runs_have_no_sweep_to_plot(tmp_path: Path) -> None:
    assert "--quick leaves out" in unplottable(str(tmp_path / "s.png"), quick=True)


@pytest.mark.skipif(HAS_MATPLOTLIB, reason="needs a process without matplotlib")
def test_without_matplotlib_the_reason_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    problem = unplottable(str(tmp_path / "s.png"), quick=False)
    assert "needs matplotlib" in problem and "[plot]" in problem and "\n" not in problem


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="needs matplotlib (the plot extra)")
def test_the_sweep_is_drawn_as_a_png(tmp_path: Path) -> None:
    png = tmp_path / "s.png"
    assert unplottable(str(png), quick=False) is None
    assert unplottable(str(tmp_path / "missing" / "s.png"), quick=False).startswith("--plot ")
    sweeps = {"requests": [(1, 20.0, 1 << 20), (64, 90.0, 2 << 20)],
              "tokens": [(1, 20.0, 1 << 20), (1024, 300.0, 8 << 20)]}
    plot_scaling({"device": "cpu", "machine": "host", "scaling": sweeps,
                  "scaling_forward_us": 0}, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
