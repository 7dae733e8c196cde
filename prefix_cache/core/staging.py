"""Staging slots: the bound on unconsumed steps, and the pinned pages a staged write passes through."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from prefix_cache.devices.base import DeviceBackend, HostBuffer
from prefix_cache.errors import OmniPrefixCacheStagingTimeoutError
from prefix_cache.core.host_copies import SlotArena
from prefix_cache.core.kept_tensors import keeping_tensors


#: Who holds a staging slot: `("step", step_id)` until the step is consumed, and
#: `("write", task_id)` until the write passing through the slot has landed.
Holder = tuple[str, int]


class StagingPool:
    """`depth` slots; each is held by an unconsumed step and by the write that passes through it.

    Invariant: a slot is free iff it has no holder; a holder is released only
    by its own owner, so a failed step can never free a slot another step or
    write still holds. Staged backends get one `[capacity, F]` host buffer per
    slot and key, allocated on first use.
    """

    def __init__(self, depth: int, capacity: int, backend: DeviceBackend) -> None:
        self.depth = depth
        self.capacity = capacity
        self._backend = backend
        self._holders: list[set[Holder]] = [set() for _ in range(depth)]
        self._buffers: dict[tuple[int, str], HostBuffer] = {}
        self.arenas = [SlotArena(backend) for _ in range(depth)]  # each slot's host copies
        #: the holders; `_cond` (over it) wakes waiting claimers. Each call takes the lock
        #: itself: a Condition's `with` costs two Python-level calls more
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._claimers_waiting = 0  # a release wakes them; with none, it notifies nobody
        self.waits = 0
        self.wait_time_s = 0.0

    def claim(self, step_id: int, timeout_s: float, pending_tasks: Callable[[], int]) -> int:
        """A free slot, held by `("step", step_id)`; waits at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        start = None
        with self._mutex:
            while True:
                for slot, holders in enumerate(self._holders):
                    if not holders:
                        holders.add(("step", step_id))
                        if start is not None:
                            self.waits += 1
                            self.wait_time_s += time.monotonic() - start
                        return slot
                start = start or time.monotonic()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    unused = sorted(i for holders in self._holders
                                    for kind, i in holders if kind == "step")
                    raise OmniPrefixCacheStagingTimeoutError(
                        f"step {step_id}: no staging slot free after {timeout_s:.1f}s; "
                        f"unused step ids {unused}, {pending_tasks()} write tasks pending "
                        f"(materialize or discard_step each step id)")
                self._claimers_waiting += 1
                try:
                    self._cond.wait(remaining)
                finally:
                    self._claimers_waiting -= 1

    def hold(self, slot: int, holder: Holder) -> None:
        """Add a holder to a slot the caller already holds (a write passing through it)."""
        with self._mutex:
            if not self._holders[slot]:
                raise RuntimeError(f"staging slot {slot} is free: {holder} cannot join it")
            self._holders[slot].add(holder)

    def release(self, slot: int, holder: Holder) -> None:
        """Drop `holder`'s hold; a holder that holds nothing there changes nothing."""
        with self._mutex:
            self._holders[slot].discard(holder)
            if self._claimers_waiting and not self._holders[slot]:
                self._cond.notify_all()

    def buffer(self, slot: int, key: str, width: int, dtype: torch.dtype) -> torch.Tensor:
        """Slot `slot`'s `[capacity, width]` host page for `key`."""
        buf = self._buffers.get((slot, key))
        if buf is None:  # made on a step's first staged write, maybe in inference mode
            with keeping_tensors():
                buf = self._backend.alloc_host((self.capacity, width), dtype)
            self._buffers[(slot, key)] = buf
        return buf.tensor

    def nbytes(self) -> int:
        return (sum(buf.nbytes for buf in self._buffers.values())
                + sum(arena.nbytes for arena in self.arenas))

    def close(self) -> None:
        for buf in self._buffers.values():
            buf.close()
        self._buffers.clear()
        self.arenas = []
