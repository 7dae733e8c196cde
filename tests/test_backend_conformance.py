"""The DeviceBackend contract (SPEC §6, devices/base.py), one suite over every backend.

Every test that takes the `backend` fixture runs on cpu, cuda and npu (unavailable ones
skip), so an accelerator must pass exactly what the CPU reference passes. Transfers are
completed the way the core's committer does it: a bounded `wait_event`, `verify()`, then
`finish()`.
CUDA-only behaviour (mapped pools, the staged fallback) is at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import closing

import pytest
import torch

from prefix_cache import devices
from prefix_cache.devices.base import DeviceBackend, HostBuffer, Transfer
from prefix_cache.devices.cpu import CpuBackend
from prefix_cache.devices.cuda import CudaBackend

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]
WIDTHS = [1, 3, 16, 2048]
#: Pool fill value. Random rows (randn, or integers in [0, 250)) never equal it, so an
#: untouched slot and a written one are always told apart.
SENTINEL = 255

Alloc = Callable[[Sequence[int], torch.dtype], HostBuffer]


@pytest.fixture
def alloc(backend: DeviceBackend) -> Iterator[Alloc]:
    """`backend.alloc_host`, closing every buffer at teardown (a CUDA registration must not
    outlive its memory)."""
    buffers: list[HostBuffer] = []

    def allocate(shape: Sequence[int], dtype: torch.dtype) -> HostBuffer:
        buffers.append(backend.alloc_host(shape, dtype))
        return buffers[-1]

    yield allocate
    for buffer in buffers:
        buffer.close()


def random_rows(n: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, width, generator=gen).to(dtype)
    return torch.randint(0, 250, (n, width), generator=gen).to(dtype)


def random_slots(n: int, num_slots: int, seed: int = 0) -> torch.Tensor:
    return torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:n]


def filled(buffer: HostBuffer) -> HostBuffer:
    buffer.tensor.fill_(SENTINEL)
    return buffer


def staging_for(backend: DeviceBackend, alloc: Alloc, n: int, width: int,
                dtype: torch.dtype) -> torch.Tensor | None:
    """A caller-owned staging buffer with spare rows where the backend stages, else None."""
    return alloc((n + 3, width), dtype).tensor if backend.needs_staging else None


def complete(transfer: Transfer) -> None:
    devices.wait_event(transfer.event, 10, lambda: "conformance transfer")
    if transfer.verify is not None:
        transfer.verify()
    if transfer.finish is not None:
        transfer.finish()


def scatter_and_check(backend: DeviceBackend, pool: HostBuffer, rows: torch.Tensor,
                      slots: torch.Tensor, staging: torch.Tensor | None) -> Transfer:
    """Scatter after a compute-stream event and check written slots and untouched ones."""
    expected = pool.tensor.clone()
    expected[slots] = rows.cpu()
    transfer = backend.scatter_rows(rows, slots, pool, ready=backend.record_event(),
                                    staging=staging)
    complete(transfer)
    assert torch.equal(pool.tensor, expected)
    return transfer


def busy_compute_stream(device: torch.device) -> None:
    """Queue tens of milliseconds of matmuls on the current stream, so a copy that did not
    wait for a later event would run before the work queued after this."""
    x = torch.randn(4096, 4096, device=device)
    for _ in range(8):
        x = x @ x


def skip_unless_accelerator(backend: DeviceBackend) -> None:
    if backend.synchronous:
        pytest.skip(f"{backend.name}: transfers complete in the call, no streams to order")


def skip_unless_staging(backend: DeviceBackend) -> None:
    if not backend.needs_staging:
        pytest.skip(f"{backend.name}: scatter_rows does not stage")


# ---------------------------------------------------------------- streams and events

def test_record_event_is_none_exactly_when_transfers_are_synchronous(
        backend: DeviceBackend) -> None:
    event = backend.record_event()
    assert (event is None) == backend.synchronous
    devices.wait_event(event, 10, lambda: "recorded event")
    assert event is None or event.query()


def test_backend_device_type_is_its_name(backend: DeviceBackend) -> None:
    assert backend.device.type == backend.name


def test_snapshot_is_a_private_copy_on_the_same_device(backend: DeviceBackend) -> None:
    source = torch.arange(12.0, device=backend.device).view(3, 4)
    snap = backend.snapshot(source)
    source.zero_()
    assert snap.device == source.device
    assert torch.equal(snap.cpu(), torch.arange(12.0).view(3, 4))


# ---------------------------------------------------------------- host memory

@pytest.mark.parametrize(("shape", "dtype", "nbytes"), [
    ((3, 1000), torch.float32, 12000),
    ((7, 3), torch.bfloat16, 42),
    ((5,), torch.uint8, 5),
    ((1000, 2048), torch.float16, 4_096_000),
], ids=["3x1000-f32", "7x3-bf16", "5-u8", "1000x2048-f16"])
def test_alloc_host_is_exact_size_with_the_requested_shape_and_dtype(
        backend: DeviceBackend, alloc: Alloc, shape: tuple[int, ...], dtype: torch.dtype,
        nbytes: int) -> None:
    buffer = alloc(shape, dtype)
    assert buffer.tensor.shape == shape and buffer.tensor.dtype == dtype
    assert buffer.tensor.device.type == "cpu" and buffer.tensor.is_contiguous()
    assert buffer.nbytes == nbytes
    assert buffer.tensor.untyped_storage().nbytes() == nbytes  # no power-of-two rounding


def test_alloc_host_is_pinned_on_accelerators(backend: DeviceBackend, alloc: Alloc) -> None:
    buffer = alloc((4, 1024), torch.float32)
    assert buffer.pinned is (backend.name in ("cuda", "npu"))
    if backend.name == "cuda":  # memory pinned by cudaHostRegister reports is_pinned() too
        assert buffer.tensor.is_pinned()


def test_closing_a_host_buffer_twice_is_a_no_op(backend: DeviceBackend) -> None:
    buffer = backend.alloc_host((8, 16), torch.float32)
    buffer.close()
    buffer.close()
    assert buffer.device_view is None


# ---------------------------------------------------------------- scatter_rows

@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_rows_writes_each_row_into_its_slot_and_nothing_else(
        backend: DeviceBackend, alloc: Alloc, dtype: torch.dtype, width: int) -> None:
    pool = filled(alloc((24, width), dtype))
    rows = random_rows(10, width, dtype).to(backend.device)
    scatter_and_check(backend, pool, rows, random_slots(10, 24),
                      staging_for(backend, alloc, 10, width, dtype))


def test_scatter_of_zero_rows_leaves_the_pool_unchanged(backend: DeviceBackend,
                                                        alloc: Alloc) -> None:
    pool = filled(alloc((8, 16), torch.bfloat16))
    rows = torch.empty((0, 16), dtype=torch.bfloat16, device=backend.device)
    scatter_and_check(backend, pool, rows, torch.empty(0, dtype=torch.int64),
                      staging_for(backend, alloc, 0, 16, torch.bfloat16))
    assert torch.all(pool.tensor == SENTINEL)


@pytest.mark.parametrize(("n", "given", "width"), [(4, 2, 16), (2, 4, 16), (4, 4, 24), (4, 4, 8)],
                         ids=["more-rows-than-slots", "more-slots-than-rows", "wider-rows",
                              "narrower-rows"])
def test_scatter_of_rows_that_do_not_match_their_slots_or_pool_raises_and_writes_nothing(
        backend: DeviceBackend, alloc: Alloc, n: int, given: int, width: int) -> None:
    """Rows beyond their slots must not land in slots a page kept from an earlier write, nor be
    dropped while the write reports success; rows of another width must not run past their
    slot or the pool. Refused at the call, or by a staged write at its landing."""
    pool = filled(alloc((24, 16), torch.float32))
    rows = random_rows(n, width, torch.float32).to(backend.device)
    with pytest.raises((ValueError, IndexError, RuntimeError)):
        complete(backend.scatter_rows(rows, random_slots(given, 24), pool,
                                      ready=backend.record_event(),
                                      staging=staging_for(backend, alloc, n, width,
                                                          torch.float32)))
    assert backend.drain(10)
    assert torch.all(pool.tensor == SENTINEL)


@pytest.mark.parametrize("view", ["column-slice", "row-stride", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
def test_scatter_rows_accepts_strided_row_views(backend: DeviceBackend, alloc: Alloc,
                                                view: str, dtype: torch.dtype) -> None:
    """The contract asks for `[n, F]` rows, not contiguous ones: every backend takes a view."""
    base = random_rows(16, 32, dtype).to(backend.device)
    rows = {"column-slice": base[:6, ::2], "row-stride": base[:12:2, :16],
            "transposed": base[:, :6].t()}[view]
    assert rows.shape == (6, 16) and not rows.is_contiguous()
    pool = filled(alloc((20, 16), dtype))
    scatter_and_check(backend, pool, rows, random_slots(6, 20),
                      staging_for(backend, alloc, 6, 16, dtype))


def test_staged_scatter_without_a_staging_buffer_takes_a_page_of_its_own(
        backend: DeviceBackend, alloc: Alloc) -> None:
    skip_unless_staging(backend)
    pool = filled(alloc((32, 64), torch.float16))
    rows = random_rows(9, 64, torch.float16).to(backend.device)
    scatter_and_check(backend, pool, rows, random_slots(9, 32), staging=None)


def test_staging_buffer_smaller_than_the_step_is_refused(backend: DeviceBackend,
                                                         alloc: Alloc) -> None:
    skip_unless_staging(backend)
    pool = alloc((32, 8), torch.float32)
    rows = torch.ones(5, 8, device=backend.device)
    with pytest.raises(ValueError, match="staging buffer of 4 rows"):
        backend.scatter_rows(rows, random_slots(5, 32), pool, ready=None,
                             staging=alloc((4, 8), torch.float32).tensor)


def test_synchronous_scatter_is_complete_when_the_call_returns(backend: DeviceBackend,
                                                               alloc: Alloc) -> None:
    if not backend.synchronous:
        pytest.skip(f"{backend.name}: transfers are asynchronous")
    pool = filled(alloc((4, 2), torch.float32))
    transfer = backend.scatter_rows(torch.zeros(1, 2), torch.tensor([2]), pool, ready=None,
                                    staging=None)
    assert transfer.complete_at_launch
    assert torch.equal(pool.tensor[2], torch.zeros(2))


def test_large_scatter_of_bf16_rows_on_accelerators(backend: DeviceBackend,
                                                    alloc: Alloc) -> None:
    skip_unless_accelerator(backend)
    n, width = 4096, 2048
    pool = filled(alloc((2 * n, width), torch.bfloat16))
    rows = torch.randn(n, width, device=backend.device).to(torch.bfloat16)
    scatter_and_check(backend, pool, rows, random_slots(n, 2 * n),
                      staging_for(backend, alloc, n, width, torch.bfloat16))


def test_scatter_launched_after_ready_sees_the_compute_streams_last_write(
        backend: DeviceBackend, alloc: Alloc) -> None:
    skip_unless_accelerator(backend)
    pool = filled(alloc((128, 256), torch.float32))
    slots = random_slots(64, 128)
    rows = torch.ones(64, 256, device=backend.device)
    busy_compute_stream(backend.device)
    rows.mul_(2)
    transfer = backend.scatter_rows(rows, slots, pool, ready=backend.record_event(),
                                    staging=staging_for(backend, alloc, 64, 256, torch.float32))
    complete(transfer)
    assert torch.all(pool.tensor[slots] == 2)


def test_cpu_scatter_into_random_distinct_slots_matches_index_assignment() -> None:
    """A property test on the CPU reference. hypothesis (the `test` extra) is imported here,
    not at module scope: the cuda and npu CI rows need not install it, and a module-level
    import error would hide this whole suite there."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    backend = CpuBackend()

    @hypothesis.settings(max_examples=50, deadline=None)
    @hypothesis.given(num_slots=st.integers(1, 64), data=st.data(),
                      width=st.integers(1, 8), dtype=st.sampled_from(DTYPES),
                      seed=st.integers(0, 2**16))
    def scatter_random_slots(num_slots: int, data: st.DataObject, width: int,
                             dtype: torch.dtype, seed: int) -> None:
        slots = data.draw(st.lists(st.integers(0, num_slots - 1), unique=True,
                                   max_size=num_slots))
        pool = filled(backend.alloc_host((num_slots, width), dtype))
        scatter_and_check(backend, pool, random_rows(len(slots), width, dtype, seed),
                          torch.tensor(slots, dtype=torch.int64), staging=None)

    scatter_random_slots()


