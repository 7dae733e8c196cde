"""A capped host pool against vLLM's real scheduler: the cache's scheduler class keeps the map of
KV blocks to pool blocks, the manager follows it, and every row any request receives is its own.

Random workloads (shared-prefix families, chunked prefill, aborts, a KV cache that preempts) run
through vLLM's `Scheduler` and `AsyncScheduler` (step N's output read after step N+1 is
scheduled) with `PoolResidency` over a pool of a little more than one longest
request's blocks; a `BatchMirror` plays the runner and `StepChecker` checks each request's rows
(its prefix hit's included) against the rows of its tokens, exactly. Every block a running request
holds has a pool block after each schedule, the pool is never over its blocks, blocks are
evicted, and hits are both served and cut.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from prefix_cache import PrefixCacheConfig, OmniPrefixCacheManager, devices
from prefix_cache.core.residency import POOL_MOVES_ATTR
from tests import scheduler_trace
from tests.scheduler_trace import (KEY_WIDTHS, POLICY, BatchMirror, StepChecker, Workload,
                                   random_workload)
from tests.vllm_fixtures import thinker_model_dir  # noqa: F401

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HIDDEN = 256  # the tiny model's hidden size: the scheduler side sizes the pool by it
TOKEN_BYTES = HIDDEN * 4  # float32


class Restarts:
    """`scheduler_trace.step_spans`, with a request resumed after preemption at a prefix hit past
    the positions its steps reached delivering from 0, its hit included (SPEC §4 rule 2: a
    resume is a restart; the capped pool's admission preempts more, so vLLM resumes requests on
    hits other requests made meanwhile)."""

    def __init__(self) -> None:
        self.reach: dict[str, int] = {}

    def __call__(self, so: Any) -> dict[str, tuple[int, int, int]]:
        spans = STEP_SPANS(so)
        for req_id in so.finished_req_ids:
            self.reach.pop(req_id, None)
        restarted = {new.req_id for new in so.scheduled_new_reqs}
        for req_id in so.scheduled_cached_reqs.resumed_req_ids:
            start, n, end = spans[req_id]
            if n > self.reach.get(req_id, 0):
                spans[req_id] = (0, n, end)
            restarted.add(req_id)
        for req_id, (_, n, end) in spans.items():
            self.reach[req_id] = end if req_id in restarted else max(end,
                                                                     self.reach.get(req_id, 0))
        return spans


STEP_SPANS = scheduler_trace.step_spans


def capped_run(workload: Workload, pool_blocks: int, max_model_len: int,
               async_scheduling: bool = False) -> tuple[StepChecker, dict[str, Any], Any]:
    """`workload` through vLLM's scheduler with a host budget of `pool_blocks` blocks and the
    cache's scheduler class, the manager on a `BatchMirror`, every step checked."""
    from vllm.v1.request import RequestStatus

    from prefix_cache.integration.workers.finishes import PoolResidency
    from tests.vllm_fixtures import fake_model_step, make_request, make_scheduler

    bs = workload.block_size

    def configure(vllm_config: Any) -> None:
        vllm_config.scheduler_config.async_scheduling = async_scheduling
        vllm_config.additional_config = {"prefix_cache": {
            "host_budget_bytes": pool_blocks * bs * TOKEN_BYTES}}
        base = vllm_config.scheduler_config.get_scheduler_cls()
        vllm_config.scheduler_config.scheduler_cls = type(
            f"Resident{base.__name__}", (PoolResidency, base), {})

    scheduler = make_scheduler(workload.num_blocks, bs, workload.max_num_seqs,
                               workload.max_num_batched_tokens, max_model_len=max_model_len,
                               configure=configure)
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    assert isinstance(scheduler, AsyncScheduler) == async_scheduling
    residency = scheduler._omni_residency
    assert residency is not None and residency.pool_blocks == pool_blocks
    mirror = BatchMirror(bs, workload.seed)
    manager = OmniPrefixCacheManager(
        PrefixCacheConfig(workload.num_blocks, bs, pool_blocks=pool_blocks,
                          staging_capacity_tokens=workload.max_num_batched_tokens,
                          staging_claim_timeout_s=10.0),
        mirror, backend=devices.get_backend("cpu"))
    manager.register_policy(POLICY)
    requests = {r.req_id: make_request(r.req_id, r.prompt, r.max_tokens, hash_block_size=bs)
                for r in workload.requests}
    checker = StepChecker(manager, mirror, lambda r: requests[r].all_token_ids, bs, lag=1)
    seen: Counter[str] = Counter()
    scheduler_trace.step_spans = Restarts()
    in_flight = None  # asynchronous: the step whose output is not read yet
    try:
        for step in range(800):
            for r in workload.requests:
                if r.arrive_at == step:
                    scheduler.add_request(requests[r.req_id])
                if r.abort_at == step and not requests[r.req_id].is_finished():
                    scheduler.finish_requests(r.req_id, RequestStatus.FINISHED_ABORTED)
            if step > max(r.arrive_at for r in workload.requests) \
                    and not scheduler.has_requests():
                if in_flight is None:
                    break
                fake_model_step(scheduler, in_flight)
                in_flight = None
                continue
            so = scheduler.schedule()
            if in_flight is not None:  # asynchronous: step N's output is read after N+1 is
                fake_model_step(scheduler, in_flight)  # scheduled, before N+1 runs
                in_flight = None
            moves = getattr(so, POOL_MOVES_ATTR)
            seen["moves"] += len(moves.kv_blocks)
            for req in scheduler.running:  # every block a running request holds has rows
                (blocks,) = scheduler.kv_cache_manager.get_block_ids(req.request_id)
                assert all(residency.pool_of[b] for b in blocks), (step, req.request_id)
            assert residency.resident_blocks <= pool_blocks - 1
            checker.step(so)
            if async_scheduling:
                in_flight = so
            else:
                fake_model_step(scheduler, so)
        else:
            raise AssertionError(f"{workload.name}: still running after 800 steps")
        checker.drain()
        stats = manager.stats()
    finally:
        scheduler_trace.step_spans = STEP_SPANS
        manager.shutdown()
    return checker, stats, scheduler


