"""The recycled done events (`prefix_cache.devices.cuda._events`) on CPU, over the stand-in CUDA
runtime of `tests/test_dma_issuer.py` (ctypes callbacks: no runtime exists on this machine).
What is real is all of `_events`; on a GPU the CUDA backend records every done event through it
(`tests/test_devices.py`)."""

from __future__ import annotations

import gc
import time

import pytest

from prefix_cache.devices.cuda import _events
from tests.test_dma_issuer import FakeRuntime

#: the runtime functions an EventPool takes, by their index in FakeRuntime.addresses
#: create, record, query, synchronize, destroy, last error, error name
_EVENT_FUNCTIONS = (1, 2, 3, 4, 5, 7, 8)


def _pool(runtime: FakeRuntime) -> _events.EventPool:
    return _events.EventPool(tuple(runtime.addresses[i] for i in _EVENT_FUNCTIONS))


def test_an_event_goes_back_to_the_pool_when_dropped_and_an_empty_pool_asks_to_grow() -> None:
    runtime = FakeRuntime()
    pool = _pool(runtime)
    assert pool.counts == (0, 0) and pool.record(7) is None
    pool.grow(2)
    first, second = pool.record(7), pool.record(7)
    assert pool.counts == (0, 2) and pool.record(7) is None
    del first
    assert pool.counts == (1, 2)
    third = pool.record(7)  # the dropped one, recorded again
    assert pool.counts == (0, 2) and len(runtime._events) == 2
    del second, third
    assert pool.counts == (2, 2)


def test_an_event_completes_with_the_work_recorded_before_it() -> None:
    runtime = FakeRuntime()
    pool = _pool(runtime)
    pool.grow(1)
    runtime.device_busy.clear()
    done = pool.record(7)
    assert not done.query()
    runtime.device_busy.set()
    done.synchronize()  # waits, GIL released, until the stand-in device is free
    deadline = time.monotonic() + 5
    while not done.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert done.query()


def test_a_runtime_error_raises_naming_the_call_and_the_error() -> None:
    runtime = FakeRuntime()
    runtime.events_left = 1
    pool = _pool(runtime)
    with pytest.raises(RuntimeError, match=r"cudaEventCreateWithFlags failed: "
                                           r"cudaErrorInvalidValue \(2\)"):
        pool.grow(2)
    assert pool.counts == (1, 1)  # the one made before the failure stays usable
    with pytest.raises(ValueError, match="EventPool: a tuple of 7 function addresses"):
        _events.EventPool(runtime.addresses[:5])


def test_a_failed_runtime_call_is_raised_and_cleared_from_the_runtimes_last_error() -> None:
    """The runtime keeps a failed call's error for the thread's next launch check, where torch
    would raise it from an unrelated kernel: each failure raised here is cleared first."""
    runtime = FakeRuntime()
    runtime.events_left = 1
    pool = _pool(runtime)
    with pytest.raises(RuntimeError, match="cudaEventCreateWithFlags failed"):
        pool.grow(2)
    assert runtime.last_error == 0
    runtime.record_error = 400  # cudaErrorInvalidResourceHandle
    with pytest.raises(RuntimeError, match=r"cudaEventRecord failed: .* \(400\)"):
        pool.record(7)
    assert runtime.last_error == 0 and pool.counts == (1, 1)  # its event back in the pool


def test_the_pool_destroys_its_events_once_the_last_one_handed_out_is_dropped() -> None:
    runtime = FakeRuntime()
    pool = _pool(runtime)
    pool.grow(3)
    held = pool.record(7)
    del pool
    gc.collect()
    assert len(runtime._events) == 3  # the held event keeps its pool
    del held
    assert runtime._events == {}
