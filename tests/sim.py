"""A minimal model of what a vLLM runner hands the cache each step, for scenario tests.

`StepDriver` keeps each request's block list and computed-token count the way
vLLM's persistent batch does, builds `SimpleNamespace` scheduler outputs with
SchedulerOutput's field names, and serves the view protocol. Row values are a
pure function of (request tokens, position), so a hit must reproduce exactly
the rows a cache-off run computes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from prefix_cache.core.runs import slot_runs


def token_rows(tokens: Sequence[int], width: int, dtype: torch.dtype = torch.float32,
               salt: int = 0) -> torch.Tensor:
    """Deterministic `[len(tokens), width]` rows: row p depends on tokens[: p + 1] only."""
    prefix_hash = np.cumsum(np.asarray(tokens, dtype=np.int64) * 7919 + 13 + salt) % 100_003
    cols = np.arange(width, dtype=np.int64)
    values = (prefix_hash[:, None] * 31 + cols[None, :] * 17) % 997
    return torch.from_numpy(values.astype(np.float32) / 997.0).to(dtype)


@dataclass
class SimRequest:
    req_id: str
    tokens: list[int]
    blocks: list[int]
    computed: int


@dataclass
class StepDriver:
    """Scheduler outputs plus the view protocol over a simulated persistent batch."""

    block_size: int
    reqs: dict[str, SimRequest] = field(default_factory=dict)
    batch: list[str] = field(default_factory=list)
    scheduled: dict[str, int] = field(default_factory=dict)
    #: requests the current step retires: held until it ends, as a runner holds them until
    #: it updates its batch (after the step's first hook)
    retiring: list[SimRequest] = field(default_factory=list)

    def step(self, *, new: Sequence[tuple[str, list[int], list[int], int, int]] = (),
             cached: Mapping[str, int] | None = None, finished: Sequence[str] = (),
             new_blocks: Mapping[str, list[int]] | None = None) -> SimpleNamespace:
        """new: (req_id, tokens, blocks, num_computed, num_scheduled); cached: req -> n."""
        self._retire()
        self.retiring = [self.reqs[r] for r in finished if r in self.reqs]
        for req_id, blocks in (new_blocks or {}).items():
            self.reqs[req_id].blocks.extend(blocks)
        new_reqs = []
        self.scheduled = {}
        for req_id, tokens, blocks, computed, n in new:
            self.reqs[req_id] = SimRequest(req_id, list(tokens), list(blocks), computed)
            new_reqs.append(SimpleNamespace(req_id=req_id, num_computed_tokens=computed,
                                            block_ids=(list(blocks),)))
            self.scheduled[req_id] = n
        self.scheduled.update(cached or {})
        self.batch = list(self.scheduled)
        return SimpleNamespace(
            finished_req_ids=set(finished), scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=list(cached or {}), resumed_req_ids=set(),
                new_block_ids=[(list(new_blocks[r]),) if r in (new_blocks or {}) else None
                               for r in cached or {}]),
            num_scheduled_tokens=dict(self.scheduled))

    def outputs(self, width: int, dtype: torch.dtype = torch.float32, salt: int = 0
                ) -> torch.Tensor:
        """This step's rows in batch order: each request's scheduled positions."""
        parts = [token_rows(self.reqs[r].tokens, width, dtype, salt)[
                 self.reqs[r].computed: self.reqs[r].computed + self.scheduled[r]]
                 for r in self.batch]
        return torch.cat(parts) if parts else torch.empty((0, width), dtype=dtype)

    def advance(self) -> None:
        for req_id, n in self.scheduled.items():
            self.reqs[req_id].computed += n
        self._retire()

    def _retire(self) -> None:
        for req in self.retiring:
            if self.reqs.get(req.req_id) is req:  # not re-added under its id meanwhile
                del self.reqs[req.req_id]
        self.retiring = []

    # the view protocol
    def batch_req_ids(self) -> list[str]:
        return list(self.batch)

    def request_positions_runs(self, req_id: str, num_positions: int,
                               start: int = 0) -> np.ndarray | None:
        """The slots of a live request's positions `[start, num_positions)` as runs."""
        req = self.reqs.get(req_id)
        if req is None:
            return None
        slots = np.array([req.blocks[p // self.block_size] * self.block_size
                          + p % self.block_size for p in range(start, num_positions)],
                         dtype=np.int64)
        return slot_runs(slots)[0]

    def requests_positions_runs(self, req_ids: Sequence[str], starts: Sequence[int],
                                ends: Sequence[int]) -> np.ndarray | None:
        """`request_positions_runs` of every request at once, end to end; None unless each
        one is live."""
        if not all(req_id in self.reqs for req_id in req_ids):
            return None
        positions = [(self.reqs[req_id].blocks, p) for req_id, start, end
                     in zip(req_ids, starts, ends, strict=True) for p in range(start, end)]
        slots = np.array([blocks[p // self.block_size] * self.block_size + p % self.block_size
                          for blocks, p in positions], dtype=np.int64)
        return slot_runs(slots)[0]

    def step_slots_cpu(self, req_ids: Sequence[str], num_scheduled_tokens: Mapping[str, int]
                       ) -> torch.Tensor:
        slots = []
        for req_id in req_ids:
            req = self.reqs[req_id]
            for pos in range(req.computed, req.computed + num_scheduled_tokens[req_id]):
                slots.append(req.blocks[pos // self.block_size] * self.block_size
                             + pos % self.block_size)
        return torch.tensor(slots, dtype=torch.int64)
