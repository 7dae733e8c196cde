"""Pipeline figures on vLLM's real engine: M8 (what stage 1's prefix caching saves, and the
two-stage end to end), the engine step time with the cache against vLLM's plain worker, and
M10 (M8's stage 1 with its host pool capped at a quarter of the KV mirror; `--only M10`).

    python -m prefix_cache.tools.pipeline_bench [--runs N] [--json PATH] [--only M8|M5e|M10]
        [--model small|7b|tiny] [--cudagraphs] [--profile DIR]

Each figure is the median of `runs` runs made back to back, on and off interleaved, with the
smallest and largest beside it. Engines are started once and warmed up; between runs their
prefix caches are emptied, so every run starts cold. It prints its progress and a table like the
bench's; vLLM's logs go to a file it names. `--profile DIR` then profiles both engines of the
step comparison (`profile_capture`) and prints where their threads spent the window (`profile`);
with `--cudagraphs`, vLLM's worker profiler also traces `TRACE_PASSES` alternating passes of each
engine, and their decode steps are compared function by function (`step_trace`). Either way,
what the device ran in each engine's traced steps is shown side by side (`device_trace`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import statistics
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefix_cache.channel import StageChannel
from prefix_cache.tools.reporting.bench_report import Metric, metric_json, report
from prefix_cache.tools.profiling.device_trace import DeviceWork, device_work
from prefix_cache.tools.profiling.device_trace import compare_table as device_compare_table
from prefix_cache.tools.pipelines.engine_logs import new_log_path, output_to_log
from prefix_cache.tools.reporting.harness import (REPORT_WIDTH, machine, source_commit, spread,
                                                  unwritable, write_json)
from prefix_cache.tools.reporting.targets import PIPELINE_METRICS, MetricSpec, Target
from prefix_cache.tools.pipelines.engines import (CUDA_GRAPH_ARGS, MODELS, Engine,
                                                  EngineShape, StageModel,
                                                  cache_engine_thread_s, engine_core_pid,
                                                  multiprocessing_mode, platform_stage_model,
                                                  start_talker, start_thinker, vllm_trace_config)
from prefix_cache.tools.pipelines.pipeline import StageRequest, run_pipeline, warm_up
from prefix_cache.tools.profiling.profile import ProfileSummary, format_table
from prefix_cache.tools.profiling.profile_capture import profile_engine, torch_trace_path
from prefix_cache.tools.profiling.step_trace import StepTrace, compare_table, read_trace, step_trace


M8_SHAPE = EngineShape(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512,
                       long_prefill_token_threshold=0, num_blocks=129)
#: vLLM's own worker (no cache) per platform, for the step-time comparison.
PLAIN_WORKER = {"cpu": "vllm.v1.worker.cpu_worker.CPUWorker",
                "cuda": "vllm.v1.worker.gpu_worker.Worker"}
#: The no-recompute limit: stage 1's time with caching on / off <= SLACK x (1 - hit fraction).
SLACK = 1.15
#: Passes of each engine under vLLM's worker profiler (`--profile` with `--cudagraphs`).
TRACE_PASSES = 3
TALKER_TOKENS = 8


def m8_workload(*, families: int = 2, per_family: int = 8, prefix: int = 192, suffix: int = 64,
                seed: int = 0) -> list[StageRequest]:
    """Prompts of `prefix + suffix` tokens, the prefix shared within a family (75% by default);
    one token generated each, all arriving at once."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1, 1000) for _ in range(prefix)] for _ in range(families)]
    return [StageRequest(f"m8-{f}-{i}", heads[f] + [rng.randrange(1, 1000)
                                                    for _ in range(suffix)], 1)
            for i in range(per_family) for f in range(families)]


def m8_stage_one(model: str = "small") -> tuple[str, StageModel, EngineShape]:
    """This platform's name, its stage-1 model `model` and engine shape (bf16 on a GPU)."""
    device, stage_model, dtype = platform_stage_model(model)
    return device, stage_model, dataclasses.replace(M8_SHAPE, dtype=dtype)


def _cold(*engines: Engine | None) -> None:
    for engine in engines:
        if engine is not None:
            engine.engine.reset_prefix_cache()


