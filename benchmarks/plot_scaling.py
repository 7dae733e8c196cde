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
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (name, points) in zip(axes, result["scaling"].items()):
        xs, ys = zip(*points)
        ax.loglog(xs, ys, "o-")
        ax.set_xlabel(f"{name} per step")
        ax.set_ylabel("engine-thread µs per step")
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"omni-prefix-cache engine-thread time, {result['device']}: {result['machine']}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
