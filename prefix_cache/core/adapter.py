"""The one module that knows vLLM's SchedulerOutput field names (vLLM 0.23 to 0.33).

`translate_step` turns a scheduler output — or any object with the same
fields, such as a `types.SimpleNamespace` — into the events the manager acts
on. Fields that moved between releases are read through getattr. On the C step
path `_core.running_step` reads the fields `_only_running` reads, the same way,
to take a step of running requests only in one call (tests/test_core.py holds
the two to the same answer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from prefix_cache.errors import OmniPrefixCacheInputError, OmniPrefixCacheUnmatchError


class StartedRequest(NamedTuple):
    """A request (re)starting from `num_computed_tokens` cached tokens on the cached group's blocks."""

    req_id: str
    num_computed_tokens: int
    block_ids: tuple[int, ...]


class StepEvents(NamedTuple):
    """What one scheduler step means to the cache, in the order the manager applies it (a
    tuple: a frozen dataclass's fields cost a step's engine thread several µs to set)."""

    finished: tuple[str, ...]
    preempted: frozenset[str]
    block_copies: tuple[tuple[int, int], ...]
    started: tuple[StartedRequest, ...]  # scheduled_new_reqs
    resumed: frozenset[str]
    #: resumed requests whose cached-request data carries their computed tokens and blocks
    resumed_starts: tuple[StartedRequest, ...]
    num_scheduled_tokens: Mapping[str, int]


#: The events of a step of running requests only, but for its scheduled tokens (none started,
#: resumed, finished, preempted, or copied a block)
RUNNING_ONLY = StepEvents((), frozenset(), (), (), frozenset(), (), {})


def _req_id(new_req: Any) -> str:
    req_id = getattr(new_req, "req_id", None)
    return getattr(new_req, "request_id", None) if req_id is None else req_id


def _group_blocks(block_ids: Any, group_id: int, req_id: str) -> tuple[int, ...]:
    """The cached group's block list out of vLLM's per-group tuple (or a bare list)."""
    if block_ids is None:
        return ()
    groups = list(block_ids)
    if groups and not isinstance(groups[0], (list, tuple)):
        groups = [groups]  # a single group given as a flat list
    if group_id >= len(groups):
        raise OmniPrefixCacheUnmatchError(
            f"request {req_id}: block_ids has {len(groups)} KV-cache group(s), "
            f"the cache mirrors group {group_id}")
    return tuple(map(int, groups[group_id]))


def _resumed(cached: Any) -> frozenset[str]:
    if cached is None:
        return frozenset()
    resumed = getattr(cached, "resumed_req_ids", None)
    if resumed is not None:  # vLLM >= 0.11.1
        return frozenset(resumed)
    flags = getattr(cached, "resumed_from_preemption", None) or ()
    return frozenset(r for r, flag in zip(getattr(cached, "req_ids", ()), flags) if flag)


def _resumed_starts(cached: Any, resumed: frozenset[str], group_id: int
                    ) -> tuple[StartedRequest, ...]:
    """Resumed requests as restarts: a resume's `new_block_ids` are all of its blocks."""
    computed = getattr(cached, "num_computed_tokens", None)
    new_blocks = getattr(cached, "new_block_ids", None)
    if not resumed or computed is None or new_blocks is None:
        return ()
    return tuple(StartedRequest(req_id, int(h), _group_blocks(blocks, group_id, req_id))
                 for req_id, h, blocks in zip(cached.req_ids, computed, new_blocks)
                 if req_id in resumed)


def _block_copies(copies: Iterable[Any] | None) -> tuple[tuple[int, int], ...]:
    out = []
    for copy in copies or ():
        if isinstance(copy, (tuple, list)):
            src, dst = copy
        else:
            src, dst = copy.src_block_id, copy.dst_block_id
        out.append((int(src), int(dst)))
    return tuple(out)


_NONE: frozenset[str] = frozenset()


def _only_running(scheduler_output: Any) -> bool:
    """Whether the step only schedules running requests (most decode steps): nothing new,
    resumed, finished, preempted or copied."""
    return not (getattr(scheduler_output, "scheduled_new_reqs", None)
                or getattr(scheduler_output, "finished_req_ids", None)
                or getattr(scheduler_output, "preempted_req_ids", None)
                or getattr(scheduler_output, "kv_cache_block_copies", None)
                or _resumed(getattr(scheduler_output, "scheduled_cached_reqs", None)))


def translate_step(scheduler_output: Any, group_id: int = 0) -> StepEvents:
    """The step's events from a vLLM `SchedulerOutput` (0.23-0.33) or a look-alike."""
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None)
    if not isinstance(scheduled, Mapping):
        raise OmniPrefixCacheInputError(
            f"new_step_starts: expected a vLLM SchedulerOutput (or an object with its fields, "
            f"num_scheduled_tokens a dict), got {type(scheduler_output).__name__}")
    if _only_running(scheduler_output):
        return StepEvents((), _NONE, (), (), _NONE, (), dict(scheduled))
    started = tuple(
        StartedRequest(_req_id(new), int(getattr(new, "num_computed_tokens", 0) or 0),
                       _group_blocks(getattr(new, "block_ids", None), group_id, _req_id(new)))
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ())
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    resumed = _resumed(cached)
    resumed_starts = _resumed_starts(cached, resumed, group_id)
    for req in started + resumed_starts:
        if req.num_computed_tokens < 0:
            raise OmniPrefixCacheUnmatchError(
                f"request {req.req_id}: negative num_computed_tokens {req.num_computed_tokens}")
    return StepEvents(
        finished=tuple(getattr(scheduler_output, "finished_req_ids", None) or ()),
        preempted=frozenset(getattr(scheduler_output, "preempted_req_ids", None) or ()),
        block_copies=_block_copies(getattr(scheduler_output, "kv_cache_block_copies", None)),
        started=started,
        resumed=resumed,
        resumed_starts=resumed_starts,
        num_scheduled_tokens=dict(scheduled),
    )


def allocated_blocks(scheduler_output: Any, events: StepEvents, block_size: int,
                     group_id: int = 0) -> list[int]:
    """The blocks vLLM gave new tenants in this step: a (re)started request's blocks past its
    prefix hit, and a running request's `new_block_ids` (all of a resumed one's where its hit is
    not known: marking a block too many only costs a hit on it its early read)."""
    restarts = events.started + events.resumed_starts
    blocks = [b for req in restarts for b in req.block_ids[req.num_computed_tokens // block_size:]]
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    new_blocks = getattr(cached, "new_block_ids", None) or ()
    restarted = {req.req_id for req in events.resumed_starts}
    for req_id, added in zip(getattr(cached, "req_ids", ()), new_blocks):
        if added is not None and req_id not in restarted:
            blocks.extend(_group_blocks(added, group_id, req_id))
    return blocks
