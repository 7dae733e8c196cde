"""Slots outside the pool (issue 21): the zero-copy scatter refuses them and its write fails.

What needs no GPU runs here: the range helpers, the slot pages' flag bookkeeping over host
stand-ins for mapped pages, the index_copy_ fallback on host tensors, the Triton kernel under
Triton's interpreter (where Triton is installed), and the landing of a write whose check
fails. The kernel on the device: tests/test_devices.py (CUDA-marked).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from prefix_cache.core.committer import Committer
from prefix_cache.devices.base import HostBuffer, Transfer
from prefix_cache.devices.cpu import CpuBackend
from prefix_cache.devices.cuda import CudaBackend, scatter
from prefix_cache.devices.cuda.slot_pages import (SlotPages, SlotRangeError, count_out_of_range,
                                                  out_of_range_error)
from prefix_cache.errors import OmniPrefixCacheError
from prefix_cache.core.tasks import TaskState, WriteTask
from tests.faults import GatedEvent
from tests.sim import token_rows
from tests.test_manager import make, run_step

REPO_ROOT = Path(__file__).resolve().parents[1]
FLAG_CELLS = scatter.FLAG_CELLS


# ---------------------------------------------------------------- range helpers

@pytest.mark.parametrize(("slots", "num_slots", "refused"), [
    ([], 4, 0), ([0, 3, 1], 4, 0), ([-1, 0, 4, 9], 4, 3), ([0, 1], 0, 2),
], ids=["empty", "in-range", "both-sides", "empty-pool"])
def test_count_out_of_range_counts_slots_outside_the_pool(slots: list[int], num_slots: int,
                                                          refused: int) -> None:
    for dtype in (np.int32, np.int64):
        assert count_out_of_range(np.array(slots, dtype=dtype), num_slots) == refused


def test_out_of_range_error_names_the_count_the_range_and_the_first_offender() -> None:
    error = out_of_range_error("cuda scatter", 2, 5, 64, np.array([3, 70, 1, -1, 2]))
    assert isinstance(error, SlotRangeError) and isinstance(error, RuntimeError)
    assert str(error) == ("cuda scatter: 2 of 5 rows had a slot out of range, outside [0, 64) "
                          "(first: row 1, slot 70); they were not written to the pool")
    assert "(first" not in str(out_of_range_error("cuda scatter", 1, 5, 64))


# ---------------------------------------------------------------- slot pages

class _Pages:
    """SlotPages over host stand-ins for mapped pages (the device view is the host tensor)."""

    def __init__(self, pages: int = 2, capacity: int = 8) -> None:
        self.allocated: list[HostBuffer] = []
        self.closed: list[HostBuffer] = []
        self.pages = SlotPages(torch.device("cpu"), pages=pages, capacity=capacity,
                               alloc=self._alloc)

    def _alloc(self, cells: int) -> HostBuffer:
        tensor = torch.full((cells,), -1, dtype=torch.int64)  # garbage until take zeroes it
        buffer = HostBuffer(tensor, pinned=False, release=lambda: self.closed.append(buffer))
        buffer.device_view = tensor
        self.allocated.append(buffer)
        return buffer


def _done() -> tuple[GatedEvent, threading.Event]:
    gate = threading.Event()
    return GatedEvent(None, gate), gate


def test_a_page_carries_the_slots_and_zeroed_flag_cells() -> None:
    fake = _Pages()
    lease = fake.pages.take(torch.tensor([5, 2, 7]))
    assert lease.slots.tolist() == [5, 2, 7]
    assert lease.flags.shape == (FLAG_CELLS,) and not lease.flags.any()
    assert lease.page.buffer.tensor.shape[0] == 8 + FLAG_CELLS
    assert fake.pages.refused(lease) == 0
    flag_only = fake.pages.take(None)  # a launch that reads a device slot mapping
    assert flag_only.slots is None and not flag_only.flags.any()
    assert flag_only.page is not lease.page


def test_a_launchs_count_is_read_before_its_page_is_zeroed_for_the_next_launch() -> None:
    fake = _Pages(pages=1)
    first = fake.pages.take(torch.tensor([1, 2]))
    first.flags[3] = 2  # what two programs of the kernel store
    first.flags[9] = 1
    done, gate = _done()
    fake.pages.release_after(first, done)
    gate.set()
    assert fake.pages.refused(first) == 3  # still on its page
    second = fake.pages.take(torch.tensor([4]))  # the one page comes back, read then zeroed
    assert second.page.buffer is fake.allocated[0] and first.page is None
    assert not second.flags.any()
    assert fake.pages.refused(first) == 3  # kept with the lease
    assert fake.pages.refused(second) == 0
    assert len(fake.allocated) == 1


def test_a_page_is_not_reused_before_its_launch_completed_and_a_burst_adds_a_page() -> None:
    fake = _Pages(pages=1, capacity=4)
    first = fake.pages.take(torch.tensor([1]))
    done, gate = _done()
    fake.pages.release_after(first, done)
    second = fake.pages.take(torch.arange(6))  # the copy still runs: a page more, sized for it
    assert second.page is not first.page and second.page.capacity >= 6
    assert first.page.buffer is fake.allocated[0]
    gate.set()
    third = fake.pages.take(None)
    assert third.page.buffer is fake.allocated[0] and len(fake.allocated) == 2


def test_an_abandoned_page_never_comes_back_and_close_unregisters_every_page() -> None:
    fake = _Pages(pages=2)
    busy = fake.pages.take(torch.tensor([1]))
    busy.flags[0] = 4
    done, gate = _done()
    fake.pages.release_after(busy, done)
    abandoned = fake.pages.take(torch.tensor([2]))
    fake.pages.abandon(abandoned)
    taken = fake.pages.take(torch.tensor([3]))  # neither is free: a third page
    assert len(fake.allocated) == 3
    gate.set()
    fake.pages.close()  # the caller drained the copies first
    assert sorted(map(id, fake.closed)) == sorted(map(id, fake.allocated))
    assert fake.pages.refused(busy) == 4  # a landing after close still reads its count
    assert fake.pages.refused(abandoned) == 0 and taken.page is not None


# ---------------------------------------------------------------- the scatters on host tensors

def _guarded_pool(num_slots: int, width: int, guard: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool with `guard` rows of -7 before and after it, in one buffer: a write outside the
    pool lands in a guard."""
    full = torch.full((num_slots + 2 * guard, width), -7.0)
    return full, full[guard:guard + num_slots]


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
def test_the_index_copy_fallback_sends_refused_rows_to_the_null_slot_and_counts_them(
        slot_dtype: torch.dtype) -> None:
    full, pool = _guarded_pool(16, 4)
    rows = torch.arange(1, 25, dtype=torch.float32).view(6, 4)
    mapping = torch.tensor([5, -1, 9, 16, 21, 2, -1, -1], dtype=slot_dtype)  # longer than n
    flags = torch.zeros(FLAG_CELLS, dtype=torch.int64)
    scatter.index_copy_rows(rows, mapping, pool, flags)
    assert flags.tolist() == [3] + [0] * (FLAG_CELLS - 1)
    assert (full[:3] == -7).all() and (full[-3:] == -7).all()
    assert torch.equal(pool[[5, 9, 2]], rows[[0, 2, 5]])
    untouched = [s for s in range(16) if s not in (0, 5, 9, 2)]
    assert (pool[untouched] == -7).all()  # slot 0 took the refused rows: nothing reads it


