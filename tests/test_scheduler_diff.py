"""The cache against vLLM 0.32's real v1 Scheduler: every delivered row checked, step by step.

Workloads (tests/scheduler_trace.py) mix shared prefixes, chunked prefill, aborts
at any point, and KV caches small enough that the scheduler preempts requests and
hands blocks that still hold cached prefixes to new tenants. No model runs:
`fake_model_step` completes each step, and each row is `token_rows` of its
request's tokens, so every row the cache delivers has an exact reference. The
runner's persistent batch is `BatchMirror`, shuffled every step.
"""

from __future__ import annotations

from collections import Counter
from itertools import zip_longest

import pytest

pytest.importorskip("vllm")

from tests.scheduler_trace import (  # noqa: E402
    TRACE_DIR,
    TRACE_WORKLOADS,
    WorkloadRun,
    chunked_prefill_aborts,
    preemption_eviction,
    random_workload,
    run_workload,
    shared_prefixes,
)

pytestmark = pytest.mark.vllm

NUM_RANDOM_WORKLOADS = 120


def assert_matches_cache_off(on: WorkloadRun, off: WorkloadRun) -> None:
    """In both runs the next stage holds every computed position of each completed request,
    and requests completed in both end with the same tokens. (An abort may land before or
    after a request completes, depending on how much its prefix hit sped it up.)"""
    for run in (on, off):
        assert {r: run.checker.delivered[r] for r in run.completed} == run.completed
    both = on.completed.keys() & off.completed.keys()
    assert {r: on.trace.tokens[r] for r in both} == {r: off.trace.tokens[r] for r in both}
    assert off.checker.hit_requests == 0


def test_random_workloads_deliver_exact_rows_like_a_cache_off_run() -> None:
    seen: Counter[str] = Counter()
    for seed in range(NUM_RANDOM_WORKLOADS):
        workload = random_workload(seed)
        lag = seed % 3  # materialize at once, or while the next one or two steps run
        try:
            on = run_workload(workload, lag=lag)
            off = run_workload(workload, prefix_caching=False)
            assert on.cache_stats.get("hit_tokens", 0) == on.checker.hit_tokens
            assert_matches_cache_off(on, off)
        except AssertionError as exc:
            raise AssertionError(f"{workload.name} (lag {lag}): {exc}") from exc
        seen.update(steps=len(on.trace.steps), preemptions=on.preemptions,
                    hits=on.checker.hit_requests,
                    hits_on_reused_blocks=on.checker.hits_on_reused_blocks,
                    overwritten_blocks=on.checker.overwritten_blocks, **on.aborts)

    # The generator must keep producing what this test is for.
    assert seen["preemptions"] >= 50, seen
    assert seen["hits"] >= 200 and seen["hits_on_reused_blocks"] >= 50, seen
    assert seen["overwritten_blocks"] >= 500, seen
    assert seen["mid_prefill"] >= 5 and seen["decoding"] >= 20 and seen["waiting"] >= 50, seen


def test_shared_prefixes_hit_each_family_without_preemption() -> None:
    run = run_workload(shared_prefixes())

    assert run.preemptions == 0 and not run.aborts
    assert run.checker.hit_requests == 6
    assert run.cache_stats["hit_tokens"] == run.checker.hit_tokens == 144
    assert {r: run.checker.delivered[r] for r in run.completed} == run.completed


def test_chunked_prefill_aborts_deliver_what_ran_and_serve_later_hits() -> None:
    run = run_workload(chunked_prefill_aborts())

    assert run.aborts == {"mid_prefill": 1, "waiting": 1, "decoding": 1}
    assert run.checker.delivered["long"] == 16  # its first 16-token chunk, then the abort
    assert "waiting" not in run.checker.delivered
    hits = {new["req_id"]: new["num_computed_tokens"] for step in run.trace.steps
            for new in step.scheduler_output["scheduled_new_reqs"]
            if new["num_computed_tokens"]}
    assert hits == {"after-long": 16, "after-decoding": 24}  # on the aborted requests' blocks
    assert run.cache_stats["hit_tokens"] == 40
    assert {r: run.checker.delivered[r] for r in run.completed} == run.completed


def test_preemption_eviction_hits_blocks_that_changed_tenant() -> None:
    run = run_workload(preemption_eviction())

    assert run.preemptions >= 3
    assert run.checker.overwritten_blocks >= 20
    assert run.checker.hits_on_reused_blocks >= 2
    assert run.cache_stats["hit_tokens"] == run.checker.hit_tokens
    assert {r: run.checker.delivered[r] for r in run.completed} == run.completed


@pytest.mark.parametrize("name", TRACE_WORKLOADS)
def test_recorded_traces_match_todays_vllm(name: str) -> None:
    """The committed traces are what today's vLLM schedules; re-record with
    `python -m tests.record_traces` when a vLLM change is intended."""
    recorded = (TRACE_DIR / f"{name}.json").read_text().splitlines()
    today = run_workload(TRACE_WORKLOADS[name]()).trace.dumps().splitlines()

    for line, (old, new) in enumerate(zip_longest(recorded, today), start=1):
        assert old == new, (f"tests/traces/{name}.json line {line} differs from today's vLLM; "
                            f"re-record with `python -m tests.record_traces`:\n"
                            f"recorded: {old}\ntoday:    {new}")
