"""A step's chunks planned from every request's slots in one view call (`requests_positions_runs`)
are those planned a request at a time (`request_positions_runs`, the reference), on random
schedules: chunked prefills, decode steps, requests left out of a step, recomputed after
preemption from behind where their chunks reached, finished, and chunks of requests gone."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import numpy as np
import pytest
import torch

from prefix_cache import HIDDEN_KEY, OmniPrefixCacheManager, PrefixCacheConfig
from prefix_cache.core.chunk_reads import ChunkRows
from prefix_cache.core.pool_rows import PoolRows
from prefix_cache.devices import get_backend
from tests.sim import StepDriver, token_rows

BS = 4
WIDTH = 8
MAX_TOKENS = 24


class OneAtATime:
    """The simulated runner's view without `requests_positions_runs`: a step's chunks are
    planned a request at a time."""

    def __init__(self, inner: StepDriver) -> None:
        self._inner = inner

    def batch_req_ids(self) -> list[str]:
        return self._inner.batch_req_ids()

    def step_slots_cpu(self, req_ids: Sequence[str],
                       num_scheduled_tokens: Mapping[str, int]) -> torch.Tensor:
        return self._inner.step_slots_cpu(req_ids, num_scheduled_tokens)

    def request_positions_runs(self, req_id: str, num_positions: int,
                               start: int = 0) -> np.ndarray | None:
        return self._inner.request_positions_runs(req_id, num_positions, start)


def held_bytes(chunk: ChunkRows) -> np.ndarray | str | None:
    """The chunk's hidden rows as bytes (None: it has none), or the error it raises; its rows
    let go."""
    try:
        rows = chunk.hold().get(HIDDEN_KEY)
    except Exception as exc:  # noqa: BLE001 - the error is what is compared
        return f"{type(exc).__name__}: {exc}"
    finally:
        chunk.cancel()
    if rows is None:
        return None
    if isinstance(rows, PoolRows):
        return rows.byte_copy()
    return rows.contiguous().view(torch.uint8).numpy().copy()


def as_bytes(rows: torch.Tensor) -> np.ndarray:
    return rows.contiguous().numpy().view(np.uint8).reshape(len(rows), -1)


@pytest.mark.parametrize("seed", range(6))
def test_chunks_planned_in_one_view_call_are_those_planned_a_request_at_a_time(seed: int
                                                                               ) -> None:
    rng = random.Random(seed)
    sim = StepDriver(BS)
    blocks_each = -(-MAX_TOKENS // BS)
    num_requests = 14
    config = PrefixCacheConfig(1 + num_requests * blocks_each, BS, staging_claim_timeout_s=5.0)
    backend = get_backend("cpu")
    batched = OmniPrefixCacheManager(config, sim, backend=backend)
    reference = OmniPrefixCacheManager(config, OneAtATime(sim), backend=backend)
    managers = (batched, reference)
    for manager in managers:
        manager.preallocate(HIDDEN_KEY, (WIDTH,), torch.float32)
    tokens: dict[str, list[int]] = {}
    stands: dict[str, int] = {}  # where each live request's saved steps reach
    added = 0
    compared = 0
    try:
        for _ in range(40):
            finished = [r for r in sim.reqs if rng.random() < 0.08]
            new, cached = [], {}
            for req_id, req in sim.reqs.items():
                left = len(req.tokens) - req.computed
                if req_id in finished or left == 0 or rng.random() < 0.15:
                    continue  # finished, done computing, or left out of this step
                if rng.random() < 0.1:  # preempted, recomputed from a block boundary behind
                    computed = rng.randrange(0, req.computed + 1) // BS * BS
                    new.append((req_id, req.tokens, req.blocks, computed,
                                rng.randint(1, len(req.tokens) - computed)))
                else:
                    cached[req_id] = rng.randint(1, min(left, 6))
            if added < num_requests and rng.random() < 0.5:
                req_id, added = f"r{added}", added + 1
                tokens[req_id] = [rng.randrange(50_000) for _ in range(rng.randint(4, MAX_TOKENS))]
                blocks = list(range(1 + added * blocks_each - blocks_each, 1 + added * blocks_each))
                new.append((req_id, tokens[req_id], blocks, 0, rng.randint(1, len(tokens[req_id]))))
            out = sim.step(new=new, cached=cached, finished=finished)
            rows = sim.outputs(WIDTH)
            for manager in managers:
                manager.new_step_starts(out)
                manager.discard_step(manager.save_outputs(
                    rows, None, num_tokens_unpadded=len(rows), num_tokens_padded=len(rows),
                    plan_reads=False))
            for req_id in finished:
                stands.pop(req_id, None)
            for req_id, _, _, computed, _ in new:
                stands[req_id] = computed
            for req_id, n in sim.scheduled.items():
                stands[req_id] += n
            # chunks from anywhere, some past where the request stands; at times one of a
            # request gone (the view holds not all of them: each is asked alone)
            chunks = {}
            gone = ["gone"] if rng.random() < 0.2 else []
            for req_id in [*rng.sample(sorted(tokens), min(len(tokens), 5)), *gone]:
                start = rng.randint(0, stands.get(req_id, 0) + 2)
                chunks[req_id] = (start, start + rng.randint(0, 8))
            got = [manager.plan_chunk_rows(chunks) for manager in managers]
            assert list(got[0]) == list(got[1]) == [r for r in chunks if r in sim.reqs]
            for req_id, one in got[0].items():
                other = got[1][req_id]
                start, end = chunks[req_id]
                num_rows = max(min(stands.get(req_id, 0), end), start)
                assert (one.start, one.num_rows) == (other.start, other.num_rows) == \
                    (start, num_rows), req_id
                a, b = held_bytes(one), held_bytes(other)
                if num_rows > start:
                    assert np.array_equal(a, b), req_id
                    assert np.array_equal(
                        a, as_bytes(token_rows(tokens[req_id], WIDTH)[start:num_rows])), req_id
                    compared += 1
                else:
                    assert a is None and b is None, req_id
            sim.advance()
        assert compared > 20  # the schedules do stream rows
        for manager in managers:
            assert not manager.pool.any_pinned(np.arange(manager.pool.num_slots))
    finally:
        for manager in managers:
            manager.shutdown()
