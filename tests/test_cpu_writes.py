"""The host row copies (issue 22): the CPU pool write, `_core.copy_rows` and
`CpuBackend.scatter_rows` over it, and every pool's hit gather, `_core.gather_rows`.

Checked against the `index_copy_` and fancy indexing they replace: random slot sets (runs,
singletons, the null block 0 given several times), every dtype the pools hold,
multi-dimensional rows, runs past the streaming-store threshold; and their refusals (slots
outside the pool, mismatched buffers) raised before a byte is written.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefix_cache.core import _core
from prefix_cache.devices.base import HostBuffer
from prefix_cache.devices.cpu import CpuBackend, copy_rows

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
SENTINEL = 77


def rows_of(n: int, feat: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, *feat, generator=gen).to(dtype)
    return torch.randint(-2**40, 2**40, (n, *feat), generator=gen, dtype=dtype)


def pool_of(num_slots: int, feat: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full((num_slots, *feat), SENTINEL, dtype=dtype)


def expected_write(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """What `index_copy_` writes, a slot given several times holding its last row (the
    documented rule; index_copy_ leaves which one unspecified)."""
    want = pool.clone()
    distinct = [i for i in range(len(slots)) if int(slots[i]) not in slots[i + 1:].tolist()]
    index = torch.tensor(distinct, dtype=torch.int64)
    want.index_copy_(0, slots[index], rows[index].to(pool.dtype))
    return want


def random_slot_set(num_slots: int, n: int, rng: np.random.Generator) -> torch.Tensor:
    """n slots in 1..num_slots-1 made of runs of random lengths (singletons among them), in
    random order, with some rows sent to the null block 0."""
    out: list[int] = []
    free = rng.permutation(np.arange(1, num_slots))
    taken: set[int] = set()
    for first in free:
        if len(out) >= n:
            break
        length = int(rng.choice([1, 1, 2, 5, 16, 40]))
        run = [s for s in range(int(first), min(int(first) + length, num_slots)) if s not in taken]
        run = run[: n - len(out)]
        taken.update(run)
        out.extend(run)
    slots = np.array(out, dtype=np.int64)
    slots[rng.random(len(slots)) < 0.1] = 0  # discarded rows
    return torch.from_numpy(slots)


# ------------------------------------------------------------------ equality with index_copy_

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(6))
def test_copy_rows_matches_index_copy_over_random_slot_sets(dtype: torch.dtype,
                                                            seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_slots, width = 512, int(rng.choice([1, 3, 64, 2048]))
    n = int(rng.integers(0, 300))
    slots = random_slot_set(num_slots, n, rng)
    rows = rows_of(len(slots), (width,), dtype, seed)
    pool = pool_of(num_slots, (width,), dtype)
    want = expected_write(pool, slots, rows)
    copy_rows(rows, slots, pool)
    assert torch.equal(pool, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_rows_into_a_host_buffer_by_host_slots_keeps_its_byte_view(dtype: torch.dtype
                                                                        ) -> None:
    """The core's save on CPU: a pool's HostBuffer lends the view it made once, the slots
    come as an int64 array; three writes land as index_copy_ would land them."""
    rng = np.random.default_rng(7)
    buffer = HostBuffer(pool_of(256, (24,), dtype), pinned=False)
    want = buffer.tensor.clone()
    for step in range(3):
        slots = random_slot_set(256, 40, rng)
        rows = rows_of(len(slots), (24,), dtype, step)
        want = expected_write(want, slots, rows)
        copy_rows(rows, slots.numpy(), buffer)
        assert torch.equal(buffer.tensor, want)
    view = buffer.byte_rows
    assert view is buffer.byte_rows and view.shape == (256, 24 * buffer.tensor.element_size())
    buffer.close()
    assert buffer._byte_rows is None  # no view outlives close


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_runs_singletons_and_a_full_pool_write(dtype: torch.dtype) -> None:
    for slots in ([3, 4, 5, 9, 1, 2, 7], [7, 6, 5, 4], list(range(32)), [31], [0, 0, 0]):
        slot_t = torch.tensor(slots, dtype=torch.int64)
        rows = rows_of(len(slots), (5,), dtype, len(slots))
        pool = pool_of(32, (5,), dtype)
        want = expected_write(pool, slot_t, rows)
        copy_rows(rows, slot_t, pool)
        assert torch.equal(pool, want), slots


def test_the_null_block_given_several_times_holds_its_last_row() -> None:
    rows = torch.arange(12.0).view(6, 2)
    pool = pool_of(8, (2,), torch.float32)
    copy_rows(rows, torch.tensor([0, 3, 0, 4, 5, 0]), pool)
    assert torch.equal(pool[0], rows[5])
    assert torch.equal(pool[3:6], rows[[1, 3, 4]])
    assert (pool[[1, 2, 6, 7]] == SENTINEL).all()


@pytest.mark.parametrize("feat", [(4, 8), (2, 3, 5), (1,)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_multi_dimensional_rows_and_their_flattened_form(feat: tuple[int, ...],
                                                          dtype: torch.dtype) -> None:
    slots = torch.tensor([6, 7, 8, 2, 0, 11])
    rows = rows_of(len(slots), feat, dtype, 3)
    pool = pool_of(12, feat, dtype)
    want = expected_write(pool, slots, rows)
    copy_rows(rows, slots, pool)
    assert torch.equal(pool, want)
    flat = pool_of(12, (int(np.prod(feat)),), dtype)  # what _save hands the backend
    copy_rows(rows.reshape(len(slots), -1), slots, flat)
    assert torch.equal(flat, want.reshape(12, -1))


@pytest.mark.parametrize("view", ["column-slice", "row-stride", "transposed"])
def test_strided_rows_are_made_contiguous_first(view: str) -> None:
    base = rows_of(16, (32,), torch.bfloat16)
    rows = {"column-slice": base[:6, ::2], "row-stride": base[:12:2, :16],
            "transposed": base[:, :6].t()}[view]
    assert not rows.is_contiguous()
    slots = torch.tensor([9, 1, 2, 3, 14, 0])
    pool = pool_of(20, (16,), torch.bfloat16)
    want = expected_write(pool, slots, rows)
    copy_rows(rows, slots, pool)
    assert torch.equal(pool, want)
    strided_slots = torch.tensor([9, -5, 1, -5, 2, -5, 3, -5, 14, -5, 0, -5])[::2]
    assert not strided_slots.is_contiguous()
    copy_rows(rows, strided_slots, pool)
    assert torch.equal(pool, want)


def test_rows_of_another_dtype_are_converted_as_index_copy_did() -> None:
    rows = torch.randn(4, 8)
    slots = torch.tensor([1, 2, 5, 6])
    pool = pool_of(8, (8,), torch.bfloat16)
    want = pool.clone().index_copy_(0, slots, rows.to(torch.bfloat16))
    copy_rows(rows, slots, pool)
    assert torch.equal(pool, want)


def test_zero_rows_and_zero_width_rows_write_nothing() -> None:
    pool = pool_of(8, (16,), torch.float32)
    copy_rows(torch.empty(0, 16), torch.empty(0, dtype=torch.int64), pool)
    empty = torch.empty(5, 0)
    copy_rows(torch.empty(3, 0), torch.tensor([1, 2, 4]), empty)
    assert (pool == SENTINEL).all()
    with pytest.raises(IndexError, match="slot 5 .index 0. is outside 0..4"):
        copy_rows(torch.empty(1, 0), torch.tensor([5]), empty)


def test_inference_tensors_are_written() -> None:
    with torch.inference_mode():
        rows = torch.randn(3, 4).to(torch.bfloat16)
    pool = pool_of(6, (4,), torch.bfloat16)
    copy_rows(rows, torch.tensor([3, 4, 5]), pool)
    assert torch.equal(pool[3:], rows)


@pytest.mark.parametrize("width", [1, 15, 17, 4099, 8192, 65536, 65539])
def test_long_runs_and_odd_row_widths_match_a_row_loop(width: int) -> None:
    """Runs past the streaming threshold (64 KiB) go through non-temporal stores on x86-64:
    destinations at every alignment, heads and tails of any length, and the null block given
    several times among them."""
    rng = np.random.default_rng(width)
    num_slots = max(64, (1 << 21) // width)
    n = min(num_slots - 8, 40 + (1 << 20) // width)
    slots = np.concatenate([np.arange(3, 3 + n // 2), [0], rng.permutation(
        np.arange(4 + n // 2, num_slots))[: n - n // 2 - 2], [0]]).astype(np.int64)
    src = rng.integers(0, 255, (len(slots), width), dtype=np.uint8)
    dst = np.full((num_slots, width), 0xEE, dtype=np.uint8)
    want = dst.copy()
    for i, slot in enumerate(slots):
        want[slot] = src[i]
    _core.copy_rows(src, slots, dst)
    assert np.array_equal(dst, want)


# ------------------------------------------------------------------ refusals

@pytest.mark.parametrize("bad", [8, 9, 2**40, -1, -8, -(2**63), 2**63 - 1])
@pytest.mark.parametrize("where", [0, 2, 4])
def test_a_slot_outside_the_pool_raises_and_leaves_the_pool_unchanged(bad: int,
                                                                      where: int) -> None:
    slots = torch.tensor([1, 2, 3, 4, 5], dtype=torch.int64)
    slots[where] = bad
    pool = pool_of(8, (4,), torch.float32)
    with pytest.raises(IndexError, match=rf"copy_rows: slot {bad} \(index {where}\) is outside "
                                         r"0\.\.7"):
        copy_rows(torch.ones(5, 4), slots, pool)
    assert (pool == SENTINEL).all()


def test_the_backend_raises_an_out_of_range_write_before_writing() -> None:
    backend = CpuBackend()
    pool = backend.alloc_host((16, 8), torch.bfloat16)
    pool.tensor.fill_(SENTINEL)
    with pytest.raises(IndexError, match="slot 16 .index 3."):
        backend.scatter_rows(torch.ones(4, 8, dtype=torch.bfloat16), torch.tensor([0, 1, 2, 16]),
                             pool, ready=None, staging=None)
    assert (pool.tensor == SENTINEL).all()
    transfer = backend.scatter_rows(torch.ones(4, 8, dtype=torch.bfloat16),
                                    torch.tensor([0, 1, 2, 15]), pool, ready=None, staging=None)
    assert transfer.complete_at_launch
    assert (pool.tensor[[0, 1, 2, 15]] == 1).all() and (pool.tensor[3:15] == SENTINEL).all()


def test_the_backend_reads_host_slots_alone_without_a_slot_tensor() -> None:
    """`host_slots_only`: the core passes the slots as a host array alone (no tensor of them
    made each step); the write and its refusal are those of the tensor's."""
    backend = CpuBackend()
    assert backend.host_slots_only
    pool = backend.alloc_host((16, 8), torch.bfloat16)
    pool.tensor.fill_(SENTINEL)
    rows = torch.arange(32.0).view(4, 8).to(torch.bfloat16)
    with pytest.raises(IndexError, match="slot 16 .index 2."):
        backend.scatter_rows(rows, None, pool, ready=None, staging=None,
                             host_slots=np.array([3, 0, 16, 5]))
    assert (pool.tensor == SENTINEL).all()
    backend.scatter_rows(rows, None, pool, ready=None, staging=None,
                         host_slots=np.array([3, 0, 9, 5]))
    assert torch.equal(pool.tensor[[3, 0, 9, 5]], rows)


