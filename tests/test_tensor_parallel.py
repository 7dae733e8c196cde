"""Tensor parallelism on vLLM's real CPU engine: a thinker with `tensor_parallel_size=2` and the
cache's worker publishes every request's rows as a single-worker thinker with prefix caching
off computes them, and only tensor-parallel rank 0 builds the cache and publishes (SPEC §4.12).

Workers in processes of their own need the engine core in a process of its own and synchronous
scheduling (both refused otherwise, docs/vllm.md); vLLM's CPU platform turns asynchronous
scheduling off itself. vLLM's default CPU thread binding ("auto") gives each rank a NUMA node of
its own and refuses more ranks than nodes, so the test binds each rank to its share of this
process's CPUs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prefix_cache import HIDDEN_KEY
from prefix_cache.channel import open_channel
from prefix_cache.tools import demo
from tests.vllm_fixtures import thinker_model_dir  # noqa: F401

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TP = 2
#: Rows of the same tokens from two ranks' partial sums, all-reduced, against one rank's full
#: sums: float32 in another summation order. Measured: at most 3.2e-5 (rows of RMS 1).
TOLERANCE = demo.TOLERANCE["cpu"]


def omp_threads_bind(ranks: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` giving each of `ranks` CPU workers an equal share of the CPUs
    this process may run on ("0|1" on two CPUs)."""
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // ranks
    return "|".join(",".join(map(str, cpus[rank * share:(rank + 1) * share]))
                    for rank in range(ranks))


def run_thinker(model_dir: Path, *, tensor_parallel_size: int, prefix_caching: bool
                ) -> tuple[Any, list[dict[str, int | float]]]:
    """The demo's workload through one thinker: its `PipelineRun` and each rank's stats. A
    tensor-parallel engine runs its engine core in a process of its own, a single worker in this
    one (it starts faster)."""
    from prefix_cache.tools.pipelines.engines import multiprocessing_mode, start_thinker
    from prefix_cache.tools.pipelines.pipeline import run_pipeline
    parallel = tensor_parallel_size > 1
    with multiprocessing_mode(parallel), open_channel() as channel:
        thinker = start_thinker(model_dir, channel, prefix_caching=prefix_caching,
                                tensor_parallel_size=tensor_parallel_size,
                                distributed_executor_backend="mp" if parallel else None)
        try:
            run = run_pipeline(thinker, channel, demo.make_workload(seed=1))
            stats = thinker.rank_stats()
        finally:
            thinker.close()
    return run, stats


@pytest.fixture(scope="module")
def single_worker_run(thinker_model_dir: Path) -> Any:
    """The reference: one worker, prefix caching off."""
    run, _ = run_thinker(thinker_model_dir, tensor_parallel_size=1, prefix_caching=False)
    return run


@pytest.fixture(scope="module")
def tensor_parallel_run(thinker_model_dir: Path
                        ) -> Iterator[tuple[Any, list[dict[str, int | float]]]]:
    """TP=2 with prefix caching on, each rank's threads bound to its CPUs."""
    if len(os.sched_getaffinity(0)) < TP:
        pytest.skip(f"tensor parallelism over {TP} CPU workers needs {TP} CPUs")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", omp_threads_bind(TP))
        yield run_thinker(thinker_model_dir, tensor_parallel_size=TP, prefix_caching=True)


def test_tensor_parallel_entries_match_a_single_worker_without_caching(
        tensor_parallel_run: tuple[Any, list[dict[str, int | float]]],
        single_worker_run: Any) -> None:
    run, stats = tensor_parallel_run
    checks = demo.compare(run, single_worker_run, TOLERANCE)
    assert [c for c in checks if not c.ok] == []
    (aborted,) = [c for c in checks if c.aborted]
    assert run.results[aborted.req_id].aborted
    hits = [c for c in checks if c.cached_tokens > 0]
    assert len(hits) >= 6
    assert stats[0]["hit_tokens"] == sum(c.cached_tokens for c in hits)


def test_only_rank_zero_holds_a_pool_and_publishes(
        tensor_parallel_run: tuple[Any, list[dict[str, int | float]]]) -> None:
    run, stats = tensor_parallel_run
    assert len(stats) == TP
    leader, *others = stats
    assert leader[f"pool_bytes.{HIDDEN_KEY}"] > 0
    assert leader["delivery_published"] == len(run.results)
    for rank_stats in others:  # no stage at all: its process's resident bytes only
        assert rank_stats.keys() == {"worker_rss_bytes"}
