"""Sweep the CUDA scatter kernel's launch shape: save efficiency (M1) and GEMM interference (M7).

    PYTHONPATH=. python3 benchmarks/scatter_sweep.py      # on a CUDA machine
"""

from __future__ import annotations

import torch

from prefix_cache import devices
from prefix_cache.devices.cuda import scatter
from prefix_cache.tools import bench
from prefix_cache.tools.demo import format_table

#: (programs, warps, rows per program iteration)
SHAPES = [(16, 4, 1), (16, 8, 4), (16, 8, 8), (32, 8, 4), (32, 8, 2), (8, 8, 8)]


def main() -> None:
    backend = devices.get_backend("cuda")
    rows = []
    for ctas, warps, per_iter in SHAPES:
        scatter.SCATTER_CTAS, scatter.SCATTER_WARPS, scatter.SCATTER_ROWS = ctas, warps, per_iter
        cells = []
        for tokens in (2048, 8192):
            save = bench.measure_save(backend, tokens, 15092, torch.bfloat16, 5)
            cells.append(f"{save['scatter'] / save['contiguous']:.2f} "
                         f"({save['scatter']:.1f}/{save['contiguous']:.1f} GB/s)")
        inter = bench.gemm_interference(backend, torch.bfloat16, 20)
        rows.append([ctas, warps, per_iter, *cells, f"{inter['copy']:.3f}",
                     f"{inter['full_grid']:.3f}"])
    print(format_table(["programs", "warps", "rows/iter", "M1 2048 tok", "M1 8192 tok",
                        "GEMM x", "full-grid GEMM x"], rows))


if __name__ == "__main__":
    main()
