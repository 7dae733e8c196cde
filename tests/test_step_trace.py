"""The vLLM worker trace reader (`tools/step_trace.py`), on small synthetic Chrome traces."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest

from prefix_cache.tools.profiling.step_trace import compare_table, read_trace, step_trace

ENGINE, OUTPUT = 10, 11
PREFILL = "execute_context_1(64)_generation_0(0)"
DECODE = "execute_context_0(0)_generation_4(4)"


def span(tid: int, ts: float, dur: float, name: str, cat: str = "python_function",
         pid: int = 1) -> dict[str, Any]:
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name, "cat": cat}


def step(start: float, execute_self: float) -> list[dict[str, Any]]:
    """One step on the engine thread and the output thread's work meanwhile: the worker's
    execute_model runs the cache's save (which runs a torch op) and a builtin; the step's
    annotation (a marker, no call) counts for nothing."""
    return [
        span(ENGINE, start, execute_self + 40, DECODE, "user_annotation"),
        span(ENGINE, start, execute_self + 30, "vllm/v1/worker/gpu_worker.py(1): execute_model"),
        span(ENGINE, start + 1, 20, "prefix_cache/manager.py(5): save_outputs"),
        span(ENGINE, start + 2, 5, "aten::copy_", "cpu_op"),
        span(ENGINE, start + 22, 10, "<built-in method copy_ of Tensor object at 0x7f0012>"),
        span(OUTPUT, start + 5, 30, "prefix_cache/integration/stage_outputs.py(264): _deliver"),
        span(OUTPUT, start + 6, 25, "prefix_cache/manager.py(234): materialize_step"),
        span(OUTPUT, start + 40, 50, "threading.py(1): wait"),
        span(0, start + 3, 40, "a kernel", "kernel", pid=0),
    ]


def trace(execute_self: float) -> list[dict[str, Any]]:
    """A prompt step (left out), two decode steps 200 µs apart, and a last one (no step follows
    it, so it is left out too), all inside the engine's loop, which runs from before the trace
    to after it."""
    return [span(ENGINE, -100, 2000, "vllm/v1/engine/core.py(1): run_busy_loop"),
            span(ENGINE, 0, 90, PREFILL, "user_annotation"),
            span(ENGINE, 1, 80, "vllm/v1/worker/gpu_worker.py(1): execute_model"),
            span(OUTPUT, 2, 60, "prefix_cache/integration/stage_outputs.py(264): _deliver"),
            *step(200, execute_self), *step(400, execute_self),
            span(ENGINE, 600, 95, DECODE, "user_annotation"),
            span(ENGINE, 601, 500, "vllm/v1/worker/gpu_worker.py(1): execute_model")]


def test_decode_steps_give_self_times_per_step_and_the_cache_s_outermost_calls_elsewhere(
        ) -> None:
    got = step_trace([trace(execute_self=50)])
    assert got.steps == 2 and got.step_us == 200
    assert got.engine_self_us == {
        "vllm/v1/engine/core.py(1): run_busy_loop": 200 - 80,  # the step less execute_model
        "vllm/v1/worker/gpu_worker.py(1): execute_model": 50,
        "prefix_cache/manager.py(5): save_outputs": 15,
        "aten::copy_ (the cache's call)": 5,  # its innermost Python function is the cache's
        "<built-in method copy_ of Tensor object>": 10,
    }
    # the self times add up to the step: each call's time counts in the steps it spans
    assert (got.engine_cache_us, got.engine_others_us) == (20, 200 - 20)
    # the output thread's outermost cache call per step; its waits outside the cache left out
    assert got.cache_threads_busy_us == {
        "prefix_cache/integration/stage_outputs.py(264): _deliver": 30}


def test_the_table_splits_the_engine_thread_and_names_what_took_longer_in_the_cache_s(
        tmp_path: Path) -> None:
    path = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": trace(execute_self=70)}, f)
    cache, plain = step_trace([read_trace(path)]), step_trace([trace(execute_self=40)])
    lines = compare_table(plain, cache).splitlines()
    row = {cells[0]: cells[1:] for cells in (re.split(r" {2,}", line.strip())
                                             for line in lines[2:])}
    assert row["steps (median of 2 / 2): interval"] == ["200", "200", "0"]
    assert row["engine thread, self, the cache's functions"] == ["20", "20", "0"]
    assert row["engine thread, self, vLLM's, torch's and others"] == ["180", "180", "0"]
    assert row["vllm/v1/worker/gpu_worker.py(1): execute_model"] == ["40", "70", "30"]
    assert row["busy thread: prefix_cache/integration/stage_outputs.py(264): _deliver"] == [
        "-", "30", "-"]


def test_a_trace_without_a_decode_step_followed_by_another_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no decode step .* follows in the trace"):
        step_trace([[span(ENGINE, 0, 90, PREFILL, "user_annotation"),
                     span(ENGINE, 100, 90, DECODE, "user_annotation")]])
