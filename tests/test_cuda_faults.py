"""The CUDA layer's faults of issue 54 (items 8-12): a refused host registration, a DMA job that
failed before issuing, shapes a scatter cannot take, a forked child dropping the DMA issuer, a
zero-width key beside a DMA save.

What needs no GPU runs here: the registration's error handling over a stand-in runtime, the
backend's refusals and its zero-byte path over host stand-ins (tests/test_scatter_bounds.py's).
The issuer's ordering and fork guard on CPU: tests/test_dma_issuer.py. The rest needs the GPU.
"""

from __future__ import annotations

import gc
import os
import time
from contextlib import closing

import numpy as np
import pytest
import torch

from prefix_cache.devices import wait_event
from prefix_cache.devices.base import HostBuffer, Transfer
from prefix_cache.devices.cuda import CudaBackend, host_memory
from tests.sim import token_rows
from tests.test_manager import make
from tests.test_scatter_bounds import _host_cuda_backend, _host_pool, _Pages

ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


# ---------------------------------------------------------------- a refused registration

class _RefusingRuntime:
    """cudaHostRegister refusing as the runtime does: the error returned, and kept as the
    thread's last error until cudaGetLastError takes it."""

    def __init__(self) -> None:
        self.last_error = 0

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.last_error = ALREADY_REGISTERED
        return ALREADY_REGISTERED

    def cudaGetLastError(self) -> int:
        error, self.last_error = self.last_error, 0
        return error

    def cudaGetErrorName(self, error: int) -> bytes:
        return b"cudaErrorHostMemoryAlreadyRegistered"


def test_a_refused_registration_raises_naming_the_error_and_clears_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = _RefusingRuntime()
    monkeypatch.setattr(host_memory, "_runtime", lambda: runtime)
    with pytest.raises(RuntimeError, match=r"^cudaHostRegister of 256 bytes failed: "
                                           r"cudaErrorHostMemoryAlreadyRegistered \(712\)$"):
        host_memory.pin_mapped(torch.empty(64))
    assert runtime.last_error == 0  # torch's next launch check finds nothing


@pytest.mark.cuda
def test_a_registration_the_runtime_refuses_leaves_no_error_for_the_next_kernel() -> None:
    """A real refusal (the range is registered already), then an unrelated kernel: torch's
    launch check after it, and a synchronization, raise nothing."""
    device = torch.device("cuda", torch.cuda.current_device())
    pool = host_memory.register_host((64, 16), torch.float32, device)
    try:
        with torch.cuda.device(device), pytest.raises(
                RuntimeError, match="cudaHostRegister of 4096 bytes failed: "
                                    "cudaErrorHostMemoryAlreadyRegistered"):
            host_memory.pin_mapped(pool.tensor)
        doubled = torch.arange(8.0, device=device) * 2
        torch.cuda.synchronize()
        assert doubled.sum().item() == 56.0
    finally:
        pool.close()


