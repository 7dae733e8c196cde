"""When a streaming stage's chunks are due, and how far each request's chunks reach.

A request's positions go out as chunks while it runs: once `every` new positions stand, and
once its prompt's positions all stand. A prompt position stands once computed (a prompt token
is never a stop token); a later one, fed a sampled token, one step after: an asynchronous
scheduler feeds a stop token in the step it already has in flight, and that row is cut at the
finish, so no chunk may carry it.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import Protocol


class StepSpans(Protocol):
    """A step's rows in batch order: request i has rows `ends[i-1]:ends[i]`, from position
    `starts[i]` on (`prefix_cache.integration.stage_outputs.StepBatch`)."""

    req_ids: Sequence[str]
    starts: Sequence[int]
    ends: Sequence[int]


def due_chunk_end(sent: int, end: int, prompt_len: int, every: int) -> int | None:
    """Where a chunk from position `sent` ends, for a request whose rows reach position `end`
    and whose prompt is `prompt_len` long (0: unknown); None while no chunk is due."""
    stands = end if end <= prompt_len else end - 1
    if stands - sent >= every or sent < prompt_len <= stands:
        return stands
    return None


class ChunkSchedule:
    """A streaming stage's chunks per live request, planned on the engine thread where the
    cache keeps its rows (each chunk read back from the pool).

    Invariant: a request's chunks cover its positions `[0, sent)`, each position once; a
    request recomputed after preemption never streams positions again.
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self._sent: dict[str, int] = {}  # per request seen: where its chunks reach
        self._prompt_lens: dict[str, int] = {}

    def note_prompts(self, prompt_lens: Mapping[str, int]) -> None:
        """Prompt lengths of the requests a step schedules anew (before its rows are due)."""
        if prompt_lens:
            self._prompt_lens.update(prompt_lens)

    def first_chunk(self, req_id: str, num_rows: int) -> bool:
        """A prefix hit's rows `[0, num_rows)` go out as the request's first chunk: True for a
        request not seen before, whose chunks now reach `num_rows`; False for one seen (resumed
        after preemption: its positions went out already)."""
        if req_id in self._sent:
            return False
        self._sent[req_id] = num_rows
        return True

    def due(self, batch: StepSpans, skip: Container[str] = ()) -> dict[str, tuple[int, int]]:
        """The chunks a saved step makes due, `(start, end)` positions per request (those in
        `skip` left out: published already); each request's chunks then reach `end`."""
        chunks = {}
        first = 0
        for req_id, start, end_row in zip(batch.req_ids, batch.starts, batch.ends):
            end, first = start + end_row - first, end_row
            if req_id in skip:
                continue
            sent = self._sent.setdefault(req_id, 0)
            stands = due_chunk_end(sent, end, self._prompt_lens.get(req_id, 0), self.every)
            if stands is not None:
                chunks[req_id] = (sent, stands)
                self._sent[req_id] = stands
        return chunks

    def reach(self, req_ids: list[str]) -> dict[str, int]:
        """Where each request's chunks reach (0 for one not seen)."""
        return {req_id: self._sent.get(req_id, 0) for req_id in req_ids}

    def forget(self, req_ids: list[str]) -> dict[str, int]:
        """The requests finished: where each one's chunks reached (its final entry's rows start
        there); they are forgotten."""
        for req_id in req_ids:
            self._prompt_lens.pop(req_id, None)
        return {req_id: self._sent.pop(req_id, 0) for req_id in req_ids}
