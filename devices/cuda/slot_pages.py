"""Mapped host pages a scatter reads its slot indices from and reports refused rows into.

Passing a step's slots through a mapped page costs one small host copy on the
engine thread; uploading them would cost a pinned allocation and an H2D copy
per step. Each page ends in `FLAG_CELLS` int64 cells, zeroed by `take`, into which
the launch that holds the page counts the rows whose slot it found outside the
pool (a launch that reads the runner's device slot mapping holds a page for
those cells alone). A page goes back to the free list when the copy that used it
is done; its count is read then, before the page can be zeroed for another
launch, and kept with the launch's lease for the write's landing to check.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import numpy as np
import torch

from prefix_cache.devices.base import DeviceEvent, HostBuffer
from prefix_cache.devices.cuda.host_memory import register_host
from prefix_cache.devices.cuda.scatter import FLAG_CELLS


class SlotRangeError(RuntimeError):
    """A scatter was handed slots outside its pool; those rows were not written."""


def count_out_of_range(slots: np.ndarray, num_slots: int) -> int:
    """How many of `slots` lie outside `[0, num_slots)`."""
    if slots.size == 0:
        return 0
    if int(slots.min()) >= 0 and int(slots.max()) < num_slots:  # the usual case: two passes
        return 0
    return int(np.count_nonzero((slots < 0) | (slots >= num_slots)))


def out_of_range_error(what: str, refused: int, n: int, num_slots: int,
                       slots: np.ndarray | None = None) -> SlotRangeError:
    """The error for `refused` of `n` rows with slots outside `[0, num_slots)`; `slots`, where
    the host has them, adds the first offending row and slot."""
    detail = ""
    if slots is not None:
        bad = np.flatnonzero((slots < 0) | (slots >= num_slots))
        if bad.size:
            detail = f" (first: row {int(bad[0])}, slot {int(slots[bad[0]])})"
    return SlotRangeError(f"{what}: {refused} of {n} rows had a slot out of range, outside "
                          f"[0, {num_slots}){detail}; they were not written to the pool")


#: The flag cells' bytes of a launch that refused no row.
_NONE_REFUSED = bytes(8 * FLAG_CELLS)


class _Page:
    """A registered page with its host cells and the device views of its slots and flag cells,
    made once (views cost microseconds on the engine thread)."""

    __slots__ = ("buffer", "cells", "flag_cells", "capacity", "slots", "flags")

    def __init__(self, buffer: HostBuffer) -> None:
        self.buffer = buffer
        self.cells: np.ndarray = buffer.tensor.numpy()
        self.flag_cells: np.ndarray = self.cells[-FLAG_CELLS:]
        self.capacity = self.cells.shape[0] - FLAG_CELLS
        self.slots: torch.Tensor = buffer.device_view
        self.flags: torch.Tensor = buffer.device_view[-FLAG_CELLS:]

    def refused(self) -> int:
        """The count the launch that used this page stored (its event has completed)."""
        if self.flag_cells.tobytes() == _NONE_REFUSED:  # the usual case: a tenth of a sum's cost
            return 0
        return int(self.flag_cells.sum())


class SlotLease:
    """One launch's hold on a page: the device views of its slots and of its flag cells.

    `refused` is the launch's count of refused rows once its page went back to the free
    list (the page's cells are read then); until then the page's cells hold it.
    """

    __slots__ = ("page", "slots", "flags", "refused")

    def __init__(self, page: _Page, slots: torch.Tensor | None) -> None:
        self.page: _Page | None = page
        self.slots = slots
        self.flags = page.flags
        self.refused: int | None = None


class SlotPages:
    """int64 pages mapped into the device; a page in use is paired with the event that frees it.

    Every scatter in flight holds a page: a step's write (one per key; one that reads the
    runner's device slot mapping holds it for its flag cells) and each retiring request's
    deferred write. A page comes back when its launch completed, whether or not its write
    has landed. 16 pages (1 MiB) cover a batch of retirements while the copy stream is
    behind, next to the few steps in flight; a burst beyond them registers a page more,
    kept from then on.

    Invariant: every page registered is in `_pages`, and is in at most one of `_free`,
    `_busy` (paired with its lease and the event that frees it) or a lease not yet released
    (taken, or abandoned by a launch that failed: such a page never comes back); a page in
    `_busy` is read (its count moves to the lease) and zeroed only after its event completed.
    """

    def __init__(self, device: torch.device, *, pages: int = 16, capacity: int = 8192,
                 alloc: Callable[[int], HostBuffer] | None = None) -> None:
        self._capacity = capacity
        #: a mapped int64 buffer of that many cells (a stand-in's in tests)
        self._alloc = alloc if alloc is not None else (
            lambda cells: register_host((cells,), torch.int64, device))
        self._pages: list[_Page] = [_Page(self._alloc(capacity + FLAG_CELLS))
                                    for _ in range(pages)]
        self._free: list[_Page] = list(self._pages)
        self._busy: collections.deque[tuple[DeviceEvent, SlotLease]] = collections.deque()
        self._lock = threading.Lock()

    def take(self, slots: torch.Tensor | None) -> SlotLease:
        """A page holding `slots` (an int64 CPU tensor; None: the flag cells only), its flag
        cells zeroed."""
        n = 0 if slots is None else slots.shape[0]
        with self._lock:
            while self._busy and self._busy[0][0].query():  # events complete in launch order
                _, done = self._busy.popleft()
                page = done.page
                done.refused, done.page = page.refused(), None  # read before it is zeroed
                self._free.append(page)
            page = None
            for i in range(len(self._free) - 1, -1, -1):  # the latest freed first
                if self._free[i].capacity >= n:
                    page = self._free.pop(i)
                    break
        if page is None:  # a step larger than every free page: a new page, kept for later
            page = _Page(self._alloc(max(n, self._capacity) + FLAG_CELLS))
            with self._lock:
                self._pages.append(page)
        page.flag_cells.fill(0)  # numpy writes: a fifth of torch's call cost
        if slots is None:
            return SlotLease(page, None)
        page.cells[:n] = slots.numpy()
        return SlotLease(page, page.slots[:n])

    def release_after(self, lease: SlotLease, done: DeviceEvent) -> None:
        """`lease`'s page may be read and rewritten once `done` has completed (events recorded
        in launch order)."""
        with self._lock:
            self._busy.append((done, lease))

    def abandon(self, lease: SlotLease) -> None:
        """A launch failed after `take`: whether it reads the page is unknown, so the page
        stays out of use until `close`."""
        lease.page = None

    def refused(self, lease: SlotLease) -> int:
        """The rows `lease`'s launch refused; call once the event it was released with has
        completed (or, never released, the launch is known to be done)."""
        with self._lock:
            if lease.page is not None:  # still paired with its page: the cells hold the count
                return lease.page.refused()
            return lease.refused or 0

    def close(self) -> None:
        """Unregister every page, taken ones too; the caller has waited for the copies that
        read them."""
        with self._lock:
            pages = list(self._pages)
            self._pages.clear()
            self._free.clear()
            for _, lease in self._busy:  # a verify still to run reads the count kept here
                if lease.page is not None:
                    lease.refused, lease.page = lease.page.refused(), None
            self._busy.clear()
        for page in pages:
            page.buffer.close()