def test_the_index_copy_fallback_writes_nothing_into_a_pool_without_a_null_slot() -> None:
    full, pool = _guarded_pool(0, 4)
    flags = torch.zeros(FLAG_CELLS, dtype=torch.int64)
    scatter.index_copy_rows(torch.ones(2, 4), torch.tensor([0, 1]), pool, flags)
    assert flags[0] == 2 and (full == -7).all()


def _host_cuda_backend(pages: SlotPages, *, check_slots: bool = False) -> CudaBackend:
    """The CUDA backend's zero-copy path over host stand-ins: slot pages and pool are host
    tensors (their own device views), the scatter is the index_copy_ fallback, launches are
    complete at once. It runs `_scatter_mapped` as written, without a device."""
    backend = object.__new__(CudaBackend)
    backend._slot_pages = pages
    backend.zero_copy = True
    backend.use_kernel = False
    backend.check_slots = check_slots
    backend._dma = None  # the kernel path (copy-engine saves: tests/test_cuda_dma.py)
    completed = threading.Event()
    completed.set()
    backend._issue_scope = lambda ready, in_stream: contextlib.nullcontext()
    backend._record_done = lambda in_stream: GatedEvent(None, completed)
    return backend


def _host_pool(num_slots: int, width: int) -> tuple[torch.Tensor, HostBuffer]:
    full, rows = _guarded_pool(num_slots, width)
    pool = HostBuffer(rows, pinned=False)
    pool.device_view = rows
    return full, pool


