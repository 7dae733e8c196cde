"""M5, the 0%-hit overhead: steps per second of a forward loop with the cache's calls ÷ without.
"""

from __future__ import annotations

import statistics

import torch

from prefix_cache.config import HIDDEN_KEY, PrefixCacheConfig
from prefix_cache.devices.base import DeviceBackend
from prefix_cache.integration.group_view import FullAttentionGroupView
from prefix_cache.manager import OmniPrefixCacheManager
from prefix_cache.tools.reporting.harness import paired_seconds
from prefix_cache.tools.metrics.workload import (BLOCK, WIDTH, RunnerBatch, scheduler_step,
                                                 synchronize)


def step_loop(backend: DeviceBackend, tokens: int, dtype: torch.dtype, steps: int, pairs: int,
              write_stream: str = "compute", whole_entries: bool = False
              ) -> tuple[list[float], float]:
    """M5: steps per second of a stand-in forward with the cache's calls ÷ without, per pair
    of loops of `steps` steps run back to back (see `paired_seconds`); and the median
    steps per second without, from the same loops.

    The forward is an MLP stack whose last projection gives the WIDTH-wide rows the cache
    saves: on a device, an 8B-class model's MLPs (32 layers of 4096 -> 14336 -> 4096,
    ~3.4 ms a step for 256 tokens on an H200); on CPU one small layer, run by the host itself.
    Each step is the next chunk of one long prompt, walking through four chunks' blocks; the
    output builder runs one step behind, on the engine thread (the costliest place for it).
    `whole_entries`: each step is saved as the runner saves a stage of whole entries (no read
    planned) and discarded, and the prompt's rows are read back once each pass through its
    four chunks, on the engine thread too (the runner's output thread reads them at the finish).
    """
    chunks = 4  # more than the steps unconsumed at once: a step never rewrites a held one's slots
    batch = RunnerBatch(1, chunks * tokens)
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

    so = scheduler_step({"r0": tokens})
    with OmniPrefixCacheManager(config, view, backend=backend) as cache:
        cache.preallocate(HIDDEN_KEY, (WIDTH,), dtype)

        def without_cache() -> None:
            for step in range(steps):
                batch.move_to(step % chunks * tokens)
                forward()
            synchronize(backend)

        def with_cache() -> None:
            pending = None
            for step in range(steps):
                batch.move_to(step % chunks * tokens)
                cache.new_step_starts(so)
                hidden = forward()
                sid = cache.save_outputs(hidden, None, num_tokens_unpadded=tokens,
                                         num_tokens_padded=tokens, plan_reads=not whole_entries)
                if whole_entries:
                    cache.discard_step(sid)
                    if step % chunks == chunks - 1:
                        cache.plan_request_rows({"r0": chunks * tokens})["r0"].resolve()
                    continue
                if pending is not None:
                    cache.materialize(pending, ["r0"])
                pending = sid
            if pending is not None:
                cache.materialize(pending, ["r0"])
            synchronize(backend)

        without_cache(), with_cache()  # warm-up
        times = paired_seconds(without_cache, with_cache, pairs)
    ratios = [alone / cached for alone, cached in times]
    return ratios, steps / statistics.median(alone for alone, _ in times)