def test_mismatched_or_shared_buffers_are_refused() -> None:
    pool = pool_of(8, (4,), torch.float32)
    with pytest.raises(TypeError, match="slots must be int64"):
        copy_rows(torch.ones(2, 4), torch.tensor([1, 2], dtype=torch.int32), pool)
    with pytest.raises(ValueError, match="2 slots for 3 rows"):
        copy_rows(torch.ones(3, 4), torch.tensor([1, 2]), pool)
    with pytest.raises(ValueError, match="share memory"):
        copy_rows(pool[2:4], torch.tensor([5, 6]), pool)
    with pytest.raises(RuntimeError):  # index_copy_'s own refusal of rows of another shape
        copy_rows(torch.ones(2, 5), torch.tensor([1, 2]), pool)
    assert (pool == SENTINEL).all()


def test_the_core_function_refuses_what_is_not_byte_rows() -> None:
    dst = np.zeros((4, 8), dtype=np.uint8)
    slots = np.array([1, 2], dtype=np.int64)
    src = np.ones((2, 8), dtype=np.uint8)
    with pytest.raises(TypeError, match="src: expected a 2-D uint8 array"):
        _core.copy_rows(np.ones((2, 2), dtype=np.float32), slots, dst)
    with pytest.raises(TypeError, match="dst: expected a C-contiguous writable"):
        _core.copy_rows(src, slots, np.zeros((8, 4), dtype=np.uint8).T)
    readonly = dst.copy()
    readonly.flags.writeable = False
    with pytest.raises(TypeError, match="dst: expected a C-contiguous writable"):
        _core.copy_rows(src, slots, readonly)
    with pytest.raises(TypeError, match="int64"):
        _core.copy_rows(src, slots.astype(np.int32), dst)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        _core.copy_rows(src, slots)
    with pytest.raises(ValueError, match="rows of 8 bytes, into rows of 4 bytes"):
        _core.copy_rows(src, slots, np.zeros((4, 4), dtype=np.uint8))
    assert not dst.any()
    _core.copy_rows(src, slots, dst)
    assert dst[1:3].all() and not dst[[0, 3]].any()


