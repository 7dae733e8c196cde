"""The device registry (names, auto-detection, plug-ins) and each device's kernel-block rules."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from prefix_cache import OmniPrefixCacheManager, PrefixCacheConfig, devices
import prefix_cache.devices.npu
from prefix_cache.core.committer import Committer
from prefix_cache.devices.base import DeviceBackend, HostBuffer, Transfer, host_bytes
from prefix_cache.devices.cpu import CpuBackend
from prefix_cache.devices.cuda import CudaBackend, scatter
from prefix_cache.devices.base import CHECK_SLOTS_ENV
from prefix_cache.devices.cuda.slot_pages import SlotRangeError
from prefix_cache.devices.kernel_blocks import MultipleOf, accepts
from prefix_cache.devices.npu import NpuBackend
from prefix_cache.errors import OmniPrefixCacheError, OmniPrefixCacheUnmatchError
from prefix_cache.core.tasks import TaskState, WriteTask

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILTINS = ("npu", "cuda", "cpu")  # the auto-detection order


class XpuTestBackend(CpuBackend):
    """A third-party backend as a plug-in ships it (host memory stands in for its device)."""

    name = "xpu-test"


def install_entry_points(monkeypatch: pytest.MonkeyPatch, *eps: SimpleNamespace) -> None:
    """Make `eps` the installed entry points of the group `prefix_cache.devices`."""
    def entry_points(*, group: str) -> list[SimpleNamespace]:
        return list(eps) if group == "prefix_cache.devices" else []

    monkeypatch.setattr(devices, "entry_points", entry_points)


def entry_point(name: str, load: Callable[[], type[DeviceBackend]]) -> SimpleNamespace:
    return SimpleNamespace(name=name, load=load)


# ---------------------------------------------------------------- registry

def test_available_includes_cpu_and_follows_the_auto_detection_order() -> None:
    names = devices.available()
    order = list(devices.backend_classes())
    assert "cpu" in names
    assert order[:3] == list(BUILTINS)
    assert names == sorted(names, key=order.index)


def test_get_backend_without_a_name_gives_the_first_available_type() -> None:
    with closing(devices.get_backend(None)) as backend:  # cpu on a machine without accelerators
        assert backend.name == devices.available()[0]


@pytest.mark.parametrize(("usable", "chosen"), [
    ({"npu", "cuda"}, NpuBackend), ({"cuda"}, CudaBackend), (set(), CpuBackend),
], ids=["npu-before-cuda", "cuda-before-cpu", "cpu-fallback"])
def test_auto_detection_asks_npu_then_cuda_then_cpu(
        monkeypatch: pytest.MonkeyPatch, usable: set[str], chosen: type[DeviceBackend]) -> None:
    for cls in (NpuBackend, CudaBackend):
        monkeypatch.setattr(cls, "is_available", classmethod(lambda c: c.name in usable))
        monkeypatch.setattr(cls, "__init__", lambda self: None)  # no device to set up here
    assert type(devices.get_backend(None)) is chosen


def test_unknown_device_type_is_a_value_error_naming_the_known_types() -> None:
    with pytest.raises(ValueError, match="'nope'") as info:
        devices.get_backend("nope")
    assert all(repr(name) in str(info.value) for name in BUILTINS)


def test_unavailable_device_type_is_a_cache_error_naming_what_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NpuBackend, "is_available", classmethod(lambda c: False))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="'npu' is not usable") as info:
        devices.get_backend("npu")
    assert NpuBackend.missing() in str(info.value) and "\n" not in str(info.value)


@pytest.mark.skipif(CudaBackend.is_available(), reason="needs a process without a CUDA GPU")
def test_a_cuda_manager_without_a_gpu_says_what_is_missing() -> None:
    view = SimpleNamespace(batch_req_ids=list, step_slots_cpu=lambda req_ids, counts: None)
    with pytest.raises(OmniPrefixCacheUnmatchError) as info:
        OmniPrefixCacheManager(PrefixCacheConfig(16, 4, device="cuda"), view)
    message = str(info.value)
    assert "'cuda' is not usable in this process" in message and "\n" not in message
    assert ("not a CUDA build" in message) != ("no NVIDIA GPU" in message)
    assert message.endswith("usable here: cpu")


def test_entry_point_backend_is_discovered_and_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    install_entry_points(monkeypatch, entry_point("xpu-test", lambda: XpuTestBackend))
    assert devices.backend_classes()["xpu-test"] is XpuTestBackend
    assert devices.available()[-1] == "xpu-test"
    assert isinstance(devices.get_backend("xpu-test"), XpuTestBackend)


def test_broken_entry_point_is_skipped_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    def load() -> type[DeviceBackend]:
        raise ImportError("xpu driver missing")

    install_entry_points(monkeypatch, entry_point("xpu-broken", load))
    with caplog.at_level(logging.WARNING, logger="devices"):
        classes = devices.backend_classes()
    assert "xpu-broken" not in classes and set(BUILTINS) <= set(classes)
    assert "'xpu-broken' failed to load: xpu driver missing" in caplog.text


def test_entry_point_cannot_replace_a_builtin_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    install_entry_points(monkeypatch, entry_point("cpu", lambda: XpuTestBackend))
    assert devices.backend_classes()["cpu"] is CpuBackend


# ---------------------------------------------------------------- NPU import rules

def test_importing_the_npu_module_does_not_import_torch_npu() -> None:
    # A clean interpreter, since this one may have torch_npu loaded (on Ascend). Autoload off
    # as in ci/env.sh, or `import torch` itself would load torch_npu through torch's hook.
    script = ("import sys, devices, devices.npu; devices.backend_classes(); "
              "assert 'torch_npu' not in sys.modules, 'torch_npu was imported'")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=300,
                            env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None,
                    reason="torch_npu is installed here")
def test_npu_backend_is_unavailable_without_torch_npu() -> None:
    assert NpuBackend.is_available() is False
    assert "npu" not in devices.available()


@pytest.mark.parametrize("error", [ImportError, OSError, RuntimeError],
                         ids=["not-installed", "cann-library-missing", "cann-init-failed"])
def test_npu_backend_is_unavailable_when_torch_npu_fails_to_import(
        monkeypatch: pytest.MonkeyPatch, error: type[Exception]) -> None:
    def import_module(name: str) -> None:
        raise error(f"cannot import {name}")

    monkeypatch.setattr(devices.npu, "importlib", SimpleNamespace(import_module=import_module))
    assert NpuBackend.is_available() is False


# ---------------------------------------------------------------- kernel-block rules

def block_table(unit: int, *, dcp_world_size: int = 1,
                dtype: torch.dtype = torch.int32) -> SimpleNamespace:
    """What the checks read of a runner's BlockTable: id unit, DCP size, CPU id table."""
    ids = torch.zeros(4, 8, dtype=dtype)
    return SimpleNamespace(block_size=unit, dcp_world_size=dcp_world_size,
                           get_cpu_tensor=lambda: ids)


