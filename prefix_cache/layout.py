"""Where a step's rows sit: each scheduled request's row range in batch order, and each row's slot.

Built on the engine thread with a handful of numpy calls whatever the batch
size; the per-request lookup table is only built when someone asks for it
(hits, deferred keys, `materialize`), off the per-step fast path.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

import numpy as np
import torch

from prefix_cache import _core
from prefix_cache.errors import OmniPrefixCacheUnmatchError
from prefix_cache.runs import slot_runs


class GroupView(Protocol):
    """Row order and slots of a step's outputs (see FullAttentionGroupView)."""

    def batch_req_ids(self) -> Sequence[str]: ...

    def step_slots_cpu(self, req_ids: Sequence[str],
                       num_scheduled_tokens: Mapping[str, int]) -> torch.Tensor: ...


class StepLayout:
    """Rows `ends[i-1]:ends[i]` of the step belong to `order[i]`; row r was computed into `slots[r]`."""

    def __init__(self, order: list[str], ends: np.ndarray, slots: np.ndarray,
                 runs: np.ndarray) -> None:
        self.order = order
        self.ends = ends
        self.slots = slots
        self.runs = runs  # the slots as runs (see prefix_cache.runs)
        self._index: dict[str, int] | None = None

    @classmethod
    def of_step(cls, view: GroupView, scheduled: Mapping[str, int], num_rows: int,
                block_size: int, num_slots: int) -> StepLayout:
        """The layout of a step's `num_rows` rows, checked against the scheduler's counts."""
        order, ends, total, smallest = _scheduled_rows(list(view.batch_req_ids()), scheduled)
        left_out = len(scheduled) - len(order)  # only requests scheduled for 0 tokens may be
        if total != num_rows or smallest <= 0 < len(order) or (
                left_out and left_out != sum(1 for c in scheduled.values() if c <= 0)):
            raise OmniPrefixCacheUnmatchError(
                f"save_outputs: {num_rows} rows but the batch {order} schedules {total} tokens "
                f"for {len(order)} of {len(scheduled)} scheduled requests")
        slots = np.ascontiguousarray(view.step_slots_cpu(order, scheduled).numpy(),
                                     dtype=np.int64)
        if len(slots) != num_rows:
            raise OmniPrefixCacheUnmatchError(
                f"save_outputs: the view gave {len(slots)} slots for {num_rows} rows")
        runs, low, high = slot_runs(slots)
        if num_rows and (low < block_size or high >= num_slots):
            raise OmniPrefixCacheUnmatchError(
                f"save_outputs: slots outside 1..{num_slots // block_size - 1} blocks "
                f"(min {low}, max {high}); block 0 is vLLM's null block")
        return cls(order, ends, slots, runs)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._lookup()

    def rows(self, req_id: str) -> tuple[int, int]:
        """`req_id`'s row range in the step; KeyError if it has no rows there."""
        i = self._lookup()[req_id]
        return (int(self.ends[i - 1]) if i else 0), int(self.ends[i])

    def items(self) -> Iterator[tuple[str, tuple[int, int]]]:
        starts = np.concatenate(([0], self.ends[:-1])).tolist()
        return zip(self.order, zip(starts, self.ends.tolist()))

    def _lookup(self) -> dict[str, int]:
        if self._index is None:
            self._index = {r: i for i, r in enumerate(self.order)}
        return self._index


def _scheduled_rows(batch: list[str], scheduled: Mapping[str, int]
                    ) -> tuple[list[str], np.ndarray, int, int]:
    """The batch's scheduled requests in batch order, their row ends, the total and the
    smallest count."""
    ends = np.empty(len(batch), dtype=np.int64)
    if len(batch) == len(scheduled):  # vLLM's runner batch holds exactly the scheduled requests
        try:
            return (batch, ends, *_core.row_ends(batch, scheduled, ends))
        except KeyError:
            pass
    order = [r for r in batch if scheduled.get(r, 0) > 0]
    ends = ends[: len(order)]
    return (order, ends, *_core.row_ends(order, scheduled, ends))
