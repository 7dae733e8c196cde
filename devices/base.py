"""The backend contract: what the cache core asks of one device type.

A backend owns the device side of every transfer (streams, events, the kernels
or DMA that move rows) and the host memory those transfers land in. The core
never touches a device API directly.
"""

from __future__ import annotations

import math
import os
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np
import torch

T = TypeVar("T")

#: A slot of vLLM's null block 0, which no hit or step reads: where rows that must not land go.
NULL_SLOT = 0

#: Set to 1: every zero-copy scatter checks its slots against the pool on the host before it
#: launches (a device slot mapping is copied to the host for it: a synchronization, so for
#: debugging only); the cache core compares the runner's mapping with the view's slots too.
CHECK_SLOTS_ENV = "OMNI_PREFIX_CACHE_CHECK_SLOTS"


def slot_checks_on() -> bool:
    """Whether `CHECK_SLOTS_ENV` asks for the debugging slot checks."""
    return os.environ.get(CHECK_SLOTS_ENV, "0") not in ("", "0")


class DeviceEvent(Protocol):
    """The part of a torch device event the core relies on."""

    def query(self) -> bool: ...

    def wait(self, stream: Any = None) -> None:
        """Makes the work queued later on `stream` (None: the current one) wait for it."""


class _HostMemory:
    """A CPU tensor's memory as numpy sees it (`__array_interface__`), holding its storage: an
    array made from it keeps the memory alive, even where the tensor is later given another
    (`set_`)."""

    __slots__ = ("__array_interface__", "storage")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.storage = tensor.untyped_storage()
        self.__array_interface__ = {"data": (tensor.data_ptr(), False), "typestr": "|u1",
                                    "shape": (tensor.nbytes,), "version": 3}


def host_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's memory as a flat uint8 array (no copy), of any dtype, without
    a torch op: each may hand the GIL to a busy thread and wait to take it back
    (`benchmarks/gil_handovers.py`), which an engine's output thread pays per chunk. Its
    pointer and size are attribute reads, which keep the GIL."""
    if not tensor.is_cpu or not tensor.is_contiguous():
        raise ValueError(f"host_bytes takes a contiguous CPU tensor, got one on {tensor.device} "
                         f"with strides {tensor.stride()} for shape {tuple(tensor.shape)}")
    if tensor.nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.asarray(_HostMemory(tensor))


def byte_rows(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous host tensor's memory as a uint8 [rows, bytes per row] array (no copy), the
    form `prefix_cache.core._core`'s row copies take (`host_bytes`: any dtype, no torch op)."""
    shape = tensor.shape
    if 0 in shape:  # nothing to view; the row width still has to match
        return np.empty((shape[0], math.prod(shape[1:]) * tensor.element_size()),
                        dtype=np.uint8)
    return host_bytes(tensor).reshape(shape[0], -1)


def _in_process(pid: int, release: Callable[[], None]) -> None:
    """Run `release` only in the process that registered the memory (never in a forked child)."""
    if os.getpid() == pid:
        release()


class HostBuffer:
    """An exact-size host tensor, page-locked where the device can use that.

    Invariant: `tensor` stays valid until `close()`; closing twice is a no-op,
    and a forked child never releases its parent's registration.
    """

    def __init__(self, tensor: torch.Tensor, *, pinned: bool,
                 release: Callable[[], None] | None = None) -> None:
        self.tensor = tensor
        #: `tensor`'s dtype and shape, read once (a torch attribute read costs the engine
        #: thread microseconds after a forward)
        self.dtype: torch.dtype = tensor.dtype
        self.shape: tuple[int, ...] = tuple(tensor.shape)
        self.pinned = pinned
        # a finalizer, so a buffer dropped without close() is still unregistered
        self._release = (weakref.finalize(self, _in_process, os.getpid(), release)
                         if release is not None else None)
        self.device_view: torch.Tensor | None = None  # set by zero-copy backends
        self._byte_rows: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def byte_rows(self) -> np.ndarray:
        """`tensor`'s rows as uint8 (`byte_rows`), made on first use: the host row copies'
        view of a pool, which every save and gather would otherwise make again."""
        if self._byte_rows is None:
            self._byte_rows = byte_rows(self.tensor)
        return self._byte_rows

    def close(self) -> None:
        self.device_view = self._byte_rows = None
        if self._release is not None:
            self._release()  # a finalizer runs at most once: close() stays idempotent


