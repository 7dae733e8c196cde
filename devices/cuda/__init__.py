"""NVIDIA GPUs: exact-size mapped pinned pools, written by the copy engine or a small-grid
scatter kernel.

A step's rows cross PCIe once, straight into their pool slots. A save of a key of at least
1 MiB (`dma.DMA_MIN_BYTES`: prefill) is one `cudaMemcpyBatchAsync` of its slot runs on the
copy stream, issued off the engine thread (`dma`); a smaller one (decode) is the Triton
scatter kernel, which reads the rows in place. While a DMA save may still be writing, every
later save goes by DMA too, so copies into one slot land in save order. If mapping host
memory is not available (no unified addressing, a driver refusal, no Triton and no mapped
view), a start-up self-test falls back to the staged path shared with NPU.

No shape is trusted either: a save whose rows are not the pool's rows (another row shape), or
whose slots are not one a row (a device slot mapping may be longer), raises ValueError before
anything is launched or queued; rows past their slots would otherwise land in slots a page
kept from an earlier launch (kernel) or be dropped while the write lands clean (DMA), and rows
of another width run past their slots and the pool's end. A save of no bytes (no rows, or a
key of zero width) writes nothing: it returns complete, and waits for no copy before it.

No slot is trusted. A DMA save checks its host slots before it queues anything and raises
IndexError naming the first outside the pool. The kernel does not write a row whose slot
lies outside its pool (host memory outside the mapped pool is not the cache's), and the
write's landing fails its task with a `SlotRangeError` (`Transfer.verify`), read from the
launch's mapped flag cells without a device synchronization.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from prefix_cache.devices.accelerator import AcceleratorBackend
from prefix_cache.devices.base import (CHECK_SLOTS_ENV, DeviceEvent, HostBuffer, Transfer,
                                       slot_checks_on)
from prefix_cache.devices.cuda import scatter
from prefix_cache.devices.cuda.dma import DmaDone, RunCopier, dma_enabled, dma_min_bytes
from prefix_cache.devices.cuda.events import DoneEvents
from prefix_cache.devices.cuda.host_memory import register_host
from prefix_cache.devices.cuda.slot_pages import (SlotLease, SlotPages, count_out_of_range,
                                                  out_of_range_error)
from prefix_cache.devices.kernel_blocks import CUDA_KERNEL_BLOCK_SIZES, check_kernel_block

logger = logging.getLogger(__name__)

#: How long `close()` waits for the copy stream before it leaves its pages registered.
CLOSE_DRAIN_TIMEOUT_S = 30.0


class CudaBackend(AcceleratorBackend):
    """torch.cuda streams and events; zero-copy scatter when the self-test passes."""

    name = "cuda"

    @classmethod
    def is_available(cls) -> bool:
        # vllm-ascend rebinds torch.cuda names to torch.npu: ask for a CUDA build too.
        return torch.version.cuda is not None and torch.cuda.is_available()

    @classmethod
    def missing(cls) -> str:
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is not a CUDA build"
        return "torch sees no NVIDIA GPU (torch.cuda.is_available() is False)"

    def __init__(self, device_index: int | None = None, *, zero_copy: bool = True) -> None:
        super().__init__(device_index)
        self.use_kernel = scatter.triton_available()
        #: check each scatter's slots on the host before it launches (debugging: syncs)
        self.check_slots = slot_checks_on()
        self._done_events = self._start_done_events()
        self._copy_stream_handle: int = self.copy_stream.cuda_stream
        self._slot_pages: SlotPages | None = None
        self.zero_copy = zero_copy and self._self_test()
        if not self.zero_copy and self._slot_pages is not None:
            self._slot_pages.close()
            self._slot_pages = None
        self.device_slots = self.zero_copy
        #: saves of a key at least this large go by DMA (tests lower it to send every save)
        self.dma_min_bytes = dma_min_bytes()
        self._dma = self._start_dma() if self.zero_copy else None  # serves mapped pools only

    def dma_takes(self, nbytes: int) -> bool:
        """Whether a save of `nbytes` of one key into a mapped pool goes by copy engine (the
        path is on and passed its self-test, and the save is at least `dma_min_bytes`)."""
        return self._dma is not None and nbytes >= self.dma_min_bytes

    def _start_done_events(self) -> DoneEvents | None:
        """Recycled done events, unless the loaded CUDA runtime cannot be found (torch's then)."""
        try:
            return DoneEvents(self.device)
        except (RuntimeError, OSError, AttributeError) as exc:
            logger.warning("recycled CUDA events unavailable (%s); using torch's", exc)
            return None

    def _record_blocking(self, in_stream: bool) -> DeviceEvent:
        if self._done_events is None:
            return super()._record_blocking(in_stream)
        return self._done_events.record(self._raw_current_stream() if in_stream
                                        else self._copy_stream_handle)

    def _start_dma(self) -> RunCopier | None:
        """The copy-engine path, unless turned off or the runtime has no batch copies."""
        if not dma_enabled():
            return None
        copier = None
        try:
            copier = RunCopier(self.device.index, self.copy_stream)
            pool = register_host((8, 4), torch.float32, self.device)
            try:  # rows into scattered slots, read back
                pool.tensor.zero_()
                rows = torch.arange(16, device=self.device, dtype=torch.float32).view(4, 4)
                done = copier.submit(rows, np.array([5, 2, 1, 6]), pool, None,
                                     self._raw_current_stream())
                done.synchronize()
                _dma_failed(done)
                if not torch.equal(pool.tensor[[5, 2, 1, 6]], rows.cpu()):
                    raise RuntimeError("rows read back differ from rows written")
            finally:
                pool.close()
        except (RuntimeError, OSError) as exc:
            logger.warning("CUDA copy-engine saves unavailable (%s); using the scatter kernel",
                           exc)
            if copier is not None:
                copier.close()
            return None
        return copier

    def _self_test(self) -> bool:
        """Scatter rows of each word width into a mapped buffer, through the first launch and
        through the compiled launcher the later ones take, and read them back."""
        try:
            self._slot_pages = SlotPages(self.device)
            for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.uint8):
                pool = register_host((8, 4), dtype, self.device)
                try:
                    pool.tensor.zero_()
                    rows = torch.arange(16, device=self.device).to(dtype).view(4, 4)
                    transfers = [
                        self._scatter_mapped(part, torch.tensor(slots), pool,
                                             ready=self.record_event(), in_stream=False)
                        for part, slots in ((rows[:2], [5, 2]), (rows[2:], [1, 6]))]
                    transfers[-1].event.synchronize()  # the copy stream's last: both are done
                    for transfer in transfers:
                        transfer.verify()  # the flag cells read back as zero
                    if not torch.equal(pool.tensor[[5, 2, 1, 6]], rows.cpu()):
                        raise RuntimeError("rows read back differ from rows written")
                finally:
                    pool.close()
        except Exception as exc:  # any failure means: use the staged path
            logger.warning("CUDA zero-copy scatter unavailable (%s); using staged copies", exc)
            return False
        return True

    def _raw_current_stream(self) -> int:
        return torch._C._cuda_getCurrentRawStream(self.device.index)  # as Triton's launch

    def alloc_host(self, shape: Sequence[int], dtype: torch.dtype) -> HostBuffer:
        """Page-locked host memory the device maps; where the mapping is refused (a memlock
        limit, say), memory pinned through torch, and every save from then on takes the
        staged path with host slots (a pool without a mapping cannot be written on the
        device, and one save path keeps the saves into a slot in order)."""
        try:
            return register_host(shape, dtype, self.device)
        except RuntimeError as exc:
            if self.zero_copy:
                logger.warning("cudaHostRegister refused a pool of %s %s (%d bytes: %s); "
                               "pinning through torch, and saves take staged copies from now "
                               "on (raise the memlock limit to keep zero-copy saves)",
                               tuple(shape), dtype, math.prod(shape) * dtype.itemsize, exc)
                self.zero_copy = self.device_slots = False
            return super().alloc_host(shape, dtype)

    def scatter_rows(self, rows: torch.Tensor, slots: torch.Tensor, pool: HostBuffer, *,
                     ready: DeviceEvent | None, staging: torch.Tensor | None,
                     in_stream: bool = False, host_slots: np.ndarray | None = None) -> Transfer:
        shape = rows.shape
        on_host = slots.is_cpu
        if on_host:
            host_slots = slots.numpy()
        _check_shapes(rows, shape, slots.shape[0], on_host, host_slots, pool)
        if 0 in shape:  # nothing to write: no copy to order it after, none to wait for
            return Transfer()
        mapped = self.zero_copy and pool.device_view is not None  # else staged
        # DMA into mapped pools only: a staged write lands on the host later, and a DMA save
        # into one of its slots could land first
        if self._dma is not None and host_slots is not None and mapped and (
                rows.nbytes >= self.dma_min_bytes or self._dma.pending()):
            return self._scatter_dma(rows, host_slots, pool, ready=ready, in_stream=in_stream)
        # device slots alone (no caller in the core), or the first save after mapping was
        # given up: neither may overtake a DMA save into its slots
        if self._dma is not None and self._dma.pending() and not self.drain(
                CLOSE_DRAIN_TIMEOUT_S):
            raise RuntimeError(f"cuda backend: a copy-engine save still running after "
                               f"{CLOSE_DRAIN_TIMEOUT_S:.0f}s")
        if mapped:
            return self._scatter_mapped(rows, slots, pool, ready=ready, in_stream=in_stream)
        return super().scatter_rows(rows, slots, pool, ready=ready, staging=staging,
                                    in_stream=in_stream)

    def _scatter_mapped(self, rows: torch.Tensor, slots: torch.Tensor, pool: HostBuffer, *,
                        ready: DeviceEvent | None, in_stream: bool) -> Transfer:
        if rows.dtype != pool.dtype:
            raise TypeError(f"rows are {rows.dtype}, the pool holds {pool.dtype}")
        pages = self._slot_pages
        if pages is None:
            raise RuntimeError("cuda backend: scatter_rows after close()")
        n, num_slots = rows.shape[0], pool.shape[0]  # the mapped view is the pool's rows
        host_slots = slots.is_cpu
        if not (host_slots or in_stream):
            raise ValueError("cuda backend: device slots are read in stream order only")
        if self.check_slots:
            self._check_slots(slots, n, num_slots)
        # CPU slots travel in the page; a device slot mapping is read in stream order, and the
        # page is then held for its flag cells alone
        lease = pages.take(slots if host_slots else None)
        device_slots = lease.slots if host_slots else slots
        try:
            with self._issue_scope(ready, in_stream):
                if self.use_kernel:
                    scatter.scatter_rows(rows, device_slots, pool.device_view, lease.flags)
                else:
                    scatter.index_copy_rows(rows, device_slots, pool.device_view, lease.flags)
                done = self._record_done(in_stream)
        except BaseException:
            pages.abandon(lease)  # the launch may still read it: never reused
            raise
        pages.release_after(lease, done)
        return Transfer(event=done, keepalive=(rows,),
                        verify=self._verifier(lease, n, num_slots, slots if host_slots else None))

    def _scatter_dma(self, rows: torch.Tensor, slots: np.ndarray, pool: HostBuffer, *,
                     ready: DeviceEvent | None, in_stream: bool) -> Transfer:
        """The rows' copy into their slots by the copy engine, from a private copy where the
        caller's stream may overwrite them (`in_stream`) or they are strided."""
        if rows.dtype != pool.dtype:
            raise TypeError(f"rows are {rows.dtype}, the pool holds {pool.dtype}")
        if in_stream or not rows.is_contiguous():  # copied on the caller's stream: the copy
            rows = rows.clone(memory_format=torch.contiguous_format)  # engine waits for it
            ready = None
        done = self._dma.submit(rows, np.ascontiguousarray(slots, dtype=np.int64), pool, ready,
                                self._raw_current_stream())
        return Transfer(event=done, keepalive=(rows, ready), verify=lambda: _dma_failed(done))

    def _verifier(self, lease: SlotLease, n: int, num_slots: int,
                  host_slots: torch.Tensor | None) -> Callable[[], None]:
        """The landing's check of a launch: raise if it refused rows (read from its flag cells,
        in host memory: no device synchronization)."""
        pages = self._slot_pages

        def verify() -> None:
            refused = pages.refused(lease)
            if refused:
                raise out_of_range_error(
                    "cuda scatter", refused, n, num_slots,
                    None if host_slots is None else host_slots.numpy())

        return verify

    @staticmethod
    def _check_slots(slots: torch.Tensor, n: int, num_slots: int) -> None:
        """Debug mode: refuse the scatter before it launches if a slot is outside the pool."""
        host = slots[:n].cpu().numpy()  # a device mapping: a synchronization (debugging only)
        refused = count_out_of_range(host, num_slots)
        if refused:
            raise out_of_range_error(f"cuda scatter ({CHECK_SLOTS_ENV}=1)", refused, n,
                                     num_slots, host)

    def stats(self) -> dict[str, int]:
        """`dma_jobs`: saves issued to the copy engine (the rest took the kernel)."""
        return {"dma_jobs": 0 if self._dma is None else self._dma.submitted}

    def drain(self, timeout_s: float) -> bool:
        if self._dma is not None and not self._dma.flush(timeout_s):
            return False  # a DMA save is still not issued on the copy stream
        return super().drain(timeout_s)

    def close(self) -> None:
        if self._slot_pages is None and self._dma is None:
            return
        # no copy may still read a page being unregistered: a copy that never ends keeps them
        if not self.drain(CLOSE_DRAIN_TIMEOUT_S):
            logger.error("cuda backend: copies still running after %.0fs; slot pages and the "
                         "copy-engine issuer kept", CLOSE_DRAIN_TIMEOUT_S)
            return
        if self._slot_pages is not None:
            self._slot_pages.close()
            self._slot_pages = None
        if self._dma is not None:
            self._dma.close()
            self._dma = None

    def check_block_table(self, table: Any, block_size: int, kernel_block_size: int | None,
                          attention_backend: str | None = None) -> str | None:
        reason = super().check_block_table(table, block_size, kernel_block_size)
        if reason is not None:
            return reason
        kernel = kernel_block_size if kernel_block_size is not None else int(table.block_size)
        return check_kernel_block(CUDA_KERNEL_BLOCK_SIZES, "CUDA", kernel, block_size,
                                  attention_backend)


