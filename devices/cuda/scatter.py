"""A small-grid Triton kernel that writes device rows straight into slots of a mapped host pool.

A full grid (torch `index_copy_` on the mapped view) stalls enough SMs on PCIe
writes to slow a concurrent GEMM loop by 8-14%, so the grid is fixed and small.
Measured on an H200 (2048-wide bf16 rows into random 16-row blocks, 4 saves in
flight, `benchmarks/scatter_sweep.py` at a757c2f): one row per program
iteration reaches 0.53-0.57 of a contiguous pinned D2H; four rows per
iteration with 8 warps 0.70 (2048 rows) and 0.77 (8192 rows), at a GEMM-loop
cost of ~1.04x; more programs or rows did not pay.

The kernel trusts no slot: a row whose slot lies outside `[0, num_slots)` is not
written (a write there would land outside the mapped pool, in host memory the
cache does not own). Each program counts the rows it refused into its own cell
of the launch's flag cells (mapped host memory, `FLAG_CELLS` int64 cells that
the host zeroed), with a plain store: no atomics on host memory over PCIe. Once
the launch's event completed, the host sums the cells without a device sync.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from prefix_cache.devices.base import NULL_SLOT
from prefix_cache.devices.cuda import _launch
from prefix_cache.devices.cuda.libraries import function_addresses, loaded_driver

logger = logging.getLogger(__name__)

SCATTER_CTAS = 16
SCATTER_WARPS = 8
SCATTER_ROWS = 4  # rows each program moves per iteration (more stores in flight per program)
_BLOCK = 512  # elements of the row's widest integer view moved per inner iteration
#: int64 cells a launch's flag has: one per program, each program's count of refused rows
FLAG_CELLS = SCATTER_CTAS


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_rows", "row_elems", "num_slots"])
    def scatter_rows_kernel(src_ptr, dst_ptr, slot_ptr, flag_ptr, n_rows, row_elems, num_slots,
                            BLOCK: tl.constexpr, ROWS: tl.constexpr):
        # each program moves ROWS rows per iteration, so that many stores are in flight
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        cols = tl.arange(0, BLOCK)
        lanes = tl.arange(0, ROWS)
        refused = tl.zeros([ROWS], dtype=tl.int32)  # rows whose slot is outside the pool
        for first in range(pid * ROWS, n_rows, nprog * ROWS):
            rows = first + lanes
            live = rows < n_rows
            slots = tl.load(slot_ptr + rows, mask=live, other=0)
            ok = live & (slots >= 0) & (slots < num_slots)  # a write outside the pool: none
            refused += (live & ((slots < 0) | (slots >= num_slots))).to(tl.int32)
            src_rows = src_ptr + rows.to(tl.int64)[:, None] * row_elems
            dst_rows = dst_ptr + slots.to(tl.int64)[:, None] * row_elems  # int32 mappings too
            for start in range(0, row_elems, BLOCK):
                offs = (start + cols)[None, :]
                mask = ok[:, None] & (offs < row_elems)
                tl.store(dst_rows + offs, tl.load(src_rows + offs, mask=mask), mask=mask)
        # one plain store per program into its own cell (the host zeroed them all)
        tl.store(flag_ptr + pid, tl.sum(refused, axis=0).to(tl.int64))

    return scatter_rows_kernel


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


#: the integer type of each word size
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_dtype(row_bytes: int, *addresses: int) -> torch.dtype:
    """The widest integer type (up to 8 bytes) whose size divides `row_bytes` and each of
    `addresses`."""
    common = row_bytes | 8
    for a in addresses:
        common |= a
    return _WORDS[common & -common]  # the lowest bit set: the largest power of two dividing all


def as_words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` ([n, F], contiguous) viewed as `dtype` words (`word_dtype` of its rows and address)."""
    return t.view(torch.uint8).view(dtype)


