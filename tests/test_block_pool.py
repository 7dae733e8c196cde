"""PrefixBlockPool.gather: every path returns the rows at the given slots, in order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import prefix_cache.block_pool as block_pool
from prefix_cache.devices.cpu import CpuBackend
from prefix_cache.block_pool import PrefixBlockPool

BS = 4


def filled_pool(num_blocks: int = 32) -> PrefixBlockPool:
    pool = PrefixBlockPool(num_blocks, BS, CpuBackend())
    pool.install(pool.allocate("k", (3,), torch.float32))
    pool.keys["k"].flat.copy_(torch.arange(num_blocks * BS * 3, dtype=torch.float32).view(-1, 3))
    return pool


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("slots", [
    np.array([8, 9, 10, 11, 40, 41, 42, 43, 4, 5, 6, 7]),  # whole blocks: the block path
    np.array([9, 40, 41, 4, 127, 5, 6]),                    # anything else: the slot path
], ids=["blocks", "slots"])
def test_gather_returns_the_rows_at_the_slots_in_order(monkeypatch: pytest.MonkeyPatch,
                                                        threads: int, slots: np.ndarray) -> None:
    monkeypatch.setattr(block_pool, "GATHER_THREADS", threads)
    monkeypatch.setattr(block_pool, "PARALLEL_GATHER_BYTES", 0)  # split even tiny gathers
    pool = filled_pool()
    out = torch.empty((len(slots), 3))
    pool.gather("k", slots, out)
    assert torch.equal(out, pool.keys["k"].flat[torch.from_numpy(slots)])
    pool.close()