@dataclass
class Transfer:
    """A device→host move in flight.

    Done once `event` has completed (None: complete at creation) and `finish`
    (the host half of a staged move) has run. `keepalive` holds device tensors
    the copy still reads until the event completes. `verify`, where the device
    side can find the move wrong (a slot outside the pool: those rows were not
    written), runs once the event has completed, before `finish`, when the write
    lands; it raises to fail the write. It must not wait on the device.
    """

    event: DeviceEvent | None = None
    finish: Callable[[], None] | None = None
    keepalive: tuple[Any, ...] = field(default_factory=tuple)
    verify: Callable[[], None] | None = None

    @property
    def complete_at_launch(self) -> bool:
        return self.event is None and self.finish is None


def check_timeout(timeout_s: float, what: str) -> float:
    """`timeout_s` if it is a finite number of seconds >= 0; else a ValueError naming `what`
    (a NaN deadline never passes, so a wait given one would never end)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not math.isfinite(timeout_s) or timeout_s < 0:
        raise ValueError(f"{what}: timeout_s must be a finite number of seconds >= 0, "
                         f"got {timeout_s!r}")
    return timeout_s


def poll_until(poll: Callable[[], T | bool | None], timeout_s: float,
               timed_out: Callable[[], Exception], *, first_pause_s: float = 1e-5,
               max_pause_s: float = 1e-4,
               sleep: Callable[[float], None] = time.sleep) -> T | bool:
    """Call `poll` until it returns something other than False or None (a check that turns
    true, or a value that is None until it is ready) and return that, backing off from
    `first_pause_s` to `max_pause_s` between calls (the GIL is free meanwhile, no pause runs
    past the deadline; `sleep` pauses, and may return early when there is news); raise
    `timed_out()` once `timeout_s` passed."""
    check_timeout(timeout_s, "poll_until")
    deadline = time.monotonic() + timeout_s
    pause = first_pause_s
    while (result := poll()) is None or result is False:
        left = deadline - time.monotonic()
        if left <= 0:
            raise timed_out()
        sleep(min(pause, left))
        pause = min(pause * 2, max_pause_s)
    return result


def wait_event(event: DeviceEvent | None, timeout_s: float, what: Callable[[], str], *,
               error: type[Exception] = TimeoutError, max_pause_s: float = 1e-4) -> None:
    """Poll `event` until it completes; raise `error` naming `what()` after `timeout_s`.

    Device events only offer an unbounded `synchronize()`, so bounded waits poll.
    """
    if event is not None:
        poll_until(event.query, timeout_s, lambda: error(
            f"{what()}: device copy not complete after {timeout_s:.1f}s"),
            max_pause_s=max_pause_s)


def block_on_event(event: DeviceEvent | None, timeout_s: float, what: Callable[[], str]) -> None:
    """Wait for `event` in the driver (GIL released, no polling) where it can, else poll.

    For background threads only: a device that never completes the copy blocks
    the caller, so the threads that wait on *it* must use bounded waits.
    """
    synchronize = getattr(event, "synchronize", None)
    if synchronize is not None:
        synchronize()
    else:
        wait_event(event, timeout_s, what)


class DeviceBackend(ABC):
    """One device type's streams, events, host memory and row transfers.

    Rows handed to `scatter_rows` / `copy_to_host` must stay unchanged until the
    returned transfer completes; `snapshot` makes such a private copy. With
    `in_stream=True` the move is issued on the caller's current stream instead of
    the copy stream: stream order then keeps the caller's later work off the
    rows until the move has read them, so they need no private copy.
    """

    name: ClassVar[str]
    #: True when `scatter_rows` lands rows straight in the pool (no host step).
    zero_copy: bool = False
    #: True when every transfer completes inside the call that starts it.
    synchronous: bool = False
    #: True when an in-stream `scatter_rows` may read its slots from a device tensor.
    device_slots: bool = False
    #: True when `scatter_rows` reads `host_slots` alone where they are given: the core then
    #: passes no `slots` tensor (None), which would cost each step a `torch.from_numpy`.
    host_slots_only: bool = False

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this device type can be used in this process."""

    @classmethod
    def missing(cls) -> str:
        """What this process lacks for the device type, where `is_available` is False."""
        return "its backend reports it unavailable"

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    def needs_staging(self) -> bool:
        """Whether `scatter_rows` needs a pinned staging buffer to pass through."""
        return not (self.zero_copy or self.synchronous)

    def bind_thread(self) -> None:
        """Make this backend's device current on the calling helper thread (before device calls)."""

    def check_rows(self, what: str, tensor: torch.Tensor) -> None:
        """Refuse rows that are not on this backend's device, naming them and both devices."""
        device = self.device
        if tensor.device.type != device.type or (
                device.index is not None and tensor.device.index != device.index):
            raise ValueError(f"{what} are on {tensor.device}, the cache's device is {device}")

    # streams and events
    @abstractmethod
    def record_event(self) -> DeviceEvent | None:
        """An event on the current (compute) stream; None where work is synchronous."""

    def drain(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` for every copy issued so far; False if one still runs."""
        return True

    def stats(self) -> dict[str, int]:
        """Counters of the backend's own paths since it started (none here)."""
        return {}

    def snapshot(self, tensor: torch.Tensor) -> torch.Tensor:
        """A private copy of `tensor` on its device, ordered on the current stream."""
        return tensor.detach().clone()

    # host memory
    @abstractmethod
    def alloc_host(self, shape: Sequence[int], dtype: torch.dtype) -> HostBuffer:
        """Exact-size host memory the device can copy into (pinned where that exists)."""

    # transfers
    @abstractmethod
    def scatter_rows(self, rows: torch.Tensor, slots: torch.Tensor | None, pool: HostBuffer, *,
                     ready: DeviceEvent | None, staging: torch.Tensor | None,
                     in_stream: bool = False, host_slots: np.ndarray | None = None) -> Transfer:
        """Write `rows[i]` into `pool.tensor[slots[i]]` after `ready` (or in stream order).

        `rows` is `[n, F]` on the device, `slots` an int64 CPU tensor of n
        distinct slots (except slot 0, of vLLM's never-read null block, which
        may take any number of discarded rows), `pool.tensor` a `[num_slots, F]`
        host tensor. Where `device_slots` is True, an in-stream write also takes
        `slots` on the device: the runner's slot mapping (int32 or int64), whose first
        n entries are the rows' slots (it may be longer); `host_slots`, where the caller has
        them, are the same n slots as an int64 host array (a backend that reads them alone,
        `host_slots_only`, is given None for `slots` then). `staging` is a host `[>= n, F]`
        buffer for backends that stage (`needs_staging`); None lets
        them take a page of their own.
        """

    @abstractmethod
    def copy_to_host(self, tensor: torch.Tensor, *, ready: DeviceEvent | None,
                     out: torch.Tensor | None = None,
                     in_stream: bool = False) -> tuple[torch.Tensor, Transfer]:
        """A host copy of `tensor`, valid once the transfer completes.

        `out`, a host tensor of `tensor`'s shape and dtype (from `alloc_arena`),
        receives the copy without any allocation; None allocates one.
        """

    def alloc_arena(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of host memory for `copy_to_host(out=...)` views, pinned where that exists.

        Dropping the tensor is safe while copies into it are in flight.
        """
        return torch.empty(nbytes, dtype=torch.uint8)

    # kernel-block knowledge for FullAttentionGroupView
    def check_block_table(self, table: Any, block_size: int, kernel_block_size: int | None,
                          attention_backend: str | None = None) -> str | None:
        """Why this device's runner table cannot be mirrored, or None when it can.

        `table` is the runner's block table for the cached group; its ids are in
        units of `table.block_size` tokens. `kernel_block_size` is the attention
        kernel's block size where the runner splits blocks outside the table.
        """
        unit = int(table.block_size)
        if unit <= 0 or block_size % unit:
            return f"block table unit {unit} does not divide block_size {block_size}"
        if kernel_block_size is not None and block_size % kernel_block_size:
            return (f"kernel block size {kernel_block_size} does not divide "
                    f"block_size {block_size}")
        for attr in ("dcp_world_size", "pcp_world_size"):
            if int(getattr(table, attr, 1)) > 1:
                return f"{attr}={getattr(table, attr)}: context-parallel striping is not mirrored"
        return None

    def close(self) -> None:
        """Release what the backend holds (streams, self-test buffers)."""
