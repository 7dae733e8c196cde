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

from prefix_cache.errors import OmniPrefixCacheUnmatchError


class GroupView(Protocol):
    """Row order and slots of a step's outputs (see FullAttentionGroupView)."""

    def batch_req_ids(self) -> Sequence[str]: ...

    def step_slots_cpu(self, req_ids: Sequence[str],
                       num_scheduled_tokens: Mapping[str, int]) -> torch.Tensor: ...


class StepLayout:
    """Rows `ends[i-1]:ends[i]` of the step belong to `order[i]`; row r was computed into `slots[r]`."""

    def __init__(self, order: list[str], ends: np.ndarray, slots: np.ndarray) -> None:
        self.order = order
        self.ends = ends
        self.slots = slots
        self._index: dict[str, int] | None = None

    @classmethod
    def of_step(cls, view: GroupView, scheduled: Mapping[str, int], num_rows: int,
                block_size: int, num_slots: int) -> StepLayout:
        """The layout of a step's `num_rows` rows, checked against the scheduler's counts."""
        batch = view.batch_req_ids()
        if len(batch) == len(scheduled) and all(map(scheduled.__contains__, batch)):
            order = list(batch)  # vLLM's runner batch holds exactly the scheduled requests
        else:
            order = [r for r in batch if scheduled.get(r, 0) > 0]
        counts = np.fromiter(map(scheduled.__getitem__, order), dtype=np.int64, count=len(order))
        ends = np.cumsum(counts)
        total = int(ends[-1]) if len(ends) else 0
        left_out = len(scheduled) - len(order)  # only requests scheduled for 0 tokens may be
        if total != num_rows or (counts <= 0).any() or (
                left_out and left_out != sum(1 for c in scheduled.values() if c <= 0)):
            raise OmniPrefixCacheUnmatchError(
                f"save_outputs: {num_rows} rows but the batch {order} schedules {total} tokens "
                f"for {len(order)} of {len(scheduled)} scheduled requests")
        slots = view.step_slots_cpu(order, scheduled).numpy().astype(np.int64, copy=False)
        if len(slots) != num_rows:
            raise OmniPrefixCacheUnmatchError(
                f"save_outputs: the view gave {len(slots)} slots for {num_rows} rows")
        if num_rows and (slots.min() < block_size or slots.max() >= num_slots):
            raise OmniPrefixCacheUnmatchError(
                f"save_outputs: slots outside 1..{num_slots // block_size - 1} blocks "
                f"(min {slots.min()}, max {slots.max()}); block 0 is vLLM's null block")
        return cls(order, ends, slots)

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
