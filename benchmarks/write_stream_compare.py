"""Writes on the compute stream vs on the copy stream, side by side: M2, M2p, M5 and M7.

    PYTHONPATH=. python3 benchmarks/write_stream_compare.py --runs 5 --json PATH   # on a GPU

Each run measures both settings back to back (the order alternates between runs), so host
noise falls on both; the table gives each figure's median over the runs and its spread.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from prefix_cache import devices
from prefix_cache.bench import engine_thread_us, gemm_interference, step_loop
from prefix_cache.config import WRITE_STREAMS


def one_run(backend: devices.DeviceBackend, order: tuple[str, ...]) -> dict[str, dict[str, float]]:
    dtype = torch.bfloat16
    out: dict[str, dict[str, float]] = {w: {} for w in order}
    for w in order:
        out[w]["M2 µs"] = engine_thread_us(backend, 64, 1, dtype, 200, write_stream=w).median_us
        out[w]["M2p µs"] = engine_thread_us(backend, 1, 2048, dtype, 100,
                                            write_stream=w).median_us
    off = step_loop(backend, 256, dtype, 50, with_cache=False)
    for w in order:
        out[w]["M5"] = step_loop(backend, 256, dtype, 50, with_cache=True, write_stream=w) / off
    inter = gemm_interference(backend, dtype, 30)
    out["compute"]["M7"], out["copy"]["M7"] = inter["in_stream"], inter["kernel"]
    return out


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
