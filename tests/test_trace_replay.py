"""Traces recorded from vLLM's real Scheduler, replayed through the cache on every backend.

tests/traces/*.json hold, per step, the SchedulerOutput fields the adapter reads,
the persistent batch order and every row's slot, and each request's tokens
(`python -m tests.record_traces` writes them; test_scheduler_diff.py checks they
are what today's vLLM schedules). Replaying needs no vLLM: scheduler outputs
are SimpleNamespaces with SchedulerOutput's field names.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from prefix_cache import devices
from tests.scheduler_trace import TRACE_DIR, TRACE_WORKLOADS, Trace, replay

TRACES = sorted(path.stem for path in TRACE_DIR.glob("*.json"))


def recorded_hit_tokens(trace: Trace) -> int:
    """vLLM's prefix hits: `num_computed_tokens` summed over newly scheduled requests."""
    return sum(new["num_computed_tokens"] for step in trace.steps
               for new in step.scheduler_output["scheduled_new_reqs"])


def test_every_trace_workload_has_a_trace_file() -> None:
    assert TRACES == sorted(TRACE_WORKLOADS)


@pytest.mark.parametrize("lag", [0, 1], ids=["materialize-at-once", "materialize-a-step-late"])
@pytest.mark.parametrize("name", TRACES)
def test_replay_delivers_exact_rows_and_counts_recorded_hits(
        backend: devices.DeviceBackend, name: str, lag: int) -> None:
    trace = Trace.load(name)

    checker, stats = replay(trace, backend, lag)

    assert stats["hit_tokens"] == recorded_hit_tokens(trace) > 0
    completed = {r: len(t) - 1 for r, t in trace.tokens.items() if r not in trace.aborted}
    assert {r: checker.delivered[r] for r in completed} == completed


def test_replay_catches_a_hit_on_the_wrong_block() -> None:
    """The check has teeth: point one recorded hit at another written block, get other rows."""
    trace = Trace.load("shared_prefixes")
    index, step = next((i, s) for i, s in enumerate(trace.steps)
                       if any(n["num_computed_tokens"] for n in s.scheduler_output[
                           "scheduled_new_reqs"]))
    new_reqs = step.scheduler_output["scheduled_new_reqs"]
    new = next(n for n in new_reqs if n["num_computed_tokens"])
    first, *rest = new["block_ids"][0]
    wrong = {**step.scheduler_output, "scheduled_new_reqs": [
        {**n, "block_ids": [[first + 1, *rest]]} if n is new else n for n in new_reqs]}
    steps = list(trace.steps)
    steps[index] = dataclasses.replace(step, scheduler_output=wrong)

    with pytest.raises(AssertionError, match=f"{new['req_id']} .*differ from the reference"):
        replay(dataclasses.replace(trace, steps=tuple(steps)), devices.get_backend("cpu"))


def test_replay_runs_without_vllm() -> None:
    code = ("import sys, devices; from tests.scheduler_trace import Trace, replay; "
            "replay(Trace.load('preemption_eviction'), devices.get_backend('cpu')); "
            "assert 'vllm' not in sys.modules, 'the replay imported vllm'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=TRACE_DIR.parent.parent,
                   env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
