"""M7, compute interference: a GEMM loop's time with concurrent saves ÷ alone (CUDA only).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np
import torch

from prefix_cache.devices.base import DeviceBackend, Transfer
from prefix_cache.tools.reporting.harness import paired_seconds
from prefix_cache.tools.metrics.save import land, saves_by_dma, without_dma
from prefix_cache.tools.metrics.workload import BLOCK, WIDTH, random_slots, synchronize


#: Pairs of GEMM loops (alone, with saves) per figure: SPEC §8 asks for medians of 5 or more.
M7_PAIRS = 5


def gemm_interference(backend: DeviceBackend, dtype: torch.dtype, iters: int) -> dict[str, float]:
    """GEMM-loop time with a 2048-token save per iteration ÷ without (CUDA only), median of
    M7_PAIRS back-to-back pairs, by where the save runs: `copy` (the copy stream, concurrent
    with the GEMMs), `compute` (in stream, between them), `compute_kernel` (the same by the
    scatter kernel, where the backend saves by DMA too), and `full_grid` (torch `index_copy_`
    on the copy stream)."""
    a = torch.randn(8192, 8192, device=backend.device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=backend.device, dtype=torch.bfloat16)
    pool = backend.alloc_host((4096 * BLOCK, WIDTH), dtype)
    rows = torch.randn(2048, WIDTH, device=backend.device).to(dtype)
    slots = random_slots(4096, 2048, np.random.default_rng(2))
    staging = backend.alloc_host((2048, WIDTH), dtype)

    def loop(save: Callable[[], Transfer] | None) -> None:
        transfers = []
        for _ in range(iters):
            a @ b
            if save is not None:
                transfers.append(save())
        synchronize(backend)
        for t in transfers:
            land(t)

    def kernel_save() -> Transfer:
        return backend.scatter_rows(rows, slots, pool, ready=backend.record_event(),
                                    staging=staging.tensor)

    slots_on_device = slots.to(backend.device)

    def full_grid_save() -> Transfer:  # torch index_copy_ on the mapped pool
        pool.device_view.index_copy_(0, slots_on_device, rows)
        return Transfer()

    device_slots = slots_on_device if backend.device_slots else slots

    def in_stream_save() -> Transfer:  # as the cache's save: the runner's mapping and the host's
        return backend.scatter_rows(rows, device_slots, pool, ready=None, staging=staging.tensor,
                                    in_stream=True, host_slots=slots.numpy())

    def full_grid_on_copy_stream() -> None:
        with torch.cuda.stream(backend.copy_stream):
            loop(full_grid_save)

    runs = {"copy": lambda: loop(kernel_save), "compute": lambda: loop(in_stream_save)}
    if saves_by_dma(backend, rows.numel() * rows.element_size()):  # the kernel, side by side
        runs["compute_kernel"] = lambda: without_dma(backend, lambda: loop(in_stream_save))
    if pool.device_view is not None:
        runs["full_grid"] = full_grid_on_copy_stream
    # a GEMM loop heats the device and its clocks drift over seconds: timing every loop
    # with saves after every loop alone would count that drift as the saves' cost
    for run in (lambda: loop(None), *runs.values()):
        run()  # warm-up
    out = {name: statistics.median(with_saves / alone for alone, with_saves
                                   in paired_seconds(lambda: loop(None), run, M7_PAIRS))
           for name, run in runs.items()}
    pool.close()
    staging.close()
    return out