def rules_of(cls: type[DeviceBackend]) -> DeviceBackend:
    """An instance that only answers check_block_table, built without __init__.

    This machine has no GPU, and Ascend hardware cannot exist on it; check_block_table reads
    no device state (no stream, no self-test), so this runs the real CUDA / NPU rules here.
    It is the sanctioned fake for both.
    """
    return object.__new__(cls)


def test_kernel_size_lists_accept_exact_sizes_and_multiples() -> None:
    assert MultipleOf(16).accepts(48) and not MultipleOf(16).accepts(24)
    assert not MultipleOf(16).accepts(0)
    assert accepts((16, MultipleOf(64)), 16) and accepts((16, MultipleOf(64)), 192)
    assert not accepts((16, MultipleOf(64)), 32)


@pytest.mark.parametrize(("unit", "block_size", "kernel", "attention_backend"), [
    (16, 32, 16, "FLASH_ATTN"),
    (16, 32, 16, "flash_attn"),
    (64, 64, None, "FLASHMLA"),
    (32, 64, 32, "FLASHINFER"),
    (16, 64, 16, None),
], ids=["flash-attn-16-in-32", "lower-case-name", "flashmla-unsplit-64",
        "flashinfer-32-in-64", "any-backend-16"])
def test_cuda_mirrors_kernel_blocks_that_divide_the_block_size(
        unit: int, block_size: int, kernel: int | None, attention_backend: str | None) -> None:
    assert rules_of(CudaBackend).check_block_table(block_table(unit), block_size, kernel,
                                                   attention_backend) is None