def _check_shapes(rows: torch.Tensor, shape: torch.Size, num_given: int, on_host: bool,
                  host_slots: np.ndarray | None, pool: HostBuffer) -> None:
    """Refuse a save of `rows` (of `shape`) into `pool` unless they are the pool's rows and get
    one slot each from the `num_given` slots (on the host: exactly one a row; a device slot
    mapping may be longer) and from `host_slots`."""
    n = shape[0]
    slots_fit = num_given == n if on_host else num_given >= n
    given = n if host_slots is None else host_slots.shape[0]
    if slots_fit and given == n and shape[1:] == pool.shape[1:]:
        return
    raise ValueError(f"cuda scatter: {given if slots_fit else num_given} slots for {n} rows of "
                     f"{_row_type(shape, rows.dtype)}, into a pool of {pool.shape[0]} rows of "
                     f"{_row_type(pool.shape, pool.dtype)}; nothing was written")


def _row_type(shape: Sequence[int], dtype: torch.dtype) -> str:
    """A row's shape and element type: "2048 bfloat16", "4x2 float32"."""
    return f"{'x'.join(map(str, shape[1:])) or 1} {str(dtype).removeprefix('torch.')}"


def _dma_failed(done: DmaDone) -> None:
    """The landing's check of a DMA save: raise if a CUDA call of it failed."""
    error = done.error()
    if error is not None:
        raise RuntimeError(f"cuda DMA save: {error}; its rows were not written")
