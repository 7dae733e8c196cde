"""NVIDIA GPUs: exact-size mapped pinned pools and a small-grid scatter kernel into them.

A step's rows cross PCIe once, from the device clone straight into their pool
slots, on the copy stream after the forward. If mapping host memory is not
available (no unified addressing, a driver refusal, no Triton and no mapped
view), a start-up self-test falls back to the staged path shared with NPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from prefix_cache.devices.accelerator import AcceleratorBackend
from prefix_cache.devices.base import DeviceEvent, HostBuffer, Transfer
from prefix_cache.devices.cuda import scatter
from prefix_cache.devices.cuda.host_memory import register_host
from prefix_cache.devices.cuda.slot_pages import SlotPages
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

    def __init__(self, device_index: int | None = None, *, zero_copy: bool = True) -> None:
        super().__init__(device_index)
        self.use_kernel = scatter.triton_available()
        self._slot_pages: SlotPages | None = None
        self.zero_copy = zero_copy and self._self_test()
        if not self.zero_copy and self._slot_pages is not None:
            self._slot_pages.close()
            self._slot_pages = None
        self.device_slots = self.zero_copy

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
                    for part, slots in ((rows[:2], [5, 2]), (rows[2:], [1, 6])):
                        transfer = self._scatter_mapped(
                            part, torch.tensor(slots), pool, ready=self.record_event(),
                            in_stream=False)
                    transfer.event.synchronize()
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
        try:
            return register_host(shape, dtype, self.device)
        except RuntimeError as exc:  # no mapping: the staged path only needs pinned pages
            logger.warning("cudaHostRegister refused (%s); pinning through torch", exc)
            return super().alloc_host(shape, dtype)

    def scatter_rows(self, rows: torch.Tensor, slots: torch.Tensor, pool: HostBuffer, *,
                     ready: DeviceEvent | None, staging: torch.Tensor | None,
                     in_stream: bool = False) -> Transfer:
        if self.zero_copy and pool.device_view is not None:
            return self._scatter_mapped(rows, slots, pool, ready=ready, in_stream=in_stream)
        return super().scatter_rows(rows, slots, pool, ready=ready, staging=staging,
                                    in_stream=in_stream)

    def _scatter_mapped(self, rows: torch.Tensor, slots: torch.Tensor, pool: HostBuffer, *,
                        ready: DeviceEvent | None, in_stream: bool) -> Transfer:
        if rows.dtype != pool.tensor.dtype:
            raise TypeError(f"rows are {rows.dtype}, the pool holds {pool.tensor.dtype}")
        if self._slot_pages is None:
            raise RuntimeError("cuda backend: scatter_rows after close()")
        if slots.device.type == "cpu":
            page, device_slots = self._slot_pages.take(slots)
        elif in_stream:  # the runner's slot mapping, read in stream order
            page, device_slots = None, slots
        else:
            raise ValueError("cuda backend: device slots are read in stream order only")
        with self._issue_scope(ready, in_stream):
            if self.use_kernel:
                if pool.device_words is None:  # once per pool
                    pool.device_words = scatter.as_words(pool.device_view)
                scatter.scatter_rows(rows, device_slots, pool.device_view, pool.device_words)
            else:
                pool.device_view.index_copy_(0, device_slots[: rows.shape[0]].long(), rows)
            done = self._record_done(in_stream)
        if page is not None:
            self._slot_pages.release_after(page, done)
        return Transfer(event=done, keepalive=(rows,))

    def close(self) -> None:
        if self._slot_pages is None:
            return
        # no copy may still read a page being unregistered: a copy that never ends keeps them
        if not self.drain(CLOSE_DRAIN_TIMEOUT_S):
            logger.error("cuda backend: copies still running after %.0fs; slot pages kept "
                         "registered", CLOSE_DRAIN_TIMEOUT_S)
            return
        self._slot_pages.close()
        self._slot_pages = None

    def check_block_table(self, table: Any, block_size: int, kernel_block_size: int | None,
                          attention_backend: str | None = None) -> str | None:
        reason = super().check_block_table(table, block_size, kernel_block_size)
        if reason is not None:
            return reason
        kernel = kernel_block_size if kernel_block_size is not None else int(table.block_size)
        return check_kernel_block(CUDA_KERNEL_BLOCK_SIZES, "CUDA", kernel, block_size,
                                  attention_backend)
