"""Staging slots: the bound on unconsumed steps, and the pinned pages a staged write passes through."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from prefix_cache.devices.base import DeviceBackend, HostBuffer
from prefix_cache.errors import OmniPrefixCacheStagingTimeoutError


class StagingPool:
    """`depth` slots; each is held by an unconsumed step and by the write that passes through it.

    Invariant: a slot is free iff it has no holder. Staged backends get one
    `[capacity, F]` host buffer per slot and key, allocated on first use.
    """

    def __init__(self, depth: int, capacity: int, backend: DeviceBackend) -> None:
        self.depth = depth
        self.capacity = capacity
        self._backend = backend
        self._holders: list[set[str]] = [set() for _ in range(depth)]
        self._step_of_slot: list[int | None] = [None] * depth
        self._buffers: dict[tuple[int, str], HostBuffer] = {}
        self._cond = threading.Condition()
        self.waits = 0
        self.wait_time_s = 0.0

    def claim(self, step_id: int, timeout_s: float, pending_tasks: Callable[[], int]) -> int:
        """A free slot for `step_id`, held by it and its write; waits at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        start = None
        with self._cond:
            while True:
                for slot, holders in enumerate(self._holders):
                    if not holders:
                        holders.update(("step", "write"))
                        self._step_of_slot[slot] = step_id
                        if start is not None:
                            self.waits += 1
                            self.wait_time_s += time.monotonic() - start
                        return slot
                start = start or time.monotonic()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    unused = sorted(s for s, h in zip(self._step_of_slot, self._holders)
                                    if s is not None and "step" in h)
                    raise OmniPrefixCacheStagingTimeoutError(
                        f"step {step_id}: no staging slot free after {timeout_s:.1f}s; "
                        f"unused step ids {unused}, {pending_tasks()} write tasks pending "
                        f"(materialize or discard_step each step id)")
                self._cond.wait(remaining)

    def release(self, slot: int, holder: str) -> None:
        with self._cond:
            self._holders[slot].discard(holder)
            if not self._holders[slot]:
                self._step_of_slot[slot] = None
                self._cond.notify_all()

    def buffer(self, slot: int, key: str, width: int, dtype: torch.dtype) -> torch.Tensor:
        """Slot `slot`'s `[capacity, width]` host page for `key`."""
        buf = self._buffers.get((slot, key))
        if buf is None:
            buf = self._backend.alloc_host((self.capacity, width), dtype)
            self._buffers[(slot, key)] = buf
        return buf.tensor

    def nbytes(self) -> int:
        return sum(buf.nbytes for buf in self._buffers.values())

    def close(self) -> None:
        for buf in self._buffers.values():
            buf.close()
        self._buffers.clear()