def test_rows_given_by_address_copy_as_their_array_does() -> None:
    """`(address, n, W)` source rows (the CPU write's, a tensor's `data_ptr`) are read in place
    as the same bytes given as an array; a malformed address triple, or one as the
    destination, is refused before a byte is written."""
    rng = np.random.default_rng(3)
    src = rng.integers(0, 255, (5, 24), dtype=np.uint8)
    slots = np.array([7, 0, 3, 4, 0], dtype=np.int64)
    by_array, by_address = (np.zeros((9, 24), dtype=np.uint8) for _ in range(2))
    _core.copy_rows(src, slots, by_array)
    _core.copy_rows((src.ctypes.data, 5, 24), slots, by_address)
    assert np.array_equal(by_address, by_array)
    _core.copy_rows((0, 0, 24), slots[:0], by_address)  # no rows: no address needed
    for bad, error, message in [((src.ctypes.data, 5), TypeError, "a tuple of 2"),
                                ((src.ctypes.data, -1, 24), ValueError, "-1 rows"),
                                ((0, 5, 24), ValueError, "5 rows of 24 bytes"),
                                ((src.ctypes.data, 5, 12), ValueError, "rows of 12 bytes"),
                                ((src.ctypes.data, 4, 24), ValueError, "5 slots for 4 rows"),
                                ((by_address.ctypes.data + 24, 5, 24), ValueError, "share memory"),
                                (("x", 5, 24), TypeError, "int")]:
        with pytest.raises(error, match=message):
            _core.copy_rows(bad, slots, by_address)
    assert np.array_equal(by_address, by_array)
    with pytest.raises(TypeError, match="dst: expected a C-contiguous writable"):
        _core.copy_rows(src, slots, (by_address.ctypes.data, 9, 24))


