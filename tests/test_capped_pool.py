"""The capped host pool without vLLM: the scheduler side's map and its use order, the worker's
copy of it, the pool's size under a host budget, and the manager on a pool smaller than the KV
cache (SPEC §7, "The host pool (capped)")."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from prefix_cache import (HIDDEN_KEY, OmniPrefixCacheManager, OmniPrefixCacheUnmatchError,
                          PrefixCacheConfig, devices)
from prefix_cache.core.residency import (POOL_MOVES_ATTR, BlockResidency, PoolMap, PoolMoves)
from prefix_cache.errors import OmniPrefixCacheError
from prefix_cache.integration.gate import check_host_pool, host_pool_blocks
from tests.sim import token_rows

MIB = 1 << 20


def test_blocks_take_free_pool_blocks_then_the_least_recently_used_unheld_one() -> None:
    residency = BlockResidency(num_kv_blocks=10, pool_blocks=4)  # 3 usable
    held = {1, 2, 3}
    residency.place([1, 2, 3], held.__contains__)
    assert residency.take_moves({}).pool_blocks.tolist() == [1, 2, 3]
    with pytest.raises(OmniPrefixCacheError, match="all 3 pool blocks hold blocks of running"):
        residency.place([4], held.__contains__)
    held = {2}
    residency.use([1])  # a hit on block 1: now the most recent
    residency.place([5], held.__contains__)  # 2 is held, 3 is the least recently used
    moves = residency.take_moves({"r": 16})
    assert moves.kv_blocks.tolist() == [5] and moves.pool_blocks.tolist() == [3]
    assert moves.evicted == 1 and dict(moves.trimmed) == {"r": 16}
    assert residency.resident_prefix([1, 2, 3, 5]) == 2
    with pytest.raises(OmniPrefixCacheError, match="KV block 3, whose rows the pool no longer"):
        residency.use([3])


def test_the_workers_map_translates_runs_across_blocks_and_refuses_unmapped_ones() -> None:
    pool_map = PoolMap(num_kv_blocks=10, pool_blocks=4, block_size=4)
    pool_map.apply(PoolMoves(np.array([7, 8]), np.array([2, 1])))
    runs = np.array([[29, 35]])  # KV block 7 positions 1..3, block 8 positions 0..2
    assert pool_map.runs(runs, "x").tolist() == [[9, 12], [4, 7]]
    pool_map.apply(PoolMoves(np.array([9]), np.array([2])))  # pool block 2 leaves KV block 7
    assert pool_map.resident_blocks == 2
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"request r: KV blocks \[7\] have no"):
        pool_map.runs(runs, "request r")


def test_the_pool_mirrors_the_kv_cache_where_it_fits_and_is_capped_where_not() -> None:
    config = PrefixCacheConfig(num_blocks=100, block_size=16, host_budget_bytes=100 * 16 * 1024)
    assert host_pool_blocks(config, token_bytes=1024, max_model_len=256,
                            device_type="cpu") is None
    capped = PrefixCacheConfig(num_blocks=100, block_size=16, host_budget_bytes=20 * 16 * 1024
                               + 5)
    assert host_pool_blocks(capped, token_bytes=1024, max_model_len=256, device_type="cpu") == 20
    with pytest.raises(OmniPrefixCacheUnmatchError) as refused:
        host_pool_blocks(capped, token_bytes=1024, max_model_len=1024, device_type="cpu")
    assert "max_model_len=1024" in str(refused.value) and "host_budget_bytes" in str(
        refused.value)
    line = check_host_pool(PrefixCacheConfig(num_blocks=100, block_size=16, pool_blocks=20,
                                             host_budget_bytes=20 * 16 * 1024),
                           keys=1, feat_shape=(256,), dtype=torch.float32, device_type="cpu")
    assert line.startswith("0.31 MiB: 1 key(s) x 0.31 MiB (320 pool slots x 256 x 4 B of "
                           "torch.float32), capped: rows of 19 of the 99 KV blocks"), line


class Slots:
    """A view whose requests hold fixed KV blocks from position 0."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.batch: list[str] = []

    def batch_req_ids(self) -> list[str]:
        return list(self.batch)

    def step_slots_cpu(self, req_ids, num_scheduled_tokens) -> torch.Tensor:
        bs = self.block_size
        slots = [self.blocks[r][p // bs] * bs + p % bs for r in req_ids
                 for p in range(self.computed[r], self.computed[r] + num_scheduled_tokens[r])]
        return torch.tensor(slots, dtype=torch.int64)


def step(new: list[tuple[str, int, list[int]]], scheduled: dict[str, int], moves: PoolMoves,
         finished: tuple[str, ...] = ()) -> SimpleNamespace:
    so = SimpleNamespace(
        finished_req_ids=set(finished), num_scheduled_tokens=scheduled,
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=h, block_ids=(b,))
                            for r, h, b in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[]))
    setattr(so, POOL_MOVES_ATTR, moves)
    return so


