"""Mapped host pages the scatter kernel reads its slot indices from, recycled once read.

Passing a step's slots through a mapped page costs one small host copy on the
engine thread; uploading them would cost a pinned allocation and an H2D copy
per step. A page goes back to the free list when the copy that read it is done.
"""

from __future__ import annotations

import collections
import threading

import torch

from prefix_cache.devices.base import DeviceEvent, HostBuffer
from prefix_cache.devices.cuda.host_memory import register_host


class SlotPages:
    """int64 pages mapped into the device; a page in use is paired with the event that frees it.

    Every scatter in flight holds a page: a step's write and each retiring request's
    deferred write. 16 pages (1 MiB) cover a batch of retirements while the copy
    stream is behind; a burst beyond them registers a page more, kept from then on.

    Invariant: a page is in exactly one of `_free` and `_busy`, and a page in
    `_busy` is only rewritten after its event has completed.
    """

    def __init__(self, device: torch.device, *, pages: int = 16, capacity: int = 8192) -> None:
        self._device = device
        self._free: list[HostBuffer] = [register_host((capacity,), torch.int64, device)
                                        for _ in range(pages)]
        self._busy: collections.deque[tuple[DeviceEvent, HostBuffer]] = collections.deque()
        self._lock = threading.Lock()

    def take(self, slots: torch.Tensor) -> tuple[HostBuffer, torch.Tensor]:
        """A page holding `slots` and its first `len(slots)` entries as a device tensor."""
        n = slots.shape[0]
        with self._lock:
            while self._busy and self._busy[0][0].query():  # events complete in launch order
                self._free.append(self._busy.popleft()[1])
            page = next((p for p in self._free if p.tensor.shape[0] >= n), None)
            if page is not None:
                self._free.remove(page)
        if page is None:  # a step larger than every free page: a new page, kept for later
            page = register_host((max(n, 8192),), torch.int64, self._device)
        page.tensor.numpy()[:n] = slots.numpy()  # a numpy copy: a fifth of torch's call cost
        return page, page.device_view[:n]

    def release_after(self, page: HostBuffer, done: DeviceEvent) -> None:
        """`page` may be rewritten once `done` has completed (events recorded in launch order)."""
        with self._lock:
            self._busy.append((done, page))

    def close(self) -> None:
        """Unregister every page; the caller has waited for the copies that read them."""
        with self._lock:
            pages = self._free + [page for _, page in self._busy]
            self._free.clear()
            self._busy.clear()
        for page in pages:
            page.close()
