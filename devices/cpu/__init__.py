"""The host backend: synchronous, no streams; the reference every other backend matches.

Its pool write is `_core.copy_rows`: on the calling thread, GIL released, one copy per run
of consecutive slots (streaming stores for long runs). torch's `index_copy_` splits the
copy across its OpenMP threads, and where other work keeps the host's cores busy each call
waits for a worker to be scheduled: 5-8 ms for a 2 MiB step on a loaded 2-core host,
against 0.4-0.6 ms for the single-thread copy there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from prefix_cache.core import _core
from prefix_cache.devices.base import (DeviceBackend, DeviceEvent, HostBuffer, Transfer,
                                        byte_rows)


_CPU = torch.device("cpu")


class CpuBackend(DeviceBackend):
    """Rows already live in host memory, so every transfer completes in its call."""

    name = "cpu"
    synchronous = True
    host_slots_only = True

    @classmethod
    def is_available(cls) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return _CPU

    def record_event(self) -> DeviceEvent | None:
        return None

    def alloc_host(self, shape: Sequence[int], dtype: torch.dtype) -> HostBuffer:
        return HostBuffer(torch.empty(tuple(shape), dtype=dtype), pinned=False)

    def scatter_rows(self, rows: torch.Tensor, slots: torch.Tensor | None, pool: HostBuffer, *,
                     ready: DeviceEvent | None, staging: torch.Tensor | None,
                     in_stream: bool = False, host_slots: np.ndarray | None = None) -> Transfer:
        """`pool.tensor[slots[i]] = rows[i]`, complete when it returns.

        Rows of another dtype are converted to the pool's first (the core never passes
        any); strided rows are made contiguous first. Every slot is checked before a row
        is written: one outside the pool raises IndexError naming it and leaves the pool
        unchanged. A slot given several times (the null block 0) keeps its last row.
        """
        copy_rows(rows, slots if host_slots is None else host_slots, pool)
        return Transfer()

    def copy_to_host(self, tensor: torch.Tensor, *, ready: DeviceEvent | None,
                     out: torch.Tensor | None = None,
                     in_stream: bool = False) -> tuple[torch.Tensor, Transfer]:
        if out is None:
            return tensor.detach().to("cpu", copy=True), Transfer()
        return out.copy_(tensor), Transfer()


def copy_rows(rows: torch.Tensor, slots: torch.Tensor | np.ndarray,
              pool: torch.Tensor | HostBuffer) -> None:
    """`pool[slots[i]] = rows[i]` for host tensors `rows` [n, F...] and `pool` [num_slots, F...]
    (int64 `slots`, a tensor or an array), as `pool.index_copy_(0, slots, rows.to(pool.dtype))`
    does, through `_core.copy_rows` on their bytes (any dtype, bfloat16 included): every slot
    is checked before a byte is written, and a slot given twice keeps its last row. A pool that
    is not contiguous, or rows of another row shape, take `index_copy_` itself. A HostBuffer
    pool lends its byte view, made once (`HostBuffer.byte_rows`); the rows are read at their
    address (`data_ptr`), without a view of their own."""
    buffer = pool if isinstance(pool, HostBuffer) else None
    target = pool.tensor if buffer is not None else pool
    # a HostBuffer's dtype and shape are values: the engine thread reads fewer torch attributes
    dtype, shape = (buffer.dtype, buffer.shape) if buffer is not None \
        else (target.dtype, target.shape)
    if rows.dtype != dtype:
        rows = rows.to(dtype)
    row_shape = rows.shape
    if len(row_shape) != len(shape) or row_shape[1:] != shape[1:] or (
            buffer is None and (not shape or not target.is_contiguous())):
        target.index_copy_(0, torch.as_tensor(slots), rows)  # torch's own checks and messages
        return
    slot_array = slots.numpy() if isinstance(slots, torch.Tensor) else slots
    if slot_array.dtype != np.int64:
        raise TypeError(f"cpu scatter: slots must be int64, got {slots.dtype}")
    if not rows.is_cpu:
        raise ValueError(f"cpu scatter: rows must be a host tensor, got one on {rows.device}")
    if not rows.is_contiguous():
        rows = rows.contiguous()
    dst = buffer.byte_rows if buffer is not None else byte_rows(target)
    # the rows read in place at their address (held by `rows` for the call): no numpy view
    _core.copy_rows((rows.data_ptr(), row_shape[0], dst.shape[1]),
                    np.ascontiguousarray(slot_array), dst)
