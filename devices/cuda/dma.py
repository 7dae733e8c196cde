"""Saves by the copy engine: a step's rows into their pool slots, a run of consecutive slots at
a time, in one `cudaMemcpyBatchAsync` issued by `_dma`'s thread instead of the engine thread.

On the H200 (`benchmarks/h200_dma_runs.txt`) the batch moves 1.00x a contiguous D2H at every
run size from one 16-row block up, against 0.87-0.89x for the scatter kernel, and beside a
GEMM loop it costs 1.002-1.011x against 1.035x. The driver spends about 0.4 us a run issuing
it, which the issuing thread pays; the engine thread pays a private copy of the rows on the
device (in-stream saves: the caller may overwrite its rows once its stream moves on) and one
C call.
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np
import torch

from prefix_cache.devices.base import HostBuffer
from prefix_cache.devices.cuda import _dma
from prefix_cache.devices.cuda.libraries import function_addresses, loaded_cudart


#: Set to 0: every save takes the scatter kernel (for side-by-side measurements).
DMA_ENV = "OMNI_PREFIX_CACHE_CUDA_DMA"
#: Saves of at least this many bytes of a key go by DMA; smaller ones (decode steps) take the
#: kernel, which needs no private copy and whose launch costs less than a batch's issue.
DMA_MIN_BYTES = 1 << 20
#: Overrides DMA_MIN_BYTES (0: every save by DMA, as the GPU engine tests run it).
DMA_MIN_BYTES_ENV = "OMNI_PREFIX_CACHE_CUDA_DMA_MIN_BYTES"
#: Jobs an issuer holds at once: saves in flight, bounded in practice by the staging slots.
RING = 4096

_RUNTIME_FUNCTIONS = ("cudaSetDevice", "cudaEventCreateWithFlags", "cudaEventRecord",
                      "cudaEventQuery", "cudaEventSynchronize", "cudaEventDestroy",
                      "cudaStreamWaitEvent",
                      "cudaGetLastError", "cudaGetErrorName", "cudaMemcpyBatchAsync")


def dma_enabled() -> bool:
    return os.environ.get(DMA_ENV, "1") not in ("", "0")


def dma_min_bytes() -> int:
    """The smallest save of a key that goes by DMA: DMA_MIN_BYTES_ENV, else DMA_MIN_BYTES."""
    value = os.environ.get(DMA_MIN_BYTES_ENV, "")
    try:
        return DMA_MIN_BYTES if value == "" else max(0, int(value))
    except ValueError:
        raise ValueError(f"{DMA_MIN_BYTES_ENV}={value!r} is not a number of bytes") from None


class DmaDone:
    """One DMA save's end, as a device event: over once its rows are copied, or it failed."""

    __slots__ = ("_issuer", "job")

    def __init__(self, issuer: _dma.Issuer, job: int) -> None:
        self._issuer = issuer
        self.job = job

    def query(self) -> bool:
        return self._issuer.query(self.job)

    def synchronize(self) -> None:
        self._issuer.synchronize(self.job)

    def error(self) -> str | None:
        return self._issuer.error(self.job)

    def __del__(self) -> None:
        self._issuer.release(self.job)


class RunCopier:
    """The copy-engine path of one device's saves, issued on its copy stream.

    Invariant: jobs are issued on the copy stream in submit order, each after its caller's
    stream (or `ready`) at submit time, and are over in that order (a job's done event is
    recorded after every earlier job's runs, its own batch failed or not); one thread
    submits at a time (`submit`'s lock).
    """

    def __init__(self, device_index: int, copy_stream: torch.cuda.Stream) -> None:
        lib = loaded_cudart()
        version = ctypes.c_int(0)
        asked = lib.cudaRuntimeGetVersion(ctypes.byref(version))
        if asked != 0:
            lib.cudaGetLastError()  # not left for torch's next launch check
        if asked != 0 or version.value < 12080 or not hasattr(lib, "cudaMemcpyBatchAsync"):
            raise RuntimeError(f"CUDA runtime {version.value} has no cudaMemcpyBatchAsync "
                               f"(needs 12.8 or later)")
        self._issuer = _dma.Issuer(function_addresses(lib, _RUNTIME_FUNCTIONS), version.value,
                                   device_index, copy_stream.cuda_stream, RING)
        self._tail: DmaDone | None = None  # the latest job
        self._lock = threading.Lock()
        self.submitted = 0  # jobs submitted since start

    def pending(self) -> bool:
        """Whether a job submitted earlier may still be writing (the latest one is not over:
        jobs are over in submit order)."""
        return self._tail is not None and not self._tail.query()

    def submit(self, rows: torch.Tensor, slots: np.ndarray, pool: HostBuffer,
               ready: torch.cuda.Event | None, caller_stream: int) -> DmaDone:
        """Queue `pool.tensor[slots[i]] = rows[i]` (contiguous device rows, int64 host slots)
        after `ready`, or after the caller's stream as it is now."""
        target = pool.tensor
        row_bytes = rows[0].numel() * rows.element_size() if len(rows) else 1
        with self._lock:
            job = self._issuer.submit(caller_stream, 0 if ready is None else ready.cuda_event,
                                      rows.data_ptr(), row_bytes, slots, target.data_ptr(),
                                      target.shape[0])
            self._tail = DmaDone(self._issuer, job)
            self.submitted += 1
            return self._tail

    def flush(self, timeout_s: float) -> bool:
        """Whether every job submitted so far was issued on the copy stream within `timeout_s`."""
        return self._issuer.flush(timeout_s)

    def close(self) -> None:
        self._tail = None
        self._issuer.close()