def test_the_backends_write_lands_the_rows_in_range_and_its_verify_names_the_others() -> None:
    fake = _Pages(pages=1)
    backend = _host_cuda_backend(fake.pages)
    full, pool = _host_pool(16, 4)
    rows = torch.arange(1, 17, dtype=torch.float32).view(4, 4)
    transfer = backend.scatter_rows(rows, torch.tensor([3, 16, 5, -1]), pool, ready=None,
                                    staging=None)
    assert torch.equal(pool.tensor[[3, 5]], rows[[0, 2]])
    assert (full[:3] == -7).all() and (full[-3:] == -7).all()
    with pytest.raises(SlotRangeError, match=r"^cuda scatter: 2 of 4 rows had a slot out of "
                                             r"range, outside \[0, 16\) \(first: row 1, "
                                             r"slot 16\); they were not written to the pool$"):
        transfer.verify()
    for turn in range(3):  # the one page again, its flag cells zeroed: clean writes verify
        clean = backend.scatter_rows(rows[:2] + turn, torch.tensor([7, 8]), pool, ready=None,
                                     staging=None)
        clean.verify()
    assert len(fake.allocated) == 1
    with pytest.raises(SlotRangeError):
        transfer.verify()  # the count outlives the page's reuse


def test_the_slot_check_mode_refuses_a_write_before_it_takes_a_page() -> None:
    fake = _Pages(pages=1)
    backend = _host_cuda_backend(fake.pages, check_slots=True)
    full, pool = _host_pool(8, 2)
    with pytest.raises(SlotRangeError, match=r"OMNI_PREFIX_CACHE_CHECK_SLOTS=1\): 1 of 2 rows"):
        backend.scatter_rows(torch.ones(2, 2), torch.tensor([1, 8]), pool, ready=None,
                             staging=None)
    assert (full == -7).all()
    assert fake.pages.take(None).page.buffer is fake.allocated[0]  # the page stayed free


@pytest.mark.parametrize(("n", "given", "width", "device_slots"), [
    (4, 2, 4, False), (2, 4, 4, False), (4, 4, 6, False), (4, 4, 2, False), (4, 2, 4, True)],
    ids=["more-rows-than-slots", "more-slots-than-rows", "wider-rows", "narrower-rows",
         "more-rows-than-device-slots"])