@pytest.mark.parametrize("gather", [False, True], ids=["copy_rows", "gather_rows"])
def test_a_large_copy_releases_the_gil_and_is_correct(gather: bool) -> None:
    """Over the no-GIL threshold another thread runs while the caller copies: with a switch
    interval longer than the copy, only a released GIL lets it count meanwhile."""
    import sys
    import threading
    import time
    rows = np.random.default_rng(0).integers(0, 255, (8192, 8192), dtype=np.uint8)
    pool = np.zeros((16384, 8192), dtype=np.uint8)
    slots = np.random.default_rng(1).permutation(16384)[:8192].astype(np.int64)
    if gather:
        pool[slots] = rows
        rows = np.zeros_like(rows)
    src, dst = (pool, rows) if gather else (rows, pool)
    copy = _core.gather_rows if gather else _core.copy_rows
    ticks = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0)  # hands the GIL back at once

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    thread = threading.Thread(target=count)
    thread.start()
    counted = []
    try:
        for _ in range(20):  # on a loaded host the counter may find no core for a while
            before = ticks
            copy(src, slots, dst)
            counted.append(ticks - before)
            if counted[-1]:
                break
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert np.array_equal(pool[slots], rows)
    assert max(counted) > 0, counted


# ------------------------------------------------------------------ extreme inputs

