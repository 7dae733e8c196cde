"""FullAttentionGroupView: the step's row order and slots, read from the runner's persistent batch.

It reads the CPU block table and `num_computed_tokens_cpu`, never the device
`slot_mapping`, so it costs no device synchronisation; it hands that device
`slot_mapping` on, untouched, for writes that read it in stream order. The
device backend decides at the first step whether the runner's table layout can
be mirrored.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from prefix_cache.devices import get_backend
from prefix_cache.core import _core
from prefix_cache.devices.base import DeviceBackend
from prefix_cache.errors import OmniPrefixCacheUnmatchError
from prefix_cache.core.runs import runs_slots


class FullAttentionGroupView:
    """Slots of one full-attention KV-cache group, `slot = table[req, pos // u] * u + pos % u`.

    `u` is the table's own block unit (`table.block_size`): allocator blocks, or
    kernel blocks where the runner splits them; both give the same slot when
    `u` divides `block_size`, which the backend checks before the first step.

    `request_block_ids` gives each KV-cache group's allocator block ids of a request the runner
    still holds (its cached request state): the slots of a request the batch has dropped
    before its finish (an asynchronous scheduler's step that does not schedule a request
    whose last token is surely sampled leaves it out of the batch a step early).
    """

    def __init__(self, input_batch: Any, block_size: int, *, group_id: int = 0,
                 backend: DeviceBackend | None = None, kernel_block_size: int | None = None,
                 attention_backend: str | None = None,
                 request_block_ids: Callable[[str], Sequence[Sequence[int]] | None] | None = None
                 ) -> None:
        self.input_batch = input_batch
        self.block_size = block_size
        self.group_id = group_id
        self.backend = backend if backend is not None else get_backend()
        self.kernel_block_size = kernel_block_size
        self.attention_backend = attention_backend
        self._request_block_ids = request_block_ids
        self._checked = False

    def _table(self) -> Any:
        tables = self.input_batch.block_table
        try:
            return tables[self.group_id]
        except (IndexError, KeyError, TypeError) as exc:
            raise OmniPrefixCacheUnmatchError(
                f"runner has no block table for KV-cache group {self.group_id}") from exc

    def device_slot_mapping(self) -> torch.Tensor | None:
        """The runner's slot mapping of this group for the current step, where it keeps one:
        the KV-cache write's, the same slot numbers as `step_slots_cpu` (first rows only)."""
        return getattr(getattr(self._table(), "slot_mapping", None), "gpu", None)

    def check(self) -> None:
        """Refuse a table layout the cache cannot mirror (done once, at the first step)."""
        reason = self.backend.check_block_table(self._table(), self.block_size,
                                                self.kernel_block_size, self.attention_backend)
        if reason is not None:
            raise OmniPrefixCacheUnmatchError(
                f"{self.backend.name} runner's block table for group {self.group_id} cannot be "
                f"mirrored: {reason}")
        self._checked = True

    def batch_req_ids(self) -> list[str]:
        return [r for r in self.input_batch.req_ids if r is not None]

    def step_slots_cpu(self, req_ids: Sequence[str],
                       num_scheduled_tokens: Mapping[str, int]) -> torch.Tensor:
        return torch.from_numpy(runs_slots(self.step_slot_runs(req_ids, num_scheduled_tokens)))

    def step_slot_runs(self, req_ids: Sequence[str],
                       num_scheduled_tokens: Mapping[str, int]) -> np.ndarray:
        """`step_slots_cpu` as runs of consecutive slots (`[k, 2]` of (first, end)), found a
        block at a time: O(requests + blocks), whatever the step's tokens."""
        if not self._checked:
            self.check()
        table = self._table()
        return request_slot_runs(req_ids, num_scheduled_tokens, self.input_batch.req_id_to_index,
                                 np.asarray(self.input_batch.num_computed_tokens_cpu),
                                 self._block_ids(table), int(table.block_size),
                                 "the runner's batch")

    def step_layout(self, num_scheduled_tokens: Mapping[str, int], num_rows: int
                    ) -> tuple[list[str], np.ndarray, int, int, np.ndarray | None, int, int]:
        """The step's row order and slots in one C call (`_core.step_layout`): the batch's
        scheduled requests, their row ends, their tokens' total and smallest count, and
        `step_slot_runs` of them with the runs' min and max slot (None where the step's
        `num_rows` rows are not its scheduled tokens: the step is refused for its rows)."""
        if not self._checked:
            self.check()
        table = self._table()
        try:
            return _core.step_layout(self.input_batch.req_ids, num_scheduled_tokens,
                                     self.input_batch.req_id_to_index,
                                     np.asarray(self.input_batch.num_computed_tokens_cpu),
                                     self._block_ids(table), int(table.block_size), _int64s,
                                     num_rows)
        except (IndexError, KeyError) as exc:
            raise OmniPrefixCacheUnmatchError(
                f"the runner's batch does not hold the scheduled positions: {exc}") from None

    def request_positions_runs(self, req_id: str, num_positions: int,
                               start: int = 0) -> np.ndarray | None:
        """The slots of `req_id`'s positions `[start, num_positions)` as runs, from its row of
        the block table, else from the runner's state of it; None where neither holds it."""
        row = self.input_batch.req_id_to_index.get(req_id)
        if row is None:
            held = None if self._request_block_ids is None else self._request_block_ids(req_id)
            if held is None:
                return None
            return positions_slot_runs(req_id, start, num_positions,
                                       np.asarray(held[self.group_id], dtype=np.int64),
                                       self.block_size, "the runner's request state")
        table = self._table()
        return positions_slot_runs(req_id, start, num_positions, self._block_ids(table)[row],
                                   int(table.block_size), "the runner's batch")

    def requests_positions_runs(self, req_ids: Sequence[str], starts: Sequence[int],
                                ends: Sequence[int]) -> np.ndarray | None:
        """`request_positions_runs` of every request at once, `[starts[i], ends[i])` of
        `req_ids[i]`, end to end; None where the batch does not hold each of them."""
        index_of = self.input_batch.req_id_to_index
        rows = [index_of.get(req_id) for req_id in req_ids]
        if None in rows:
            return None
        table = self._table()
        return rows_positions_runs(req_ids, rows, starts, ends, self._block_ids(table),
                                   int(table.block_size), "the runner's batch")

    @staticmethod
    def _block_ids(table: Any) -> np.ndarray:
        return table.get_numpy_array() if hasattr(table, "get_numpy_array") \
            else table.get_cpu_tensor().numpy()


