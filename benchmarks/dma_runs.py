"""Issue 22, "Write block runs with the copy engine": DMA of slot runs vs the Triton scatter kernel.

    PYTHONPATH=. python3 benchmarks/dma_runs.py           # on a CUDA machine (about 1-3 minutes)
    PYTHONPATH=. python3 benchmarks/dma_runs.py --plan    # the run plans only: numpy, no GPU

A save writes a step's rows (bf16, 2048 wide: 4 KiB a row) into a pinned, mapped host pool
(`register_host`), row i into slot `slots[i]`. Slots come in runs (vLLM blocks of 16 slots; a
request's new tokens fill consecutive slots; consecutive block ids make longer runs), so a save
is a list of (src, dst, bytes) runs. For steps of 2048 and 8192 tokens this compares:

  contiguous    one cudaMemcpyAsync (torch `copy_`) of the whole rows tensor into a pinned
                buffer: the reference (M1's denominator)
  kernel        today's path: the Triton scatter kernel (`scatter_rows`), slots read from a
                mapped host page as `SlotPages` passes them, flag cells in mapped host memory
  batch         one cudaMemcpyBatchAsync of the runs (libcudart through ctypes; pointer arrays
                in numpy), one attribute entry: srcAccessOrder = stream
  batch-ovl     the same with cudaMemcpyFlagPreferOverlapWithCompute
  batch-cb      the same call through cuda-bindings (`cuda.bindings.runtime`), Python lists
  percopy       one cudaMemcpyAsync per run (libcudart through ctypes)
  percopy-cb    one cudaMemcpyAsync per run through cuda-bindings
  percopy-torch one `pool[d:d+n].copy_(rows[s:s+n], non_blocking=True)` per run

for runs of 16 rows (64 KiB, random blocks), 64 rows (256 KiB: 4 consecutive blocks), 256 rows
(1 MiB) and 2048 rows (8 MiB, whole requests). Each save's issue includes finding its runs in the
slot array (numpy), as a save would.

Measured (CUDA events): device time of SAVES_IN_FLIGHT saves issued back to back while the side
stream is held by a spin kernel (`torch.cuda._sleep`), so host issue speed does not enter it;
host time to issue one save (perf_counter); "eff" = bytes / max(device, issue) per save, the
throughput one engine thread issuing back to back could sustain. GEMM interference (M7-like):
a loop of GEMM_ITERS bf16 GEMMs (GEMM_N^3) on the default stream alone vs with saves issued
back to back on a side stream for the whole loop (both streams released by one event).
Decode-like tiny saves: 64 rows each in a different random block (64 runs of 4 KiB).

Every variant is measured on its own: one that fails is reported and the rest go on.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

WIDTH = 2048
ROW_BYTES = WIDTH * 2  # bf16
BLOCK = 16
STEP_TOKENS = (2048, 8192)
RUN_ROWS = (16, 64, 256, 2048)
POOL_SLOTS = 65536  # 256 MiB of pinned pool: room for every plan, every run size divides it
SAVES_IN_FLIGHT = 4
WARMUP = 2
TIMED = 5
GEMM_N = 8192  # as prefix_cache.bench.gemm_interference (M7): ~1.4 ms a GEMM on an H200
GEMM_ITERS = 20
GEMM_REPS = 3  # timed pairs (alone, with) after one warm-up pair
GEMM_TOKENS = 2048
GEMM_COVER = 1.3  # saves enqueued for this many times the GEMM loop's length
GEMM_MAX_SAVES = 3000
DECODE_ROWS = 64
DECODE_SAVES = 50
DECODE_LATENCY_REPS = 20
DEADLINE_S = 165.0  # no new measurement starts after this (the run's hard limit is ~240 s)

_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", flush=True)


def out_of_time() -> bool:
    return time.perf_counter() - _T0 > DEADLINE_S


# ----------------------------------------------------------------------------- planning (numpy)

def plan_slots(tokens: int, run_rows: int, num_slots: int, rng: np.random.Generator) -> np.ndarray:
    """Slots of a `tokens`-row save whose runs are `run_rows` long: run j takes rows
    [j*run_rows, (j+1)*run_rows) into a random run_rows-aligned segment of the pool (segment 0,
    which holds vLLM's null block, is never used)."""
    if num_slots % run_rows:
        raise ValueError(f"run of {run_rows} rows does not tile a pool of {num_slots} slots")
    n_runs = -(-tokens // run_rows)
    segments = num_slots // run_rows
    if n_runs > segments - 1:
        raise ValueError(f"{n_runs} runs of {run_rows} rows do not fit {num_slots} slots")
    seg = rng.choice(np.arange(1, segments), size=n_runs, replace=False)
    slots = (seg[:, None] * run_rows + np.arange(run_rows)).ravel()[:tokens]
    return slots.astype(np.int64)


def plan_decode_slots(rows: int, num_slots: int, rng: np.random.Generator) -> np.ndarray:
    """`rows` rows, each in a different random 16-slot block at a random offset in it."""
    blocks = rng.choice(np.arange(1, num_slots // BLOCK), size=rows, replace=False)
    return (blocks * BLOCK + rng.integers(0, BLOCK, size=rows)).astype(np.int64)


def runs_from_slots(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first row, first slot, rows) of each maximal run of consecutive slots."""
    n = slots.shape[0]
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    starts = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate((np.zeros(1, dtype=np.int64), starts))
    lengths = np.diff(np.concatenate((starts, np.array([n], dtype=np.int64))))
    return starts, slots[starts], lengths


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if k and i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plan_main() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for tokens in STEP_TOKENS:
        for run_rows in RUN_ROWS:
            slots = plan_slots(tokens, run_rows, POOL_SLOTS, rng)
            st, dst, ln = runs_from_slots(slots)
            assert int(ln.sum()) == tokens and len(np.unique(slots)) == tokens
            assert slots.min() >= BLOCK and slots.max() < POOL_SLOTS
            rows.append([tokens, run_rows, f"{run_rows * ROW_BYTES // 1024} KiB", len(ln),
                         int(ln.min()), int(ln.max()), f"{tokens * ROW_BYTES / 2**20:.0f} MiB"])
    slots = plan_decode_slots(DECODE_ROWS, POOL_SLOTS, rng)
    st, dst, ln = runs_from_slots(slots)
    rows.append(["decode", 1, "4 KiB", len(ln), int(ln.min()), int(ln.max()),
                 f"{DECODE_ROWS * ROW_BYTES // 1024} KiB"])
    print(format_table(["tokens", "run rows", "run size", "runs", "min rows", "max rows",
                        "bytes"], rows))


# ----------------------------------------------------------------------------- CUDA plumbing

class CudaError(RuntimeError):
    pass


class _MemcpyAttributes(ctypes.Structure):
    """struct cudaMemcpyAttributes (driver_types.h, CUDA 12.8-13.x): the enum srcAccessOrder, two
    cudaMemLocation {type, id} hints, unsigned flags: 24 bytes."""
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocType", ctypes.c_int),
                ("srcLocId", ctypes.c_int), ("dstLocType", ctypes.c_int),
                ("dstLocId", ctypes.c_int), ("flags", ctypes.c_uint)]


SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream
FLAG_PREFER_OVERLAP = 1  # cudaMemcpyFlagPreferOverlapWithCompute
MEMCPY_D2H = 2  # cudaMemcpyDeviceToHost


class Cudart:
    """The libcudart torch loaded, called through ctypes."""

    def __init__(self) -> None:
        self.path = self._find()
        lib = ctypes.CDLL(self.path)
        self.lib = lib
        vp, sz, ci = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        lib.cudaMemcpyAsync.argtypes = [vp, vp, sz, ci, vp]
        lib.cudaMemcpyAsync.restype = ci
        lib.cudaGetLastError.argtypes = []
        lib.cudaGetLastError.restype = ci
        lib.cudaGetErrorName.argtypes = [ci]
        lib.cudaGetErrorName.restype = ctypes.c_char_p
        v = ctypes.c_int(0)
        lib.cudaRuntimeGetVersion(ctypes.byref(v))
        self.runtime_version = v.value
        lib.cudaDriverGetVersion(ctypes.byref(v))
        self.driver_version = v.value
        self.has_batch = hasattr(lib, "cudaMemcpyBatchAsync") and self.runtime_version >= 12080
        if self.has_batch:
            # 13.0 dropped `size_t *failIdx` (before the stream) from the runtime call
            self.batch_has_fail_idx = self.runtime_version < 13000
            args = [vp, vp, vp, sz, vp, vp, sz] + ([vp] if self.batch_has_fail_idx else []) + [vp]
            lib.cudaMemcpyBatchAsync.argtypes = args
            lib.cudaMemcpyBatchAsync.restype = ci
        self._fail_idx = ctypes.c_size_t(0)

    @staticmethod
    def _find() -> str:
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    path = line.split()[-1] if len(line.split()) >= 6 else ""
                    if "libcudart.so" in os.path.basename(path):
                        return path
        except OSError:
            pass
        import torch
        candidates = [Path(torch.__file__).parent / "lib"]
        candidates += [Path(p) / "nvidia" / sub / "lib" for p in sys.path if p
                       for sub in ("cu13", "cuda_runtime")]
        for d in candidates:
            for f in sorted(d.glob("libcudart.so*"), reverse=True) if d.is_dir() else []:
                return str(f)
        return "libcudart.so.13"

    def check(self, err: int, what: str) -> None:
        if err != 0:
            self.lib.cudaGetLastError()  # clear it, so torch's next launch check does not see it
            name = self.lib.cudaGetErrorName(err)
            raise CudaError(f"{what} failed: {name.decode() if name else '?'} ({err})")

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check(self.lib.cudaMemcpyAsync(dst, src, nbytes, MEMCPY_D2H, stream),
                   "cudaMemcpyAsync")

    def batch_async(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                    attr: _MemcpyAttributes, attr_idx: np.ndarray, stream: int) -> None:
        n = dsts.shape[0]
        args = [dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, n,
                ctypes.addressof(attr), attr_idx.ctypes.data, 1]
        if self.batch_has_fail_idx:
            args.append(ctypes.addressof(self._fail_idx))
        self.check(self.lib.cudaMemcpyBatchAsync(*args, stream), "cudaMemcpyBatchAsync")


def load_cuda_bindings() -> tuple[Any, str]:
    try:
        from cuda.bindings import runtime as cbrt
        import cuda.bindings
        return cbrt, getattr(cuda.bindings, "__version__", "?")
    except ImportError:
        from cuda import cudart as cbrt  # cuda-python before the cuda.bindings layout
        return cbrt, "cuda.cudart (old layout)"


def import_repo_modules() -> tuple[Callable[..., Any], Any, str]:
    """register_host and the scatter module; if the package does not import (it is being
    refactored), scatter.py is loaded from its file and register_host is redone here."""
    try:
        from prefix_cache.devices.cuda import scatter
        from prefix_cache.devices.cuda.host_memory import register_host
        return register_host, scatter, "prefix_cache.devices.cuda"
    except Exception as exc:  # noqa: BLE001
        log(f"WARNING: prefix_cache.devices.cuda did not import ({type(exc).__name__}: {exc}); "
            "loading devices/cuda/scatter.py from its file and registering pools here")
    root = Path(__file__).resolve().parent.parent
    try:
        spec = importlib.util.spec_from_file_location("_dma_runs_scatter",
                                                      root / "devices" / "cuda" / "scatter.py")
        scatter = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(scatter)
    except Exception as exc:  # noqa: BLE001
        log(f"WARNING: devices/cuda/scatter.py did not load either ({type(exc).__name__}: {exc}): "
            "no kernel variant")
        return _register_host_local, None, "local register_host, no scatter kernel"
    return _register_host_local, scatter, "devices/cuda/scatter.py (file), local register_host"


class _LocalBuffer:
    def __init__(self, tensor: Any, device_view: Any) -> None:
        self.tensor, self.device_view = tensor, device_view


def _register_host_local(shape: Any, dtype: Any, device: Any) -> _LocalBuffer:
    import torch

    class _Arr:
        def __init__(self, ptr: int, nbytes: int) -> None:
            self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                             "data": (ptr, False), "version": 3, "strides": None}
    t = torch.empty(tuple(shape), dtype=dtype)
    nbytes = t.numel() * t.element_size()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 2)  # Mapped
    if int(err) != 0:
        raise CudaError(f"cudaHostRegister failed ({int(err)})")
    view = torch.as_tensor(_Arr(t.data_ptr(), nbytes), device=device).view(dtype).view(t.shape)
    return _LocalBuffer(t, view)


# ----------------------------------------------------------------------------- the benchmark

class Bench:
    def __init__(self) -> None:
        import torch
        self.torch = torch
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --plan for the plans only")
        self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.init()
        self.side = torch.cuda.Stream(self.device)
        self.side_handle = int(self.side.cuda_stream)
        self.errors: list[str] = []
        self.ctx_dead = False
        self.register_host, self.scatter, self.repo_source = import_repo_modules()
        try:
            self.cudart: Cudart | None = Cudart()
        except Exception as exc:  # noqa: BLE001
            self.cudart = None
            self.errors.append(f"ctypes libcudart: {type(exc).__name__}: {exc}")
        try:
            self.cb, self.cb_version = load_cuda_bindings()
            self.cb.cudaSetDevice(self.device.index)
        except Exception as exc:  # noqa: BLE001
            self.cb, self.cb_version = None, f"unavailable ({type(exc).__name__}: {exc})"
            self.errors.append(f"cuda-bindings: {self.cb_version}")
        try:
            self.print_versions()
        except Exception as exc:  # noqa: BLE001
            self.errors.append(f"printing versions: {type(exc).__name__}: {exc}")

        log("allocating the pinned pool, staging buffers and rows")
        # HostBuffers are kept: dropping one unregisters its memory (a finalizer)
        self.pool = self._alloc((POOL_SLOTS, WIDTH), torch.bfloat16)
        self.pool_view = self.pool.device_view
        self.pool_base = self.pool.tensor.data_ptr()
        cap = max(STEP_TOKENS)
        self.page = self._alloc((cap,), torch.int64)
        self.page_np = self.page.tensor.numpy()
        self.page_dev = self.page.device_view
        flag_cells = self.scatter.FLAG_CELLS if self.scatter else 16
        self.flag_buf = self._alloc((flag_cells,), torch.int64)
        self.flag_buf.tensor.zero_()
        self.flags = self.flag_buf.device_view
        gen = torch.Generator(device=self.device).manual_seed(0)
        self.rows = {t: torch.randn(t, WIDTH, device=self.device, generator=gen
                                    ).to(torch.bfloat16) for t in STEP_TOKENS}
        self.rows_cpu = {t: r.cpu() for t, r in self.rows.items()}
        self.staging_bufs = {t: self._alloc((t, WIDTH), torch.bfloat16) for t in STEP_TOKENS}
        self.staging = {t: buf.tensor for t, buf in self.staging_bufs.items()}
        self.attr = _MemcpyAttributes(srcAccessOrder=SRC_ACCESS_ORDER_STREAM)
        self.attr_ovl = _MemcpyAttributes(srcAccessOrder=SRC_ACCESS_ORDER_STREAM,
                                          flags=FLAG_PREFER_OVERLAP)
        self.attr_idx = np.zeros(1, dtype=np.uint64)
        self.cb_attr = None
        if self.cb is not None:
            try:
                self.cb_attr = self._cb_attr(0)
            except Exception as exc:  # noqa: BLE001
                self.errors.append(f"cuda-bindings cudaMemcpyAttributes: {exc}")
        torch.cuda.synchronize()
        self.cycles_per_ms = self._calibrate_sleep()

    # ---- setup helpers

    def _alloc(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """register_host's buffer; if the repo's register_host fails, the local one from then on."""
        try:
            buf = self.register_host(shape, dtype, self.device)
            if getattr(buf, "device_view", None) is None:
                raise CudaError("register_host returned no device view")
            return buf
        except Exception as exc:  # noqa: BLE001
            if self.register_host is _register_host_local:
                raise
            self.errors.append(f"register_host failed ({type(exc).__name__}: {exc}); "
                               "registered with the local copy instead")
            log("WARNING: " + self.errors[-1])
            self.register_host = _register_host_local
            self.repo_source += " (register_host: local)"
            return _register_host_local(shape, dtype, self.device)

    def print_versions(self) -> None:
        torch = self.torch
        props = torch.cuda.get_device_properties(self.device)
        try:
            import triton
            triton_v = triton.__version__
        except Exception as exc:  # noqa: BLE001
            triton_v = f"unavailable ({exc})"
        smi = "?"
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=15).stdout.strip() or "?"
        except Exception:  # noqa: BLE001
            pass
        cr, sc = self.cudart, self.scatter
        print(format_table(["what", "version"], [
            ["python", platform.python_version()],
            ["torch", torch.__version__],
            ["torch CUDA", torch.version.cuda],
            ["device", f"{props.name}, {props.multi_processor_count} SMs, "
                       f"{props.total_memory / 2**30:.0f} GiB"],
            ["driver (nvidia-smi)", smi],
            ["cudaDriverGetVersion", cr.driver_version if cr else "?"],
            ["cudaRuntimeGetVersion", cr.runtime_version if cr else "?"],
            ["libcudart (ctypes)", cr.path if cr else "unavailable"],
            ["cudaMemcpyBatchAsync", ("yes, " + ("12.8 form (failIdx)" if cr.batch_has_fail_idx
                                                 else "13.x form (no failIdx)"))
             if cr and cr.has_batch else "no"],
            ["triton", triton_v],
            ["cuda-bindings", self.cb_version],
            ["numpy", np.__version__],
            ["scatter / register_host from", self.repo_source],
            ["scatter shape", f"{sc.SCATTER_CTAS} programs, {sc.SCATTER_WARPS} warps, "
                              f"{sc.SCATTER_ROWS} rows/iter" if sc else "none"],
        ]), flush=True)

    def _cb_attr(self, flags: int) -> Any:
        cb = self.cb
        a = cb.cudaMemcpyAttributes()
        a.srcAccessOrder = cb.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        if flags:
            a.flags = cb.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
        return a

    def _calibrate_sleep(self) -> float | None:
        torch = self.torch
        if not hasattr(torch.cuda, "_sleep"):
            self.errors.append("torch.cuda._sleep missing: saves are timed without a gate "
                               "(device times then include host issue gaps)")
            return None
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(50_000_000)  # lets the clocks ramp up first
        cycles = 10_000_000
        rates = []
        for _ in range(3):
            a.record()
            torch.cuda._sleep(cycles)
            b.record()
            b.synchronize()
            rates.append(cycles / a.elapsed_time(b))
        # the fastest clock seen: a gate sized with it only lasts longer at a lower clock
        log(f"spin kernel: {max(rates) / 1e3:.0f} MHz (runs: "
            + ", ".join(f"{r / 1e3:.0f}" for r in rates) + ")")
        return max(rates)

    def sleep_ms(self, ms: float) -> None:
        if self.cycles_per_ms is not None and ms > 0:
            self.torch.cuda._sleep(int(ms * self.cycles_per_ms))

    # ---- issuers: each returns a callable issuing one save on the side stream

    def make_issue(self, variant: str, rows: Any, slots: np.ndarray,
                   staging: Any = None) -> Callable[[], None]:
        stream = self.side_handle
        rows_base = rows.data_ptr()
        n = rows.shape[0]
        pool_base = np.uint64(self.pool_base)
        rb = np.uint64(ROW_BYTES)

        def pointer_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            st, dst, ln = runs_from_slots(slots)
            return (pool_base + dst.astype(np.uint64) * rb, np.uint64(rows_base)
                    + st.astype(np.uint64) * rb, ln.astype(np.uint64) * rb)

        if variant == "contiguous":
            def issue() -> None:
                staging.copy_(rows, non_blocking=True)
            return issue
        if variant == "kernel":
            if self.scatter is None:
                raise CudaError("the scatter kernel's module did not load")
            scatter_rows = self.scatter.scatter_rows
            page_np, page_dev, pool_view, flags = (
                self.page_np, self.page_dev, self.pool_view, self.flags)

            def issue() -> None:
                page_np[:n] = slots  # the engine copies a step's slots into a mapped page
                scatter_rows(rows, page_dev[:n], pool_view, flags)
            return issue
        if variant in ("batch", "batch-ovl"):
            cr = self._need_cudart(batch=True)
            attr = self.attr_ovl if variant == "batch-ovl" else self.attr
            attr_idx = self.attr_idx

            def issue() -> None:
                d, s, z = pointer_arrays()
                cr.batch_async(d, s, z, attr, attr_idx, stream)
            return issue
        if variant == "batch-cb":
            cb, attr = self._need_cb(), self.cb_attr
            if attr is None:
                raise CudaError("no cuda-bindings cudaMemcpyAttributes")
            ok = cb.cudaError_t.cudaSuccess

            def issue() -> None:
                d, s, z = pointer_arrays()
                k = d.shape[0]
                res = cb.cudaMemcpyBatchAsync(d.tolist(), s.tolist(), z.tolist(), k, [attr], [0], 1,
                                              stream)
                err = res[0] if isinstance(res, tuple) else res
                if err != ok:
                    cb.cudaGetLastError()
                    raise CudaError(f"cuda-bindings cudaMemcpyBatchAsync: {err!r}")
            return issue
        if variant == "percopy":
            cr = self._need_cudart()
            memcpy = cr.lib.cudaMemcpyAsync

            def issue() -> None:
                d, s, z = pointer_arrays()
                for dd, ss, zz in zip(d.tolist(), s.tolist(), z.tolist()):
                    err = memcpy(dd, ss, zz, MEMCPY_D2H, stream)
                    if err:
                        cr.check(err, "cudaMemcpyAsync")
            return issue
        if variant == "percopy-cb":
            cb = self._need_cb()
            kind = cb.cudaMemcpyKind.cudaMemcpyDeviceToHost
            ok = cb.cudaError_t.cudaSuccess

            def issue() -> None:
                d, s, z = pointer_arrays()
                for dd, ss, zz in zip(d.tolist(), s.tolist(), z.tolist()):
                    res = cb.cudaMemcpyAsync(dd, ss, zz, kind, stream)
                    err = res[0] if isinstance(res, tuple) else res
                    if err != ok:
                        cb.cudaGetLastError()
                        raise CudaError(f"cuda-bindings cudaMemcpyAsync: {err!r}")
            return issue
        if variant == "percopy-torch":
            pool = self.pool.tensor

            def issue() -> None:
                st, dst, ln = runs_from_slots(slots)
                for a, d, k in zip(st.tolist(), dst.tolist(), ln.tolist()):
                    pool[d:d + k].copy_(rows[a:a + k], non_blocking=True)
            return issue
        raise ValueError(variant)

    def _need_cudart(self, batch: bool = False) -> Cudart:
        if self.cudart is None:
            raise CudaError("libcudart not loadable through ctypes")
        if batch and not self.cudart.has_batch:
            raise CudaError(f"libcudart {self.cudart.runtime_version} has no cudaMemcpyBatchAsync")
        return self.cudart

    def _need_cb(self) -> Any:
        if self.cb is None:
            raise CudaError("cuda-bindings unavailable")
        return self.cb

    # ---- measurement

    def run_variant(self, what: str, fn: Callable[[], Any]) -> Any:
        """fn() or None; a failure is logged and kept for the report."""
        if self.ctx_dead:
            self.errors.append(f"{what}: skipped, the CUDA context failed earlier")
            return None
        if out_of_time():
            self.errors.append(f"{what}: skipped, past the {DEADLINE_S:.0f} s deadline")
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            msg = f"{what}: {type(exc).__name__}: {exc}"
            log("FAILED " + msg)
            tb = traceback.format_exc().strip().splitlines()
            self.errors.append(msg + " | " + " / ".join(line.strip() for line in tb[-4:-1]))
            try:
                self.torch.cuda.synchronize()
            except Exception as exc2:  # noqa: BLE001
                self.ctx_dead = True
                self.errors.append(f"CUDA context unusable after {what}: {exc2}")
            return None

    def timed_saves(self, issue: Callable[[], None], n_saves: int, warmup: int = WARMUP,
                    timed: int = TIMED) -> dict[str, float]:
        """Median device ms per save (n_saves back to back, the stream held by a spin kernel
        until all are issued) and host µs to issue one."""
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        gate_ms = 2.0
        dev, host = [], []
        late = 0
        for rep in range(warmup + timed):
            with torch.cuda.stream(self.side):
                self.sleep_ms(gate_ms)
                start.record(self.side)
                t0 = time.perf_counter()
                for _ in range(n_saves):
                    issue()
                t1 = time.perf_counter()
                end.record(self.side)
            gate_open = start.query()  # the spin ended before every save was issued
            end.synchronize()
            issue_ms = (t1 - t0) * 1e3
            if rep >= warmup:
                dev.append(start.elapsed_time(end) / n_saves)
                host.append(issue_ms * 1e3 / n_saves)
                late += bool(gate_open and self.cycles_per_ms is not None)
            gate_ms = max(gate_ms, 1.5 * issue_ms + 1.0)
        return {"dev_ms": statistics.median(dev), "host_us": statistics.median(host),
                "late": late}

    def check_save(self, issue: Callable[[], None], tokens: int, slots: np.ndarray,
                   staging: Any = None) -> str:
        """One save into rows the host zeroed first: the first, middle and last run compared."""
        torch = self.torch
        torch.cuda.synchronize()
        rows_cpu = self.rows_cpu[tokens]
        n = slots.shape[0]
        if staging is not None:
            staging.zero_()
        st, dst, ln = runs_from_slots(slots)
        picks = sorted({0, len(st) // 2, len(st) - 1})
        pool = self.pool.tensor
        for j in picks:
            pool[int(dst[j]):int(dst[j] + ln[j])].zero_()
        with torch.cuda.stream(self.side):
            issue()
        torch.cuda.synchronize()
        if staging is not None:
            return "ok" if torch.equal(staging.view(torch.int16), rows_cpu[:n].view(torch.int16)) \
                else "WRONG"
        for j in picks:
            a, d, k = int(st[j]), int(dst[j]), int(ln[j])
            got, want = pool[d:d + k].view(torch.int16), rows_cpu[a:a + k].view(torch.int16)
            if not torch.equal(got, want):
                return f"WRONG (run {j})"
        refused = int(self.flag_buf.tensor.sum())
        return "ok" if refused == 0 else f"WRONG ({refused} refused)"

    # ---- the three parts

    def bandwidth(self) -> list[dict[str, Any]]:
        variants = ["kernel", "batch", "batch-ovl", "batch-cb", "percopy", "percopy-cb",
                    "percopy-torch"]
        results = []
        for tokens in STEP_TOKENS:
            rows = self.rows[tokens]
            nbytes = tokens * ROW_BYTES
            staging = self.staging[tokens]

            def contiguous() -> dict[str, Any]:
                issue = self.make_issue("contiguous", rows, np.arange(tokens), staging)
                check = self.check_save(issue, tokens, np.arange(tokens), staging)
                return {**self.timed_saves(issue, SAVES_IN_FLIGHT), "check": check}
            r = self.run_variant(f"bw {tokens} contiguous", contiguous)
            ref = r["dev_ms"] if r else None
            if r:
                results.append({"tokens": tokens, "run_rows": tokens, "runs": 1,
                                "variant": "contiguous", **r, "nbytes": nbytes})
                self._log_bw(tokens, tokens, 1, "contiguous", r, nbytes, ref)
            for run_rows in RUN_ROWS:
                rng = np.random.default_rng(1000 * tokens + run_rows)
                slots = plan_slots(tokens, run_rows, POOL_SLOTS, rng)
                n_runs = len(runs_from_slots(slots)[0])
                for variant in variants:
                    def one(variant: str = variant, slots: np.ndarray = slots) -> dict[str, Any]:
                        issue = self.make_issue(variant, rows, slots)
                        check = self.check_save(issue, tokens, slots)
                        return {**self.timed_saves(issue, SAVES_IN_FLIGHT), "check": check}
                    r = self.run_variant(f"bw {tokens} tok, {run_rows}-row runs, {variant}", one)
                    row = {"tokens": tokens, "run_rows": run_rows, "runs": n_runs,
                           "variant": variant, "nbytes": nbytes, "ref_ms": ref}
                    if r:
                        row.update(r)
                        self._log_bw(tokens, run_rows, n_runs, variant, r, nbytes, ref)
                    results.append(row)
        return results

    def _log_bw(self, tokens: int, run_rows: int, n_runs: int, variant: str, r: dict[str, Any],
                nbytes: int, ref: float | None) -> None:
        gbs = nbytes / (r["dev_ms"] * 1e-3) / 1e9
        ratio = f"{ref / r['dev_ms']:.2f}x contig" if ref else "no ref"
        log(f"bw {tokens} tok, run {run_rows} rows ({n_runs} runs), {variant:13s}: "
            f"{gbs:6.1f} GB/s device, {ratio}, issue {r['host_us']:8.1f} us/save, "
            f"check {r['check']}" + (f", {r['late']} reps not gated" if r["late"] else ""))

    def gemm_interference(self, bw: list[dict[str, Any]]) -> list[dict[str, Any]]:
        torch = self.torch
        a = torch.randn(GEMM_N, GEMM_N, device=self.device, dtype=torch.bfloat16)
        b = torch.randn(GEMM_N, GEMM_N, device=self.device, dtype=torch.bfloat16)
        c = torch.empty_like(a)
        default = torch.cuda.current_stream(self.device)
        gate = torch.cuda.Event()
        g0, g1, s1 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        for _ in range(3):
            torch.mm(a, b, out=c)
        torch.cuda.synchronize()
        rows = self.rows[GEMM_TOKENS]
        staging = self.staging[GEMM_TOKENS]
        by_key = {(r["tokens"], r["run_rows"], r["variant"]): r for r in bw if "dev_ms" in r}

        def loop(issue: Callable[[], None] | None, n: int, gate_ms: float) -> tuple[float, float]:
            self.sleep_ms(gate_ms)  # holds both streams while the host enqueues everything
            gate.record(default)
            g0.record(default)
            for _ in range(GEMM_ITERS):
                torch.mm(a, b, out=c)
            g1.record(default)
            if issue is not None:
                self.side.wait_event(gate)
                with torch.cuda.stream(self.side):
                    for _ in range(n):
                        issue()
                    s1.record(self.side)
            torch.cuda.synchronize()
            return g0.elapsed_time(g1), (g0.elapsed_time(s1) if issue is not None else 0.0)

        alone_ms = statistics.median(loop(None, 0, 2.0)[0] for _ in range(3))
        log(f"GEMM loop alone: {alone_ms:.2f} ms ({GEMM_ITERS} x {GEMM_N}^3 bf16)")
        cases = [("contiguous", GEMM_TOKENS), ("kernel", 16), ("kernel", 256), ("batch", 16),
                 ("batch", 256), ("batch-ovl", 16), ("batch-ovl", 256), ("percopy", 256)]
        out = []
        for variant, run_rows in cases:
            def one(variant: str = variant, run_rows: int = run_rows) -> dict[str, Any]:
                if variant == "contiguous":
                    slots = np.arange(GEMM_TOKENS)
                    issue = self.make_issue(variant, rows, slots, staging)
                    ref = by_key.get((GEMM_TOKENS, GEMM_TOKENS, "contiguous"))
                else:
                    slots = plan_slots(GEMM_TOKENS, run_rows, POOL_SLOTS,
                                       np.random.default_rng(1000 * GEMM_TOKENS + run_rows))
                    issue = self.make_issue(variant, rows, slots)
                    ref = by_key.get((GEMM_TOKENS, run_rows, variant))
                save_ms = ref["dev_ms"] if ref else 0.2
                host_us = ref["host_us"] if ref else 100.0
                n = min(GEMM_MAX_SAVES, math.ceil(GEMM_COVER * alone_ms / max(save_ms, 0.01)) + 2)
                gate_ms = min(3000.0, 2.0 + 1.5 * n * host_us / 1e3)
                alone, with_, span = [], [], []
                for rep in range(1 + GEMM_REPS):
                    t_alone = loop(None, 0, gate_ms)[0]
                    t_with, t_span = loop(issue, n, gate_ms)
                    if rep:
                        alone.append(t_alone)
                        with_.append(t_with)
                        span.append(t_span)
                med_alone, med_with = statistics.median(alone), statistics.median(with_)
                med_span = statistics.median(span)
                return {"variant": variant, "run_rows": run_rows, "saves": n,
                        "alone_ms": med_alone, "with_ms": med_with, "ratio": med_with / med_alone,
                        "cover": med_span / med_with,
                        "save_gbs": n * GEMM_TOKENS * ROW_BYTES / (med_span * 1e-3) / 1e9}
            r = self.run_variant(f"GEMM + {variant} {run_rows}-row runs", one)
            if r:
                out.append(r)
                log(f"GEMM + {variant:10s} runs of {run_rows:4d} rows: {r['ratio']:.3f}x "
                    f"({r['with_ms']:.2f} / {r['alone_ms']:.2f} ms), {r['saves']} saves over "
                    f"{r['cover']:.2f}x the loop at {r['save_gbs']:.1f} GB/s")
            else:
                out.append({"variant": variant, "run_rows": run_rows})
        return out

    def decode(self) -> list[dict[str, Any]]:
        torch = self.torch
        tokens = min(STEP_TOKENS)
        rows = self.rows[tokens][:DECODE_ROWS]
        slots = plan_decode_slots(DECODE_ROWS, POOL_SLOTS, np.random.default_rng(7))
        staging = self.staging[tokens][:DECODE_ROWS]
        out = []
        for variant in ["contiguous", "kernel", "batch", "batch-cb", "percopy", "percopy-cb",
                        "percopy-torch"]:
            def one(variant: str = variant) -> dict[str, Any]:
                if variant == "contiguous":
                    issue = self.make_issue(variant, rows, np.arange(DECODE_ROWS), staging)
                    check = self.check_save(issue, tokens, np.arange(DECODE_ROWS), staging)
                else:
                    issue = self.make_issue(variant, rows, slots)
                    check = self.check_save(issue, tokens, slots)
                r = self.timed_saves(issue, DECODE_SAVES)
                lat = []
                for rep in range(3 + DECODE_LATENCY_REPS):
                    t0 = time.perf_counter()
                    with torch.cuda.stream(self.side):
                        issue()
                    self.side.synchronize()
                    if rep >= 3:
                        lat.append((time.perf_counter() - t0) * 1e6)
                return {"variant": variant, **r, "wall_us": statistics.median(lat),
                        "check": check}
            r = self.run_variant(f"decode {variant}", one)
            if r:
                out.append(r)
                log(f"decode {variant:13s}: issue {r['host_us']:7.1f} us, device "
                    f"{r['dev_ms'] * 1e3:7.1f} us, isolated save+sync {r['wall_us']:7.1f} us, "
                    f"check {r['check']}")
            else:
                out.append({"variant": variant})
        return out


# ----------------------------------------------------------------------------- report

def report_bw(bw: list[dict[str, Any]]) -> None:
    print()
    print("=" * 100)
    print("Save throughput: device GB/s (ratio to contiguous D2H of the same step)")
    print("  device = SAVES_IN_FLIGHT saves back to back on a gated stream; issue = host us per "
          "save;\n  eff = bytes / max(device, issue) per save: one engine thread issuing "
          "back to back")
    for tokens in STEP_TOKENS:
        rows_t = [r for r in bw if r["tokens"] == tokens]
        contig = next((r for r in rows_t if r["variant"] == "contiguous" and "dev_ms" in r), None)
        nbytes = tokens * ROW_BYTES
        print(f"\n{tokens} tokens ({nbytes / 2**20:.0f} MiB a save)"
              + (f": contiguous {nbytes / contig['dev_ms'] / 1e6:.1f} GB/s device, issue "
                 f"{contig['host_us']:.1f} us, check {contig['check']}" if contig else
                 ": contiguous FAILED"))
        variants = [v for v in dict.fromkeys(r["variant"] for r in rows_t) if v != "contiguous"]
        headers = ["variant"]
        for run_rows in RUN_ROWS:
            runs = next((r["runs"] for r in rows_t if r["run_rows"] == run_rows), "?")
            headers.append(f"{run_rows * ROW_BYTES // 1024} KiB x{runs}")
        for label, cell in (("device GB/s (x contig)", _cell_gbs),
                            ("host issue us/save", _cell_issue),
                            ("eff GB/s (x contig)", _cell_eff)):
            table = []
            for v in variants:
                line = [v]
                for run_rows in RUN_ROWS:
                    r = next((x for x in rows_t if x["variant"] == v and x["run_rows"] == run_rows),
                             None)
                    line.append(cell(r, contig))
                table.append(line)
            print(f"\n  {label}")
            print("\n".join("  " + ln for ln in format_table(headers, table).splitlines()))
    bad = [r for r in bw if "check" in r and r["check"] != "ok"]
    late = [r for r in bw if r.get("late")]
    if bad:
        print("\nWRONG ROWS: " + "; ".join(f"{r['tokens']}/{r['run_rows']}/{r['variant']}: "
                                           f"{r['check']}" for r in bad))
    if late:
        print("\nnot fully gated (host issue outran the spin kernel; device time may include "
              "gaps): " + "; ".join(f"{r['tokens']}/{r['run_rows']}/{r['variant']} "
                                    f"({r['late']}/{TIMED})" for r in late))

    sys.stdout.flush()


def report_gemm(gemm: list[dict[str, Any]]) -> None:
    print("\n" + "=" * 100)
    print(f"GEMM interference (M7-like, target <= 1.03): {GEMM_ITERS} x {GEMM_N}^3 bf16 GEMMs on "
          f"the default stream,\n  alone vs with {GEMM_TOKENS}-token saves issued back to back "
          "on a side stream for the whole loop")
    table = []
    for r in gemm:
        if "ratio" not in r:
            table.append([r["variant"], r["run_rows"], "FAILED", "", "", "", "", ""])
            continue
        table.append([r["variant"], r["run_rows"], f"{r['run_rows'] * ROW_BYTES // 1024} KiB",
                      r["saves"], f"{r['alone_ms']:.2f}", f"{r['with_ms']:.2f}",
                      f"{r['ratio']:.3f}", f"{r['cover']:.2f}", f"{r['save_gbs']:.1f}"])
    print(format_table(["variant", "run rows", "run", "saves", "alone ms", "with ms",
                        "GEMM x", "cover", "save GB/s"], table))
    print("  cover = (last save done - loop start) / loop time: >= 1 means saves ran through "
          "the whole loop")

    sys.stdout.flush()


def report_decode(dec: list[dict[str, Any]]) -> None:
    print("\n" + "=" * 100)
    print(f"Decode-like tiny saves: {DECODE_ROWS} rows, each in a different random block "
          f"({DECODE_ROWS} runs of 4 KiB; contiguous: one {DECODE_ROWS * 4} KiB copy)")
    table = []
    for r in dec:
        if "dev_ms" not in r:
            table.append([r["variant"], "FAILED", "", "", "", ""])
            continue
        table.append([r["variant"], f"{r['host_us']:.1f}", f"{r['dev_ms'] * 1e3:.1f}",
                      f"{r['host_us'] + r['dev_ms'] * 1e3:.1f}", f"{r['wall_us']:.1f}",
                      r["check"]])
    print(format_table(["variant", "issue us", "device us", "issue+device us",
                        "save+sync us", "check"], table))
    print(f"  issue/device: medians of {DECODE_SAVES} saves back to back (device gated); "
          f"save+sync: one save then stream sync, median of {DECODE_LATENCY_REPS}")
    sys.stdout.flush()


def report_errors(errors: list[str]) -> None:
    if errors:
        print("\n" + "=" * 100)
        print(f"{len(errors)} failure(s) / notes:")
        for e in errors:
            print("  - " + e)


def _gbs(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def _cell_gbs(r: dict[str, Any] | None, contig: dict[str, Any] | None) -> str:
    if r is None or "dev_ms" not in r:
        return "FAIL"
    ratio = f" ({contig['dev_ms'] / r['dev_ms']:.2f})" if contig else ""
    flag = "" if r.get("check") == "ok" else " !"
    return f"{_gbs(r['nbytes'], r['dev_ms']):.1f}{ratio}{flag}"


def _cell_issue(r: dict[str, Any] | None, contig: dict[str, Any] | None) -> str:
    if r is None or "host_us" not in r:
        return "FAIL"
    return f"{r['host_us']:.1f}"


def _cell_eff(r: dict[str, Any] | None, contig: dict[str, Any] | None) -> str:
    if r is None or "dev_ms" not in r:
        return "FAIL"
    ms = max(r["dev_ms"], r["host_us"] * 1e-3)
    ref = max(contig["dev_ms"], contig["host_us"] * 1e-3) if contig else None
    ratio = f" ({ref / ms:.2f})" if ref else ""
    return f"{_gbs(r['nbytes'], ms):.1f}{ratio}"


def main() -> None:
    if "--plan" in sys.argv[1:]:
        plan_main()
        return
    log("starting: torch, CUDA, Triton")
    try:
        bench = Bench()
    except SystemExit:
        raise
    except Exception:
        log("setup failed:\n" + traceback.format_exc())
        raise SystemExit(1)
    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    bw: list[dict[str, Any]] = []
    part = ""
    try:  # each part's table is printed as soon as it is done
        part = "save throughput"
        log("part 1/3: save throughput")
        bw = bench.bandwidth()
        report_bw(bw)
        part = "decode"
        log("part 2/3: decode-like tiny saves")
        report_decode(bench.decode())
        part = "GEMM interference"
        log("part 3/3: GEMM interference")
        report_gemm(bench.run_variant("GEMM interference", lambda: bench.gemm_interference(bw))
                    or [])
    except KeyboardInterrupt as exc:
        bench.errors.append(f"interrupted during {part} ({exc})")
    except Exception:  # noqa: BLE001
        bench.errors.append(f"unexpected during {part}: " + traceback.format_exc())
    finally:
        report_errors(bench.errors)
        log("done")


if __name__ == "__main__":
    main()