class _Launcher:
    """The scatter kernel launched without Triton's per-call work once a signature was compiled.

    `kernel[grid](...)` re-binds its arguments and re-computes Triton's cache key
    on every call (about 15 µs of a 20 µs launch on an H200 host). A compiled
    kernel depends on the device it was loaded on, the word type it moves, the slots'
    dtype, each pointer's 16-byte alignment and whether the pool's row count needs 64 bits,
    so those form the key here. Once compiled, a save launches it through `_launch.Kernel`
    (cuLaunchKernel, its pointers and values packed from ints: no word views, no driver
    query per pointer); where that cannot serve the kernel (`direct_kernel`) or a profiler's
    launch hook is set, through Triton's compiled launcher with the same ints (it takes an
    int as the address itself), passing what Triton's own passes (launch metadata and
    hooks). A Triton without that launcher keeps the plain path.
    """

    def __init__(self) -> None:
        #: key -> the compiled kernel and its direct launch (None: Triton's launcher)
        self._compiled: dict[tuple[Any, ...], tuple[Any, _launch.Kernel | None]] = {}
        self._knobs: Any = None
        try:
            from triton import knobs
            self._knobs = knobs.runtime
        except ImportError:  # a Triton before knobs: the plain path
            pass

    def __call__(self, rows: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                 flags: torch.Tensor, n: int, grid: int) -> None:
        """`pool[slots[i]] = rows[i]` for i < n (`rows` contiguous, of `pool`'s row bytes)."""
        row_bytes = rows.shape[1] * rows.element_size()
        src, dst, slot_ptr, flag_ptr = (rows.data_ptr(), pool.data_ptr(), slots.data_ptr(),
                                        flags.data_ptr())
        word = word_dtype(row_bytes, src, dst)
        num_slots = pool.shape[0]
        device = rows.get_device()  # a compiled kernel is loaded on one device
        # Triton passes an int argument as i32 or i64 by its value: only num_slots can be large
        key = (device, word, slots.dtype, src % 16 == 0, dst % 16 == 0, slot_ptr % 16 == 0,
               flag_ptr % 16 == 0, num_slots >= 2**31)
        entry = self._compiled.get(key) if self._knobs is not None else None
        if entry is None:
            compiled = _kernel()[(grid,)](as_words(rows, word), as_words(pool, word), slots,
                                          flags, n, row_bytes // word.itemsize, num_slots,
                                          BLOCK=_BLOCK, ROWS=SCATTER_ROWS,
                                          num_warps=SCATTER_WARPS)
            if self._knobs is not None and all(hasattr(compiled, a) for a in (
                    "run", "function", "packed_metadata", "launch_metadata")):
                self._compiled[key] = (compiled, direct_kernel(compiled, SCATTER_PARAMS))
            return
        compiled, kernel = entry
        args = (src, dst, slot_ptr, flag_ptr, n, row_bytes // word.itemsize, num_slots)
        stream = torch._C._cuda_getCurrentRawStream(device)  # as Triton's launch
        if kernel is not None and not self._hooked():
            kernel.launch(grid, stream, *args)
            return
        args += (_BLOCK, SCATTER_ROWS)
        try:
            compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata,
                         compiled.launch_metadata((grid, 1, 1), stream, *args),
                         self._knobs.launch_enter_hook, self._knobs.launch_exit_hook, *args)
        except TypeError as exc:  # another Triton's launcher signature: the plain path only
            logger.warning("direct Triton launch unavailable (%s); using kernel[grid]", exc)
            self._knobs = None
            self(rows, pool, slots, flags, n, grid)

    def _hooked(self) -> bool:
        """Whether a launch hook (a profiler's) is installed: Triton's launcher calls it. Newer
        Tritons keep a `HookChain` there, never None, holding the hooks in `calls`."""
        hook = self._knobs.launch_enter_hook
        return hook is not None and bool(getattr(hook, "calls", True))


#: The scatter kernel's parameters a launch passes (its constexprs are compiled in).
SCATTER_PARAMS = 7

_DRIVER_FUNCTIONS = ("cuLaunchKernel", "cuFuncGetParamInfo", "cuGetErrorName")


def direct_kernel(compiled: Any, num_params: int) -> _launch.Kernel | None:
    """`compiled` as a `_launch.Kernel` of `num_params` parameters, where a launch of it needs
    nothing more than cuLaunchKernel (one CTA a cluster, no scratch memory, no cooperative or
    programmatic-dependent launch) and the driver describes its parameters; else None."""
    metadata = compiled.metadata
    if (getattr(metadata, "num_ctas", 1) != 1 or getattr(metadata, "global_scratch_size", 0)
            or getattr(metadata, "profile_scratch_size", 0)
            or getattr(metadata, "launch_cooperative_grid", False)
            or getattr(metadata, "launch_pdl", False)):
        return None
    try:
        functions = function_addresses(loaded_driver(), _DRIVER_FUNCTIONS)
        return _launch.Kernel(functions, compiled.function, 32 * metadata.num_warps,
                              metadata.shared, num_params)
    except (OSError, AttributeError, ValueError) as exc:
        logger.warning("cuLaunchKernel of the scatter kernel unavailable (%s); using Triton's "
                       "launcher", exc)
        return None


_launcher = _Launcher()


def scatter_rows(rows: torch.Tensor, device_slots: torch.Tensor, pool_view: torch.Tensor,
                 flags: torch.Tensor) -> None:
    """`pool_view[device_slots[i]] = rows[i]` on the current stream with SCATTER_CTAS programs,
    for each slot in `[0, len(pool_view))`, moving the widest words the rows' width and both
    addresses allow. Program p stores its count of refused rows into `flags[p]` (int64,
    `FLAG_CELLS` of them, zeroed by the caller; cells of programs not launched stay 0)."""
    n = rows.shape[0]
    if n == 0:
        return
    _launcher(rows.contiguous(), pool_view, device_slots, flags, n,
              min(SCATTER_CTAS, -(-n // SCATTER_ROWS)))


def index_copy_rows(rows: torch.Tensor, device_slots: torch.Tensor, pool_view: torch.Tensor,
                    flags: torch.Tensor) -> None:
    """`scatter_rows` without Triton: torch's full-grid `index_copy_` on the mapped view.

    `index_copy_` asserts on an index outside the pool, and a device-side assert poisons the
    process's CUDA context; so a row whose slot is outside the pool goes to `NULL_SLOT` (vLLM's
    null block takes any number of discarded rows) and is counted into `flags[0]`. Stream
    ordered, no synchronization (dropping the rows instead would need their count on the host).
    """
    n = rows.shape[0]
    if n == 0:
        return
    num_slots = pool_view.shape[0]
    index = device_slots[:n].long()
    refused = (index < 0) | (index >= num_slots)
    flags[:1].copy_(refused.sum().view(1))
    if num_slots > NULL_SLOT:  # a pool without a null slot gets no row at all
        pool_view.index_copy_(0, index.masked_fill(refused, NULL_SLOT), rows)
