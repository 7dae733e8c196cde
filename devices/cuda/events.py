"""The done events of the backend's launches, from a pool of CUDA events recycled when dropped.

A torch event costs the engine thread its constructor, a `cudaEventCreate` at its first record
and a `cudaEventDestroy` when it is dropped: about 8 µs a save on an H100 host (M2's call timing,
`benchmarks/engine_call_timing.py --m2`). `_events.EventPool` records an event it created
earlier, and takes it back when the last reference to it goes.
"""

from __future__ import annotations

import torch

from prefix_cache.devices.cuda import _events
from prefix_cache.devices.cuda.libraries import function_addresses, loaded_cudart

#: Events created at a time: the first batch covers the saves in flight of a few steps.
GROW = 64

_RUNTIME_FUNCTIONS = ("cudaEventCreateWithFlags", "cudaEventRecord", "cudaEventQuery",
                      "cudaEventSynchronize", "cudaEventDestroy", "cudaGetLastError",
                      "cudaGetErrorName")


class DoneEvents:
    """Blocking, untimed events of one device, recorded on a stream by its raw handle."""

    def __init__(self, device: torch.device) -> None:
        self._pool = _events.EventPool(function_addresses(loaded_cudart(), _RUNTIME_FUNCTIONS))
        self._device = device
        self._grow()

    def record(self, stream: int) -> _events.Event:
        """An event recorded on the stream of raw handle `stream` (of this device)."""
        done = self._pool.record(stream)
        if done is None:  # every event is held: more are made
            self._grow()
            done = self._pool.record(stream)
        return done

    @property
    def counts(self) -> tuple[int, int]:
        """(free, created) events."""
        return self._pool.counts

    def _grow(self) -> None:
        with torch.cuda.device(self._device):  # events belong to the device current at creation
            self._pool.grow(GROW)