I64 = np.iinfo(np.int64)
EXTREMES = st.sampled_from([I64.min, I64.min + 1, -(2**31), -1, 0, 1, 2**31 - 1, 2**31,
                            2**62, I64.max - 1, I64.max])


def _split_gather_case(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A pool and 4701 slots of 300 random blocks: 18.4 MiB of rows, split 8 ways at most."""
    rng = np.random.default_rng(seed)
    width, num_slots = 4096, 8192
    blocks = rng.permutation(np.arange(num_slots // 16))[:300]
    slots = (blocks[:, None] * 16 + np.arange(16)).ravel()[:4701].astype(np.int64)
    return rng.integers(0, 255, (num_slots, width), dtype=np.uint8), slots


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _thread_counts(answer: Any) -> None:
    """In a new process: its threads before the first split gather, after it, after ten more."""
    pool, slots = _split_gather_case(1)
    out = np.zeros((len(slots), pool.shape[1]), dtype=np.uint8)
    counts = [_os_threads()]
    _core.gather_rows(pool, slots, out, 8)
    counts.append(_os_threads())
    for _ in range(10):
        out[:] = 0
        _core.gather_rows(pool, slots, out, 8)
        assert np.array_equal(out, pool[slots])
    answer.put([*counts, _os_threads()])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_a_split_gathers_threads_are_started_once_and_kept() -> None:
    """Starting and joining threads per gather cost as much as the copy they share; the
    copy threads (7 for an 8-way split) start at the first split gather and serve every
    later one."""
    spawn = multiprocessing.get_context("spawn")
    answer = spawn.Queue()
    child = spawn.Process(target=_thread_counts, args=(answer,))
    child.start()
    try:
        before, first, later = answer.get(timeout=120)
    finally:
        child.join(30)
    assert first == before + 7 and later == first


def test_split_gathers_from_several_threads_at_once_are_each_correct() -> None:
    """One gather at a time has the copy threads; one that finds them busy copies alone."""
    pool, slots = _split_gather_case(2)
    wrong: list[int] = []

    def gather(seed: int) -> None:
        mine = np.random.default_rng(seed).permutation(slots)
        out = np.zeros((len(mine), pool.shape[1]), dtype=np.uint8)
        for _ in range(8):
            _core.gather_rows(pool, mine, out, 8)
            if not np.array_equal(out, pool[mine]):
                wrong.append(seed)

    threads = [threading.Thread(target=gather, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads) and wrong == []


def _gather_in_child(pool: np.ndarray, slots: np.ndarray, answer: Any) -> None:
    out = np.zeros((len(slots), pool.shape[1]), dtype=np.uint8)
    _core.gather_rows(pool, slots, out, 8)
    answer.put(bool(np.array_equal(out, pool[slots])))


def test_a_forked_child_gathers_without_its_parents_copy_threads() -> None:
    """Threads do not survive fork: a child (vLLM forks its workers) starts copy threads of its
    own instead of waiting for its parent's."""
    pool, slots = _split_gather_case(3)
    _core.gather_rows(pool, slots, np.zeros((len(slots), pool.shape[1]), dtype=np.uint8), 8)
    fork = multiprocessing.get_context("fork")
    answer = fork.Queue()
    child = fork.Process(target=_gather_in_child, args=(pool, slots, answer))
    child.start()
    try:
        assert answer.get(timeout=60) is True
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


@settings(max_examples=300, deadline=None)
@example(slots=[I64.max], num_slots=1, width=1)
@example(slots=[0, 1, 2, 3], num_slots=4, width=3)
@example(slots=[3, 0, 0], num_slots=4, width=0)
@given(slots=st.lists(EXTREMES | st.integers(-3, 12), max_size=12),
       num_slots=st.integers(0, 10), width=st.integers(0, 9))
def test_copy_rows_refuses_extreme_slots_and_otherwise_matches_a_python_loop(
        slots: list[int], num_slots: int, width: int) -> None:
    src = np.arange(len(slots) * width, dtype=np.int64).astype(np.uint8).reshape(
        len(slots), width)
    dst = np.full((num_slots, width), 0xEE, dtype=np.uint8)
    before = dst.copy()
    try:
        _core.copy_rows(src, np.array(slots, dtype=np.int64), dst)
    except IndexError as exc:
        bad = next(i for i, s in enumerate(slots) if not 0 <= s < num_slots)
        assert f"slot {slots[bad]} (index {bad})" in str(exc)
        assert np.array_equal(dst, before)  # nothing written
        return
    assert all(0 <= s < num_slots for s in slots)
    for i, s in enumerate(slots):  # row order: a slot given twice holds its last row
        before[s] = src[i]
    assert np.array_equal(dst, before)


@settings(max_examples=100, deadline=None)
@given(dtype=st.sampled_from(DTYPES), num_slots=st.integers(1, 64), width=st.integers(1, 8),
       data=st.data())
def test_scatter_rows_matches_index_copy_on_drawn_slots(dtype: torch.dtype, num_slots: int,
                                                        width: int, data: st.DataObject) -> None:
    distinct = data.draw(st.lists(st.integers(1, num_slots - 1), unique=True,
                                  max_size=num_slots - 1)) if num_slots > 1 else []
    nulls = data.draw(st.integers(0, 3))
    order = data.draw(st.permutations(distinct + [0] * nulls))
    slots = torch.tensor(order, dtype=torch.int64)
    rows = rows_of(len(order), (width,), dtype, len(order))
    pool = HostBuffer(pool_of(num_slots, (width,), dtype), pinned=False)
    want = expected_write(pool.tensor, slots, rows)
    CpuBackend().scatter_rows(rows, slots, pool, ready=None, staging=None)
    assert torch.equal(pool.tensor, want)


# ------------------------------------------------------------------ the hit gather

@pytest.mark.parametrize("width", [1, 15, 4099, 65536, 65539])
def test_gather_rows_matches_fancy_indexing(width: int) -> None:
    """Runs past the streaming threshold, odd widths, repeated and scattered slots: each row of
    the output is its slot's row of the pool, and the pool is left as it was."""
    rng = np.random.default_rng(width)
    num_slots = max(64, (1 << 21) // width)
    n = min(num_slots - 8, 40 + (1 << 20) // width)
    slots = np.concatenate([np.arange(3, 3 + n // 2), [0, 0], rng.integers(
        0, num_slots, n - n // 2 - 2)]).astype(np.int64)
    pool = rng.integers(0, 255, (num_slots, width), dtype=np.uint8)
    before = pool.copy()
    out = np.full((len(slots), width), 0xEE, dtype=np.uint8)
    _core.gather_rows(pool, slots, out)
    assert np.array_equal(out, pool[slots]) and np.array_equal(pool, before)


@pytest.mark.parametrize("threads", [2, 3, 16, 64])
def test_a_split_gather_matches_fancy_indexing(threads: int) -> None:
    """At 2 MiB a thread at least, the rows split at row boundaries that cut runs in two; each
    thread copies its share and the caller joins them all (more threads than allowed: 16)."""
    rng = np.random.default_rng(threads)
    width, num_slots = 4096, 8192
    blocks = rng.permutation(np.arange(num_slots // 16))[:300]
    slots = (blocks[:, None] * 16 + np.arange(16)).ravel()[:4701].astype(np.int64)  # 18.4 MiB
    pool = rng.integers(0, 255, (num_slots, width), dtype=np.uint8)
    out = np.zeros((len(slots), width), dtype=np.uint8)
    _core.gather_rows(pool, slots, out, threads)
    assert np.array_equal(out, pool[slots])
    with pytest.raises(ValueError, match="threads must be at least 1, got 0"):
        _core.gather_rows(pool, slots, out, 0)
    with pytest.raises(TypeError, match="copy_rows takes 3 arguments, got 4"):
        _core.copy_rows(out, slots, pool, 2)  # a pool write keeps row order: one thread


@settings(max_examples=300, deadline=None)
@example(slots=[I64.max], num_slots=1, width=1)
@example(slots=[3, 0, 0], num_slots=4, width=0)
@given(slots=st.lists(EXTREMES | st.integers(-3, 12), max_size=12),
       num_slots=st.integers(0, 10), width=st.integers(0, 9))
def test_gather_rows_refuses_extreme_slots_and_otherwise_matches_a_python_loop(
        slots: list[int], num_slots: int, width: int) -> None:
    pool = np.arange(num_slots * width, dtype=np.int64).astype(np.uint8).reshape(
        num_slots, width)
    out = np.full((len(slots), width), 0xEE, dtype=np.uint8)
    try:
        _core.gather_rows(pool, np.array(slots, dtype=np.int64), out)
    except IndexError as exc:
        bad = next(i for i, s in enumerate(slots) if not 0 <= s < num_slots)
        assert f"gather_rows: slot {slots[bad]} (index {bad})" in str(exc)
        assert (out == 0xEE).all()  # nothing written
        return
    for i, s in enumerate(slots):
        assert np.array_equal(out[i], pool[s])


def test_gather_rows_refuses_mismatched_or_shared_buffers() -> None:
    pool = np.arange(32, dtype=np.uint8).reshape(8, 4)
    slots = np.array([1, 2], dtype=np.int64)
    with pytest.raises(ValueError, match="2 slots for 3 rows of 4 bytes, from rows of 4"):
        _core.gather_rows(pool, slots, np.zeros((3, 4), dtype=np.uint8))
    with pytest.raises(ValueError, match="rows of 8 bytes, from rows of 4 bytes"):
        _core.gather_rows(pool, slots, np.zeros((2, 8), dtype=np.uint8))
    with pytest.raises(ValueError, match="gather_rows: src and dst share memory"):
        _core.gather_rows(pool, slots, pool[4:6])
    with pytest.raises(TypeError, match="gather_rows: slots: expected a 1-D int64"):
        _core.gather_rows(pool, slots.astype(np.int32), np.zeros((2, 4), dtype=np.uint8))
    with pytest.raises(TypeError, match="gather_rows: dst: expected a C-contiguous writable"):
        _core.gather_rows(pool, slots, np.zeros((4, 2), dtype=np.uint8).T)
    assert np.array_equal(pool, np.arange(32, dtype=np.uint8).reshape(8, 4))


def test_gather_parts_fills_each_dst_with_its_slots_in_order() -> None:
    """A step's rows of several requests, each into a tensor of its own (a hit's, after its
    hit rows), in one call: the same rows as one gather_rows, split over the copy threads."""
    pool, slots = _split_gather_case(4)
    sizes = [0, 1, 700, 2048, 1, 1951]  # 4701 rows, a part of no rows included
    dsts = [np.zeros((n, pool.shape[1]), dtype=np.uint8) for n in sizes]
    _core.gather_parts(pool, slots, dsts, 8)
    assert np.array_equal(np.concatenate(dsts), pool[slots])
    small = [np.zeros((1, pool.shape[1]), dtype=np.uint8) for _ in range(3)]
    _core.gather_parts(pool, slots[:3], small)  # under the no-GIL size, on the caller alone
    assert np.array_equal(np.concatenate(small), pool[slots[:3]])


def test_gather_parts_refuses_before_copying_anything() -> None:
    pool = np.arange(64, dtype=np.uint8).reshape(16, 4)
    slots = np.array([3, 4, 5], dtype=np.int64)
    first, second = np.zeros((2, 4), dtype=np.uint8), np.zeros((1, 4), dtype=np.uint8)
    with pytest.raises(ValueError, match="3 slots for 2 rows"):
        _core.gather_parts(pool, slots, [first])
    with pytest.raises(ValueError, match=r"dsts\[1\] has 2 rows of 4 bytes, after 2 of the 3"):
        _core.gather_parts(pool, slots, [first, np.zeros((2, 4), dtype=np.uint8)])
    with pytest.raises(ValueError, match=r"dsts\[0\] has 3 rows of 8 bytes"):
        _core.gather_parts(pool, slots, [np.zeros((3, 8), dtype=np.uint8)])
    with pytest.raises(IndexError, match="slot 16 .index 2."):
        _core.gather_parts(pool, np.array([3, 4, 16], dtype=np.int64), [first, second])
    with pytest.raises(ValueError, match=r"src and dsts\[0\] share memory"):
        _core.gather_parts(pool, slots[:2], [pool[:2]])
    with pytest.raises(TypeError, match=r"dsts\[1\]"):
        _core.gather_parts(pool, slots, [first, np.zeros((1, 4), dtype=np.float32)])
    assert not first.any() and not second.any()
    _core.gather_parts(pool, slots, [first, second])
    assert np.array_equal(np.concatenate([first, second]), pool[slots])
