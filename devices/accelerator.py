"""What CUDA and Ascend share: torch's device-module API for streams, events and pinned copies.

`torch.get_device_module(name)` gives `Stream`, `Event`, `current_stream` and
`stream` for both device types, so the staged transfer path below is written
once. Device modules subclass `AcceleratorBackend` only where the hardware
differs (CUDA: mapped pinned pools and a scatter kernel; NPU: table rules).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from prefix_cache.devices.base import DeviceBackend, DeviceEvent, HostBuffer, Transfer, wait_event


#: Stream objects `_current_stream` keeps (a runner uses a handful of streams).
_MAX_CACHED_STREAMS = 64

#: The issue scope of an in-stream move: the caller's stream as it is (reentrant, so shared).
_IN_STREAM = contextlib.nullcontext()


class _StreamScope:
    """`with` block on `stream`, restoring the previous current stream and current device on exit.

    The bare current-stream swap of torch's `stream()` context, at a third of its
    cost (it runs on the engine thread every step). `set_stream` also makes the
    stream's device current, so the caller's current device is put back too.
    """

    __slots__ = ("_module", "_stream", "_current", "_previous", "_previous_device")

    def __init__(self, module: Any, stream: Any, current: Callable[[], Any]) -> None:
        self._module = module
        self._stream = stream
        self._current = current  # the caller's current stream on the stream's device
        self._previous: Any = None
        self._previous_device = 0

    def __enter__(self) -> None:
        self._previous_device = self._module.current_device()
        self._previous = self._current()
        self._module.set_stream(self._stream)

    def __exit__(self, *exc: object) -> None:
        self._module.set_stream(self._previous)
        if self._module.current_device() != self._previous_device:
            self._module.set_device(self._previous_device)


class AcceleratorBackend(DeviceBackend):
    """Staged device→host transfers on one copy stream, ordered after the compute stream,
    or in stream order on the compute stream itself (`in_stream`).

    Invariant: every copy issued here runs either on `copy_stream`, after the
    event its caller recorded on the compute stream, or on the caller's stream;
    on each stream launch order is write order, and `_in_stream_tail` is the
    done event of the latest in-stream move.
    """

    def __init__(self, device_index: int | None = None) -> None:
        self.module: Any = torch.get_device_module(self.name)
        index = self.module.current_device() if device_index is None else device_index
        self._device = torch.device(self.name, index)
        self.copy_stream = self.module.Stream(device=self._device)
        self._in_stream_tail: DeviceEvent | None = None
        self._streams: dict[int, Any] = {}  # raw stream handle -> its Stream object

    @property
    def device(self) -> torch.device:
        return self._device

    def bind_thread(self) -> None:
        self.module.set_device(self._device)

    def record_event(self) -> DeviceEvent:
        event = self.module.Event()
        event.record(self._current_stream())
        return event

    def _current_stream(self) -> Any:
        """The calling thread's current stream on this backend's device.

        The device module builds a new Stream object on each `current_stream()` (about 5 µs
        on an H200 host, several times a step on the engine thread); where the device gives
        the stream's raw handle cheaply, the object is built once per handle. A handle names
        one stream for as long as the stream lives, and a Stream object is only its handle.
        """
        handle = self._raw_current_stream()
        if handle is None:
            return self.module.current_stream(self._device)
        stream = self._streams.get(handle)
        if stream is None:
            if len(self._streams) >= _MAX_CACHED_STREAMS:  # streams made and dropped: start over
                self._streams.clear()
            stream = self._streams[handle] = self.module.current_stream(self._device)
        return stream

    def _raw_current_stream(self) -> int | None:
        """The current stream's raw handle, where the device gives it without building a
        Stream object; None: ask the device module each time."""
        return None

    def drain(self, timeout_s: float) -> bool:
        done = self.module.Event()
        done.record(self.copy_stream)
        try:
            wait_event(done, timeout_s, lambda: f"{self.name} copy stream")
            wait_event(self._in_stream_tail, timeout_s, lambda: f"{self.name} in-stream copies")
        except TimeoutError:
            return False
        return True

    def snapshot(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().clone()

    def alloc_host(self, shape: Sequence[int], dtype: torch.dtype) -> HostBuffer:
        return HostBuffer(torch.empty(tuple(shape), dtype=dtype, pin_memory=True), pinned=True)

    def _issue_scope(self, ready: DeviceEvent | None,
                     in_stream: bool) -> _StreamScope | contextlib.nullcontext[None]:
        """Where a move is issued: the copy stream after `ready`, or the caller's own stream."""
        if in_stream:
            return _IN_STREAM
        if ready is not None:
            self.copy_stream.wait_event(ready)
        return _StreamScope(self.module, self.copy_stream, self._current_stream)

    def _record_done(self, in_stream: bool) -> DeviceEvent:
        """An event after the move just issued, inside its `_issue_scope` block."""
        done = self._record_blocking(in_stream)
        if in_stream:
            self._in_stream_tail = done
        return done

    def _record_blocking(self, in_stream: bool) -> DeviceEvent:
        """A blocking event recorded on the caller's stream (`in_stream`), else the copy stream:
        a thread waiting on it sleeps in the driver instead of spinning there, where a spin
        contends with the engine thread's launches."""
        done = self.module.Event(blocking=True)
        done.record(self._current_stream() if in_stream else self.copy_stream)
        return done

    def scatter_rows(self, rows: torch.Tensor, slots: torch.Tensor, pool: HostBuffer, *,
                     ready: DeviceEvent | None, staging: torch.Tensor | None,
                     in_stream: bool = False, host_slots: np.ndarray | None = None) -> Transfer:
        if staging is None:  # a one-off write (deferred keys): a pinned page of its own
            staging = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        if staging.shape[0] < rows.shape[0]:
            raise ValueError(f"{self.name}: staged scatter of {rows.shape[0]} rows into a staging "
                             f"buffer of {staging.shape[0]} rows")
        host = staging[: rows.shape[0]]
        with self._issue_scope(ready, in_stream):
            host.copy_(rows, non_blocking=True)
            done = self._record_done(in_stream)
        target = pool.tensor

        def finish() -> None:
            target.index_copy_(0, slots, host)

        return Transfer(event=done, finish=finish, keepalive=(rows,))

    def alloc_arena(self, nbytes: int) -> torch.Tensor:
        # torch's caching host allocator: a block is reused only once its copies completed
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy_to_host(self, tensor: torch.Tensor, *, ready: DeviceEvent | None,
                     out: torch.Tensor | None = None,
                     in_stream: bool = False) -> tuple[torch.Tensor, Transfer]:
        if tensor.device.type != self.name:
            host = tensor.detach().to("cpu", copy=True)
            return (host if out is None else out.copy_(host)), Transfer()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True) if out is None \
            else out
        with self._issue_scope(ready, in_stream):
            host.copy_(tensor, non_blocking=True)
            done = self._record_done(in_stream)
        return host, Transfer(event=done, keepalive=(tensor,))
