"""The capped host pool: which KV blocks' rows the pool holds, decided by the scheduler, followed by the worker.

A pool capped below the KV mirror holds `pool_blocks - 1` blocks of rows (pool block 0 stays
unused, as vLLM's null block does). The map from KV block to pool block has one owner, the
scheduler side (`BlockResidency`, driven by `prefix_cache.integration.workers.finishes`): it
gives every block vLLM allocates to a request a pool block, taking the least recently used one
whose KV block no request holds when none is free, and it cuts each prefix hit vLLM finds to the
longest prefix whose blocks it maps (the rest is recomputed). Each step's changes travel with
that step's scheduler output (`PoolMoves`, an attribute of it: pickled with it to workers in
other processes). The worker (`PoolMap`) applies them when the step starts and sees the step,
its view and its reads in pool blocks only (`PoolStep`, `ResidentView`), so the cache below
works on a smaller pool as it does on the mirror.

Invariant: a pool block changes owner only when the scheduler moves it, only away from a KV
block no request holds, and the worker applies a step's moves before that step's reads and
writes and after the reads of the requests retired before it; so a pool block changes owner
exactly where a KV block would change tenant (the pool's claims already serve that: the new
owner's first write makes every older row there count no more), and no hit is handed out on a
KV block without a pool block, whatever the scheduling (synchronous or asynchronous: moves are
applied in step order) or the process the worker runs in.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from prefix_cache.core import _core
from prefix_cache.errors import OmniPrefixCacheError, OmniPrefixCacheUnmatchError

#: The scheduler output's attribute that carries a capped pool's `PoolMoves`.
POOL_MOVES_ATTR = "omni_pool_moves"


@dataclass(frozen=True)
class PoolMoves:
    """One step's changes of the map: KV block `kv_blocks[i]` now has pool block
    `pool_blocks[i]` (the KV block that had it before has none); `evicted` of them took a pool
    block from another KV block, whose rows are gone; `trimmed` is, per request the step starts,
    the hit tokens vLLM found that are recomputed because their rows were gone."""

    kv_blocks: np.ndarray
    pool_blocks: np.ndarray
    evicted: int = 0
    trimmed: Mapping[str, int] = field(default_factory=dict)


NO_MOVES = PoolMoves(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


class BlockResidency:
    """The scheduler side's map of KV blocks to pool blocks, and its use order.

    Invariant: `pool_of[kv] == p > 0` iff `kv_of[p] == kv`; every pool block in 1..n-1 is
    either free or maps one KV block; `_use` orders the mapped pool blocks by their last use (a
    request taking the block: allocated or hit)."""

    def __init__(self, num_kv_blocks: int, pool_blocks: int) -> None:
        if not 1 < pool_blocks <= num_kv_blocks:
            raise ValueError(f"BlockResidency: pool_blocks must be in 2..{num_kv_blocks}, "
                             f"got {pool_blocks}")
        self.pool_blocks = pool_blocks
        self.pool_of = np.zeros(num_kv_blocks, dtype=np.int64)  # 0: none
        self.kv_of = np.full(pool_blocks, -1, dtype=np.int64)
        self._free = list(range(pool_blocks - 1, 0, -1))  # popped from the end: 1 first
        self._use: OrderedDict[int, None] = OrderedDict()
        self._moved: dict[int, int] = {}  # kv -> pool, this step
        self._evicted = 0
        self.evicted_blocks = 0  # since start

    @property
    def capacity(self) -> int:
        """KV blocks whose rows the pool can hold at once."""
        return self.pool_blocks - 1

    @property
    def resident_blocks(self) -> int:
        return len(self._use)

    def resident_prefix(self, kv_blocks: Sequence[int]) -> int:
        """How many of `kv_blocks`, from the first, have pool blocks."""
        for i, kv in enumerate(kv_blocks):
            if not self.pool_of[kv]:
                return i
        return len(kv_blocks)

    def use(self, kv_blocks: Iterable[int]) -> None:
        """A request took `kv_blocks`, cached blocks of a prefix hit: used now. Each must have
        a pool block (hits are cut to those that do): one without would read another block's
        rows, so it raises instead."""
        for kv in kv_blocks:
            pool = int(self.pool_of[kv])
            if not pool:
                raise OmniPrefixCacheError(
                    f"capped host pool: a prefix hit took KV block {kv}, whose rows the pool no "
                    f"longer holds (hits are cut to the blocks it holds)")
            self._use.move_to_end(pool)

    def place(self, kv_blocks: Iterable[int], held: Callable[[int], bool]) -> None:
        """Give each of `kv_blocks` (blocks vLLM just allocated, to be computed) a pool block,
        and mark them used now: its own where it kept one, else a free one, else the least
        recently used whose KV block is not `held`; raises where every pool block is held (the
        caller admits no more than fit)."""
        for kv in kv_blocks:
            pool = int(self.pool_of[kv])
            if pool:
                self._use.move_to_end(pool)
                continue
            pool = self._free.pop() if self._free else self._evict(held)
            self.pool_of[kv], self.kv_of[pool] = pool, kv
            self._use[pool] = None
            self._moved[kv] = pool

    def _evict(self, held: Callable[[int], bool]) -> int:
        for _ in range(len(self._use)):
            pool = next(iter(self._use))
            old = int(self.kv_of[pool])
            if held(old):  # in use now: the most recent
                self._use.move_to_end(pool)
                continue
            del self._use[pool]
            self.pool_of[old], self.kv_of[pool] = 0, -1
            self._moved.pop(old, None)
            self._evicted += 1
            self.evicted_blocks += 1
            return pool
        raise OmniPrefixCacheError(
            f"capped host pool: all {self.capacity} pool blocks hold blocks of running "
            f"requests, none can take a new block (the scheduler admitted more than fit)")

    def take_moves(self, trimmed: Mapping[str, int]) -> PoolMoves:
        """The moves since the last call, for the step just scheduled."""
        if not (self._moved or self._evicted or trimmed):
            return NO_MOVES
        moved, self._moved = self._moved, {}
        evicted, self._evicted = self._evicted, 0
        return PoolMoves(np.fromiter(moved.keys(), dtype=np.int64, count=len(moved)),
                         np.fromiter(moved.values(), dtype=np.int64, count=len(moved)),
                         evicted, dict(trimmed))


class PoolMap:
    """The worker's copy of the map, moved in step order; translates KV blocks, slots and runs
    into pool ones, refusing any KV block without a pool block by name.

    Invariant: it equals the scheduler's map as of the last step applied."""

    def __init__(self, num_kv_blocks: int, pool_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool_blocks = pool_blocks
        self._pool_of = np.zeros(num_kv_blocks, dtype=np.int64)
        self._kv_of = np.full(pool_blocks, -1, dtype=np.int64)
        self.resident_blocks = 0

    def apply(self, moves: PoolMoves) -> None:
        for kv, pool in zip(moves.kv_blocks.tolist(), moves.pool_blocks.tolist()):
            if not 0 < pool < self.pool_blocks:
                raise OmniPrefixCacheUnmatchError(
                    f"capped host pool: the scheduler moved KV block {kv} to pool block {pool}, "
                    f"outside 1..{self.pool_blocks - 1}: it sizes the pool otherwise")
            old = int(self._kv_of[pool])
            if old >= 0:
                self._pool_of[old] = 0
            else:
                self.resident_blocks += 1
            self._pool_of[kv], self._kv_of[pool] = pool, kv

    def blocks(self, kv_blocks: Sequence[int], what: str) -> list[int]:
        """The pool blocks of `kv_blocks` (`what` names them in the refusal)."""
        return self._pool_blocks(np.asarray(kv_blocks, dtype=np.int64), what).tolist()

    def _pool_blocks(self, kv: np.ndarray, what: str) -> np.ndarray:
        if len(kv) and (kv.min() < 0 or kv.max() >= len(self._pool_of)):
            raise OmniPrefixCacheUnmatchError(
                f"{what}: KV block ids {kv.tolist()[:8]} outside 0..{len(self._pool_of) - 1}")
        pools = self._pool_of[kv]
        if len(pools) and not pools.all():
            raise OmniPrefixCacheUnmatchError(
                f"{what}: KV blocks {kv[pools == 0].tolist()[:8]} have no rows in the capped "
                f"host pool (the scheduler side maps every block a request holds)")
        return pools

    def runs(self, runs: np.ndarray, what: str) -> np.ndarray:
        """`[k, 2]` runs of KV slots as runs of pool slots (split where blocks end)."""
        if not len(runs):
            return runs
        bs = self.block_size
        first, last = runs[:, 0] // bs, (runs[:, 1] - 1) // bs
        if np.array_equal(first, last):  # each run inside one block (decode steps)
            return runs + ((self._pool_blocks(first, what) - first) * bs)[:, None]
        counts = last - first + 1
        which = np.repeat(np.arange(len(runs)), counts)
        ends = np.cumsum(counts)
        blocks = first[which] + np.arange(int(ends[-1])) - (ends - counts)[which]
        lo = np.maximum(runs[which, 0], blocks * bs)
        hi = np.minimum(runs[which, 1], (blocks + 1) * bs)
        shift = (self._pool_blocks(blocks, what) - blocks) * bs
        return np.stack([lo + shift, hi + shift], axis=1)

    def slots(self, slots: np.ndarray, what: str) -> np.ndarray:
        blocks = slots // self.block_size
        return slots + (self._pool_blocks(blocks, what) - blocks) * self.block_size


class ResidentView:
    """A group view (`prefix_cache.core.layout.GroupView`) in pool slots: the runner's view,
    each slot translated through the worker's `PoolMap`."""

    def __init__(self, view: Any, pool_map: PoolMap) -> None:
        self.inner = view
        self._map = pool_map
        if callable(getattr(view, "step_slot_runs", None)):
            self.step_slot_runs = self._step_slot_runs
        if callable(getattr(view, "step_layout", None)):
            self.step_layout = self._step_layout
        if callable(getattr(view, "request_positions_runs", None)):
            self.request_positions_runs = self._request_positions_runs
        if callable(getattr(view, "requests_positions_runs", None)):
            self.requests_positions_runs = self._requests_positions_runs

    def batch_req_ids(self) -> Sequence[str]:
        return self.inner.batch_req_ids()

    def step_slots_cpu(self, req_ids: Sequence[str],
                       num_scheduled_tokens: Mapping[str, int]) -> torch.Tensor:
        slots = self.inner.step_slots_cpu(req_ids, num_scheduled_tokens).numpy()
        return torch.from_numpy(self._map.slots(slots.astype(np.int64, copy=False),
                                                "the step's slots"))

    def _step_slot_runs(self, req_ids: Sequence[str],
                        num_scheduled_tokens: Mapping[str, int]) -> np.ndarray:
        return self._map.runs(self.inner.step_slot_runs(req_ids, num_scheduled_tokens),
                              "the step's slots")

    def _step_layout(self, num_scheduled_tokens: Mapping[str, int], num_rows: int
                     ) -> tuple[list[str], np.ndarray, int, int, np.ndarray | None, int, int]:
        order, ends, total, smallest, runs, low, high = self.inner.step_layout(
            num_scheduled_tokens, num_rows)
        if runs is not None:
            runs = self._map.runs(runs, "the step's slots")
            _, low, high = _core.run_stats(runs)
        return order, ends, total, smallest, runs, low, high

    def _request_positions_runs(self, req_id: str, num_positions: int,
                                start: int = 0) -> np.ndarray | None:
        runs = self.inner.request_positions_runs(req_id, num_positions, start)
        return None if runs is None else self._map.runs(runs, f"request {req_id}")

    def _requests_positions_runs(self, req_ids: Sequence[str], starts: Sequence[int],
                                 ends: Sequence[int]) -> np.ndarray | None:
        runs = self.inner.requests_positions_runs(req_ids, starts, ends)
        return None if runs is None else self._map.runs(runs, f"requests {list(req_ids)}")


class PoolStep:
    """A scheduler output seen in pool blocks: its new requests' and resumed requests' block
    ids and its block copies translated through the worker's `PoolMap`; every other field is
    the output's own."""

    def __init__(self, scheduler_output: Any, pool_map: PoolMap, group_id: int = 0) -> None:
        self._output = scheduler_output
        self.scheduled_new_reqs = []
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            new = copy.copy(new)
            new.block_ids = _groups(new.block_ids, pool_map, group_id,
                                    f"request {getattr(new, 'req_id', '?')}")
            self.scheduled_new_reqs.append(new)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None and any(ids is not None
                                      for ids in getattr(cached, "new_block_ids", None) or ()):
            cached = copy.copy(cached)
            cached.new_block_ids = [
                None if groups is None else _groups(groups, pool_map, group_id,
                                                    f"request {req_id}")
                for req_id, groups in zip(cached.req_ids, cached.new_block_ids)]
        self.scheduled_cached_reqs = cached
        copies = getattr(scheduler_output, "kv_cache_block_copies", None)
        if copies:
            self.kv_cache_block_copies = [
                tuple(pool_map.blocks(_pair(c), "a block copy")) for c in copies]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._output, name)


def _pair(copy_: Any) -> tuple[int, int]:
    if isinstance(copy_, (tuple, list)):
        return int(copy_[0]), int(copy_[1])
    return int(copy_.src_block_id), int(copy_.dst_block_id)


def _groups(groups: Any, pool_map: PoolMap, group_id: int, what: str) -> Any:
    """vLLM's per-group block ids (or a flat list: one group) with the cached group's
    translated."""
    if groups is None:
        return None
    groups = list(groups)
    if groups and not isinstance(groups[0], (list, tuple)):
        return pool_map.blocks(groups, what)
    if group_id < len(groups):
        groups[group_id] = pool_map.blocks(groups[group_id], what)
    return tuple(groups)