# ---------------------------------------------------------------- copy_to_host

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_to_host_returns_an_equal_private_cpu_copy(backend: DeviceBackend,
                                                        dtype: torch.dtype) -> None:
    source = random_rows(5, 7, dtype).to(backend.device)
    expected = source.cpu().clone()
    host, transfer = backend.copy_to_host(source, ready=backend.record_event())
    complete(transfer)
    source.zero_()
    assert host.device.type == "cpu" and host.dtype == dtype
    assert torch.equal(host, expected)


def test_copy_to_host_launched_after_ready_sees_the_compute_streams_last_write(
        backend: DeviceBackend) -> None:
    skip_unless_accelerator(backend)
    source = torch.ones(256, 1024, device=backend.device)
    busy_compute_stream(backend.device)
    source.mul_(2)
    host, transfer = backend.copy_to_host(source, ready=backend.record_event())
    complete(transfer)
    assert torch.all(host == 2)


# ---------------------------------------------------------------- CUDA only

@pytest.fixture
def mapped_cuda() -> Iterator[CudaBackend]:
    with closing(CudaBackend(zero_copy=True)) as backend:
        yield backend


@pytest.fixture
def staged_cuda() -> Iterator[CudaBackend]:
    with closing(CudaBackend(zero_copy=False)) as backend:
        yield backend


