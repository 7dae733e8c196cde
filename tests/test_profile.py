"""The py-spy profile parser and its shares, on small synthetic collapsed-stack files."""

from __future__ import annotations

import pytest

from prefix_cache.tools.profiling.profile import format_table, parse_collapsed, summarize

ENGINE = "thread (100): MainThread;<module> (prefix_cache/tools/pipeline_bench.py:9)"
STEP = (ENGINE + ";LLMEngine.step (vllm/v1/engine/llm_engine.py:1)"
        ";PrefixCacheRunnerMixin.execute_model (/repo/prefix_cache/integration/runner_mixin.py:2)")
#: 100 ticks of the engine thread: 40 in vLLM's forward (called by the cache's mixin), 10 in
#: the cache's step hooks (a torch call inside counts as the cache's), 5 in the scheduler mixin,
#: 45 in vLLM outside a step; an output thread 30 ticks at work, 70 parked.
ALL = f"""\
{STEP};GPUModelRunner.execute_model (vllm/v1/worker/gpu_model_runner.py:3);Qwen2.forward (vllm/model_executor/models/qwen2.py:4) 40
{STEP};OmniPrefixCacheManager.new_step_starts (/repo/prefix_cache/manager.py:5) 6
{STEP};OmniPrefixCacheManager.save_outputs (/repo/prefix_cache/manager.py:6);Tensor.copy_ (torch/_tensor.py:7) 4
{ENGINE};Scheduler.update_from_output (vllm/v1/core/sched/scheduler.py:8);FinishReporting.update_from_output (/repo/prefix_cache/integration/workers/finishes.py:9) 5
{ENGINE};LLMEngine.step (vllm/v1/engine/llm_engine.py:1) 45
thread (101): omni-stage-outputs;Thread.run (threading.py:1);OutputThread._run (/repo/prefix_cache/integration/output_thread.py:2);StepReads.assemble (/repo/prefix_cache/core/step_reads.py:3) 30
thread (101): omni-stage-outputs;Thread.run (threading.py:1);OutputThread._run (/repo/prefix_cache/integration/output_thread.py:2);Queue.get (queue.py:3);Condition.wait (threading.py:4) 70
"""
#: The threads running at those ticks: the engine thread 90, the output thread 30.
ACTIVE = f"""\
{STEP};GPUModelRunner.execute_model (vllm/v1/worker/gpu_model_runner.py:3) 90
thread (101): omni-stage-outputs;Thread.run (threading.py:1);OutputThread._run (/repo/prefix_cache/integration/output_thread.py:2) 30
"""
#: The GIL holder at each of those ticks: the engine thread 60, the output thread 20.
GIL = f"""\
{ENGINE};LLMEngine.step (vllm/v1/engine/llm_engine.py:1) 60
thread (101): omni-stage-outputs;Thread.run (threading.py:1);OutputThread._run (/repo/prefix_cache/integration/output_thread.py:2) 20
"""


def test_stacks_parse_with_thread_process_and_frames() -> None:
    [stack] = parse_collapsed(
        'process 7:"VLLM::EngineCore";thread (0x1f): MainThread;'
        "run (vllm/v1/engine/core.py:12);<module> (x.py) 3\n\n")
    assert (stack.thread, stack.thread_name, stack.count) == ("7/0x1f", "MainThread", 3)
    assert [(f.function, f.file) for f in stack.frames] == [
        ("run", "vllm/v1/engine/core.py"), ("<module>", "x.py")]
    [child] = parse_collapsed('process 7:"a";process 9:"b c";thread (5);f (/s/vllm/x.py:1) 2')
    assert child.thread == "9/5" and child.thread_name == "" and child.owner == "vllm"


def test_a_profile_without_thread_frames_is_refused_naming_the_line() -> None:
    with pytest.raises(ValueError, match="line 1 .*--threads"):
        parse_collapsed("<module> (x.py:1);f (x.py:2) 4")


def test_shares_charge_each_sample_to_its_innermost_owner() -> None:
    summary = summarize(ALL, ACTIVE, GIL, seconds=1.0)
    assert summary.ticks == 100 and summary.engine_thread == "100"
    assert summary.in_step == pytest.approx(0.50)
    assert summary.hooks == pytest.approx(0.10)        # not the 40 in vLLM's forward
    assert summary.scheduler_mixin == pytest.approx(0.05)
    assert summary.engine_gil == pytest.approx(0.60)
    assert summary.others_gil == pytest.approx(0.20)
    output = summary.cache_threads["output"]
    assert (output.active, output.gil) == (pytest.approx(0.30), pytest.approx(0.20))
    assert set(summary.cache_threads) == {"output"}


def test_the_gil_wait_is_bounded_by_the_engine_threads_own_process_only() -> None:
    """A multiprocess engine: the engine-core process's scheduler holds its own GIL, which
    the worker process's engine thread never waits for; its output thread's it may."""
    core, worker = 'process 7:"VLLM::EngineCore";', 'process 7:"x";process 9:"VLLM::Worker";'
    step = "Worker.execute_model (vllm/v1/worker/gpu_worker.py:2)"
    all_text = (f"{worker}thread (1): MainThread;{step} 100\n"
                f"{worker}thread (2): omni-stage-outputs;OutputThread._run "
                f"(/repo/prefix_cache/integration/output_thread.py:2) 100\n"
                f"{core}thread (1): MainThread;EngineCore.step (vllm/v1/engine/core.py:1) 100\n")
    gil = (f"{worker}thread (1): MainThread;{step} 50\n"
           f"{worker}thread (2): omni-stage-outputs;OutputThread._run "
           f"(/repo/prefix_cache/integration/output_thread.py:2) 10\n"
           f"{core}thread (1): MainThread;EngineCore.step (vllm/v1/engine/core.py:1) 70\n")
    summary = summarize(all_text, "", gil, seconds=1.0)
    assert summary.engine_thread == "9/1"
    assert summary.engine_gil == pytest.approx(0.50)
    assert summary.others_gil == pytest.approx(0.10)  # not the engine core's 70


def test_no_gil_holder_seen_reads_not_available_and_the_table_lines_up() -> None:
    plain = summarize("thread (1): MainThread;LLMEngine.step (vllm/v1/engine/llm_engine.py:1)"
                      ";Worker.execute_model (vllm/v1/worker/gpu_worker.py:2) 8\n", "", "", 0.5)
    assert plain.hooks == 0 and plain.in_step == 1 and plain.engine_gil is None
    table = format_table({"cache": summarize(ALL, ACTIVE, GIL, 1.0), "plain": plain}).splitlines()
    assert table[0].split() == ["cache", "plain"]
    assert len({len(line) for line in table}) == 1
    assert "10.0%" in next(line for line in table if "hooks" in line)
    assert next(line for line in table if "holds the GIL" in line).endswith("n/a")
    output = next(line for line in table if "output thread" in line)
    assert "30.0% / 20.0%" in output and output.endswith(" -")


def test_an_empty_profile_is_refused() -> None:
    with pytest.raises(ValueError, match="no samples"):
        summarize("", "", "", 1.0)