@pytest.mark.parametrize(("unit", "block_size", "kernel", "attention_backend", "reason"), [
    (32, 32, 64, "FLASHMLA", "kernel block size 64 does not divide block_size 32"),
    (48, 96, 48, "FLASHINFER", "FLASHINFER does not use kernel block size 48"),
    (16, 32, 16, "NOT_A_BACKEND", "unknown CUDA attention backend 'NOT_A_BACKEND'"),
    (24, 48, None, None, "no CUDA attention backend uses kernel block size 24"),
    (32, 48, None, None, "block table unit 32 does not divide block_size 48"),
], ids=["flashmla-64-in-32", "flashinfer-48", "unknown-backend", "no-backend-uses-24",
        "unit-does-not-divide"])
def test_cuda_refuses_kernel_layouts_it_cannot_mirror(
        unit: int, block_size: int, kernel: int | None, attention_backend: str | None,
        reason: str) -> None:
    refusal = rules_of(CudaBackend).check_block_table(block_table(unit), block_size, kernel,
                                                      attention_backend)
    assert refusal is not None and reason in refusal


@pytest.mark.parametrize("cls", [CpuBackend, CudaBackend, NpuBackend],
                         ids=["cpu-rules", "cuda-rules", "npu-rules"])
@pytest.mark.parametrize("attr", ["dcp_world_size", "pcp_world_size"])
def test_context_parallel_tables_are_refused_on_every_device(cls: type[DeviceBackend],
                                                             attr: str) -> None:
    table = block_table(128)
    setattr(table, attr, 2)
    refusal = rules_of(cls).check_block_table(table, 128, 128, None)
    assert refusal is not None and f"{attr}=2" in refusal


@pytest.mark.parametrize(("unit", "block_size", "kernel", "attention_backend"), [
    (128, 128, 128, None), (128, 128, None, "ASCEND"), (128, 256, 128, "ASCEND_MLA"),
], ids=["128", "ascend-unsplit-128", "mla-128-in-256"])
def test_npu_mirrors_128_token_kernel_blocks(unit: int, block_size: int, kernel: int | None,
                                             attention_backend: str | None) -> None:
    assert rules_of(NpuBackend).check_block_table(block_table(unit), block_size, kernel,
                                                  attention_backend) is None


def test_npu_refuses_blocks_smaller_than_its_128_token_kernels() -> None:
    refusal = rules_of(NpuBackend).check_block_table(block_table(64), 64, None)
    assert refusal is not None
    assert "no Ascend attention backend uses kernel block size 64" in refusal


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_npu_accepts_integer_block_tables(dtype: torch.dtype) -> None:
    assert rules_of(NpuBackend).check_block_table(block_table(128, dtype=dtype), 128, None) is None


def test_npu_refuses_a_non_integer_block_table() -> None:
    refusal = rules_of(NpuBackend).check_block_table(block_table(128, dtype=torch.float32), 128,
                                                     None)
    assert refusal is not None and "not an integer id table" in refusal


# ---------------------------------------------------------------- on the hardware

@pytest.mark.npu
def test_npu_backend_round_trips_rows_through_pinned_staging() -> None:
    with closing(devices.get_backend("npu")) as backend:
        assert backend.needs_staging and not backend.zero_copy
        with (closing(backend.alloc_host((32, 64), torch.bfloat16)) as pool,
              closing(backend.alloc_host((8, 64), torch.bfloat16)) as staging):
            rows = torch.randn(8, 64).to(torch.bfloat16).to(backend.device)
            slots = torch.randperm(32)[:8]
            transfer = backend.scatter_rows(rows, slots, pool, ready=backend.record_event(),
                                            staging=staging.tensor)
            devices.wait_event(transfer.event, 10, lambda: "npu scatter")
            transfer.finish()
            assert torch.equal(pool.tensor[slots], rows.cpu())