def measure_m8(*, runs: int = 5, multiprocessing: bool | None = None, model: str = "small",
               progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """M8 on the real engine: stage 1 with its prefix caching on / off, and the two-stage
    pipeline on / off; `multiprocessing` None is vLLM's default (an engine-core process each)."""
    from prefix_cache.channel import open_channel
    device, stage_model, shape = m8_stage_one(model)
    requests = m8_workload()
    prompt_tokens = sum(len(r.prompt) for r in requests)
    with tempfile.TemporaryDirectory(prefix="omni-prefix-cache-m8-") as tmp, \
            multiprocessing_mode(multiprocessing), open_channel() as channel:
        progress(f"writing the M8 models on {device} ({stage_model.describe(shape)}; "
                 f"talker 2 layers) ...")
        thinker_dir = stage_model.write(Path(tmp) / "thinker")
        talker_dir = stage_model.write(Path(tmp) / "talker", num_layers=2, seed=1)
        progress("starting three engines (thinker with caching on and off, talker) ...")
        engines = {caching: start_thinker(thinker_dir, channel, prefix_caching=caching,
                                          shape=shape, **stage_model.engine_args)
                   for caching in (True, False)}
        talker = start_talker(talker_dir, shape, **stage_model.engine_args)
        try:
            for engine in engines.values():  # on the workload: see measure_step_time
                warm_up(engine, channel, talker, requests=requests)
            times: dict[str, list[float]] = {k: [] for k in ("on", "off", "e2e_on", "e2e_off")}
            hit_tokens = []
            for i in range(runs):
                progress(f"run {i + 1}/{runs} ...")
                order = list(engines.items())  # on first, then off first: drift cancels
                for caching, engine in order if i % 2 == 0 else order[::-1]:
                    label = "on" if caching else "off"
                    _cold(engine)
                    run = run_pipeline(engine, channel, requests)
                    times[label].append(run.seconds)
                    if caching:
                        hit_tokens.append(sum(r.cached_tokens for r in run.results.values()))
                    _cold(engine, talker)
                    run = run_pipeline(engine, channel, requests, talker=talker,
                                       talker_tokens=TALKER_TOKENS)
                    times[f"e2e_{label}"].append(run.seconds)
        finally:
            for engine in (*engines.values(), talker):
                engine.close()
    hit_fraction = statistics.median(hit_tokens) / prompt_tokens
    ratios = [a / b for a, b in zip(times["on"], times["off"], strict=True)]
    e2e_ratios = [a / b for a, b in zip(times["e2e_on"], times["e2e_off"], strict=True)]
    target = SLACK * (1 - hit_fraction)
    ratio = statistics.median(times["on"]) / statistics.median(times["off"])
    return {
        "device": device,
        "workload": f"{len(requests)} requests of {len(requests[0].prompt)} tokens, 75% in "
                    f"shared prefixes; stage 1 {stage_model.describe(shape)} on {device}, "
                    f"stage 2 x 2 layers ({TALKER_TOKENS} tokens each)",
        "runs": runs, "hit_fraction": hit_fraction,
        "stage1_on_s": spread(times["on"]), "stage1_off_s": spread(times["off"]),
        "ratio": ratio, "ratio_per_run": spread(ratios), "target": target,
        "pass": ratio <= target,
        "e2e_on_s": spread(times["e2e_on"]), "e2e_off_s": spread(times["e2e_off"]),
        "e2e_ratio": statistics.median(times["e2e_on"]) / statistics.median(times["e2e_off"]),
        "e2e_ratio_per_run": spread(e2e_ratios),
    }


#: M10's host budget: this share of the KV mirror's bytes (hidden rows of every KV slot).
M10_POOL_SHARE = 0.25
#: The scheduler a capped pool needs where the worker runs in a process of its own.
RESIDENT_SCHEDULER = "prefix_cache.integration.workers.finishes.ResidentScheduler"
M10_SPEC = MetricSpec("stage 1 time, pool capped at 25% of the KV mirror, prefix caching on / "
                      "off, / (1 - resident-hit fraction); real engine", Target("<=", SLACK))
#: Every figure this bench measures, in table order.
BENCH_METRICS = {**PIPELINE_METRICS, "M10": M10_SPEC}


def measure_m10(*, runs: int = 5, model: str = "small",
                progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """M10 on the real engine: M8's stage 1 with its host pool capped at `M10_POOL_SHARE` of the
    KV mirror, prefix caching on / off, beside the hit fraction it served (resident) and the
    one an uncapped pool serves; the capped run's rows against the off run's."""
    import torch

    from prefix_cache.channel import open_channel
    from prefix_cache.tools import demo
    device, stage_model, shape = m8_stage_one(model)
    requests = m8_workload()
    prompt_tokens = sum(len(r.prompt) for r in requests)
    row_bytes = stage_model.hidden_size * getattr(torch, shape.dtype).itemsize
    mirror = shape.num_blocks * shape.block_size * row_bytes
    budget = int(shape.num_blocks * M10_POOL_SHARE) * shape.block_size * row_bytes
    with tempfile.TemporaryDirectory(prefix="omni-prefix-cache-m10-") as tmp, \
            open_channel() as channel:
        progress(f"writing the M8 model on {device} ({stage_model.describe(shape)}) ...")
        thinker_dir = stage_model.write(Path(tmp) / "thinker")
        progress(f"starting three engines (capped at {budget:,} of {mirror:,} bytes, "
                 f"uncapped, caching off) ...")
        budgets = {"capped": budget, "uncapped": None, "off": None}
        engines = {label: start_thinker(
            thinker_dir, channel, prefix_caching=label != "off", shape=shape,
            stage_options=None if b is None else {"host_budget_bytes": b},
            scheduler_cls=RESIDENT_SCHEDULER, **stage_model.engine_args)
            for label, b in budgets.items()}
        try:
            for engine in engines.values():
                warm_up(engine, channel, requests=requests)
            times: dict[str, list[float]] = {label: [] for label in engines}
            hits: dict[str, list[int]] = {"capped": [], "uncapped": []}
            rows_exact = True
            for i in range(runs):
                progress(f"run {i + 1}/{runs} ...")
                order = list(engines.items())  # rotated each run: drift cancels
                done = {}
                for label, engine in order[i % 3:] + order[:i % 3]:
                    _cold(engine)
                    done[label] = run = run_pipeline(engine, channel, requests)
                    times[label].append(run.seconds)
                    if label in hits:
                        hits[label].append(sum(r.cached_tokens for r in run.results.values()))
                rows_exact &= all(c.ok for c in demo.compare(done["capped"], done["off"],
                                                             demo.TOLERANCE[device]))
            stats = engines["capped"].stats()
        finally:
            for engine in engines.values():
                engine.close()
    resident = statistics.median(hits["capped"]) / prompt_tokens
    ratio = statistics.median(times["capped"]) / statistics.median(times["off"])
    pool_bytes = sum(v for k, v in stats.items() if k.startswith("pool_bytes."))
    return {
        "device": device,
        "workload": f"M8's stage 1: {len(requests)} requests of {len(requests[0].prompt)} "
                    f"tokens, 75% in shared prefixes; {stage_model.describe(shape)} on "
                    f"{device}; host pool capped at {budget:,} of the mirror's {mirror:,} bytes",
        "runs": runs, "resident_hit_fraction": resident,
        "uncapped_hit_fraction": statistics.median(hits["uncapped"]) / prompt_tokens,
        "stage1_capped_s": spread(times["capped"]), "stage1_uncapped_s": spread(times["uncapped"]),
        "stage1_off_s": spread(times["off"]), "ratio": ratio,
        "uncapped_ratio": statistics.median(times["uncapped"]) / statistics.median(times["off"]),
        "target": SLACK * (1 - resident), "pass": ratio <= SLACK * (1 - resident) and rows_exact
        and pool_bytes <= budget,
        "rows_exact": rows_exact, "budget_bytes": budget, "mirror_bytes": mirror,
        "pool_bytes": pool_bytes, "pool_blocks": stats["pool_blocks"],
        "evicted_blocks": stats["evicted_blocks"], "hit_tokens_trimmed": stats["hit_tokens_trimmed"],
    }


def m10_metric(m10: dict[str, Any]) -> Metric:
    """M10 as the bench judges it: the capped stage 1's on / off ratio ÷ (1 - resident-hit
    fraction)."""
    return Metric(m10["ratio"] / (1 - m10["resident_hit_fraction"]),
                  f"stage 1 capped on/off {m10['ratio']:.3f} at resident-hit fraction "
                  f"{m10['resident_hit_fraction']:.2f} (uncapped: {m10['uncapped_hit_fraction']:.2f},"
                  f" on/off {m10['uncapped_ratio']:.3f}); pool {m10['pool_bytes']:,} B of a "
                  f"{m10['budget_bytes']:,} B budget; rows "
                  f"{'exact' if m10['rows_exact'] else 'NOT exact'}", m10["workload"])


def _timed_steps(engine: Engine, requests: list[StageRequest],
                 after_step: Callable[[], None] | None = None) -> list[float]:
    from vllm import SamplingParams
    for request in requests:
        engine.engine.add_request(request.req_id, {"prompt_token_ids": request.prompt},
                                  SamplingParams(max_tokens=request.max_tokens, temperature=0.0,
                                                 ignore_eos=True, detokenize=False))
    steps = []
    while engine.has_work():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
        if after_step is not None:
            after_step()
    return steps


def _cold_pass(engine: Engine, requests: list[StageRequest], channel: StageChannel | None,
               after_step: Callable[[], None] | None = None) -> list[float]:
    """One timed pass from a cold prefix cache; the cache's published rows (where `channel`
    is given) are taken off the channel afterwards."""
    _cold(engine)
    steps = _timed_steps(engine, requests, after_step)
    for request in requests if channel is not None else ():
        channel.get(request.req_id)
    return steps


def measure_step_time(*, runs: int = 5, decode_tokens: int = 16, model: str = "small",
                      cudagraphs: bool = False, profile_dir: Path | None = None,
                      profile_seconds: float = 10.0,
                      progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Engine step time with the cache's worker against vLLM's plain worker, both with prefix
    caching on, on the M8 stage-1 `model` and workload with `decode_tokens` generated per
    request. Engines run in-process (a step is the engine's own work); with `cudagraphs` (full
    decode graphs), each in an engine-core process of its own, since two engines with graphs
    do not share a process (a step then includes the engine core's round trip, for both).
    With `profile_dir`, both engines are then profiled there (`profile_capture`), each for
    `profile_seconds` of passes."""
    from prefix_cache.channel import open_channel
    device, stage_model, shape = m8_stage_one(model)
    requests = [StageRequest(r.req_id, r.prompt, decode_tokens) for r in m8_workload()]
    engine_args = {**stage_model.engine_args, **(CUDA_GRAPH_ARGS if cudagraphs else {})}
    mode = "engine-core processes, CUDA graphs" if cudagraphs else "in-process"
    with tempfile.TemporaryDirectory(prefix="omni-prefix-cache-steps-") as tmp, \
            multiprocessing_mode(cudagraphs), open_channel() as channel:
        thinker_dir = stage_model.write(Path(tmp) / "thinker")
        progress(f"starting vLLM's plain {device} worker and the cache's worker ({mode}; "
                 f"{stage_model.describe(shape)}) ...")
        # an engine-core process traces itself: vLLM's worker profiler, configured at start
        trace_dirs = {name: profile_dir / f"{name}-trace" for name in ("plain", "cache")
                      } if profile_dir is not None and cudagraphs else {}
        trace_args = {name: {"profiler_config": vllm_trace_config(trace_dirs[name])}
                      if trace_dirs else {} for name in ("plain", "cache")}
        engines = {"plain": start_thinker(thinker_dir, channel, prefix_caching=True,
                                          shape=shape, worker_cls=PLAIN_WORKER[device],
                                          **engine_args, **trace_args["plain"]),
                   "cache": start_thinker(thinker_dir, channel, prefix_caching=True,
                                          shape=shape, **engine_args, **trace_args["cache"])}
        channels = {"plain": None, "cache": channel}
        try:
            # on the workload itself: kernels compile on first use of each batch shape, once
            # per process, and the first engine to meet a shape would pay for both
            warm_up(engines["cache"], channel, requests=requests)
            _timed_steps(engines["plain"], requests)
            steps: dict[str, list[float]] = {"plain": [], "cache": []}
            run_ratios = []  # each run's median steps, cache ÷ plain: side by side, drift apart
            for i in range(runs):
                progress(f"run {i + 1}/{runs} ...")
                order = list(engines.items())
                run = {name: _cold_pass(engine, requests, channels[name])
                       for name, engine in (order if i % 2 == 0 else order[::-1])}
                for name, run_steps in run.items():
                    steps[name] += run_steps
                run_ratios.append(statistics.median(run["plain"])
                                  / statistics.median(run["cache"]))
            stats = engines["cache"].stats()
            progress("a pass reading the cache's engine-thread time after each step ...")
            library_steps = _library_per_step(engines["cache"], requests, channel)
            profiles = {} if profile_dir is None else {
                name: _profile(name, engine, requests, channels[name], profile_dir,
                               profile_seconds, in_process=not cudagraphs, progress=progress)
                for name, engine in engines.items()}
            if trace_dirs:  # engine-core processes: vLLM's worker profiler traces each
                trace_files = _vllm_traces(engines, requests, channels, trace_dirs, progress)
            else:  # in-process: torch's profiler traced each in `_profile`
                trace_files = {} if profile_dir is None else {
                    name: torch_trace_path(profile_dir / name) for name in engines}
        finally:
            for engine in engines.values():
                engine.close()
    traces: dict[str, StepTrace] = {}  # the decode steps compared, where vLLM traced them
    devices: dict[str, DeviceWork] = {}
    for name, path in trace_files.items():  # one trace's events in memory at a time
        events = read_trace(path)
        devices[name] = device_work(events)
        if trace_dirs:
            traces[name] = step_trace([events])
    library = cache_engine_thread_s(stats) / stats["calls.save_outputs"]
    return {
        "device": device,
        "workload": f"M8 stage 1 ({stage_model.describe(shape)} on {device}, {mode}), "
                    f"{len(requests)} requests of "
                    f"{len(requests[0].prompt)} tokens, {decode_tokens} generated each",
        "runs": runs, "steps_per_run": len(steps["cache"]) // runs,
        "step_s_plain": spread(steps["plain"]), "step_s_cache": spread(steps["cache"]),
        "step_ratio": statistics.median(steps["cache"]) / statistics.median(steps["plain"]),
        # the decode steps' mean: what a change that moves work between steps cannot hide
        "decode_step_s_mean": {name: statistics.mean(decode_steps(times))
                               for name, times in steps.items()},
        "m5e_per_run": spread(run_ratios),
        "total_ratio": sum(steps["cache"]) / sum(steps["plain"]),
        "engine_thread_library_s_per_step": library,
        "engine_thread_library_s_per_step_spread": spread(library_steps),
        "profile": profiles,
        "trace": traces,
        "device_work": devices,
    }


def decode_steps(times: list[float]) -> list[float]:
    """The decode steps among a pass's or passes' step times: those within half and twice
    their median (the prompt steps and each pass's empty last step left out)."""
    median = statistics.median(times)
    return [t for t in times if 0.5 < t / median < 2]


def _library_per_step(engine: Engine, requests: list[StageRequest], channel: StageChannel
                      ) -> list[float]:
    """The cache's engine-thread seconds in each step of an untimed pass: its median is a
    median step's, where the mean of the timed passes is weighed by the prefill steps."""
    per_step: list[float] = []
    last = cache_engine_thread_s(engine.stats())

    def after_step() -> None:
        nonlocal last
        now = cache_engine_thread_s(engine.stats())
        per_step.append(now - last)
        last = now

    _cold_pass(engine, requests, channel, after_step)
    return per_step


def _vllm_traces(engines: dict[str, Engine], requests: list[StageRequest],
                 channels: dict[str, StageChannel | None], trace_dirs: dict[str, Path],
                 progress: Callable[[str], None]) -> dict[str, Path]:
    """`TRACE_PASSES` passes of each engine, alternating, under vLLM's worker profiler, which
    runs over all of them (one trace an engine; a single traced pass varies too much to compare
    two engines by): each engine's trace file."""
    progress(f"{TRACE_PASSES} traced passes of each engine (vLLM's worker profiler, torch with "
             f"Python stacks) ...")
    before = {name: set(trace_dir.glob("*.pt.trace.json*"))
              for name, trace_dir in trace_dirs.items()}
    with contextlib.ExitStack() as tracing:
        for engine in engines.values():
            tracing.enter_context(engine.traced())
        for i in range(TRACE_PASSES):
            order = list(engines.items())
            for name, engine in order if i % 2 == 0 else order[::-1]:
                _cold_pass(engine, requests, channels[name])
    files: dict[str, Path] = {}
    for name, trace_dir in trace_dirs.items():
        written = set(trace_dir.glob("*.pt.trace.json*")) - before[name]
        if len(written) != 1:
            raise RuntimeError(f"vLLM's profiler wrote {len(written)} new traces into "
                               f"{trace_dir}, not one")
        files[name] = written.pop()
    return files


def _profile(name: str, engine: Engine, requests: list[StageRequest],
             channel: StageChannel | None, out_dir: Path, seconds: float, *, in_process: bool,
             progress: Callable[[str], None]) -> ProfileSummary | None:
    progress(f"profiling the {name} engine ({seconds:g} s of passes under py-spy"
             + (", then a pass under torch's profiler" if in_process else "") + ") ...")
    return profile_engine(lambda after_step: _cold_pass(engine, requests, channel, after_step),
                          pid=engine_core_pid(engine), prefix=out_dir / name, seconds=seconds,
                          in_process=in_process)


def m8_metric(m8: dict[str, Any]) -> Metric:
    """M8 as the bench judges it: stage 1's on / off ratio ÷ (1 - hit fraction)."""
    return Metric(m8["ratio"] / (1 - m8["hit_fraction"]),
                  f"stage 1 on/off {m8['ratio']:.3f} at hit fraction {m8['hit_fraction']:.2f}; "
                  f"two stages end to end on/off {m8['e2e_ratio']:.3f}", m8["workload"])


def m5e_metric(steps: dict[str, Any]) -> Metric:
    """M5e: engine steps per second with the cache's worker ÷ vLLM's plain worker."""
    plain, cache = steps["step_s_plain"]["median"], steps["step_s_cache"]["median"]
    decode = steps["decode_step_s_mean"]
    return Metric(1 / steps["step_ratio"],
                  f"vLLM's plain worker, median step {plain * 1e3:.2f} ms (cache's "
                  f"{cache * 1e3:.2f} ms)",
                  f"decode steps' mean {decode['plain'] * 1e3:.2f} ms (cache's "
                  f"{decode['cache'] * 1e3:.2f} ms); "
                  f"per run {steps['m5e_per_run']['min']:.3f}-{steps['m5e_per_run']['max']:.3f}"
                  f" (median {steps['m5e_per_run']['median']:.3f}); "
                  f"total time {1 / steps['total_ratio']:.3f}; the cache's engine-thread calls "
                  f"{steps['engine_thread_library_s_per_step'] * 1e6:.0f} µs a step on "
                  f"average, {steps['engine_thread_library_s_per_step_spread']['median'] * 1e6:.0f}"
                  f" µs in the median step; "
                  f"{steps['workload']}")


def _argument_problem(args: argparse.Namespace) -> str | None:
    """Why these arguments cannot run here, in one line, or None."""
    import torch
    if args.runs < 1:
        return f"--runs {args.runs}: at least 1 run"
    gpu_only = [flag for flag, asked in (("--model 7b", args.model == "7b"),
                                         ("--cudagraphs", args.cudagraphs)) if asked]
    if gpu_only and not torch.cuda.is_available():
        return (f"{' and '.join(gpu_only)}: NVIDIA GPU only, and this torch sees no GPU "
                f"(here: the small or tiny model, eager)")
    if args.model == "tiny" and torch.cuda.is_available():
        return "--model tiny: CPU only (on a GPU, --cudagraphs makes steps as Python-bound)"
    if args.cudagraphs and args.only in ("M8", "M10"):
        return f"--cudagraphs applies to M5e's step comparison: not with --only {args.only}"
    if args.profile and args.only in ("M8", "M10"):
        return f"--profile profiles M5e's step comparison: not with --only {args.only}"
    if args.json and (problem := unwritable(args.json)):
        return problem
    if args.profile:
        try:
            Path(args.profile).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"--profile {args.profile}: cannot make that folder ({exc.strerror})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prefix_cache.tools.pipeline_bench",
        description="Measures, on vLLM's real engine of this machine (CPU or GPU): M8, stage 1's "
                    "time with its prefix caching on / off on a prefill-dominated model at a "
                    "0.66 hit fraction, against the target 1.15 x (1 - hit fraction); the "
                    "two-stage pipeline on / off; and M5e, the engine step time with the cache's "
                    "worker against vLLM's plain worker. Prints a table with a pass/MISS column "
                    "(vLLM's logs go to a file it names). Exit status, as the bench's: 0 when it "
                    "measured, whatever the table says (the JSON's 'pass' fields hold each "
                    "verdict), 1 when a run failed, 2 on a usage error.",
        epilog="Takes about 5 minutes on a 2-core CPU machine and about 2 on an H200 with the "
               "default 5 runs (three engine starts, then every run on and off); a 7b model's "
               "engines start in up to a minute each on an H200.")
    parser.add_argument("--runs", type=int, default=None, help="runs per figure (default 5)")
    parser.add_argument("--quick", action="store_true",
                        help="one run per figure (about 2 minutes on 2 cores): a first look, "
                             "without the spread --runs gives")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--only", choices=list(BENCH_METRICS),
                        help="measure this figure only (default: M8 and M5e)")
    parser.add_argument("--model", choices=list(MODELS), default="small",
                        help="stage 1's model: small (default; hidden 1024 x 8 layers on a CPU, "
                             "2048 x 8 on a GPU), 7b (hidden 4096 x 32 layers, vLLM's dummy "
                             "weights; GPU only) or tiny (hidden 64 x 1 layer, CPU only: steps "
                             "bound by the engine's Python, as under CUDA graphs)")
    parser.add_argument("--cudagraphs", action="store_true",
                        help="M5e with full CUDA graphs for decode steps (GPU only; each engine "
                             "in an engine-core process of its own)")
    parser.add_argument("--profile", metavar="DIR",
                        help="after M5e's runs, profile both engines into DIR: py-spy per "
                             "thread (where installed), and torch's profiler as a Chrome trace "
                             "(in-process; with --cudagraphs, vLLM's worker profiler over "
                             f"{TRACE_PASSES} alternating passes, whose decode steps it "
                             "compares); prints where the engine's threads spent the window")
    parser.add_argument("--profile-seconds", type=float, default=10.0, metavar="S",
                        help="seconds of passes each engine runs under py-spy (default 10)")
    args = parser.parse_args(argv)
    if args.quick and args.runs is not None:
        parser.exit(2, f"{parser.prog}: error: --quick is one run per figure: not with "
                       f"--runs\n")
    args.runs = 1 if args.quick else 5 if args.runs is None else args.runs
    if problem := _argument_problem(args):
        parser.exit(2, f"{parser.prog}: error: {problem}\n")
    log_path = new_log_path("pipeline-bench")
    figures: dict[str, dict[str, Any]] = {}
    with output_to_log(log_path) as terminal:
        def say(msg: str) -> None:
            print(f"[pipeline bench] {msg}", file=terminal, flush=True)

        try:
            if args.only in (None, "M8"):
                figures["M8"] = measure_m8(runs=args.runs, model=args.model,
                                           progress=lambda msg: say(f"M8: {msg}"))
            if args.only in (None, "M5e"):
                figures["M5e"] = measure_step_time(
                    runs=args.runs, model=args.model, cudagraphs=args.cudagraphs,
                    profile_dir=args.profile and Path(args.profile),
                    profile_seconds=args.profile_seconds,
                    progress=lambda msg: say(f"M5e: {msg}"))
            if args.only == "M10":
                figures["M10"] = measure_m10(runs=args.runs, model=args.model,
                                             progress=lambda msg: say(f"M10: {msg}"))
        except Exception as exc:  # the traceback is in the log; the terminal gets one line
            traceback.print_exc()
            say(f"FAILED: {type(exc).__name__}: {exc} (details in {log_path})")
            return 1
    judged = {"M8": m8_metric, "M5e": m5e_metric, "M10": m10_metric}
    device = next(iter(figures.values()))["device"]
    specs = {name: BENCH_METRICS[name] for name in figures}
    results = {"device": device, "commit": source_commit(), "machine": machine(device),
               "model": args.model, "cudagraphs": args.cudagraphs,
               "metrics": {name: metric_json(specs[name], judged[name](figure), device)
                           for name, figure in figures.items()},
               "m8": figures.get("M8"), "step_time": figures.get("M5e"),
               "m10": figures.get("M10")}
    profiles = results["step_time"] and results["step_time"].pop("profile")
    traces = results["step_time"] and results["step_time"].pop("trace")
    devices = results["step_time"] and results["step_time"].pop("device_work")
    if profiles:
        results["profile"] = {name: summary and dataclasses.asdict(summary)
                              for name, summary in profiles.items()}
    if traces:
        results["trace"] = {name: dataclasses.asdict(trace) for name, trace in traces.items()}
    if devices:
        results["device_work"] = {name: dataclasses.asdict(work)
                                  for name, work in devices.items()}
    print(report(results, specs), flush=True)
    if profiles:
        print(profile_report(profiles, Path(args.profile), in_process=not args.cudagraphs),
              flush=True)
    if traces:
        print(textwrap.fill(f"each engine's decode steps in {TRACE_PASSES} alternating traced "
                            "passes (vLLM's worker profiler; self time, GIL waits included: "
                            "see prefix_cache/tools/profiling/step_trace.py):", REPORT_WIDTH,
                            initial_indent="\n"), compare_table(traces["plain"], traces["cache"]),
              f"traces: {args.profile}/{{plain,cache}}-trace", sep="\n", flush=True)
    if devices:
        print(device_report(devices), flush=True)
    print(f"\nvLLM's logs and warnings: {log_path}")
    if args.json:
        write_json(args.json, results)
    return 0


def device_report(devices: dict[str, DeviceWork]) -> str:
    """The device work of both engines' traces side by side, or why there is none."""
    if all(work.empty for work in devices.values()):
        return ("\nno device work in the traces: they hold no CUDA activity (a CPU run records "
                "none)")
    return textwrap.fill("what the device ran in each engine's traced steps (torch's profiler; "
                         "see prefix_cache/tools/profiling/device_trace.py):", REPORT_WIDTH,
                         initial_indent="\n") + f"\n{device_compare_table(devices)}"


def profile_report(profiles: dict[str, ProfileSummary | None], out_dir: Path, *,
                   in_process: bool) -> str:
    """The py-spy table of both engines (or why there is none) and where the profiles are."""
    summaries = {name: summary for name, summary in profiles.items() if summary is not None}
    if not summaries:
        return (f"\nno py-spy profile: py-spy is not installed beside this Python nor on PATH"
                f"\nprofiles (torch Chrome traces): {out_dir}")
    shared = ("; in-process, the engines share this process: the plain engine's column shows "
              "the cache engine's threads, idle while it is not stepped" if in_process else "")
    return textwrap.fill(f"where each engine's threads spent its profiled window (py-spy, share "
                         f"of its ticks; see prefix_cache/tools/profiling/profile.py{shared}):",
                         REPORT_WIDTH, initial_indent="\n") + \
        f"\n{format_table(summaries)}\nprofiles (raw py-spy stacks" + \
        (", torch Chrome traces" if in_process else "") + f"): {out_dir}"


if __name__ == "__main__":
    sys.exit(main())
