"""OutputBuffers: an output's memory is reused only after its caller dropped every tensor over it,
and a hit read then gathers into that memory (SPEC §4.5: the caller owns what it holds)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.multiprocessing

from prefix_cache.core.output_buffers import MIN_RECYCLED_BYTES, OutputBuffers, size_class
from tests.sim import token_rows
from tests.test_manager import make, run_step

ROWS, WIDTH = 64, MIN_RECYCLED_BYTES // 64 // 4  # one recycled size: 1 MiB of float32


def test_a_dropped_output_serves_the_next_one_and_a_held_one_never_does() -> None:
    buffers = OutputBuffers(8 << 20)
    first = buffers.empty((ROWS, WIDTH), torch.float32)
    address = first.data_ptr()
    first.fill_(1)
    held = buffers.empty((ROWS, WIDTH), torch.float32)  # first is still alive: new memory
    assert held.data_ptr() != address and buffers.reused == 0
    del first
    again = buffers.empty((ROWS, WIDTH), torch.float32, zeroed=True)
    assert again.data_ptr() == address and buffers.reused == 1
    assert not again.any()  # zeroed even though the memory held ones
    again.fill_(2)
    held.fill_(3)
    assert (again == 2).all() and (held == 3).all()


def test_a_view_keeps_the_memory_its_own() -> None:
    buffers = OutputBuffers(8 << 20)
    out = buffers.empty((ROWS, WIDTH), torch.float32)
    tail = out[ROWS // 2:]
    tail.fill_(7)
    del out
    gc.collect()
    other = buffers.empty((ROWS, WIDTH), torch.float32)
    other.fill_(0)
    assert buffers.reused == 0 and (tail == 7).all()
    del tail
    assert buffers.empty((ROWS, WIDTH), torch.float32).data_ptr() != other.data_ptr()
    assert buffers.reused == 1


def test_memory_dropped_on_another_thread_comes_back() -> None:
    buffers = OutputBuffers(8 << 20)
    box = [buffers.empty((2 * ROWS, WIDTH), torch.bfloat16)]
    dropper = threading.Thread(target=box.clear)
    dropper.start()
    dropper.join()
    assert buffers.free_bytes == size_class(2 * ROWS * WIDTH * 2)
    out = buffers.empty((2 * ROWS, WIDTH), torch.bfloat16)
    assert buffers.reused == 1 and buffers.free_bytes == 0
    del out
    assert buffers.free_bytes == 1 << 20


def test_capacity_bounds_what_is_kept_and_small_outputs_are_not_recycled() -> None:
    buffers = OutputBuffers(3 << 20)
    outs = [buffers.empty((ROWS, WIDTH), torch.float32) for _ in range(4)]
    del outs
    assert buffers.free_bytes == 3 << 20  # three 1 MiB buffers kept, the fourth freed
    small = buffers.empty((4, 4), torch.float32)
    assert small.untyped_storage().nbytes() == 64
    buffers.clear()
    assert buffers.free_bytes == 0
    del small
    out = buffers.empty((ROWS, WIDTH), torch.float32)
    del out
    assert buffers.reused == 0 and buffers.free_bytes == 0  # cleared: nothing kept any more
    none_kept = OutputBuffers(0)
    del_me = none_kept.empty((ROWS, WIDTH), torch.float32)
    del del_me
    assert none_kept.free_bytes == 0


def _share(out: torch.Tensor) -> None:
    out.share_memory_()


def _share_a_view(out: torch.Tensor) -> None:
    out[ROWS // 2:].share_memory_()


def _queue_put(out: torch.Tensor) -> None:
    queue = torch.multiprocessing.Queue()
    queue.put(out)  # pickling it moves its storage into shared memory
    # the same bytes: `out` is uninitialized, and a NaN there would never equal itself
    assert torch.equal(queue.get(timeout=30).view(torch.uint8), out.view(torch.uint8))
    assert out.is_shared()
    queue.close()
    queue.join_thread()


def _overlaps(out: torch.Tensor, start: int, nbytes: int) -> bool:
    return out.data_ptr() < start + nbytes and start < out.data_ptr() + out.nbytes


@pytest.mark.parametrize("swap", [_share, _share_a_view, _queue_put])
def test_memory_swapped_out_under_a_numpy_view_is_never_handed_out_again(
        swap: Callable[[torch.Tensor], None]) -> None:
    """torch frees an output's pages when it moves them into shared memory, while a numpy view
    still points at them: they go back to the system, not to the next output."""
    buffers = OutputBuffers(8 << 20)
    spare = buffers.empty((ROWS, WIDTH), torch.float32)
    spare_address = spare.data_ptr()
    out = buffers.empty((ROWS, WIDTH), torch.float32)
    stale = out.numpy()  # never read below: once swapped out, its memory may be unmapped
    start, nbytes = stale.__array_interface__["data"][0], stale.nbytes
    del spare  # dropped as a caller does: its memory serves the next output
    swap(out)
    assert out.data_ptr() != start and buffers.swapped_out == 1
    del out
    gc.collect()
    again = buffers.empty((ROWS, WIDTH), torch.float32)
    assert not _overlaps(again, start, nbytes)
    assert again.data_ptr() == spare_address and buffers.reused == 1 and buffers.free_bytes == 0


@pytest.mark.parametrize("export", [torch.Tensor.numpy, torch.from_dlpack],
                         ids=["numpy", "dlpack"])
def test_an_export_keeps_the_memory_a_set_swaps_out(
        export: Callable[[torch.Tensor], np.ndarray | torch.Tensor]) -> None:
    """After `set_` on the output, an export taken before still holds the old memory (torch
    keeps the storage for it); only once the export goes is that memory reused."""
    buffers = OutputBuffers(8 << 20)
    out = buffers.empty((ROWS, WIDTH), torch.float32)
    out.fill_(4)
    alias = export(out)
    address, nbytes = out.data_ptr(), out.nbytes
    out.set_(torch.zeros(3))
    del out
    gc.collect()
    assert buffers.free_bytes == 0 and buffers.swapped_out == 0  # neither kept nor freed
    other = buffers.empty((ROWS, WIDTH), torch.float32)
    other.fill_(0)
    assert not _overlaps(other, address, nbytes) and (alias == 4).all()
    del alias
    assert buffers.empty((ROWS, WIDTH), torch.float32).data_ptr() == address
    assert buffers.reused == 1 and buffers.swapped_out == 0


def test_memory_under_dropped_exports_is_reused() -> None:
    buffers = OutputBuffers(8 << 20)
    out = buffers.empty((ROWS, WIDTH), torch.float32)
    address = out.data_ptr()
    exports = [out.numpy(), torch.from_dlpack(out), out[1:].numpy(), out.untyped_storage()]
    del out, exports
    gc.collect()
    assert buffers.empty((ROWS, WIDTH), torch.float32).data_ptr() == address
    assert buffers.reused == 1 and buffers.swapped_out == 0


@pytest.mark.parametrize("nbytes", [MIN_RECYCLED_BYTES, MIN_RECYCLED_BYTES + 1, 3 << 20,
                                    (5 << 20) - 7, 1 << 30])
def test_a_size_class_holds_the_request_within_a_quarter(nbytes: int) -> None:
    size = size_class(nbytes)
    assert nbytes <= size <= nbytes * 1.25 and size_class(size) == size


def test_hit_outputs_are_recycled_across_steps_and_a_kept_one_stays_intact(backend) -> None:
    """A caller that keeps an output keeps its rows; dropped outputs serve later hits."""
    width = 1 << 16  # 256 KiB rows, so each request's output is recycled memory
    manager, d = make(backend, num_blocks=16)
    shared = list(range(10, 14))
    with manager:
        out = run_step(manager, d, d.step(new=[("r0", shared + [0, 1, 2, 3], [1, 2], 0, 8)]),
                       backend.device, mm_width=width)
        kept = out.mm_outputs["mm_feature"]["r0"]
        for i in range(1, 6):
            tokens = shared + [100 * i + t for t in range(4)]
            out = run_step(manager, d, d.step(new=[(f"r{i}", tokens, [1, 2 + i], 4, 4)],
                                              finished=[f"r{i - 1}"]),
                           backend.device, mm_width=width)
            assert torch.equal(out.mm_outputs["mm_feature"][f"r{i}"],
                               token_rows(tokens, width, salt=1))
            assert torch.equal(out.hidden_states[f"r{i}"], token_rows(tokens, 2))
            del out
        assert torch.equal(kept, token_rows(shared + [0, 1, 2, 3], width, salt=1))
        assert manager.stats()["outputs_reused"] >= 3
