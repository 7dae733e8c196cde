"""What every metric of the bench saves: `WIDTH`-wide rows in `BLOCK`-token blocks of a pool.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

import numpy as np
import torch

from prefix_cache.devices.base import DeviceBackend


WIDTH = 2048


BLOCK = 16


#: Blocks of the full bench's pools for M1 and M6: 8192-token steps' rows, 241,472 slots.
FULL_POOL_BLOCKS = 15092


def bench_dtype(backend: DeviceBackend) -> torch.dtype:
    """The rows' dtype: bfloat16 as a model emits them on a device; float32 on CPU, where
    bfloat16 arithmetic is emulated and would time the emulation."""
    return torch.float32 if backend.name == "cpu" else torch.bfloat16


def scheduler_step(num_scheduled_tokens: dict[str, int], finished: Iterable[str] = ()
                   ) -> SimpleNamespace:
    """The fields of vLLM's SchedulerOutput the cache reads, for a step that schedules only
    requests it already knows (no new or resumed ones)."""
    return SimpleNamespace(finished_req_ids=set(finished), scheduled_new_reqs=[],
                           scheduled_cached_reqs=None,
                           num_scheduled_tokens=num_scheduled_tokens)


def held_host_bytes(stats: dict[str, int | float]) -> int:
    """Host bytes a cache's `stats()` says it holds in its pools and staging."""
    return int(stats["staging_bytes"] + sum(v for k, v in stats.items()
                                            if k.startswith("pool_bytes.")))


def synchronize(backend: DeviceBackend) -> None:
    if backend.name != "cpu":
        torch.get_device_module(backend.name).synchronize()


def random_slots(num_blocks: int, tokens: int, rng: np.random.Generator) -> torch.Tensor:
    blocks = rng.choice(np.arange(1, num_blocks), size=-(-tokens // BLOCK), replace=False)
    return torch.from_numpy((blocks[:, None] * BLOCK + np.arange(BLOCK)).ravel()[:tokens])


class RunnerBatch:
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
