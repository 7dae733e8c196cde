"""The copy-engine issuer (`prefix_cache.devices.cuda._dma`) on CPU, over a stand-in CUDA runtime.

No CUDA runtime exists on this machine, so the runtime's functions are Python callbacks that
do what the device would: the batch copy moves host bytes run by run, an event completes when
the test opens its gate. What is real is all of `_dma`: the run planning, the checks, the
issuing thread, submit order, waits, failures and the ring. The same module runs on an H200
against the real runtime in `tests/test_cuda_dma.py`.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import threading
import time

import numpy as np
import pytest

from prefix_cache.devices.cuda import _dma

NOT_READY = 600
INVALID_VALUE = 1
ROW = 64  # bytes a row
ERROR_NAME = ctypes.create_string_buffer(b"cudaErrorInvalidValue")  # what the runtime names
#: every stand-in runtime's callbacks, alive for the whole run: an issuer calls them until it
#: is released, which a failed test's traceback can put off past its runtime's fixture
_ALIVE: list[list[object]] = []

_int = ctypes.c_int
_vp = ctypes.c_void_p
_sz = ctypes.c_size_t


class FakeRuntime:
    """cudaSetDevice ... cudaMemcpyBatchAsync as ctypes callbacks, in the forms of runtime
    `version` (12.8-12.9 give the batch call a `failIdx` before the stream; 13 drops it).

    `device_busy` cleared: events recorded from then on stay incomplete until it is set, then
    complete in record order (one stream).
    `fail_batch_from`: batch calls from that one on (0: the first) return
    cudaErrorInvalidValue; `record_error`, where set, is what cudaEventRecord returns.
    `calls` records each batch call that copied: (first destination, runs). `last_error` is
    the runtime's last error (one for every thread here): each failing call sets it, cudaGetLastError
    returns and clears it (left set, torch's next launch check raises it)."""

    def __init__(self, version: int = 13000) -> None:
        self.version = version
        self.device_busy = threading.Event()
        self.device_busy.set()
        self.fail_batch_from: int | None = None
        self.record_error = 0
        self.last_error = 0
        self.batch_calls = 0
        self.events_left: int | None = None  # events it can still create (None: any number)
        self.calls: list[tuple[int, int]] = []
        self.waits = 0
        self._events: dict[int, threading.Event] = {}
        self._behind: list[threading.Event] = []  # recorded while busy, in record order
        self._next = 1
        self._lock = threading.Lock()
        proto = ctypes.CFUNCTYPE
        self.functions = [
            proto(_int, _int)(lambda device: 0),
            proto(_int, ctypes.POINTER(_vp), ctypes.c_uint)(self._create),
            proto(_int, _vp, _vp)(self._record),
            proto(_int, _vp)(lambda ev: 0 if self._events[ev].is_set() else NOT_READY),
            proto(_int, _vp)(lambda ev: self._events[ev].wait() and 0),
            proto(_int, _vp)(self._destroy),
            proto(_int, _vp, _vp, ctypes.c_uint)(self._wait_event),
            proto(_int)(self._get_last_error),
            proto(_vp, _int)(lambda err: ctypes.addressof(ERROR_NAME)),
            self._batch_function(),
        ]
        self.addresses = tuple(ctypes.cast(f, _vp).value for f in self.functions)
        _ALIVE.append(self.functions)

    def _failed(self, error: int) -> int:
        self.last_error = error
        return error

    def _get_last_error(self) -> int:
        error, self.last_error = self.last_error, 0
        return error

    def _create(self, out, flags) -> int:
        if self.events_left is not None:
            if self.events_left == 0:
                return self._failed(2)  # cudaErrorMemoryAllocation
            self.events_left -= 1
        with self._lock:
            handle, self._next = self._next, self._next + 1
        self._events[handle] = threading.Event()
        self._events[handle].set()
        out[0] = handle
        return 0

    def _destroy(self, event) -> int:
        del self._events[event]
        return 0

    def _record(self, event, stream) -> int:
        if self.record_error:
            return self._failed(self.record_error)
        gate = self._events[event]
        gate.clear()
        if self.device_busy.is_set():
            gate.set()
            return 0
        with self._lock:  # completes when the device is free again, after those before it
            self._behind.append(gate)
            if len(self._behind) == 1:
                threading.Thread(target=self._complete_behind, daemon=True).start()
        return 0

    def _complete_behind(self) -> None:
        self.device_busy.wait()
        with self._lock:
            gates, self._behind = self._behind, []
        for gate in gates:  # in record order, as one stream's events complete
            gate.set()

    def _wait_event(self, stream, event, flags) -> int:
        self.waits += 1
        return 0

    def _batch_function(self) -> object:
        head = (ctypes.POINTER(_vp), ctypes.POINTER(_vp), ctypes.POINTER(_sz), _sz, _vp,
                ctypes.POINTER(_sz), _sz)
        if self.version >= 13000:
            return ctypes.CFUNCTYPE(_int, *head, _vp)(
                lambda dsts, srcs, sizes, count, *rest: self._batch(dsts, srcs, sizes, count))
        return ctypes.CFUNCTYPE(_int, *head, ctypes.POINTER(_sz), _vp)(
            lambda dsts, srcs, sizes, count, *rest: self._batch(dsts, srcs, sizes, count))

    def _batch(self, dsts, srcs, sizes, count) -> int:
        call, self.batch_calls = self.batch_calls, self.batch_calls + 1
        if self.fail_batch_from is not None and call >= self.fail_batch_from:
            return self._failed(INVALID_VALUE)
        self.calls.append((dsts[0], count))
        for i in range(count):
            ctypes.memmove(dsts[i], srcs[i], sizes[i])
        return 0


@pytest.fixture(params=[13000, 12080], ids=["cuda13", "cuda12.8"])
def runtime(request: pytest.FixtureRequest) -> FakeRuntime:
    return FakeRuntime(request.param)


def issuer_of(runtime: FakeRuntime, ring: int = 8) -> _dma.Issuer:
    return _dma.Issuer(runtime.addresses, runtime.version, 0, 1234, ring)


def save(issuer: _dma.Issuer, rows: np.ndarray, slots: list[int] | np.ndarray,
         pool: np.ndarray) -> int:
    return issuer.submit(0, 0, rows.ctypes.data, ROW, np.asarray(slots, dtype=np.int64),
                         pool.ctypes.data, len(pool))


def test_rows_land_in_their_slots_a_run_at_a_time_in_calls_of_at_most_16_runs(runtime) -> None:
    rng = np.random.default_rng(0)
    blocks = rng.permutation(np.arange(1, 64))[:40]
    slots = (blocks[:, None] * 4 + np.arange(4)).ravel()  # 40 runs of 4 slots (or merged)
    slots = np.concatenate([slots, [0, 0]])  # discarded rows to the null slot
    rows = rng.integers(0, 255, (len(slots), ROW), dtype=np.uint8)
    pool = np.zeros((256, ROW), dtype=np.uint8)
    issuer = issuer_of(runtime)
    job = save(issuer, rows, slots, pool)
    issuer.synchronize(job)
    assert issuer.query(job) and issuer.error(job) is None
    want = np.zeros_like(pool)
    want[slots] = rows
    assert np.array_equal(pool, want)
    runs = 1 + int(np.count_nonzero(np.diff(slots) != 1))
    assert sum(count for _, count in runtime.calls) == runs
    assert all(count <= 16 for _, count in runtime.calls) and len(runtime.calls) == -(-runs // 16)
    assert runtime.waits == 1  # the copy stream waited on the caller's stream once
    issuer.close()


def test_jobs_are_issued_in_submit_order_and_a_later_one_into_a_slot_wins(runtime) -> None:
    pool = np.zeros((64, ROW), dtype=np.uint8)
    issuer = issuer_of(runtime)
    rows = [np.full((8, ROW), i + 1, dtype=np.uint8) for i in range(6)]
    jobs = [save(issuer, r, np.arange(8, 16), pool) for r in rows]
    issuer.synchronize(jobs[-1])
    assert all(issuer.query(job) for job in jobs)
    assert (pool[8:16] == 6).all()
    assert [dst for dst, _ in runtime.calls] == [pool[8:].ctypes.data] * 6
    issuer.close()


def test_a_slot_outside_the_pool_raises_and_queues_nothing(runtime) -> None:
    pool = np.zeros((16, ROW), dtype=np.uint8)
    issuer = issuer_of(runtime)
    rows = np.ones((3, ROW), dtype=np.uint8)
    for bad in (16, -1, 2**62):
        with pytest.raises(IndexError, match=rf"cuda DMA: slot {bad} \(index 1\) is outside "
                                             r"0\.\.15"):
            save(issuer, rows, [2, bad, 3], pool)
    with pytest.raises(TypeError, match="slots must be a 1-D int64 array"):
        issuer.submit(0, 0, rows.ctypes.data, ROW, np.array([1, 2, 3], dtype=np.int32),
                      pool.ctypes.data, 16)
    assert issuer.flush(5.0) and not runtime.calls and runtime.waits == 0
    assert not pool.any()
    issuer.close()


def test_a_failed_batch_is_over_and_names_its_call(runtime) -> None:
    pool = np.zeros((16, ROW), dtype=np.uint8)
    issuer = issuer_of(runtime)
    runtime.fail_batch_from = 0
    job = save(issuer, np.ones((2, ROW), dtype=np.uint8), [4, 5], pool)
    assert issuer.wait(job, 5.0)
    assert issuer.error(job) == "cudaMemcpyBatchAsync failed: cudaErrorInvalidValue (1)"
    assert runtime.last_error == 0  # not left for the issuing thread's next call
    runtime.fail_batch_from = None
    rows = np.ones((2, ROW), dtype=np.uint8)  # alive until copied
    later = save(issuer, rows, [4, 5], pool)
    issuer.synchronize(later)
    assert issuer.error(later) is None and (pool[4:6] == 1).all()
    issuer.close()


def test_a_batch_failing_partway_is_over_only_once_the_runs_it_issued_have_landed(
        runtime) -> None:
    """The first 16 runs reach the copy stream, the next call fails: until those runs are
    copied the job is still writing its slots, so it is not over (a later save by another
    path could be overtaken); then it is over, failed, naming its call."""
    pool = np.zeros((128, ROW), dtype=np.uint8)
    issuer = issuer_of(runtime)
    runtime.device_busy.clear()
    runtime.fail_batch_from = 1
    rows = np.ones((40, ROW), dtype=np.uint8)
    job = save(issuer, rows, np.arange(40) * 2 + 1, pool)  # 40 runs of one slot
    assert issuer.flush(5.0)
    assert not issuer.query(job) and not issuer.wait(job, 0.05) and issuer.error(job) is None
    runtime.device_busy.set()
    assert issuer.wait(job, 5.0) and issuer.query(job)
    assert issuer.error(job) == "cudaMemcpyBatchAsync failed: cudaErrorInvalidValue (1)"
    issuer.synchronize(job)  # over: returns at once
    assert [count for _, count in runtime.calls] == [16]
    issuer.close()


def test_a_job_failing_before_it_issued_anything_is_over_only_once_the_jobs_before_it_are(
        runtime) -> None:
    """The job before it still writes when a job's first batch call fails: the failed job is
    not over until that one is (its done event is recorded on the copy stream whatever
    happened), so a caller that finds the latest job over knows every earlier one is, and
    a later save by another path cannot run beside an earlier copy into the same slots."""
    pool = np.zeros((64, ROW), dtype=np.uint8)
    issuer = issuer_of(runtime)
    runtime.device_busy.clear()
    rows = np.ones((8, ROW), dtype=np.uint8)  # alive until copied
    earlier = save(issuer, rows, np.arange(8, 16), pool)
    runtime.fail_batch_from = 1  # the next job's first call
    failed = save(issuer, rows, np.arange(16, 24), pool)
    assert issuer.flush(5.0)
    assert not issuer.query(earlier)
    assert not issuer.query(failed) and not issuer.wait(failed, 0.05)
    assert issuer.error(failed) is None  # not over yet
    runtime.device_busy.set()
    assert issuer.wait(failed, 5.0) and issuer.query(earlier)
    assert issuer.error(failed) == "cudaMemcpyBatchAsync failed: cudaErrorInvalidValue (1)"
    assert issuer.error(earlier) is None and runtime.last_error == 0
    assert (pool[8:16] == 1).all() and not pool[16:24].any()
    issuer.close()


def test_a_stream_call_that_fails_refuses_the_save_and_leaves_no_error(runtime) -> None:
    pool = np.zeros((16, ROW), dtype=np.uint8)
    issuer = issuer_of(runtime)
    runtime.record_error = 400  # cudaErrorInvalidResourceHandle
    with pytest.raises(RuntimeError, match=r"cuda DMA: cudaEventRecord failed: .* \(400\)"):
        save(issuer, np.ones((2, ROW), dtype=np.uint8), [4, 5], pool)
    assert runtime.last_error == 0 and issuer.flush(5.0) and not runtime.calls
    issuer.close()


def test_waits_are_bounded_while_the_device_is_busy(runtime) -> None:
    pool = np.zeros((16, ROW), dtype=np.uint8)
    issuer = issuer_of(runtime)
    runtime.device_busy.clear()
    job = save(issuer, np.ones((2, ROW), dtype=np.uint8), [4, 5], pool)
    assert issuer.flush(5.0)  # issued on the copy stream, not done
    start = time.monotonic()
    assert not issuer.wait(job, 0.05)
    assert time.monotonic() - start < 1.0
    assert not issuer.query(job)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="is not 0 to 1e9 seconds"):
            issuer.wait(job, bad)
    runtime.device_busy.set()
    assert issuer.wait(job, 5.0) and issuer.query(job)
    issuer.close()


def test_a_full_ring_refuses_and_a_released_job_frees_its_place(runtime) -> None:
    pool = np.zeros((16, ROW), dtype=np.uint8)
    issuer = issuer_of(runtime, ring=2)
    rows = np.ones((1, ROW), dtype=np.uint8)
    first, second = save(issuer, rows, [1], pool), save(issuer, rows, [2], pool)
    with pytest.raises(RuntimeError, match="2 copies in flight, none released: the ring is full"):
        save(issuer, rows, [3], pool)
    issuer.synchronize(second)
    issuer.release(first)
    third = save(issuer, rows, [3], pool)
    issuer.synchronize(third)
    assert (pool[1:4] == 1).all()
    with pytest.raises(ValueError, match=f"dma: no job {first}"):  # its place is reused
        issuer.query(first)
    issuer.close()


def test_close_issues_what_is_queued_and_refuses_later_saves(runtime) -> None:
    pool = np.zeros((16, ROW), dtype=np.uint8)
    issuer = issuer_of(runtime)
    rows = [np.full((1, ROW), i + 1, dtype=np.uint8) for i in range(5)]  # alive until copied
    jobs = [save(issuer, r, [i + 1], pool) for i, r in enumerate(rows)]
    issuer.close()
    assert all(issuer.query(job) for job in jobs)
    assert list(pool[1:6, 0]) == [1, 2, 3, 4, 5]
    with pytest.raises(RuntimeError, match="submit after close"):
        save(issuer, np.ones((1, ROW), dtype=np.uint8), [1], pool)


def test_the_issuer_refuses_a_runtime_without_batch_copies(runtime) -> None:
    with pytest.raises(ValueError, match="needs CUDA runtime >= 12.8"):
        _dma.Issuer(runtime.addresses, 12040, 0, 1234, 8)
    with pytest.raises(ValueError, match="10 function addresses"):
        _dma.Issuer(runtime.addresses[:9], 13000, 0, 1234, 8)


def test_an_issuer_whose_events_cannot_be_made_raises_and_frees_what_it_made(runtime) -> None:
    runtime.events_left = 3  # the ready event and two of eight done events
    with pytest.raises(RuntimeError, match="cudaEventCreateWithFlags failed"):
        _dma.Issuer(runtime.addresses, 13000, 0, 1234, 8)
    assert runtime.last_error == 0
    gc.collect()  # the half-made issuer is released without a thread to stop
    assert not runtime._events, "events it made were not destroyed"


def _drop_in_child(held: list[_dma.Issuer], pool: np.ndarray) -> None:
    """In a forked child: the parent's issuer refuses a save, then goes with its last reference."""
    issuer = held.pop()
    try:
        save(issuer, np.ones((1, ROW), dtype=np.uint8), [1], pool)
    except RuntimeError as exc:
        assert "forked" in str(exc), exc
    else:
        raise AssertionError("a forked child's save was queued for its parent's thread")
    del issuer
    gc.collect()


def test_a_forked_child_drops_its_parents_issuer_without_waiting_for_its_thread(
        runtime) -> None:
    """vLLM forks its workers: a child holding the parent's issuer has none of its thread, so it
    neither joins that thread nor queues work for it, and exits."""
    pool = np.zeros((16, ROW), dtype=np.uint8)
    held = [issuer_of(runtime)]  # the child's only reference goes with its pop
    rows = np.ones((1, ROW), dtype=np.uint8)
    held[0].synchronize(save(held[0], rows, [2], pool))  # the issuing thread runs
    child = multiprocessing.get_context("fork").Process(target=_drop_in_child,
                                                        args=(held, pool))
    child.start()
    child.join(30)
    if child.is_alive():
        child.kill()
        child.join(10)
        pytest.fail("the forked child hung dropping its parent's issuer")
    assert child.exitcode == 0
    job = save(held[0], rows, [3], pool)  # the parent's issuer is untouched
    held[0].synchronize(job)
    assert (pool[2:4] == 1).all()
    held.pop().close()
