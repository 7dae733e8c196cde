"""M4, engine-thread stalls: pinned allocations, host registrations and device synchronizations
on the engine thread over a mixed run after warm-up.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from prefix_cache.config import HIDDEN_KEY, ModelCachePolicy, PrefixCacheConfig
from prefix_cache.devices.base import DeviceBackend
from prefix_cache.manager import OmniPrefixCacheManager
from prefix_cache.tools.metrics.workload import BLOCK, WIDTH, scheduler_step


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
        """Pinned blocks torch's caching host allocator has made (0 off CUDA). A torch without
        the counter is refused: counting nothing there would pass M4 by construction."""
        if not self._cuda:
            return 0
        stats = torch.cuda.host_memory_stats()
        if "num_host_alloc" not in stats:
            raise RuntimeError(f"M4: torch {torch.__version__}'s host_memory_stats() has no "
                               f"num_host_alloc (it has {sorted(stats)}); cannot count pinned "
                               f"allocations on the engine thread")
        return int(stats["num_host_alloc"])

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
    try:  # the backend is patched from here: restored whatever raises
        with OmniPrefixCacheManager(config, view, backend=backend) as cache:
            cache.register_policy(ModelCachePolicy(deferred_keys={"codes"}))
            cache.preallocate(HIDDEN_KEY, (WIDTH,), dtype)
            _mixed_steps(cache, view, counter, backend, dtype, warmup + steps, warmup)
    finally:
        counter.restore()
    return counter.allocations, counter.syncs, steps


def _mixed_steps(cache: OmniPrefixCacheManager, view: _MixedView, counter: _StallCounter,
                 backend: DeviceBackend, dtype: torch.dtype, steps: int, warmup: int) -> None:
    """`engine_thread_stalls`' step loop; the counters restart at step `warmup`."""
    num_reqs = view.num_reqs
    finished: list[str] = []
    for step in range(steps):
        if step % 4 == 0:
            finished, view.req_ids = view.req_ids, [f"s{step}r{j}" for j in range(num_reqs)]
            view.positions = dict.fromkeys(view.req_ids, 0)
        n = 32 if step % 2 == 0 else 1
        so = scheduler_step(dict.fromkeys(view.req_ids, n), finished)
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
