"""A small-grid Triton kernel that writes device rows straight into slots of a mapped host pool.

A full grid (torch `index_copy_` on the mapped view) stalls enough SMs on PCIe
writes to slow a concurrent GEMM loop by 8-14%, so the grid is fixed and small.
Measured on an H200 (2048-wide bf16 rows into random 16-row blocks, 4 saves in
flight, `benchmarks/scatter_sweep.py`): one row per program
iteration reaches 0.53-0.57 of a contiguous pinned D2H; four rows per
iteration with 8 warps 0.70 (2048 rows) and 0.77 (8192 rows), at a GEMM-loop
cost of ~1.04x; more programs or rows did not pay.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

SCATTER_CTAS = 16
SCATTER_WARPS = 8
SCATTER_ROWS = 4  # rows each program moves per iteration (more stores in flight per program)
_BLOCK = 512  # elements of the row's widest integer view moved per inner iteration


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_rows", "row_elems"])
    def scatter_rows_kernel(src_ptr, dst_ptr, slot_ptr, n_rows, row_elems,
                            BLOCK: tl.constexpr, ROWS: tl.constexpr):
        # each program moves ROWS rows per iteration, so that many stores are in flight
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        cols = tl.arange(0, BLOCK)
        lanes = tl.arange(0, ROWS)
        for first in range(pid * ROWS, n_rows, nprog * ROWS):
            rows = first + lanes
            live = rows < n_rows
            slots = tl.load(slot_ptr + rows, mask=live, other=0)
            src_rows = src_ptr + rows.to(tl.int64)[:, None] * row_elems
            dst_rows = dst_ptr + slots.to(tl.int64)[:, None] * row_elems  # int32 mappings too
            for start in range(0, row_elems, BLOCK):
                offs = (start + cols)[None, :]
                mask = live[:, None] & (offs < row_elems)
                tl.store(dst_rows + offs, tl.load(src_rows + offs, mask=mask), mask=mask)

    return scatter_rows_kernel


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def as_words(t: torch.Tensor) -> torch.Tensor:
    """`t` ([n, F], contiguous) viewed as the widest integer type its rows and address allow."""
    row_bytes = t.shape[1] * t.element_size()
    address = t.data_ptr()
    for dtype in (torch.int64, torch.int32, torch.int16):
        if row_bytes % dtype.itemsize == 0 and address % dtype.itemsize == 0:
            return t.view(torch.uint8).view(dtype)
    return t.view(torch.uint8)


class _Launcher:
    """The scatter kernel's compiled launcher, called directly once a signature was compiled.

    `kernel[grid](...)` re-binds its arguments and re-computes Triton's cache key
    on every call (about 15 µs of a 20 µs launch on an H200 host). A compiled
    kernel depends on the argument dtypes and on each pointer's 16-byte
    alignment, so those form the key here; the launch itself passes what
    Triton's own passes (launch metadata and hooks, so profilers still see it).
    A Triton without that launcher keeps the plain path.
    """

    def __init__(self) -> None:
        self._compiled: dict[tuple[Any, ...], Any] = {}
        self._knobs: Any = None
        try:
            from triton import knobs
            self._knobs = knobs.runtime
        except ImportError:  # a Triton before knobs: the plain path
            pass

    def __call__(self, src: torch.Tensor, dst: torch.Tensor, slots: torch.Tensor, n: int,
                 grid: int) -> None:
        args = (src, dst, slots, n, src.shape[1], _BLOCK, SCATTER_ROWS)
        key = (src.dtype, dst.dtype, slots.dtype, src.data_ptr() % 16 == 0,
               dst.data_ptr() % 16 == 0, slots.data_ptr() % 16 == 0)
        compiled = self._compiled.get(key) if self._knobs is not None else None
        if compiled is None:
            compiled = _kernel()[(grid,)](*args[:5], BLOCK=_BLOCK, ROWS=SCATTER_ROWS,
                                          num_warps=SCATTER_WARPS)
            if all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata",
                                                   "launch_metadata")):
                self._compiled[key] = compiled
            return
        stream = torch._C._cuda_getCurrentRawStream(src.device.index)  # as Triton's launch
        try:
            compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata,
                         compiled.launch_metadata((grid, 1, 1), stream, *args),
                         self._knobs.launch_enter_hook, self._knobs.launch_exit_hook, *args)
        except TypeError as exc:  # another Triton's launcher signature: the plain path only
            logger.warning("direct Triton launch unavailable (%s); using kernel[grid]", exc)
            self._knobs = None
            self(src, dst, slots, n, grid)


_launch = _Launcher()


def scatter_rows(rows: torch.Tensor, device_slots: torch.Tensor, pool_view: torch.Tensor,
                 pool_words: torch.Tensor) -> None:
    """`pool_view[device_slots[i]] = rows[i]` on the current stream with SCATTER_CTAS programs;
    `pool_words` is `as_words(pool_view)`, which the caller keeps per pool."""
    n = rows.shape[0]
    if n == 0:
        return
    rows = rows.contiguous()
    src = as_words(rows)
    dst = pool_words
    if src.dtype != dst.dtype:  # pool and rows aligned differently: move bytes
        src, dst = rows.view(torch.uint8), pool_view.view(torch.uint8)
    _launch(src, dst, device_slots, n, min(SCATTER_CTAS, -(-n // SCATTER_ROWS)))
