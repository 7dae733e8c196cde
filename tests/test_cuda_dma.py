"""Copy-engine saves on a real CUDA device (`devices/cuda/dma.py`): the rows that land are the
ones the caller had when it saved, whatever it does to its buffers afterwards; copies into one
slot land in save order across the DMA and kernel paths; a bad slot is refused before anything
is queued; a full ring refuses instead of overwriting a job in flight."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefix_cache.devices.base import Transfer
from prefix_cache.devices.cuda.dma import DmaDone

pytestmark = pytest.mark.cuda

WIDTH = 2048  # bf16: 4 KiB a row, as the bench


@pytest.fixture
def backend():
    from prefix_cache import devices
    backend = devices.get_backend("cuda")
    if backend._dma is None:
        pytest.fail("the cuda backend started without copy-engine saves")
    yield backend
    backend.close()


def _land(transfer: Transfer) -> None:
    transfer.event.synchronize()
    if transfer.verify is not None:
        transfer.verify()


def _random_block_slots(rng: np.random.Generator, num_blocks: int, rows: int) -> np.ndarray:
    blocks = rng.choice(np.arange(1, num_blocks), size=-(-rows // 16), replace=False)
    return (blocks[:, None] * 16 + np.arange(16)).ravel()[:rows].astype(np.int64)


@pytest.mark.parametrize("in_stream", [True, False])
def test_a_dma_save_lands_the_rows_of_its_call_while_the_stream_is_busy_and_the_buffer_reused(
        backend, in_stream: bool) -> None:
    """The forward still runs on a side stream when the save returns; right after, the caller
    overwrites its rows in stream order; under set_sync_debug_mode("error") nothing syncs.
    Ten saves, past every first-time allocation."""
    rng = np.random.default_rng(0)
    pool = backend.alloc_host((256 * 16, WIDTH), torch.bfloat16)
    pool.tensor.zero_()
    stream = torch.cuda.Stream()
    rows = torch.empty(512, WIDTH, device=backend.device, dtype=torch.bfloat16)
    landed = []
    for step in range(10):
        slots = _random_block_slots(rng, 256, 512)
        want = torch.randn(512, WIDTH, dtype=torch.bfloat16)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(5_000_000)  # the forward, still running
            rows.copy_(want, non_blocking=True)
            if in_stream:
                ready = None
                source = rows
            else:  # the copy stream reads a private copy, after `ready`
                source = backend.snapshot(rows)
                ready = backend.record_event()
            torch.cuda.set_sync_debug_mode("error" if step else "default")
            try:
                transfer = backend.scatter_rows(source, torch.from_numpy(slots), pool,
                                                ready=ready, staging=None, in_stream=in_stream)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            rows.fill_(-7)  # the next step's forward overwrites the output buffer
        assert isinstance(transfer.event, DmaDone), "the save did not go by DMA"
        landed.append((transfer, slots, want))
    expected = torch.zeros_like(pool.tensor)
    for transfer, slots, want in landed:  # saves into reused blocks: the later one holds them
        _land(transfer)
        expected[torch.from_numpy(slots)] = want
    assert torch.equal(pool.tensor, expected)
    pool.close()


def test_saves_into_one_slot_land_in_save_order_across_dma_and_kernel(backend) -> None:
    """A large save (DMA) and then a small one (kernel size) into the same block, issued back to
    back: the small one goes by DMA too while the first may still be writing, and the block
    ends up holding the second save's rows."""
    pool = backend.alloc_host((64 * 16, WIDTH), torch.bfloat16)
    big = torch.randn(512, WIDTH, device=backend.device).to(torch.bfloat16)
    small = torch.randn(16, WIDTH, device=backend.device).to(torch.bfloat16)
    slots_big = np.arange(16, 16 + 512, dtype=np.int64)
    slots_small = np.arange(16, 32, dtype=np.int64)  # the first block of the big save
    torch.cuda._sleep(5_000_000)
    first = backend.scatter_rows(big, torch.from_numpy(slots_big), pool, ready=None,
                                 staging=None, in_stream=True)
    assert isinstance(first.event, DmaDone) and backend._dma.pending()
    second = backend.scatter_rows(small, torch.from_numpy(slots_small), pool, ready=None,
                                  staging=None, in_stream=True)
    assert isinstance(second.event, DmaDone)  # after the DMA, not beside it on the kernel
    for transfer in (first, second):
        _land(transfer)
    assert torch.equal(pool.tensor[16:32], small.cpu())
    assert torch.equal(pool.tensor[32:528], big[16:].cpu())
    # idle again: a small save takes the kernel
    third = backend.scatter_rows(small, torch.from_numpy(slots_small), pool, ready=None,
                                 staging=None, in_stream=True)
    assert not isinstance(third.event, DmaDone)
    _land(third)
    pool.close()