@pytest.mark.cuda
def test_cuda_self_test_enables_the_zero_copy_kernel_on_a_unified_addressing_gpu() -> None:
    with closing(devices.get_backend("cuda")) as backend:
        assert backend.zero_copy, "self-test fell back to staged copies"
        assert backend.use_kernel, "triton missing: the full-grid index_copy_ fallback is used"


@pytest.mark.cuda
def test_cuda_falls_back_to_staged_copies_when_the_self_test_fails(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("mapping refused")

    monkeypatch.setattr(CudaBackend, "_scatter_mapped", refuse)
    with (caplog.at_level(logging.WARNING, logger="prefix_cache.devices.cuda"),
          closing(CudaBackend()) as backend):
        assert not backend.zero_copy and backend.needs_staging
    assert "mapping refused" in caplog.text


@pytest.mark.cuda
def test_cuda_events_and_in_stream_writes_follow_the_callers_current_stream() -> None:
    """The backend keeps one Stream object per raw stream handle: every event must still be
    recorded on the stream current at that call, on streams made after the first lookup too,
    and a copy-stream write must leave the caller's stream current."""
    with closing(devices.get_backend("cuda")) as backend, \
            closing(backend.alloc_host((64, 32), torch.float32)) as pool:
        warm = torch.zeros((4, 32), device="cuda")  # first launches compile: not behind a sleep
        backend.scatter_rows(warm, torch.arange(4).cuda(), pool, ready=None, staging=None,
                             in_stream=True)
        backend.scatter_rows(warm, torch.arange(4), pool, ready=backend.record_event(),
                             staging=None).event.synchronize()
        for turn in range(3):
            side = torch.cuda.Stream()
            rows = torch.full((4, 32), float(turn), device="cuda")
            slots = torch.arange(4 * turn, 4 * turn + 4)
            device_slots = slots.cuda()  # a copy from pageable memory behind the sleep would wait
            side.wait_stream(torch.cuda.current_stream())  # `rows` and `device_slots` are written
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000_000)  # ~0.1 s, on `side` only
                ready = backend.record_event()
                written = backend.scatter_rows(rows, device_slots, pool, ready=None,
                                               staging=None, in_stream=True)
                copied = backend.scatter_rows(rows, slots + 32, pool, ready=ready, staging=None)
                assert torch.cuda.current_stream() == side
            idle = backend.record_event()  # the default stream: nothing queued on it
            idle.synchronize()
            assert not (ready.query() or written.event.query() or copied.event.query()), turn
            for transfer in (written, copied):
                transfer.event.synchronize()
                if transfer.finish is not None:
                    transfer.finish()
            assert torch.equal(pool.tensor[slots], rows.cpu())
            assert torch.equal(pool.tensor[slots + 32], rows.cpu())


@pytest.mark.cuda
def test_cuda_done_events_follow_their_stream_and_return_to_the_pool_when_dropped() -> None:
    """A done event completes with the work before it on the stream it was recorded on (a side
    stream behind a sleep, not the default stream), and its CUDA event is reused once dropped;
    more events held at once than the pool made grow it."""
    from prefix_cache.devices.cuda.events import GROW, DoneEvents

    events = DoneEvents(torch.device("cuda", torch.cuda.current_device()))
    assert events.counts == (GROW, GROW)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s, on `side` only
        behind = events.record(side.cuda_stream)
    idle = events.record(torch.cuda.current_stream().cuda_stream)
    idle.synchronize()
    assert idle.query() and not behind.query()
    behind.synchronize()
    assert behind.query()
    del idle, behind
    assert events.counts == (GROW, GROW)
    held = [events.record(side.cuda_stream) for _ in range(GROW + 3)]  # more than were made
    assert events.counts == (2 * GROW - len(held), 2 * GROW)
    held[-1].synchronize()
    assert all(e.query() for e in held)
    held.clear()
    assert events.counts == (2 * GROW, 2 * GROW)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("offset", [0, 2, 4, 6], ids=lambda o: f"rows+{o}B")
