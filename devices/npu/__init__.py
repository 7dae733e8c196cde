"""Ascend NPUs: torch.npu streams and events, pinned staging, DMA then host scatter.

Only what Ascend does differently lives here: AI cores cannot address host
memory, so rows always go by DMA into pinned staging and the committer scatters
them; vllm-ascend's tables are int32 with attention kernels of 128 tokens.
torch_npu is imported lazily: with torch_npu installed but no CANN runtime,
importing it fails, and this backend then reports itself unavailable.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from prefix_cache.devices.accelerator import AcceleratorBackend
from prefix_cache.devices.kernel_blocks import NPU_KERNEL_BLOCK_SIZES, check_kernel_block

logger = logging.getLogger(__name__)

#: Block size vllm-ascend forces when prefix caching or chunked prefill is on.
ASCEND_BLOCK_SIZE = 128


def load_torch_npu() -> Any | None:
    """Import torch_npu (registering torch.npu), or None where it or CANN is missing."""
    try:
        return importlib.import_module("torch_npu")
    except (ImportError, OSError, RuntimeError) as exc:
        logger.debug("torch_npu unavailable: %s", exc)
        return None


class NpuBackend(AcceleratorBackend):
    """torch.npu through the shared device-module path; always staged."""

    name = "npu"

    @classmethod
    def is_available(cls) -> bool:
        if load_torch_npu() is None:
            return False
        npu = getattr(torch, "npu", None)
        return bool(npu is not None and npu.is_available())

    @classmethod
    def missing(cls) -> str:
        if load_torch_npu() is None:
            return "torch_npu (with CANN) does not import"
        return "torch_npu sees no Ascend NPU (torch.npu.is_available() is False)"

    def check_block_table(self, table: Any, block_size: int, kernel_block_size: int | None,
                          attention_backend: str | None = None) -> str | None:
        """vllm-ascend's NPUInputBatch rules on top of the generic table checks.

        Its BlockTable holds int32 ids in units of `table.block_size` (the kernel
        size where it splits blocks) and Ascend attention kernels work on
        128-token blocks, so the allocator block size must be a multiple of 128.
        """
        reason = super().check_block_table(table, block_size, kernel_block_size)
        if reason is not None:
            return reason
        cpu_table = table.get_cpu_tensor() if hasattr(table, "get_cpu_tensor") else None
        if cpu_table is not None and cpu_table.dtype not in (torch.int32, torch.int64):
            return f"block table dtype {cpu_table.dtype} is not an integer id table"
        kernel = kernel_block_size if kernel_block_size is not None else int(table.block_size)
        return check_kernel_block(NPU_KERNEL_BLOCK_SIZES, "Ascend", kernel, block_size,
                                  attention_backend)
