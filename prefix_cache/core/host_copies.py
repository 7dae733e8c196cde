"""Host copies of a step's outputs that are returned per step (leftover, deferred keys' rows).

The engine thread never allocates pinned memory for them: pinned allocation can
synchronize the device, stalling the engine behind the forward. Each staging
slot owns one arena; a step's copies are carved out of it in order and land
there by DMA. A copy that does not fit keeps its private device copy instead,
and the consumer (`materialize`, off the engine thread) moves it to the host
and grows the arena so the next step's copies fit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefix_cache.devices.base import DeviceBackend, DeviceEvent, Transfer, wait_event
from prefix_cache.errors import OmniPrefixCacheError

_ALIGN = 64  # bytes: every carved tensor starts on a cache line


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class SlotArena:
    """Host bytes for one staging slot's copies, carved in order and reset per step.

    Invariant: `carve` never allocates; only `grow` does, called by the consumer
    while the slot's step still holds the slot, so no carved view is live then.
    """

    def __init__(self, backend: DeviceBackend) -> None:
        self._backend = backend
        self._buffer: torch.Tensor | None = None
        self._used = 0
        self._needed = 0

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def reset(self) -> None:
        self._used = self._needed = 0

    def carve(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialized `shape` tensor in the arena, or None when it does not fit."""
        nbytes = _round_up(torch.Size(shape).numel() * dtype.itemsize, _ALIGN)
        start, self._used = self._used, self._used + nbytes
        self._needed = max(self._needed, self._used)
        if self._buffer is None or self._used > self._buffer.numel():
            return None
        return self._buffer[start: start + nbytes].view(dtype)[: torch.Size(shape).numel()] \
            .view(shape)

    def grow(self) -> None:
        """Make the arena hold what the last step needed (a power of two: no allocator waste)."""
        if self._needed > self.nbytes:
            self._buffer = self._backend.alloc_arena(1 << (self._needed - 1).bit_length())


class HostCopy:
    """One tensor on its way to the host: a DMA into the arena, a finished copy, or a
    private device copy the consumer moves itself; `result` hands out a CPU tensor the
    caller owns in every case."""

    __slots__ = ("_host", "_transfer", "_in_arena", "_pending", "_ready")

    def __init__(self, host: torch.Tensor | None, transfer: Transfer, *, in_arena: bool = False,
                 pending: torch.Tensor | None = None, ready: DeviceEvent | None = None) -> None:
        self._host = host
        self._transfer = transfer
        self._in_arena = in_arena
        self._pending = pending  # the private device copy, when the arena was too small
        self._ready = ready

    @classmethod
    def start(cls, backend: DeviceBackend, arena: SlotArena, tensor: torch.Tensor,
              ready: DeviceEvent | None, *, in_stream: bool) -> HostCopy:
        """Issue the copy of `tensor`: in the caller's stream order (`in_stream`, reading the
        caller's tensor in place), or after `ready` from a private copy nobody else writes."""
        if backend.synchronous or tensor.device.type == "cpu":
            return cls(*backend.copy_to_host(tensor, ready=ready))
        out = arena.carve(tensor.shape, tensor.dtype)
        if out is None:
            if in_stream:  # kept past the call: the caller may overwrite its own tensor
                tensor, ready = backend.snapshot(tensor), backend.record_event()
            return cls(None, Transfer(keepalive=(tensor,)), pending=tensor, ready=ready)
        return cls(*backend.copy_to_host(tensor, ready=ready, out=out, in_stream=in_stream),
                   in_arena=True)

    def result(self, timeout_s: float, what: str) -> torch.Tensor:
        """The copy as a CPU tensor the caller owns; waits (bounded) for the device."""
        if self._pending is not None:
            wait_event(self._ready, timeout_s, lambda: what, error=OmniPrefixCacheError)
            return self._pending.to("cpu")
        wait_event(self._transfer.event, timeout_s, lambda: what, error=OmniPrefixCacheError)
        return self._host.clone() if self._in_arena else self._host