def test_a_slot_outside_the_pool_is_refused_before_anything_is_queued(backend) -> None:
    pool = backend.alloc_host((64 * 16, WIDTH), torch.bfloat16)
    pool.tensor.fill_(3)
    rows = torch.ones(512, WIDTH, device=backend.device, dtype=torch.bfloat16)
    slots = np.arange(16, 528, dtype=np.int64)
    slots[300] = 64 * 16
    with pytest.raises(IndexError, match=r"cuda DMA: slot 1024 \(index 300\) is outside 0\.\.1023"):
        backend.scatter_rows(rows, torch.from_numpy(slots), pool, ready=None, staging=None,
                             in_stream=True)
    assert not backend._dma.pending()
    assert backend.drain(10)
    assert (pool.tensor == 3).all()
    pool.close()


def test_a_full_ring_refuses_a_save_instead_of_reusing_a_job_in_flight(monkeypatch) -> None:
    from prefix_cache import devices
    from prefix_cache.devices.cuda import dma
    monkeypatch.setattr(dma, "RING", 3)
    backend = devices.get_backend("cuda")
    pool = backend.alloc_host((64 * 16, WIDTH), torch.bfloat16)
    rows = torch.ones(256, WIDTH, device=backend.device, dtype=torch.bfloat16)
    held = [backend.scatter_rows(rows, torch.arange(16 * (i + 1), 16 * (i + 1) + 256), pool,
                                 ready=None, staging=None, in_stream=True) for i in range(2)]
    # the self-test's job was released at start: three in the ring, the third still free
    held.append(backend.scatter_rows(rows, torch.arange(512, 768), pool, ready=None,
                                     staging=None, in_stream=True))
    with pytest.raises(RuntimeError, match="3 copies in flight, none released: the ring is full"):
        backend.scatter_rows(rows, torch.arange(768, 1024), pool, ready=None, staging=None,
                             in_stream=True)
    for transfer in held:
        _land(transfer)
    del held, transfer
    done = backend.scatter_rows(rows, torch.arange(768, 1024), pool, ready=None, staging=None,
                                in_stream=True)  # released handles free their places
    _land(done)
    assert (pool.tensor[768:1024] == 1).all()
    pool.close()
    backend.close()


def test_the_bench_times_the_kernel_beside_dma_only_where_a_save_goes_by_dma(monkeypatch) -> None:
    """M1's and M7's "by the kernel" figures are a second path only where the save they time
    goes by copy engine: not below `dma_min_bytes`, nor with DMA turned off."""
    from prefix_cache import devices
    from prefix_cache.devices.cuda import dma
    from prefix_cache.tools.metrics.save import saves_by_dma
    backend = devices.get_backend("cuda")
    try:
        threshold = max(backend.dma_min_bytes, 1)
        assert saves_by_dma(backend, threshold) and not saves_by_dma(backend, threshold - 1)
    finally:
        backend.close()
    monkeypatch.setenv(dma.DMA_ENV, "0")
    backend = devices.get_backend("cuda")
    try:
        assert not saves_by_dma(backend, 1 << 30)
    finally:
        backend.close()