@pytest.mark.cuda
def test_cuda_pool_has_a_device_view_aliasing_its_host_memory(mapped_cuda: CudaBackend) -> None:
    assert mapped_cuda.zero_copy and not mapped_cuda.needs_staging
    with closing(mapped_cuda.alloc_host((16, 8), torch.float32)) as pool:
        view = pool.device_view
        assert view is not None and view.device.type == "cuda"
        assert view.data_ptr() == pool.tensor.data_ptr() and view.shape == pool.tensor.shape
        pool.tensor.zero_()
        rows = torch.arange(16.0, device=view.device).view(2, 8)
        view.index_copy_(0, torch.tensor([3, 7], device=view.device), rows)
        torch.cuda.synchronize()
        expected = torch.zeros(16, 8)
        expected[[3, 7]] = rows.cpu()
        assert torch.equal(pool.tensor, expected)


@pytest.mark.cuda
@pytest.mark.parametrize("use_kernel", [True, False], ids=["triton-kernel", "index-copy"])
def test_cuda_zero_copy_scatter_lands_rows_without_a_host_step(
        mapped_cuda: CudaBackend, monkeypatch: pytest.MonkeyPatch, use_kernel: bool) -> None:
    if use_kernel and not mapped_cuda.use_kernel:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(mapped_cuda, "use_kernel", use_kernel)
    with closing(filled(mapped_cuda.alloc_host((64, 2048), torch.bfloat16))) as pool:
        rows = random_rows(20, 2048, torch.bfloat16).to(mapped_cuda.device)
        transfer = scatter_and_check(mapped_cuda, pool, rows, random_slots(20, 64), None)
        assert transfer.finish is None


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_without_zero_copy_stages_and_still_scatters_correctly(
        staged_cuda: CudaBackend, dtype: torch.dtype) -> None:
    assert not staged_cuda.zero_copy and staged_cuda.needs_staging
    with (closing(filled(staged_cuda.alloc_host((48, 40), dtype))) as pool,
          closing(staged_cuda.alloc_host((16, 40), dtype)) as staging):
        rows = random_rows(12, 40, dtype).to(staged_cuda.device)
        transfer = scatter_and_check(staged_cuda, pool, rows, random_slots(12, 48),
                                     staging.tensor)
        assert transfer.finish is not None


@pytest.mark.cuda
def test_closing_a_cuda_pool_unpins_it_and_drops_the_device_view(
        mapped_cuda: CudaBackend) -> None:
    pool = mapped_cuda.alloc_host((4, 1024), torch.float32)
    assert pool.tensor.is_pinned() and pool.device_view is not None
    pool.close()
    pool.close()
    assert pool.device_view is None and not pool.tensor.is_pinned()