def test_a_capped_manager_serves_a_hit_from_a_reused_pool_block_and_counts_its_moves() -> None:
    """KV blocks 7 and 9 share pool block 1 in turn; a hit on 9 reads 9's rows."""
    bs, width = 4, 8
    view = Slots(bs)
    config = PrefixCacheConfig(num_blocks=12, block_size=bs, pool_blocks=3,
                               host_budget_bytes=3 * bs * width * 4)
    with OmniPrefixCacheManager(config, view, backend=devices.get_backend("cpu")) as manager:
        def run(req_id: str, tokens: list[int], blocks: list[int], hit: int,
                moves: PoolMoves, finished: tuple[str, ...] = ()) -> torch.Tensor:
            view.blocks[req_id], view.computed[req_id], view.batch = blocks, hit, [req_id]
            manager.new_step_starts(step([(req_id, hit, blocks)], {req_id: len(tokens) - hit},
                                         moves, finished))
            rows = token_rows(tokens, width)[hit:]
            sid = manager.save_outputs(rows, None, num_tokens_unpadded=len(rows),
                                       num_tokens_padded=len(rows))
            got = manager.materialize(sid, [req_id]).hidden_states[req_id]
            assert torch.equal(got, token_rows(tokens, width)), req_id
            return got

        run("a", [1, 2, 3, 4, 5], [7, 8], 0, PoolMoves(np.array([7, 8]), np.array([1, 2])))
        run("b", [6, 7, 8, 9, 10], [9, 10], 0,
            PoolMoves(np.array([9, 10]), np.array([1, 2]), evicted=2), finished=("a",))
        run("c", [6, 7, 8, 9, 11], [9, 11], 4,
            PoolMoves(np.array([11]), np.array([2]), trimmed={"c": 0}), finished=("b",))
        stats = manager.stats()
    assert stats["resident_blocks"] == 2 and stats["pool_blocks"] == 2
    assert stats["evicted_blocks"] == 2 and stats["hit_tokens"] == 4
    assert stats[f"pool_bytes.{HIDDEN_KEY}"] <= config.host_budget_bytes


def test_a_capped_manager_refuses_a_step_without_the_schedulers_moves() -> None:
    config = PrefixCacheConfig(num_blocks=12, block_size=4, pool_blocks=3)
    with OmniPrefixCacheManager(config, Slots(4), backend=devices.get_backend("cpu")) as manager:
        so = step([], {}, PoolMoves(np.zeros(0, np.int64), np.zeros(0, np.int64)))
        delattr(so, POOL_MOVES_ATTR)
        with pytest.raises(OmniPrefixCacheUnmatchError, match="carries no omni_pool_moves"):
            manager.new_step_starts(so)


@pytest.mark.parametrize("pool_blocks", [1, 13, True])
def test_pool_blocks_outside_the_kv_cache_are_refused(pool_blocks: object) -> None:
    with pytest.raises(ValueError, match="pool_blocks must be an int in 2..num_blocks=12"):
        PrefixCacheConfig(num_blocks=12, block_size=4, pool_blocks=pool_blocks)


def test_a_capped_pool_without_the_caches_scheduler_is_refused_naming_it() -> None:
    from prefix_cache.integration.workers.finishes import ResidentScheduler, check_pool_scheduler

    def config(scheduler_cls: type) -> SimpleNamespace:
        return SimpleNamespace(
            scheduler_config=SimpleNamespace(get_scheduler_cls=lambda: scheduler_cls),
            parallel_config=SimpleNamespace(distributed_executor_backend="mp"))

    check_pool_scheduler(config(ResidentScheduler))
    with pytest.raises(OmniPrefixCacheUnmatchError) as refused:
        check_pool_scheduler(config(object))
    assert "'mp' executor" in str(refused.value) and \
        'scheduler_cls="prefix_cache.integration.workers.finishes.ResidentScheduler"' in \
        str(refused.value)