def capped_workload(seed: int) -> tuple[Workload, int, int]:
    """`random_workload(seed)` over a roomier KV cache, with a pool of one longest request's
    blocks plus a few: (workload, pool blocks, max_model_len)."""
    rng = random.Random(seed)
    workload = random_workload(seed)
    bs = workload.block_size
    longest = max(-(-(len(r.prompt) + r.max_tokens) // bs) for r in workload.requests)
    pool_blocks = longest + 1 + rng.randrange(0, 4)
    num_blocks = max(workload.num_blocks, pool_blocks + 1 + rng.randrange(longest, 3 * longest))
    return (Workload(workload.name, bs, num_blocks, workload.max_num_seqs,
                     workload.max_num_batched_tokens, workload.requests, workload.seed),
            pool_blocks, longest * bs)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(12))
def test_every_row_is_exact_under_a_capped_pool_on_vllms_scheduler(
        seed: int, async_scheduling: bool) -> None:
    workload, pool_blocks, max_model_len = capped_workload(seed)
    checker, stats, scheduler = capped_run(workload, pool_blocks, max_model_len,
                                           async_scheduling)
    assert stats["resident_blocks"] <= pool_blocks - 1
    assert stats["pool_blocks"] == pool_blocks - 1
    for key, width in KEY_WIDTHS.items():
        assert stats[f"pool_bytes.{key}"] == pool_blocks * workload.block_size * width * 4


def test_a_capped_pool_evicts_cuts_hits_and_still_serves_resident_ones() -> None:
    """Over the seeds together: blocks are evicted, hits on evicted rows are cut and
    recomputed, and hits on rows that stayed are served from the pool."""
    totals: Counter[str] = Counter()
    for seed in range(12):
        workload, pool_blocks, max_model_len = capped_workload(seed)
        checker, stats, _ = capped_run(workload, pool_blocks, max_model_len)
        totals["evicted"] += stats["evicted_blocks"]
        totals["trimmed"] += stats["hit_tokens_trimmed"]
        totals["hits"] += checker.hit_tokens
    assert totals["evicted"] > 0 and totals["trimmed"] > 0 and totals["hits"] > 0, totals


# ---------------------------------------------------------------------- the real CPU engine

#: The demo's shape with prompts of up to 160 tokens: one request holds at most 5 blocks.
CAPPED_SHAPE_ARGS = dict(max_model_len=160, num_blocks=25)
#: The cache's scheduler, named for an engine whose worker runs in a process of its own.
RESIDENT_SCHEDULER = "prefix_cache.integration.workers.finishes.ResidentScheduler"
#: Eight blocks of rows (7 usable beside the unused block 0) of the KV cache's 25.
CAPPED_BUDGET = 8 * 32 * TOKEN_BYTES


def capped_workload_requests() -> list[Any]:
    """The demo's workload without its 704-token prompt (longer than this shape's requests)."""
    from prefix_cache.tools import demo
    return [r for r in demo.make_workload(seed=1) if r.req_id != "req-long"]


def run_engine(model_dir: Any, requests: list[Any], shape: Any, *, prefix_caching: bool,
               multiprocessing: bool, budget: int | None = None, asynchronous: bool = False,
               stream: bool = False, **engine_args: Any
               ) -> tuple[Any, list[dict[str, int | float]]]:
    """`requests` through a thinker of `shape` (a host budget of `budget` bytes), its run and
    each rank's stats."""
    from contextlib import nullcontext

    from prefix_cache.channel import open_channel
    from prefix_cache.tools.pipelines.engines import multiprocessing_mode, start_thinker
    from prefix_cache.tools.pipelines.pipeline import run_pipeline
    from tests.vllm_fixtures import cpu_async_scheduling, engine_runner

    options: dict[str, Any] = {} if budget is None else {"host_budget_bytes": budget}
    if stream:
        options["stream"] = True
    with multiprocessing_mode(multiprocessing), open_channel() as channel:
        with cpu_async_scheduling() if asynchronous else nullcontext():
            # an engine core of its own runs its worker in another process: the scheduler is
            # named; in this one the worker installs it
            named = {"scheduler_cls": RESIDENT_SCHEDULER} if multiprocessing else {}
            thinker = start_thinker(model_dir, channel, prefix_caching=prefix_caching,
                                    shape=shape, stage_options=options, **named,
                                    **engine_args)
        try:
            if asynchronous:
                assert engine_runner(thinker).vllm_config.scheduler_config.async_scheduling
            run = run_pipeline(thinker, channel, requests)
            stats = thinker.rank_stats()
        finally:
            thinker.close()
    return run, stats


@pytest.fixture(scope="module")
def capped_shape() -> Any:
    from prefix_cache.tools.pipelines.engines import EngineShape
    return EngineShape(**CAPPED_SHAPE_ARGS)


@pytest.fixture(scope="module")
def uncached_run(thinker_model_dir: Any, capped_shape: Any) -> Any:
    run, _ = run_engine(thinker_model_dir, capped_workload_requests(), capped_shape,
                        prefix_caching=False, multiprocessing=False)
    return run


def check_capped_run(run: Any, stats: dict[str, int | float], reference: Any) -> None:
    """Every row within float32 tolerance of the run without prefix caching, the pools under
    the budget, blocks evicted, hits cut and served."""
    from prefix_cache import HIDDEN_KEY
    from prefix_cache.tools import demo
    checks = demo.compare(run, reference, demo.TOLERANCE["cpu"])
    assert [c for c in checks if not c.ok] == []
    assert sum(v for k, v in stats.items() if k.startswith("pool_bytes.")) <= CAPPED_BUDGET
    assert stats[f"pool_bytes.{HIDDEN_KEY}"] == CAPPED_BUDGET
    assert stats["pool_blocks"] == 7 and stats["resident_blocks"] <= 7
    assert stats["evicted_blocks"] > 0
    assert stats["hit_tokens_trimmed"] > 0  # recomputed: their rows are exact above
    # vLLM counts a request's hit at its first schedule; the cache also each resume's
    served = sum(c.cached_tokens for c in checks)
    assert served > 0 and stats["hit_tokens"] >= served


def test_a_capped_multiprocess_engine_matches_a_run_without_prefix_caching(
        thinker_model_dir: Any, capped_shape: Any, uncached_run: Any) -> None:
    run, stats = run_engine(thinker_model_dir, capped_workload_requests(), capped_shape,
                            prefix_caching=True, multiprocessing=True, budget=CAPPED_BUDGET)
    check_capped_run(run, stats[0], uncached_run)


def test_a_capped_engine_scheduling_asynchronously_matches_a_run_without_prefix_caching(
        thinker_model_dir: Any, capped_shape: Any, uncached_run: Any) -> None:
    run, stats = run_engine(thinker_model_dir, capped_workload_requests(), capped_shape,
                            prefix_caching=True, multiprocessing=False, budget=CAPPED_BUDGET,
                            asynchronous=True)
    check_capped_run(run, stats[0], uncached_run)


def test_a_capped_streaming_engine_matches_a_run_without_prefix_caching(
        thinker_model_dir: Any, capped_shape: Any, uncached_run: Any) -> None:  # noqa: F811
    """Streamed: a hit's cached rows go out as its first chunk while the step runs, then a
    chunk every step, each read from the pool through the map."""
    run, stats = run_engine(thinker_model_dir, capped_workload_requests(), capped_shape,
                            prefix_caching=True, multiprocessing=False, budget=CAPPED_BUDGET,
                            stream=True)
    check_capped_run(run, stats[0], uncached_run)
    assert stats[0]["delivery_chunks"] > 0


def test_a_capped_engine_that_preempts_matches_a_run_without_prefix_caching(
        thinker_model_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Four 48-token prompts decoding 100 tokens each outgrow a 7-block KV cache and a pool of 6
    blocks: vLLM preempts (for KV blocks or for pool blocks), and every row is still exact."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from prefix_cache.tools import demo
    from tests.vllm_fixtures import PREEMPTING_SHAPE, unrelated_decoding_requests

    preempted: list[str] = []
    preempt = Scheduler._preempt_request
    monkeypatch.setattr(Scheduler, "_preempt_request", lambda self, request, *args, **kwargs: (
        preempted.append(request.request_id), preempt(self, request, *args, **kwargs))[1])
    budget = 7 * 32 * TOKEN_BYTES
    off, _ = run_engine(thinker_model_dir, unrelated_decoding_requests(), PREEMPTING_SHAPE,
                        prefix_caching=False, multiprocessing=False)
    preempted.clear()
    on, (stats,) = run_engine(thinker_model_dir, unrelated_decoding_requests(),
                              PREEMPTING_SHAPE, prefix_caching=True, multiprocessing=False,
                              budget=budget)
    assert preempted, "no request was preempted"
    checks = demo.compare(on, off, demo.TOLERANCE["cpu"])
    assert [c for c in checks if not c.ok] == []
    assert stats["pool_blocks"] == 6
    assert sum(v for k, v in stats.items() if k.startswith("pool_bytes.")) <= budget


def test_a_capped_tensor_parallel_engine_matches_a_run_without_prefix_caching(
        thinker_model_dir: Any, capped_shape: Any, uncached_run: Any,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TP=2: rank 0 holds the capped pool, under the budget, and every row is exact; the
    other rank holds none."""
    import os

    from tests.test_tensor_parallel import TP, omp_threads_bind
    if len(os.sched_getaffinity(0)) < TP:
        pytest.skip(f"tensor parallelism over {TP} CPU workers needs {TP} CPUs")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", omp_threads_bind(TP))
    run, (leader, *others) = run_engine(
        thinker_model_dir, capped_workload_requests(), capped_shape, prefix_caching=True,
        multiprocessing=True, budget=CAPPED_BUDGET, tensor_parallel_size=TP,
        distributed_executor_backend="mp")
    check_capped_run(run, leader, uncached_run)
    assert [rank.keys() for rank in others] == [{"worker_rss_bytes"}] * (TP - 1)
