"""Host memory for the tensors reads return, recycled once their caller lets go of them.

A tensor `materialize` returns is the caller's (SPEC §4.5): nothing else holds or
reuses its memory while any tensor over it lives. Once the last one is gone, the
memory comes back here instead of to the system, so a later read writes into pages
that were faulted in before. A fresh mapping costs a page fault per 4 KiB, and a
gather into one ran at about a third of the speed of one into reused pages.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import defaultdict

import numpy as np
import torch

#: Buffers smaller than this come from torch's allocator: the heap reuses them already.
MIN_RECYCLED_BYTES = 1 << 20
#: Size classes per doubling: a buffer is at most 1/CLASSES_PER_DOUBLING larger than asked.
CLASSES_PER_DOUBLING = 4


def size_class(nbytes: int) -> int:
    """The bytes of the buffer that serves a request for `nbytes` (>= MIN_RECYCLED_BYTES)."""
    step = (1 << (nbytes.bit_length() - 1)) // CLASSES_PER_DOUBLING
    return -(-nbytes // step) * step


class OutputBuffers:
    """Recycled host buffers for read outputs, at most `capacity_bytes` of them kept free.

    Invariant: a buffer is in `_free` only while no tensor over it exists; it
    gets there from the finalizer of the array its tensor was made from, which
    runs when torch drops the last tensor over that memory, on whichever thread
    drops it.
    Invariant: memory swapped out of a live output (`share_memory_`, `set_`) is never reused.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._free: dict[int, list[np.ndarray]] = defaultdict(list)
        self._free_bytes = 0
        self.reused = 0  # outputs served from a recycled buffer
        self.swapped_out = 0  # buffers freed, not kept: torch swapped them out of a live tensor
        self._lock = threading.RLock()  # a finalizer may run inside a locked call's GC

    @property
    def free_bytes(self) -> int:
        """Bytes held for reuse: resident memory no tensor uses."""
        return self._free_bytes

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, *, zeroed: bool = False
              ) -> torch.Tensor:
        """A new CPU tensor the caller owns, of `shape` and `dtype` (zero-filled if `zeroed`)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_RECYCLED_BYTES or self.capacity_bytes == 0:
            return (torch.zeros if zeroed else torch.empty)(shape, dtype=dtype)
        size = size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            buffer = free.pop() if free else None
            if buffer is not None:
                self._free_bytes -= size
                self.reused += 1
        if buffer is None:
            buffer = np.empty(size, dtype=np.uint8)
        handed = buffer[:nbytes]  # the array torch holds; its end returns `buffer` here
        out = torch.from_numpy(handed).view(dtype).view(shape)
        # either alive when `handed` ends: torch swapped the memory out under a live output
        holders = (weakref.ref(out), weakref.ref(out.untyped_storage()))
        weakref.finalize(handed, self._give_back, buffer, holders).atexit = False
        if zeroed:
            out.zero_()
        return out

    def clear(self) -> None:
        """Drop every free buffer (outputs still in use stay their holders')."""
        with self._lock:
            self._free.clear()
            self._free_bytes = 0
            self.capacity_bytes = 0  # buffers given back from now on are dropped

    def _give_back(self, buffer: np.ndarray,
                   holders: tuple[weakref.ref[torch.Tensor], weakref.ref[torch.UntypedStorage]]
                   ) -> None:
        """Keeps `buffer` only if the tensor and the storage handed out over it are gone."""
        with self._lock:
            if holders[0]() is not None or holders[1]() is not None:
                self.swapped_out += 1
            elif self._free_bytes + buffer.nbytes <= self.capacity_bytes:
                self._free[buffer.nbytes].append(buffer)
                self._free_bytes += buffer.nbytes
