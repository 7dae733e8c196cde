"""What every metric of the bench saves: `WIDTH`-wide rows in `BLOCK`-token blocks of a pool.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from prefix_cache.devices.base import DeviceBackend


WIDTH = 2048


BLOCK = 16


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
