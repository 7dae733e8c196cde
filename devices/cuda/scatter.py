"""A small-grid Triton kernel that writes device rows straight into slots of a mapped host pool.

Measured on an H200 (rows of 2048 bf16 into random 16-row blocks): 8-16 CTAs
reach 0.88-0.91 of a contiguous pinned D2H and leave a concurrent GEMM loop
untouched, while a full grid (torch `index_copy_`) stalls enough SMs on PCIe
writes to slow that loop by 8-17%. So the grid is fixed and small.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

SCATTER_CTAS = 16
_BLOCK = 512  # elements of the row's widest integer view moved per inner iteration


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_rows", "row_elems"])
    def scatter_rows_kernel(src_ptr, dst_ptr, slot_ptr, n_rows, row_elems,
                            BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        cols = tl.arange(0, BLOCK)
        for row in range(pid, n_rows, nprog):
            slot = tl.load(slot_ptr + row)
            src_row = src_ptr + row.to(tl.int64) * row_elems
            dst_row = dst_ptr + slot * row_elems
            for start in range(0, row_elems, BLOCK):
                offs = start + cols
                mask = offs < row_elems
                tl.store(dst_row + offs, tl.load(src_row + offs, mask=mask), mask=mask)

    return scatter_rows_kernel


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """`t` ([n, F], contiguous) viewed as the widest integer type its rows and address allow."""
    row_bytes = t.shape[1] * t.element_size()
    for dtype in (torch.int64, torch.int32, torch.int16):
        width = torch.empty((), dtype=dtype).element_size()
        if row_bytes % width == 0 and t.data_ptr() % width == 0:
            return t.view(torch.uint8).view(dtype)
    return t.view(torch.uint8)


def scatter_rows(rows: torch.Tensor, device_slots: torch.Tensor, pool_view: torch.Tensor) -> None:
    """`pool_view[device_slots[i]] = rows[i]` on the current stream with SCATTER_CTAS programs."""
    n = rows.shape[0]
    if n == 0:
        return
    src = _as_words(rows.contiguous())
    dst = _as_words(pool_view)
    if src.dtype != dst.dtype:  # pool and rows aligned differently: move bytes
        src, dst = rows.contiguous().view(torch.uint8), pool_view.view(torch.uint8)
    grid = (min(SCATTER_CTAS, n),)
    _kernel()[grid](src, dst, device_slots, n, src.shape[1], BLOCK=_BLOCK, num_warps=4)
