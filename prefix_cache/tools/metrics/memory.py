"""M6, host memory: bytes resident for the cache's pool, staging and arenas ÷ the bytes they
hold, measured in a new process.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import torch

from prefix_cache.devices import get_backend
from prefix_cache.config import HIDDEN_KEY, PrefixCacheConfig
from prefix_cache.integration.group_view import FullAttentionGroupView
from prefix_cache.manager import OmniPrefixCacheManager
from prefix_cache.tools.metrics.workload import (BLOCK, WIDTH, RunnerBatch, bench_dtype,
                                                 held_host_bytes, scheduler_step)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def resident_ratio(device: str, num_blocks: int) -> float:
    """`_resident_ratio` measured in a new process: in this one, memory that earlier
    measurements freed is reused without the resident set growing."""
    code = ("from prefix_cache.tools.metrics import memory; "
            f"print(memory._resident_ratio({device!r}, {num_blocks}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"M6's measuring process exited with {run.returncode}:\n"
                           f"{run.stderr[-4000:]}")
    return float(run.stdout.strip().splitlines()[-1])


def _resident_ratio(device: str, num_blocks: int) -> float:
    """Host bytes resident for a cache's pool, staging and arenas ÷ the bytes they hold.

    Resident is measured: a new process's resident set grows by exactly what was allocated
    and touched (pinned pages are resident), so rounding by any allocator shows up. A first
    run on a tiny pool takes the process's one-time costs (threads, torch's first ops).
    """
    backend = get_backend(device)
    dtype = bench_dtype(backend)
    batch = RunnerBatch(64, 1)
    view = FullAttentionGroupView(batch, BLOCK, backend=backend)
    hidden = torch.randn(64, WIDTH, device=backend.device).to(dtype)
    so = scheduler_step(dict.fromkeys(batch.req_ids, 1))

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
        return resident / (held_host_bytes(stats) + stats["output_cache_bytes"])

    measure(len(batch.req_ids) + 3)
    ratio = measure(num_blocks)
    backend.close()
    return ratio