@pytest.mark.cuda
def test_a_backend_refused_a_pools_registration_pins_it_through_torch_and_saves_go_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime refuses the pool's registration (here: its memory is registered already, a
    real CUDA error): the backend pins through torch, gives up zero-copy saves, and the next
    kernels and saves run."""
    import prefix_cache.devices.cuda as cuda_backend
    backend = CudaBackend()
    taken = host_memory.register_host((64, 16), torch.float32, backend.device)

    def refused(shape, dtype, device) -> HostBuffer:
        with torch.cuda.device(device):
            host_memory.pin_mapped(taken.tensor)  # raises: registered already
        raise AssertionError("the runtime registered a range twice")

    monkeypatch.setattr(cuda_backend, "register_host", refused)
    with closing(backend), closing(taken):
        pool = backend.alloc_host((64, 16), torch.float32)
        assert pool.pinned and pool.device_view is None and not backend.zero_copy
        rows = torch.randn(4, 16, device=backend.device) * 3  # the next kernel
        slots = torch.tensor([1, 5, 9, 2])
        transfer = backend.scatter_rows(rows, slots, pool, ready=backend.record_event(),
                                        staging=None)
        wait_event(transfer.event, 10, lambda: "staged save")
        transfer.finish()
        torch.cuda.synchronize()
        assert torch.equal(pool.tensor[slots], rows.cpu())
        pool.close()


# ---------------------------------------------------------------- a zero-width key

class _BusyCopier:
    """A DMA path whose earlier save still runs: anything that waits for it fails the test."""

    submitted = 1

    def pending(self) -> bool:
        return True

    def flush(self, timeout_s: float) -> bool:
        raise AssertionError("the engine thread waited for the copy stream")

    def submit(self, *args: object) -> None:
        raise AssertionError("a save of no bytes was queued")


def test_a_save_of_no_bytes_beside_a_dma_save_returns_at_once_without_waiting() -> None:
    """A zero-width key's pool has no mapping (nothing to register): its save writes nothing, so
    it neither waits for the DMA save still running nor launches anything."""
    backend = _host_cuda_backend(_Pages().pages)
    backend._dma = _BusyCopier()
    backend.dma_min_bytes = 0
    for rows, pool_width in ((torch.empty(4, 0), 0), (torch.empty(0, 8), 8)):
        _, pool = _host_pool(16, pool_width)
        pool.device_view = None if pool_width == 0 else pool.device_view
        transfer = backend.scatter_rows(rows, torch.arange(1, rows.shape[0] + 1), pool,
                                        ready=None, staging=None, in_stream=True,
                                        host_slots=np.arange(1, rows.shape[0] + 1))
        assert transfer.complete_at_launch and transfer.verify is None


@pytest.mark.cuda
def test_a_zero_width_key_beside_a_dma_save_makes_the_engine_thread_wait_for_nothing() -> None:
    """Every save by DMA; a key of no bytes a row beside the hidden rows; the forward still busy
    on a non-default stream when save_outputs returns, under set_sync_debug_mode("error")."""
    from prefix_cache import devices
    backend = devices.get_backend("cuda")
    if backend._dma is None:
        pytest.fail("the cuda backend started without copy-engine saves")
    backend.dma_min_bytes = 0
    manager, d = make(backend, num_blocks=64, block_size=16)
    forward = torch.cuda.Stream()
    with closing(backend), manager:
        for i in range(5):
            tokens = [i * 100 + t for t in range(16)]
            manager.new_step_starts(d.step(new=[(f"r{i}", tokens, [i + 1], 0, 16)]))
            warm = i >= 2  # first sight sizes the pools and arenas
            with torch.cuda.stream(forward):
                hidden = d.outputs(2).to(backend.device, non_blocking=True)
                empty = torch.empty(16, 0, device=backend.device)
                torch.cuda._sleep(1_000_000_000 if warm else 1000)  # ~0.5 s
                forward_done = torch.cuda.Event()
                forward_done.record()
                torch.cuda.set_sync_debug_mode("error" if warm else "default")
                start = time.monotonic()
                try:
                    sid = manager.save_outputs(hidden, {"empty": empty},
                                               num_tokens_unpadded=16, num_tokens_padded=16)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                took = time.monotonic() - start
                waited = forward_done.query()  # the forward over already: the call waited
            assert not (warm and waited), f"save_outputs waited {took:.3f}s for the forward"
            out = manager.materialize(sid, [f"r{i}"])
            assert torch.equal(out.hidden_states[f"r{i}"], token_rows(tokens, 2))
            assert out.mm_outputs["empty"][f"r{i}"].shape == (16, 0)
            d.advance()
        assert backend.stats()["dma_jobs"] >= 5  # the hidden rows went by DMA


# ---------------------------------------------------------------- shapes a scatter cannot take

@pytest.mark.cuda
@pytest.mark.parametrize(("rows", "slots", "width"), [
    (4, 2, 16), (2, 4, 16), (4, 4, 24), (4, 4, 8)],
    ids=["more-rows-than-slots", "more-slots-than-rows", "wider-rows", "narrower-rows"])
def test_a_dma_save_whose_rows_do_not_fit_is_refused_before_anything_is_queued(
        rows: int, slots: int, width: int) -> None:
    from prefix_cache import devices
    backend = devices.get_backend("cuda")
    if backend._dma is None:
        pytest.fail("the cuda backend started without copy-engine saves")
    backend.dma_min_bytes = 0
    with closing(backend), closing(backend.alloc_host((64, 16), torch.float32)) as pool:
        pool.tensor.fill_(3)
        submitted = backend._dma.submitted
        host_slots = np.arange(8, 8 + slots)
        for in_stream, given in ((False, torch.from_numpy(host_slots)),
                                 (True, torch.from_numpy(host_slots).to(backend.device))):
            with pytest.raises(ValueError, match=rf"^cuda scatter: {slots} slots for {rows} rows"):
                backend.scatter_rows(torch.ones(rows, width, device=backend.device), given, pool,
                                     ready=None, staging=None, in_stream=in_stream,
                                     host_slots=host_slots)
        assert backend._dma.submitted == submitted and backend.drain(10)
        assert (pool.tensor == 3).all()


# ---------------------------------------------------------------- a forked child

@pytest.mark.cuda
def test_a_forked_child_drops_the_backends_dma_issuer_and_exits() -> None:
    """vLLM forks its workers: a child that drops the parent's DMA issuer exits, without joining
    the parent's issuing thread and without a CUDA call."""
    from prefix_cache import devices
    backend = devices.get_backend("cuda")
    if backend._dma is None:
        pytest.fail("the cuda backend started without copy-engine saves")
    pid = os.fork()
    if pid == 0:  # the child: drop the backend's issuer, touch no device
        code = 1
        try:
            backend._dma = None
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung dropping its parent's DMA issuer")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    backend.close()  # the parent's issuer is whole: its close joins its thread
