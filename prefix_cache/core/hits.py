"""Prefix hits: the slots a hit covers, and the checks a hit passes before its step claims any.

A hit is served from the pool only if every row it reads was written and not lost;
anything else would hand the next stage rows nobody computed, so it is refused by
name (SPEC §4 rules 4 and 7).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prefix_cache.config import HIDDEN_KEY
from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.layout import StepLayout
from prefix_cache.core.outputs import StepOutputs
from prefix_cache.errors import OmniPrefixCacheUnmatchError


@dataclass(frozen=True)
class StepHits:
    """A step's prefix hits, their slots joined once for every check and plan of the step:
    hit `i` is request `req_ids[i]`'s first `tokens[i]` positions, at slots
    `slots[bounds[i]:bounds[i + 1]]`."""

    req_ids: tuple[str, ...]
    tokens: tuple[int, ...]
    slots: np.ndarray
    bounds: np.ndarray

    @classmethod
    def join(cls, hits: Sequence[tuple[str, int, np.ndarray]]) -> StepHits:
        """From `(request, hit tokens, the slots of positions [0, hit tokens))` per hit."""
        return cls(tuple(req_id for req_id, _, _ in hits), tuple(h for _, h, _ in hits),
                   np.concatenate([slots for _, _, slots in hits]) if hits
                   else np.empty(0, dtype=np.int64),
                   np.cumsum([0, *(len(slots) for _, _, slots in hits)]))

    @classmethod
    def of_blocks(cls, hits: Sequence[tuple[str, int, Sequence[int]]], block_size: int,
                  num_blocks: int) -> StepHits:
        """From `(request, hit tokens h, its block ids)` per hit: the slots of its positions
        `[0, h)`, checked as `hit_slots` checks them (its refusal, naming the request), all
        in one pass."""
        bs = block_size
        blocks: list[int] = []
        for req_id, h, block_ids in hits:
            if h % bs or len(block_ids) < h // bs:
                hit_slots(req_id, h, block_ids, bs, num_blocks)  # raises
            blocks.extend(block_ids[: h // bs])
        ids = np.asarray(blocks, dtype=np.int64)
        if len(ids) and (ids.min() <= 0 or ids.max() >= num_blocks):
            for req_id, h, block_ids in hits:  # the first request with a block outside
                hit_slots(req_id, h, block_ids, bs, num_blocks)
        tokens = tuple(h for _, h, _ in hits)
        return cls(tuple(req_id for req_id, _, _ in hits), tokens,
                   (ids[:, None] * bs + np.arange(bs)).ravel(), np.cumsum([0, *tokens]))

    def __len__(self) -> int:
        return len(self.req_ids)

    def slots_of(self, i: int) -> np.ndarray:
        return self.slots[self.bounds[i]:self.bounds[i + 1]]

    def select(self, indices: Sequence[int]) -> StepHits:
        """The hits at `indices`, in that order (itself when that is all of them)."""
        if list(indices) == list(range(len(self))):
            return self
        return StepHits.join([(self.req_ids[i], self.tokens[i], self.slots_of(i))
                              for i in indices])


#: The hits of a step without any (most steps): built once, not per step.
NO_HITS = StepHits.join([])


def hit_slots(req_id: str, num_computed_tokens: int, block_ids: Sequence[int], block_size: int,
              num_blocks: int) -> np.ndarray:
    """The slots of a request's hit positions `[0, num_computed_tokens)`, checked."""
    h, bs = num_computed_tokens, block_size
    if h % bs:
        raise OmniPrefixCacheUnmatchError(
            f"request {req_id}: prefix hit of {h} tokens is not aligned to "
            f"block_size {bs}; vLLM never caches partial blocks")
    blocks = list(block_ids[: h // bs])
    if len(blocks) < h // bs:
        raise OmniPrefixCacheUnmatchError(
            f"request {req_id}: prefix hit of {h} tokens but only "
            f"{len(block_ids)} block ids")
    if blocks and (min(blocks) <= 0 or max(blocks) >= num_blocks):
        raise OmniPrefixCacheUnmatchError(
            f"request {req_id}: hit block ids {blocks} outside 1..{num_blocks - 1}")
    return (np.asarray(blocks, dtype=np.int64)[:, None] * bs + np.arange(bs)).ravel()


def blocks_written(runs: np.ndarray, blocks: np.ndarray, block_size: int) -> np.ndarray:
    """Mask of `blocks` that some slot of `runs` (`[k, 2]` runs `[lo, hi)` of slots) falls in:
    a block is written iff a run starting before its end ends past its start."""
    if not len(runs) or not len(blocks):
        return np.zeros(len(blocks), dtype=bool)
    order = np.argsort(runs[:, 0], kind="stable")
    reach = np.maximum.accumulate(runs[order, 1])  # the furthest end of the runs up to each
    starts = blocks * block_size
    last = np.searchsorted(runs[order, 0], starts + block_size) - 1  # last run starting before
    return (last >= 0) & (reach[np.maximum(last, 0)] > starts)


def check_hits(pool: PrefixBlockPool, lock: threading.Lock, hits: StepHits, layout: StepLayout,
               outputs: StepOutputs) -> None:
    """A hit on hidden rows nobody wrote, or on rows of any key a failed write lost (and this
    step does not write again; a key the step omits included), is fatal; checked before any
    claim, for all the step's hits at once (the request is named from its own slots)."""
    if not hits or not _refused(pool, lock, hits.slots, layout, outputs).any():
        return
    for i, req_id in enumerate(hits.req_ids):  # the first refused request, named
        _check_request(pool, lock, req_id, hits.tokens[i], hits.slots_of(i), layout, outputs)


def _refused(pool: PrefixBlockPool, lock: threading.Lock, slots: np.ndarray, layout: StepLayout,
             outputs: StepOutputs) -> np.ndarray:
    """Mask of hit `slots` that cannot be served: lost (any key) or, with hidden rows in the
    step, never written; either unless this step writes them again."""
    with lock:
        refused = np.zeros(len(slots), dtype=bool)
        for key in pool.keys:
            refused |= pool.lost(key, slots)
        if outputs.hidden is not None:
            refused |= ~pool.present(HIDDEN_KEY, slots)
    # the step's own slots are looked up only where some hit slot is refused (rare)
    return refused & ~np.isin(slots, layout.slots) if refused.any() else refused


def _check_request(pool: PrefixBlockPool, lock: threading.Lock, req_id: str, h: int,
                   slots: np.ndarray, layout: StepLayout, outputs: StepOutputs) -> None:
    """`check_hits` for one request, raising its refusal by name."""
    rewritten = np.isin(slots, layout.slots)
    with lock:
        for key in pool.keys:
            lost = pool.lost(key, slots) & ~rewritten
            if lost.any():
                raise OmniPrefixCacheUnmatchError(
                    f"request {req_id}: prefix hit of {h} tokens, but the {key!r} rows "
                    f"of {int(lost.sum())} hit slots (first {int(slots[lost][0])}) "
                    f"were lost to a failed write; those positions cannot be served")
        present = pool.present(HIDDEN_KEY, slots)
    missing = ~present & ~rewritten
    if outputs.hidden is not None and missing.any():
        raise OmniPrefixCacheUnmatchError(
            f"request {req_id}: prefix hit of {h} tokens but hidden rows of "
            f"{int(missing.sum())} hit slots were never written (first slot "
            f"{int(slots[missing][0])}); the cache does not match vLLM's KV cache")
