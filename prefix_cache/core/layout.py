"""Where a step's rows sit: each scheduled request's row range in batch order, and each row's slot.

Built on the engine thread in a few C calls whatever the batch size (one, on the C step
path, where the view offers `step_layout`: `FullAttentionGroupView` does). A view
that gives its slots as runs (`step_slot_runs`, as FullAttentionGroupView does)
keeps the layout O(requests + blocks): the per-row slots and the per-request
lookup table are only built when someone asks for them (hits, deferred keys, a
host-side write, `materialize`), off the per-step fast path.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

import numpy as np
import torch

from prefix_cache.core import _core
from prefix_cache.errors import OmniPrefixCacheUnmatchError
from prefix_cache.core.runs import runs_slots, slot_runs


class GroupView(Protocol):
    """Row order and slots of a step's outputs (see FullAttentionGroupView). A view may also
    offer `step_slot_runs(req_ids, num_scheduled_tokens)`: the same slots as `[k, 2]` runs;
    and `step_layout(num_scheduled_tokens, num_rows)`: the step's order, row ends, tokens'
    total and smallest count, and those runs with their min and max slot, in one call (the
    C path; see FullAttentionGroupView.step_layout). The rows read back from the pool need
    `request_positions_runs(req_id, num_positions, start)`: a request's positions' slots as
    runs (None where the view no longer holds it); a streaming stage's chunks are planned in
    one call where it also offers `requests_positions_runs(req_ids, starts, ends)`: every
    request's, end to end (None unless it holds each one)."""

    def batch_req_ids(self) -> Sequence[str]: ...

    def step_slots_cpu(self, req_ids: Sequence[str],
                       num_scheduled_tokens: Mapping[str, int]) -> torch.Tensor: ...


class StepLayout:
    """Rows `ends[i-1]:ends[i]` of the step belong to `order[i]`; row r was computed into
    `slots[r]`, the slots `runs` holds as runs of consecutive slots (prefix_cache.core.runs)."""

    def __init__(self, order: list[str], ends: np.ndarray, runs: np.ndarray,
                 slots: np.ndarray | None = None) -> None:
        self.order = order
        self.ends = ends
        self.runs = runs
        self._slots = slots  # None: not built yet
        self._index: dict[str, int] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def slots(self) -> np.ndarray:
        """Each row's slot (int64), built from the runs on first use."""
        if self._slots is None:
            self._slots = runs_slots(self.runs)
        return self._slots

    @classmethod
    def of_step(cls, view: GroupView, scheduled: Mapping[str, int], num_rows: int,
                block_size: int, num_slots: int, *, c_path: bool = True) -> StepLayout:
        """The layout of a step's `num_rows` rows, checked against the scheduler's counts;
        `c_path`: in one call where the view offers `step_layout` (its slots are then the
        scheduled tokens' own), else its rows, then its slots, as the reference makes them."""
        layout_of = getattr(view, "step_layout", None) if c_path else None
        if layout_of is not None:
            order, ends, total, smallest, runs, low, high = layout_of(scheduled, num_rows)
            _check_rows(order, scheduled, num_rows, total, smallest)  # refuses runs None
            slots, given = None, total
        else:
            order, ends, total, smallest = _scheduled_rows(list(view.batch_req_ids()), scheduled)
            _check_rows(order, scheduled, num_rows, total, smallest)
            runs_of = getattr(view, "step_slot_runs", None)
            if runs_of is not None:
                slots = None
                runs = runs_of(order, scheduled)
                given, low, high = _core.run_stats(runs)
            else:
                slots = np.ascontiguousarray(view.step_slots_cpu(order, scheduled).numpy(),
                                             dtype=np.int64)
                runs, low, high = slot_runs(slots)
                given = len(slots)
        if given != num_rows:
            raise OmniPrefixCacheUnmatchError(
                f"save_outputs: the view gave {given} slots for {num_rows} rows")
        if num_rows and (low < block_size or high >= num_slots):
            raise OmniPrefixCacheUnmatchError(
                f"save_outputs: slots outside 1..{num_slots // block_size - 1} blocks "
                f"(min {low}, max {high}); block 0 is vLLM's null block")
        return cls(order, ends, runs, slots)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._lookup()

    def unknown(self, req_ids: Sequence[str]) -> list[str]:
        """Those of `req_ids` without rows in the step."""
        if not req_ids:  # a discarded step: no lookup table to build
            return []
        index = self._lookup()
        return [r for r in req_ids if r not in index]

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


def _check_rows(order: list[str], scheduled: Mapping[str, int], num_rows: int, total: int,
                smallest: int) -> None:
    """Refuse a step whose rows are not its batch's scheduled tokens."""
    left_out = len(scheduled) - len(order)  # only requests scheduled for 0 tokens may be
    if total != num_rows or smallest <= 0 < len(order) or (
            left_out and left_out != sum(1 for c in scheduled.values() if c <= 0)):
        raise OmniPrefixCacheUnmatchError(
            f"save_outputs: {num_rows} rows but the batch {order} schedules {total} tokens "
            f"for {len(order)} of {len(scheduled)} scheduled requests")


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