def test_the_backends_write_refuses_rows_that_do_not_fit_their_slots_or_pool_before_a_launch(
        n: int, given: int, width: int, device_slots: bool) -> None:
    """Rows past their slots would be written into slots a page kept from an earlier launch
    (kernel) or dropped as the write lands clean (DMA); rows of another width run past their
    slot and the pool's end. A device slot mapping may be longer than the rows, not shorter
    (a meta tensor stands in for it: only its length is read)."""
    fake = _Pages(pages=1)
    backend = _host_cuda_backend(fake.pages)
    full, pool = _host_pool(16, 4)
    slots = torch.arange(1, given + 1, device="meta" if device_slots else "cpu")
    with pytest.raises(ValueError, match=rf"^cuda scatter: {given} slots for {n} rows of {width} "
                                         rf"float32, into a pool of 16 rows of 4 float32; "
                                         rf"nothing was written$"):
        backend.scatter_rows(torch.ones(n, width), slots, pool, ready=None, staging=None,
                             in_stream=device_slots)
    with pytest.raises(ValueError, match="cuda scatter: 3 slots for 2 rows"):  # host slots too
        backend.scatter_rows(torch.ones(2, 4), torch.arange(1, 3, device="meta"), pool,
                             ready=None, staging=None, in_stream=True,
                             host_slots=np.array([1, 2, 3]))
    assert (full == -7).all()
    assert fake.pages.take(None).page.buffer is fake.allocated[0]  # no page was taken


@pytest.mark.parametrize(("row_bytes", "addresses", "word"), [
    (48, (0, 16), torch.int64), (48, (4, 16), torch.int32), (48, (16, 2), torch.int16),
    (47, (0, 16), torch.uint8), (12, (0, 16), torch.int32), (4096, (1 << 40, 8), torch.int64)])
def test_the_kernel_moves_the_widest_words_the_rows_width_and_both_addresses_allow(
        row_bytes: int, addresses: tuple[int, int], word: torch.dtype) -> None:
    """Rows and a pool aligned differently still move in the widest words both allow (a
    narrower one than either's own): never in words that would split a row or misalign."""
    assert scatter.word_dtype(row_bytes, *addresses) is word


