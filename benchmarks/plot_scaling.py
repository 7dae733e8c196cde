"""Plot the `scaling` section of a `python -m prefix_cache bench --json` file as a PNG."""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(json_path: str, png_path: str) -> None:
    with open(json_path) as fh:
        result = json.load(fh)
    sweeps = result["scaling"]
    fig, axes = plt.subplots(2, len(sweeps), figsize=(5 * len(sweeps), 7), squeeze=False)
    for column, (name, points) in enumerate(sweeps.items()):
        xs, micros, host_bytes = zip(*points)
        time_ax, memory_ax = axes[0][column], axes[1][column]
        time_ax.semilogx(xs, micros, "o-")  # a linear axis from 0: growth reads as it is
        time_ax.set_ylabel("engine-thread µs per step")
        time_ax.set_ylim(bottom=0)
        memory_ax.semilogx(xs, [b / 2**20 for b in host_bytes], "s-", color="tab:orange")
        memory_ax.set_ylabel("host MiB (pools + staging)")
        memory_ax.set_ylim(bottom=0)
        for ax in (time_ax, memory_ax):
            ax.set_xlabel(name if name == "pool blocks" else f"{name} per step")
            ax.grid(True, which="both", alpha=0.3)
    forward_us = result.get("scaling_forward_us", 0)
    beside = (f", each step beside a {forward_us / 1000:.1f} ms stand-in forward"
              if forward_us else "")
    fig.suptitle(f"omni-prefix-cache scaling, {result['device']}{beside}\n{result['machine']}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
