"""The bench's scaling sweep as a PNG (`python -m prefix_cache bench --plot PATH`).

matplotlib is optional (the `plot` extra): `unplottable` says in one line why a plot cannot be
drawn before any measurement starts.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from prefix_cache.tools.reporting.harness import unwritable


def unplottable(png_path: str, quick: bool) -> str | None:
    """Why `--plot png_path` cannot be drawn after this run, or None."""
    if quick:
        return "--plot draws the scaling sweep, which --quick leaves out"
    if importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install 'omni-prefix-cache[plot]' (or matplotlib)"
    return unwritable(png_path, "--plot")


def plot_scaling(result: dict[str, Any], png_path: str) -> None:
    """One column per sweep of `result["scaling"]`: engine-thread µs per step above, host MiB
    below, on linear axes from 0 so that growth reads as it is."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = result["scaling"]
    fig, axes = plt.subplots(2, len(sweeps), figsize=(5 * len(sweeps), 7), squeeze=False)
    for column, (name, points) in enumerate(sweeps.items()):
        xs, micros, host_bytes = zip(*points)
        time_ax, memory_ax = axes[0][column], axes[1][column]
        time_ax.semilogx(xs, micros, "o-")
        time_ax.set_ylabel("engine-thread µs per step")
        memory_ax.semilogx(xs, [b / 2**20 for b in host_bytes], "s-", color="tab:orange")
        memory_ax.set_ylabel("host MiB (pools + staging)")
        for ax in (time_ax, memory_ax):
            ax.set_ylim(bottom=0)
            ax.set_xlabel(name if name == "pool blocks" else f"{name} per step")
            ax.grid(True, which="both", alpha=0.3)
    forward_us = result.get("scaling_forward_us", 0)
    beside = (f", each step beside a {forward_us / 1000:.1f} ms stand-in forward"
              if forward_us else "")
    fig.suptitle(f"omni-prefix-cache scaling, {result['device']}{beside}\n{result['machine']}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