def test_cuda_kernel_scatter_moves_rows_of_any_alignment_through_its_direct_launch(
        dtype: torch.dtype, offset: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows whose address allows narrower words than the pool's (a slice of a larger buffer)
    are moved in the widest words both allow, by the first launch (which compiles) and by the
    cuLaunchKernel launches after it, from int32 and int64 device slot mappings."""
    width = 24  # 48 bytes of bf16: every word width divides the rows
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if offset % itemsize:
        pytest.skip("the offset splits an element")
    with closing(devices.get_backend("cuda")) as backend, \
            closing(backend.alloc_host((64, width), dtype)) as pool:
        assert backend.use_kernel
        raw = torch.zeros(8 * width * itemsize + 64, dtype=torch.uint8, device="cuda")
        compiled = scatter._launcher._compiled
        for turn in range(4):  # compile, then cuLaunchKernel alone: Triton's launcher refuses
            if turn == 1:
                assert compiled and all(kernel is not None for _, kernel in compiled.values())
                for key, (_, kernel) in list(compiled.items()):
                    monkeypatch.setitem(compiled, key, (_NoTritonLaunch(), kernel))
            for slot_dtype in (torch.int64, torch.int32):
                rows = raw[offset: offset + 8 * width * itemsize].view(dtype).view(8, width)
                rows.copy_((torch.arange(8 * width, device="cuda") % 97 + turn)
                           .view(8, width).to(dtype))
                slots = torch.randperm(64)[:8]
                backend.scatter_rows(rows, slots.to("cuda", slot_dtype), pool, ready=None,
                                     staging=None, in_stream=True).event.synchronize()
                assert torch.equal(pool.tensor[slots], rows.cpu()), (turn, slot_dtype)


class _NoTritonLaunch:
    """Stands in for a compiled Triton kernel that must not be launched by Triton's launcher."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"Triton's launcher was used ({name}), not cuLaunchKernel")


# ---------------------------------------------------------------- slots outside the pool (issue 21)

def _guarded_pool(backend: CudaBackend, num_slots: int, width: int,
                  guard: int) -> tuple[HostBuffer, HostBuffer]:
    """A mapped pool of `num_slots` rows inside one registered buffer with `guard` rows of -7
    before and after it: a write outside the pool would land in a guard, not in memory the
    process does not own."""
    outer = backend.alloc_host((num_slots + 2 * guard, width), torch.float32)
    assert outer.device_view is not None, "host registration fell back to plain pinning"
    outer.tensor.fill_(-7.0)
    pool = HostBuffer(outer.tensor[guard:guard + num_slots], pinned=True)
    pool.device_view = outer.device_view[guard:guard + num_slots]
    return outer, pool


@pytest.mark.cuda
@pytest.mark.parametrize("slots_on", ["host", "device-int32"])
@pytest.mark.parametrize("use_kernel", [True, False], ids=["triton", "index-copy"])
def test_cuda_scatter_refuses_slots_outside_the_pool_and_its_landing_names_the_step(
        slots_on: str, use_kernel: bool) -> None:
    """Slots -1, num_slots and num_slots + 5: no byte outside the pool changes, the other rows
    land, the write's landing fails naming its step and the problem, and the scatters after
    it (their pages' flag cells zeroed again) land clean."""
    num_slots, width, guard = 32, 64, 4
    slots = [3, -1, 9, num_slots + 5, 31, 12, num_slots, 20]
    bad = [1, 3, 6]
    good = [i for i in range(len(slots)) if i not in bad]
    with closing(devices.get_backend("cuda")) as backend:
        assert backend.zero_copy
        if use_kernel and not backend.use_kernel:
            pytest.skip("triton is not installed")
        backend.use_kernel = use_kernel
        outer, pool = _guarded_pool(backend, num_slots, width, guard)
        committer = Committer(10.0, lambda task: None, backend.bind_thread)
        try:
            rows = torch.arange(len(slots) * width, dtype=torch.float32,
                                device=backend.device).view(len(slots), width) + 1

            def scatter(rows: torch.Tensor, slots: list[int]) -> Transfer:
                if slots_on == "host":
                    return backend.scatter_rows(rows, torch.tensor(slots), pool,
                                                ready=backend.record_event(), staging=None)
                mapping = torch.tensor(slots + [-1, -1, 5], dtype=torch.int32)  # longer than n
                return backend.scatter_rows(rows, mapping.to(backend.device), pool, ready=None,
                                            staging=None, in_stream=True)

            transfer = scatter(rows, slots)
            transfer.event.synchronize()
            host_rows = rows.cpu()
            assert (outer.tensor[:guard] == -7).all() and (outer.tensor[-guard:] == -7).all()
            assert torch.equal(pool.tensor[[slots[i] for i in good]], host_rows[good])
            # the fallback sends refused rows to slot 0 (vLLM's null block), the kernel nowhere
            untouched = [s for s in range(1 if not use_kernel else 0, num_slots)
                         if s not in slots]
            assert (pool.tensor[untouched] == -7).all()

            task = WriteTask(1, "step 12", transfers=[transfer])
            task.transition(TaskState.QUEUED)
            committer.submit(task)
            with pytest.raises(OmniPrefixCacheError,
                               match=r"write task 1 \(step 12, state FAILED\) failed: cuda "
                                     r"scatter: 3 of 8 rows had a slot out of range, outside "
                                     r"\[0, 32\)"):
                task.wait(10.0)
            assert isinstance(task.error, SlotRangeError)

            for turn in range(20):  # more launches than the backend has slot pages
                clean = scatter(rows[:4] + turn, [2, 4, 6, 8])
                clean.event.synchronize()
                clean.verify()
            assert torch.equal(pool.tensor[[2, 4, 6, 8]], host_rows[:4] + 19)
            assert (outer.tensor[:guard] == -7).all() and (outer.tensor[-guard:] == -7).all()
        finally:
            committer.close(10.0)
            torch.cuda.synchronize()
            outer.close()


@pytest.mark.cuda
def test_cuda_slot_check_mode_refuses_a_scatter_before_it_launches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHECK_SLOTS_ENV, "1")
    with closing(CudaBackend()) as backend:
        assert backend.zero_copy and backend.check_slots
        outer, pool = _guarded_pool(backend, 16, 8, 2)
        try:
            rows = torch.ones(3, 8, device=backend.device)
            mapping = torch.tensor([1, 16, 2, 99], dtype=torch.int32, device=backend.device)
            with pytest.raises(SlotRangeError, match=r"1 of 3 rows had a slot out of range, "
                                                     r"outside \[0, 16\) \(first: row 1, "
                                                     r"slot 16\)"):
                backend.scatter_rows(rows, mapping, pool, ready=None, staging=None,
                                     in_stream=True)
            torch.cuda.synchronize()
            assert (outer.tensor == -7).all()  # nothing launched
            written = backend.scatter_rows(rows[:2], mapping[[0, 2]], pool, ready=None,
                                           staging=None, in_stream=True)
            written.event.synchronize()
            written.verify()
            assert (pool.tensor[[1, 2]] == 1).all()
        finally:
            torch.cuda.synchronize()
            outer.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e5m2, torch.float32, torch.int64])
def test_host_bytes_is_a_tensors_memory_and_keeps_it(dtype: torch.dtype) -> None:
    rows = torch.arange(24).reshape(4, 6).to(dtype)
    expected = rows[1:3].contiguous().view(torch.uint8).reshape(-1).numpy().copy()
    part = rows[1:3]
    view = host_bytes(part)
    part.set_(torch.zeros(2, 6, dtype=dtype))  # its memory, not the tensor's: held all the same
    del rows, part
    assert view.dtype == np.uint8 and view.tolist() == expected.tolist()
    part = torch.ones(3, 2, dtype=dtype)
    host_bytes(part)[:] = 0  # the tensor's own memory, not a copy
    assert not part.view(torch.uint8).any()
    assert host_bytes(torch.empty(0, 6, dtype=dtype)).size == 0
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        host_bytes(torch.zeros(4, 6, dtype=dtype).t())
    with pytest.raises(ValueError, match="contiguous CPU tensor, got one on meta"):
        host_bytes(torch.empty(4, 6, dtype=dtype, device="meta"))
