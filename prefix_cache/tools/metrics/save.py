"""M1, save efficiency: rows scattered into random pool slots per second ÷ one contiguous copy
of the same bytes, with `SAVES_IN_FLIGHT` saves overlapping as consecutive steps do.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from prefix_cache.devices.accelerator import AcceleratorBackend
from prefix_cache.devices.base import DeviceBackend, Transfer, block_on_event
from prefix_cache.tools.reporting.harness import timeit
from prefix_cache.tools.metrics.workload import BLOCK, WIDTH, random_slots, synchronize


#: Saves issued before waiting, as consecutive steps overlap in an engine (M1's steady state).
SAVES_IN_FLIGHT = 4


def saves_by_dma(backend: DeviceBackend, nbytes: int) -> bool:
    """Whether `backend` saves `nbytes` of a key by copy engine, so that the scatter kernel is a
    second path worth timing beside it (`without_dma`)."""
    dma_takes = getattr(backend, "dma_takes", None)
    return dma_takes is not None and dma_takes(nbytes)


def without_dma(backend: DeviceBackend, fn: Callable[[], Any]) -> Any:
    """`fn()` with every save of a CUDA backend on the scatter kernel (none by copy engine)."""
    threshold, backend.dma_min_bytes = backend.dma_min_bytes, sys.maxsize
    try:
        return fn()
    finally:
        backend.dma_min_bytes = threshold


def pipelined(backend: DeviceBackend, launch: Callable[[], Transfer | None]
              ) -> Callable[[], None]:
    """SAVES_IN_FLIGHT launches back to back, then wait for all: throughput as steps overlap."""
    def run() -> None:
        transfers = [launch() for _ in range(SAVES_IN_FLIGHT)]
        for transfer in transfers:
            if transfer is not None:
                land(transfer)
        synchronize(backend)
    return run


def land(transfer: Transfer) -> None:
    """Wait for `transfer`, then raise what its copies found wrong, as the committer does (a
    save that wrote nothing must not be timed), then run its host half."""
    block_on_event(transfer.event, 60, lambda: "bench transfer")
    if transfer.verify is not None:
        transfer.verify()
    if transfer.finish is not None:
        transfer.finish()


def measure_save(backend: DeviceBackend, tokens: int, num_blocks: int, dtype: torch.dtype,
                 repeat: int) -> dict[str, float]:
    """GB/s of: the backend's scatter, the staged design, one contiguous D2H (reference)."""
    rng = np.random.default_rng(0)
    pool = backend.alloc_host((num_blocks * BLOCK, WIDTH), dtype)
    rows = torch.randn(tokens, WIDTH, device=backend.device).to(dtype)
    slots = random_slots(num_blocks, tokens, rng)
    # a staging buffer per save in flight, as the cache gives each step a slot of its own
    stagings = [backend.alloc_host((tokens, WIDTH), dtype) for _ in range(SAVES_IN_FLIGHT)]
    next_staging = itertools.cycle(buffer.tensor for buffer in stagings)
    nbytes = rows.numel() * rows.element_size()

    def scatter() -> Transfer:
        return backend.scatter_rows(rows, slots, pool, ready=backend.record_event(),
                                    staging=next(next_staging))

    def staged() -> Transfer:
        return AcceleratorBackend.scatter_rows(backend, rows, slots, pool,
                                               ready=backend.record_event(),
                                               staging=next(next_staging))

    def contiguous() -> None:
        next(next_staging).copy_(rows, non_blocking=backend.name != "cpu")

    def gbs(launch: Callable[[], Transfer | None]) -> float:
        return SAVES_IN_FLIGHT * nbytes / timeit(pipelined(backend, launch), repeat) / 1e9

    out = {"scatter": gbs(scatter), "contiguous": gbs(contiguous)}
    if saves_by_dma(backend, nbytes):  # the kernel, side by side
        out["kernel"] = without_dma(backend, lambda: gbs(scatter))
    if isinstance(backend, AcceleratorBackend):
        pool.tensor.zero_()
        out["staged"] = gbs(staged)
    assert torch.equal(pool.tensor[slots], rows.cpu()), "a save wrote wrong rows"
    pool.close()
    for buffer in stagings:
        buffer.close()
    return out
