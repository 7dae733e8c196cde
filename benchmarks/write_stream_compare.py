"""Writes on the compute stream vs on the copy stream, side by side: M2, M2p, M5 and M7.

    PYTHONPATH=. python3 benchmarks/write_stream_compare.py --runs 5 --json PATH   # on a GPU

Each run measures both settings back to back (the order alternates between runs), so host
noise falls on both; the table gives each figure's median over the runs and its spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence

import torch

from prefix_cache import devices
from prefix_cache.tools.bench import engine_figures, gemm_interference
from prefix_cache.config import WRITE_STREAMS


def one_run(backend: devices.DeviceBackend, order: Sequence[str]) -> dict[str, dict[str, float]]:
    """The bench's full-run M2, M2p and M5 workloads for both streams, in `order`, and M7."""
    figures, _ = engine_figures(backend, torch.bfloat16, False, order)
    inter = gemm_interference(backend, torch.bfloat16, 30)
    return {w: {"M2 µs": figures[w]["M2"], "M2p µs": figures[w]["M2p"], "M5": figures[w]["M5"],
                "M7": inter[w]} for w in order}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    backend = devices.get_backend("cuda")
    runs = [one_run(backend, WRITE_STREAMS if i % 2 == 0 else WRITE_STREAMS[::-1])
            for i in range(args.runs)]
    backend.close()
    figures = list(runs[0]["compute"])
    print(f"{'figure':<8}  {'compute stream':<24}  {'copy stream':<24}")
    print(f"{'-' * 8}  {'-' * 24}  {'-' * 24}")
    summary: dict[str, dict[str, list[float]]] = {w: {} for w in WRITE_STREAMS}
    for figure in figures:
        cells = []
        for w in WRITE_STREAMS:
            values = [r[w][figure] for r in runs]
            summary[w][figure] = values
            cells.append(f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]")
        print(f"{figure:<8}  {cells[0]:<24}  {cells[1]:<24}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": args.runs, "figures": summary,
                       "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
