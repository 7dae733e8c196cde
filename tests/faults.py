"""A backend that forwards to a real one and fails on purpose at one chosen point.

A test double: real copy engines, drivers and pinned allocators fail (or stall)
only on hardware and under memory pressure this machine cannot produce, so the
failure is injected; everything that does not fail runs on the real backend.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from prefix_cache.devices.base import DeviceBackend, DeviceEvent, HostBuffer, Transfer

#: Where a fault can be injected: each backend call `save_outputs` or a deferred flush
#: makes on the engine thread, and each step of the committer's landing of a write.
ENGINE_POINTS = ("snapshot", "record_event", "copy_to_host", "alloc_host", "scatter_rows")
COMMITTER_POINTS = ("event_query", "finish", "stall")


class InjectedFault(RuntimeError):
    """The failure a FaultyBackend raises."""


class _FailingEvent:
    """An event whose query fails (a driver error) or never completes (a stalled engine)."""

    def __init__(self, *, stall: bool) -> None:
        self._stall = stall

    def query(self) -> bool:
        if self._stall:
            return False
        raise InjectedFault("injected event query failure")


class GatedEvent:
    """Completes once `gate` is set (and the real event, if any, has)."""

    def __init__(self, inner: DeviceEvent | None, gate: threading.Event) -> None:
        self._inner = inner
        self._gate = gate

    def query(self) -> bool:
        return self._gate.is_set() and (self._inner is None or self._inner.query())


class FaultyBackend(DeviceBackend):
    """`inner` with the `nth` call of `point` (counted from `arm`) failing."""

    def __init__(self, inner: DeviceBackend) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.zero_copy = inner.zero_copy
        self.synchronous = False  # transfers go through the committer, as on a device
        self._point: str | None = None
        self._countdown = 0
        self.fired = 0
        self.delay_writes: threading.Event | None = None  # when set: writes land after it

    @classmethod
    def is_available(cls) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def needs_staging(self) -> bool:
        return self.inner.needs_staging

    def arm(self, point: str, nth: int = 1) -> None:
        self._point, self._countdown = point, nth

    def _fires(self, point: str) -> bool:
        if self._point != point:
            return False
        self._countdown -= 1
        if self._countdown:
            return False
        self._point = None
        self.fired += 1
        return True

    def _maybe_raise(self, point: str) -> None:
        if self._fires(point):
            raise InjectedFault(f"injected {point} failure")

    # the backend contract, forwarded
    def bind_thread(self) -> None:
        self.inner.bind_thread()

    def record_event(self) -> DeviceEvent | None:
        self._maybe_raise("record_event")
        return self.inner.record_event()

    def snapshot(self, tensor: torch.Tensor) -> torch.Tensor:
        self._maybe_raise("snapshot")
        return self.inner.snapshot(tensor)

    def alloc_host(self, shape: Sequence[int], dtype: torch.dtype) -> HostBuffer:
        self._maybe_raise("alloc_host")
        return self.inner.alloc_host(shape, dtype)

    def copy_to_host(self, tensor: torch.Tensor, *, ready: DeviceEvent | None,
                     out: torch.Tensor | None = None,
                     in_stream: bool = False) -> tuple[torch.Tensor, Transfer]:
        self._maybe_raise("copy_to_host")
        return self.inner.copy_to_host(tensor, ready=ready, out=out, in_stream=in_stream)

    def alloc_arena(self, nbytes: int) -> torch.Tensor:
        self._maybe_raise("alloc_host")
        return self.inner.alloc_arena(nbytes)

    def scatter_rows(self, rows: torch.Tensor, slots: torch.Tensor, pool: HostBuffer, *,
                     ready: DeviceEvent | None, staging: torch.Tensor | None,
                     in_stream: bool = False, host_slots: np.ndarray | None = None) -> Transfer:
        self._maybe_raise("scatter_rows")
        if self.delay_writes is not None:  # the write itself runs late, as a slow DMA would
            gate, host_rows = self.delay_writes, rows.to("cpu", copy=True)

            def late() -> None:
                pool.tensor.index_copy_(0, slots, host_rows.to(pool.tensor.dtype))

            return self._committer_fault(Transfer(event=GatedEvent(None, gate), finish=late))
        transfer = self.inner.scatter_rows(rows, slots, pool, ready=ready, staging=staging,
                                           in_stream=in_stream)
        return self._committer_fault(transfer)

    def _committer_fault(self, transfer: Transfer) -> Transfer:
        for point in COMMITTER_POINTS:
            if self._fires(point):
                if point == "finish":
                    return Transfer(event=transfer.event, finish=_raise_finish,
                                    keepalive=transfer.keepalive)
                return Transfer(event=_FailingEvent(stall=point == "stall"),
                                finish=transfer.finish, keepalive=transfer.keepalive)
        return transfer

    def drain(self, timeout_s: float) -> bool:
        return self.inner.drain(timeout_s)

    def check_rows(self, what: str, tensor: torch.Tensor) -> None:
        self.inner.check_rows(what, tensor)

    def close(self) -> None:
        self.inner.close()


def _raise_finish() -> None:
    raise InjectedFault("injected pool write failure")


def spy(calls: list[str], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, recording `name` in `calls` each time it runs."""
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return fn(*args, **kwargs)
    return wrapped
