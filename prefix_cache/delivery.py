"""What the next stage receives: each request's rows by prompt position, assembled across steps.

A step hands over a request's rows from some position on: 0 for a prefix hit
(hit rows, then the step's), the request's computed-token count otherwise. A
request recomputed after preemption hands over rows it already delivered; they
replace the earlier ones from that position. Rows that would leave a gap are
refused, since the next stage would silently miss positions.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from prefix_cache.errors import OmniPrefixCacheUnmatchError


@dataclass
class _Part:
    start: int
    rows: dict[str, torch.Tensor]  # key -> [n, *feat]

    @property
    def end(self) -> int:
        return self.start + next(iter(self.rows.values())).shape[0]


class StageDelivery:
    """Per request, parts whose positions run contiguously from 0 (a later part may overlap)."""

    def __init__(self) -> None:
        self._parts: defaultdict[str, list[_Part]] = defaultdict(list)

    def add(self, req_id: str, start: int, rows: dict[str, torch.Tensor]) -> None:
        """`rows` (every key the same row count) hold positions `start, start + 1, ...`."""
        if not rows:
            return
        parts = self._parts[req_id]
        delivered = parts[-1].end if parts else 0
        if start > delivered:
            raise OmniPrefixCacheUnmatchError(
                f"request {req_id}: rows from position {start} but only {delivered} rows were "
                f"delivered; positions {delivered}..{start - 1} would be missing")
        while parts and parts[-1].start >= start:  # recomputed rows replace delivered ones
            parts.pop()
        if parts and parts[-1].end > start:
            kept = start - parts[-1].start
            parts[-1] = _Part(parts[-1].start, {k: v[:kept] for k, v in parts[-1].rows.items()})
        parts.append(_Part(start, rows))

    def take(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each request's rows from position 0, per key; forgets them."""
        parts_by_req, self._parts = self._parts, defaultdict(list)
        return {req_id: {key: torch.cat([p.rows[key] for p in parts]) for key in parts[0].rows}
                for req_id, parts in parts_by_req.items() if parts}