#: `_core.step_layout`'s arrays
_int64s = functools.partial(np.empty, dtype=np.int64)


def positions_slot_runs(req_id: str, start: int, end: int, block_ids: np.ndarray, unit: int,
                        batch: str) -> np.ndarray:
    """The slots of a request's positions `[start, end)` given its row of block ids, as
    `[k, 2]` runs (see `request_slot_runs`): O(blocks of the span), wherever it starts."""
    return request_slot_runs([req_id], {req_id: max(end - start, 0)}, {req_id: 0},
                             np.array([start], dtype=np.int64), block_ids[None, :], unit, batch)


def rows_positions_runs(req_ids: Sequence[str], rows: Sequence[int], starts: Sequence[int],
                        ends: Sequence[int], block_ids: np.ndarray, unit: int, batch: str
                        ) -> np.ndarray:
    """The slots of each request's positions `[starts[i], ends[i])` given its row `rows[i]` of
    block ids, end to end as `[k, 2]` runs (see `request_slot_runs`): one call for them all."""
    firsts = np.zeros(len(block_ids), dtype=np.int64)
    firsts[rows] = starts
    return request_slot_runs(req_ids, dict(zip(req_ids, map(operator.sub, ends, starts))),
                             dict(zip(req_ids, rows)), firsts, block_ids, unit, batch)


def request_slot_runs(req_ids: Sequence[str], num_scheduled_tokens: Mapping[str, int],
                      index_of: Mapping[str, int], computed: np.ndarray, table: np.ndarray,
                      unit: int, batch: str) -> np.ndarray:
    """The slots of each request's next scheduled positions, from `computed[index_of[r]]` on,
    `slot = table[index_of[r], p // unit] * unit + p % unit`, as `[k, 2]` runs of consecutive
    slots found a block at a time; `batch` names the batch in the error."""
    # a request's positions span at most count // unit + 2 blocks
    tokens = sum(map(num_scheduled_tokens.__getitem__, req_ids))
    runs = np.empty((tokens // unit + 2 * len(req_ids), 2), dtype=np.int64)
    try:
        k, _, _ = _core.request_runs(req_ids, num_scheduled_tokens, index_of, computed, table,
                                     unit, runs)
    except (IndexError, KeyError) as exc:
        raise OmniPrefixCacheUnmatchError(
            f"{batch} does not hold the scheduled positions: {exc}") from None
    return runs[:k]
