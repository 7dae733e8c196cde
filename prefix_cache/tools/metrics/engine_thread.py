"""M2 and M2p, and the scaling sweeps: the engine thread's time in `new_step_starts` +
`save_outputs` per step, and the host memory the cache holds for it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from prefix_cache.devices import get_backend
from prefix_cache.config import HIDDEN_KEY, PrefixCacheConfig
from prefix_cache.devices.base import DeviceBackend
from prefix_cache.integration.group_view import FullAttentionGroupView
from prefix_cache.manager import OmniPrefixCacheManager
from prefix_cache.tools.metrics.workload import (BLOCK, WIDTH, RunnerBatch, bench_dtype,
                                                 held_host_bytes, scheduler_step, synchronize)


#: Pool size of the requests and tokens scaling sweeps (16384 tokens fit in it).
SCALING_POOL_BLOCKS = 2048


#: Steps timed at each point of a scaling sweep (the first is left out of the median).
SCALING_STEPS = 100


#: µs of the stand-in forward running on the device while a timed step's calls are made (the
#: length of M5's MLP-stack forward for a 256-token step on an H200), the same at every point.
STEP_FORWARD_US = 3400


@dataclass
class EngineTiming:
    """Engine-thread time of a step loop after its first step, and the host memory the cache
    held for it."""

    #: each step after the first: its seconds in `new_step_starts`, then in `save_outputs`
    steps_s: list[tuple[float, float]]
    host_bytes: int  # pools plus staging

    @property
    def median_us(self) -> float:
        """µs of the median step, both calls."""
        return statistics.median(start + save for start, save in self.steps_s) * 1e6


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
                     steps: int, *, num_blocks: int | None = None,
                     write_stream: str = "compute", forward_us: float = 0.0,
                     host_sweep_bytes: int = 0) -> EngineTiming:
    """µs per step in new_step_starts + save_outputs (the median after the first), and host
    bytes; each step is saved as the runner saves a stage of whole entries (`plan_reads=False`)
    and discarded.

    The pool has `num_blocks` blocks, by default just enough for the requests' positions.
    On a device, each step passes the slot mapping a runner keeps there; a stand-in forward
    of `forward_us` (0: none, an idle device) is running when the step's calls are made; and
    the host waits for the step's writes (untimed) with a device synchronize, as an engine
    waits for its sampled tokens. On the host backend there is no device to run a forward.
    `host_sweep_bytes` of host memory are written before each step's calls (untimed), as a
    forward evicts the host's caches between an engine's steps (0: the calls run warm).
    """
    batch = RunnerBatch(num_reqs, tokens_per_req)
    view = FullAttentionGroupView(batch, BLOCK, backend=backend)
    needed = num_reqs * (tokens_per_req // BLOCK + 1) + 2
    blocks = needed if num_blocks is None else max(num_blocks, needed)
    config = PrefixCacheConfig(blocks, BLOCK, write_stream=write_stream,
                               staging_capacity_tokens=max(num_reqs * tokens_per_req, 1))
    hidden = torch.randn(num_reqs * tokens_per_req, WIDTH, device=backend.device).to(dtype)
    # decode steps walk through each request's block; larger steps rewrite it
    positions = [i * tokens_per_req for i in range(max(BLOCK // tokens_per_req, 1))]
    so = scheduler_step(dict.fromkeys(batch.req_ids, tokens_per_req))
    slot_mappings = []  # the runner's device slot mapping at each of those positions
    if backend.name != "cpu":
        for position in positions:
            batch.move_to(position)
            slot_mappings.append(view.step_slots_cpu(batch.req_ids, so.num_scheduled_tokens)
                                 .to(backend.device))
    slot_buffer = torch.empty_like(slot_mappings[0]) if slot_mappings else None
    forward = _ForwardStandIn(backend, forward_us) if forward_us and backend.name != "cpu" else None
    sweep = torch.zeros(host_sweep_bytes // 4) if host_sweep_bytes else None  # float32 words
    times = []
    with OmniPrefixCacheManager(config, view, backend=backend) as cache:
        cache.preallocate(HIDDEN_KEY, (WIDTH,), dtype)
        for step in range(steps):
            batch.move_to(positions[step % len(positions)])
            if slot_buffer is not None:  # untimed: the runner's buffer, rewritten each step
                slot_buffer.copy_(slot_mappings[step % len(positions)])
            if forward is not None:
                forward()
            if sweep is not None:
                sweep.add_(1.0)
            start = time.perf_counter()
            cache.new_step_starts(so)
            started = time.perf_counter()
            # as the runner saves a stage that publishes whole entries: rows read back at the
            # finish, none per step
            sid = cache.save_outputs(hidden, None, num_tokens_unpadded=hidden.shape[0],
                                     num_tokens_padded=hidden.shape[0],
                                     slot_mapping=slot_buffer, plan_reads=False)
            times.append((started - start, time.perf_counter() - started))
            cache.discard_step(sid)
            # untimed: the step's writes land before the next step, as a forward's length lets
            # them in an engine; back to back, large steps would time PCIe, not the host
            synchronize(backend)
        stats = cache.stats()
    return EngineTiming(times[1:], held_host_bytes(stats))


def scaling(device: str | None, passes: int = 1) -> dict[str, list[tuple[int, float, int]]]:
    """(x, engine-thread µs per step, host bytes) against requests per step (decode) and
    tokens per step (one request), both on a SCALING_POOL_BLOCKS pool, and against pool
    blocks (a 64-request decode step); each µs the median of `passes` sweeps made back to
    back, every other one in reverse order (a machine that drifts during a sweep then biases
    no end of it), each sweep's point the median of its SCALING_STEPS steps. On a device,
    every point's steps run beside the same STEP_FORWARD_US stand-in forward, so that points
    differ only in the step itself (back to back, a step after a long write waits longer in
    between, and the next step runs slower for that wait alone)."""
    backend = get_backend(device)
    dtype = bench_dtype(backend)
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
