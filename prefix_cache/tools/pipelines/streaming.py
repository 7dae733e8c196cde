"""The consumer side of a streamed stage: a request's rows from position 0 as they arrive.

A producer with `stream` on publishes a request's rows in chunks while it runs
(`StageChannel.stream`); without it, one whole entry at the finish (`get_entry`).
`RowStream` reads either the same way: iterating it yields the rows that stand
so far, from position 0, after each arrival, and records when each came, so a
stage can start as soon as the positions it needs have arrived.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from prefix_cache.channel import StageChannel
from prefix_cache.config import HIDDEN_KEY


@dataclass
class RowStream:
    """Invariant: `rows()` is every position from 0 that arrived, each once, in order."""

    channel: StageChannel
    request_id: str
    streaming: bool  # chunks as published (stream); else the whole entry (get_entry)
    timeout_s: float  # for each chunk
    key: str = HIDDEN_KEY
    arrived_at: list[float] = field(default_factory=list)  # perf_counter s of each arrival
    aborted: bool = False
    meta: dict[str, Any] = field(default_factory=dict)  # the final chunk's
    _parts: list[torch.Tensor] = field(default_factory=list)

    def __iter__(self) -> Iterator[torch.Tensor]:
        """After each arrival, the rows from position 0 so far (the last yield is all of them)."""
        if self.streaming:
            for chunk in self.channel.stream(self.request_id, self.timeout_s):
                yield self._arrive(chunk.rows, chunk.final, chunk.aborted, chunk.meta)
        else:
            entry = self.channel.get_entry(self.request_id, self.timeout_s)
            yield self._arrive(entry.outputs, True, entry.aborted, entry.meta)

    def rows(self) -> torch.Tensor:
        if not self._parts:
            return torch.empty(0)
        return torch.cat(self._parts) if len(self._parts) > 1 else self._parts[0]

    def check_whole(self) -> None:
        """Raise when the stage aborted the request: its rows stop short of its outputs."""
        if self.aborted:
            raise RuntimeError(f"request {self.request_id}: its stage aborted it after "
                               f"{len(self.rows())} rows; the next stage has no whole input")

    def _arrive(self, outputs: dict[str, torch.Tensor], final: bool, aborted: bool,
                meta: dict[str, Any]) -> torch.Tensor:
        self.arrived_at.append(time.perf_counter())
        if self.key in outputs:
            self._parts.append(outputs[self.key])
        if final:
            self.aborted, self.meta = aborted, dict(meta)
        return self.rows()