_INTERPRETED = """
import torch
from prefix_cache.devices.cuda import scatter

def run(rows, mapping, n, num_slots, guard=3):
    full = torch.full((num_slots + 2 * guard, rows.shape[1]), -7, dtype=rows.dtype)
    pool = full[guard:guard + num_slots]
    flags = torch.zeros(scatter.FLAG_CELLS, dtype=torch.int64)
    word = scatter.word_dtype(rows.shape[1] * rows.element_size(), rows.data_ptr(),
                              pool.data_ptr())
    src, dst = scatter.as_words(rows, word), scatter.as_words(pool, word)
    grid = min(scatter.SCATTER_CTAS, -(-n // scatter.SCATTER_ROWS))
    scatter._kernel()[(grid,)](src, dst, mapping, flags, n, src.shape[1], dst.shape[0],
                               BLOCK=scatter._BLOCK, ROWS=scatter.SCATTER_ROWS)
    return full, pool, flags

torch.manual_seed(0)
for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.uint8):
    for slot_dtype in (torch.int32, torch.int64):
        num_slots, n = 40, 37
        rows = (torch.arange(n * 6).view(n, 6) % 100 + 1).to(dtype)
        slots = torch.randperm(num_slots)[:n].to(slot_dtype)
        bad = {0: -1, 5: num_slots, 17: num_slots + 5, 36: -3}
        for row, slot in bad.items():
            slots[row] = slot
        mapping = torch.cat([slots, torch.full((9,), -1, dtype=slot_dtype)])  # longer than n
        full, pool, flags = run(rows, mapping, n, num_slots)
        assert int(flags.sum()) == len(bad), (dtype, slot_dtype, flags)
        assert (full[:3] == -7).all() and (full[-3:] == -7).all(), (dtype, slot_dtype)
        good = [i for i in range(n) if i not in bad]
        assert torch.equal(pool[slots[good].long()], rows[good]), (dtype, slot_dtype)
        written = set(slots[good].tolist())
        assert (pool[[s for s in range(num_slots) if s not in written]] == -7).all()
        full, pool, flags = run(rows[:5].contiguous(), torch.arange(5, dtype=slot_dtype), 5,
                                num_slots)
        assert not flags.any() and torch.equal(pool[:5], rows[:5])
print("interpreted scatter ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the compiled kernel "
                    "(tests/test_devices.py); there the interpreter fails inside Triton 3.6")
def test_the_triton_kernel_refuses_slots_outside_the_pool_under_tritons_interpreter() -> None:
    """The kernel's masks and per-program counts, run by Triton's interpreter on host tensors
    (a clean interpreter: TRITON_INTERPRET is read when triton is imported)."""
    result = subprocess.run([sys.executable, "-c", _INTERPRETED], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert "interpreted scatter ok" in result.stdout


# ---------------------------------------------------------------- landing a refused write

def _refusal() -> None:
    raise out_of_range_error("cuda scatter", 2, 4, 64)


def test_a_failing_verify_fails_its_task_only_naming_the_step_and_later_writes_land() -> None:
    landed: list[WriteTask] = []
    committer = Committer(10.0, landed.append, lambda: None)
    finished: list[int] = []
    calls: list[int] = []

    def transfer(i: int, *, refuse: bool) -> Transfer:
        def verify() -> None:
            calls.append(i)
            if refuse:
                _refusal()
        return Transfer(event=GatedEvent(None, gate), verify=verify,
                        finish=lambda: finished.append(i))

    gate = threading.Event()
    tasks = []
    for i in range(1, 4):
        task = WriteTask(i, f"step {i + 10}", transfers=[transfer(i, refuse=i == 2)])
        task.transition(TaskState.QUEUED)
        committer.submit(task)
        tasks.append(task)
    committer.sweep(host_halves=True)
    assert not landed and not calls  # no verify before the copies completed
    gate.set()
    committer.sweep(host_halves=True)
    assert committer.close(10.0)
    assert [t.task_id for t in landed] == [1, 2, 3]
    assert [t.state for t in tasks] == [TaskState.WRITTEN, TaskState.FAILED, TaskState.WRITTEN]
    assert calls == [1, 2, 3] and finished == [1, 3]  # a refused write runs no host half
    assert isinstance(tasks[1].error, SlotRangeError)
    with pytest.raises(OmniPrefixCacheError, match=r"write task 2 \(step 12, state FAILED\) "
                                                   r"failed: cuda scatter: 2 of 4 rows had a "
                                                   r"slot out of range"):
        tasks[1].wait(1.0)


class _RefusingCpu(CpuBackend):
    """The CPU backend whose writes of the chosen calls report refused slots at landing, as a
    CUDA zero-copy scatter does; writes report a completed event (they go through the
    committer's queue, as a device's do)."""

    synchronous = False  # type: ignore[assignment]

    def __init__(self, refuse: set[int]) -> None:
        super().__init__()
        self.refuse = refuse
        self.calls = 0
        self._completed = threading.Event()
        self._completed.set()

    def scatter_rows(self, *args, **kwargs) -> Transfer:
        super().scatter_rows(*args, **kwargs)
        self.calls += 1
        return Transfer(event=GatedEvent(None, self._completed),
                        verify=_refusal if self.calls in self.refuse else None)


def test_the_cache_raises_a_refused_write_naming_its_step_and_later_steps_are_served() -> None:
    backend = _RefusingCpu(refuse={1})  # step 1's hidden write (mm off)
    manager, d = make(backend)
    a, b = list(range(4)), list(range(10, 14))
    with manager:
        sid = run_step(manager, d, d.step(new=[("a", a, [1], 0, 4)]), backend.device,
                       mm_width=None, materialize=False)
        with pytest.raises(OmniPrefixCacheError,
                           match=r"write task 1 \(step 1, state FAILED\).*slot out of range"):
            manager.materialize(sid, ["a"])  # its own step's read: the write's failure
        so = d.step(new=[("b", b, [2], 0, 4)], finished=["a"])
        with pytest.raises(OmniPrefixCacheError, match=r"new_step_starts: an earlier write "
                                                       r"failed: write task 1 \(step 1, state "
                                                       r"FAILED\): cuda scatter: 2 of 4 rows"):
            manager.new_step_starts(so)  # and the next call, once
        out = run_step(manager, d, so, backend.device, mm_width=None)
        assert torch.equal(out.hidden_states["b"], token_rows(b, 2))
