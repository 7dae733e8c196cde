"""Pipeline figures on vLLM's real engine: M8 (what stage 1's prefix caching saves, and the
two-stage end to end) and the engine step time with the cache against vLLM's plain worker.

    python -m prefix_cache.tools.pipeline_bench [--runs N] [--json PATH]

Each figure is the median of `runs` runs made back to back, on and off interleaved, with the
smallest and largest beside it. Engines are started once and warmed up; between runs their
prefix caches are emptied, so every run starts cold. It prints its progress and a table like the
bench's; vLLM's logs go to a file it names.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefix_cache.tools.bench_report import Metric, metric_json, report
from prefix_cache.tools.engine_logs import new_log_path, output_to_log
from prefix_cache.tools.harness import machine, source_commit, spread, unwritable, write_json
from prefix_cache.tools.targets import PIPELINE_METRICS
from prefix_cache.tools.engines import (Engine, EngineShape, multiprocessing_mode, start_talker,
                                  start_thinker, write_random_qwen2)
from prefix_cache.tools.pipeline import StageRequest, run_pipeline, warm_up

#: A prefill-dominated stage 1 (about 100 M parameters) and a light stage 2 of its width
#: (2 layers), per vLLM platform: on a GPU, hidden 2048 in bf16 (about 400 M parameters).
M8_THINKER = {
    "cpu": dict(hidden_size=1024, num_layers=8, intermediate_size=2816, num_heads=16,
                num_kv_heads=4),
    "cuda": dict(hidden_size=2048, num_layers=8, intermediate_size=5632, num_heads=16,
                 num_kv_heads=4),
}
M8_SHAPE = EngineShape(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512,
                       long_prefill_token_threshold=0, num_blocks=129)
#: vLLM's own worker (no cache) per platform, for the step-time comparison.
PLAIN_WORKER = {"cpu": "vllm.v1.worker.cpu_worker.CPUWorker",
                "cuda": "vllm.v1.worker.gpu_worker.Worker"}
#: The no-recompute limit: stage 1's time with caching on / off <= SLACK x (1 - hit fraction).
SLACK = 1.15
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


def m8_stage_one() -> tuple[str, dict[str, Any], EngineShape]:
    """This platform's name, its M8 stage-1 model and engine shape (bf16 on a GPU)."""
    from vllm.platforms import current_platform
    device = current_platform.device_type
    if device not in M8_THINKER:
        raise RuntimeError(f"no M8 model for vLLM platform {device!r} (cpu and cuda have one)")
    shape = M8_SHAPE if device == "cpu" else dataclasses.replace(M8_SHAPE, dtype="bfloat16")
    return device, M8_THINKER[device], shape


def describe_model(model: dict[str, Any], shape: EngineShape) -> str:
    return f"hidden {model['hidden_size']} x {model['num_layers']} layers, {shape.dtype}"


def _cold(*engines: Engine | None) -> None:
    for engine in engines:
        if engine is not None:
            engine.engine.reset_prefix_cache()


def measure_m8(*, runs: int = 5, multiprocessing: bool | None = None,
               progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """M8 on the real CPU engine: stage 1 with its prefix caching on / off, and the two-stage
    pipeline on / off; `multiprocessing` None is vLLM's default (an engine-core process each)."""
    from prefix_cache.channel import open_channel
    device, model, shape = m8_stage_one()
    requests = m8_workload()
    prompt_tokens = sum(len(r.prompt) for r in requests)
    with tempfile.TemporaryDirectory(prefix="omni-prefix-cache-m8-") as tmp, \
            multiprocessing_mode(multiprocessing), open_channel() as channel:
        progress(f"writing the M8 models on {device} ({describe_model(model, shape)}; "
                 f"talker 2 layers) ...")
        thinker_dir = write_random_qwen2(Path(tmp) / "thinker", **model)
        talker_dir = write_random_qwen2(Path(tmp) / "talker", seed=1,
                                        **dict(model, num_layers=2))
        progress("starting three engines (thinker with caching on and off, talker) ...")
        engines = {caching: start_thinker(thinker_dir, channel, prefix_caching=caching,
                                          shape=shape) for caching in (True, False)}
        talker = start_talker(talker_dir, shape)
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
                    f"shared prefixes; stage 1 {describe_model(model, shape)} on {device}, "
                    f"stage 2 x 2 layers ({TALKER_TOKENS} tokens each)",
        "runs": runs, "hit_fraction": hit_fraction,
        "stage1_on_s": spread(times["on"]), "stage1_off_s": spread(times["off"]),
        "ratio": ratio, "ratio_per_run": spread(ratios), "target": target,
        "pass": ratio <= target,
        "e2e_on_s": spread(times["e2e_on"]), "e2e_off_s": spread(times["e2e_off"]),
        "e2e_ratio": statistics.median(times["e2e_on"]) / statistics.median(times["e2e_off"]),
        "e2e_ratio_per_run": spread(e2e_ratios),
    }


def _timed_steps(engine: Engine, requests: list[StageRequest]) -> list[float]:
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
    return steps


def measure_step_time(*, runs: int = 5, decode_tokens: int = 16,
                      progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Engine step time (in-process engines, so a step is the engine's own work) with the
    cache's worker against vLLM's plain CPU worker, both with prefix caching on, on the M8
    stage-1 model and workload with `decode_tokens` generated per request."""
    from prefix_cache.channel import open_channel
    device, model, shape = m8_stage_one()
    requests = [StageRequest(r.req_id, r.prompt, decode_tokens) for r in m8_workload()]
    with tempfile.TemporaryDirectory(prefix="omni-prefix-cache-steps-") as tmp, \
            multiprocessing_mode(False), open_channel() as channel:
        thinker_dir = write_random_qwen2(Path(tmp) / "thinker", **model)
        progress(f"starting vLLM's plain {device} worker and the cache's worker "
                 f"(in-process) ...")
        engines = {"plain": start_thinker(thinker_dir, channel, prefix_caching=True,
                                          shape=shape, worker_cls=PLAIN_WORKER[device]),
                   "cache": start_thinker(thinker_dir, channel, prefix_caching=True,
                                          shape=shape)}
        try:
            # on the workload itself: kernels compile on first use of each batch shape, once
            # per process, and the first engine to meet a shape would pay for both
            warm_up(engines["cache"], channel, requests=requests)
            _timed_steps(engines["plain"], requests)
            steps: dict[str, list[float]] = {"plain": [], "cache": []}
            for i in range(runs):
                progress(f"run {i + 1}/{runs} ...")
                order = list(engines.items())
                for name, engine in order if i % 2 == 0 else order[::-1]:
                    _cold(engine)
                    steps[name] += _timed_steps(engine, requests)
                    if name == "cache":  # take the published rows off the channel
                        for request in requests:
                            channel.get(request.req_id)
            stats = engines["cache"].stats()
        finally:
            for engine in engines.values():
                engine.close()
    calls = stats["calls.save_outputs"]
    library = (stats["time_s.new_step_starts"] + stats["time_s.save_outputs"]) / calls
    return {
        "device": device,
        "workload": f"M8 stage 1 ({describe_model(model, shape)} on {device}), "
                    f"{len(requests)} requests of "
                    f"{len(requests[0].prompt)} tokens, {decode_tokens} generated each",
        "runs": runs, "steps_per_run": len(steps["cache"]) // runs,
        "step_s_plain": spread(steps["plain"]), "step_s_cache": spread(steps["cache"]),
        "step_ratio": statistics.median(steps["cache"]) / statistics.median(steps["plain"]),
        "total_ratio": sum(steps["cache"]) / sum(steps["plain"]),
        "engine_thread_library_s_per_step": library,
    }


def m8_metric(m8: dict[str, Any]) -> Metric:
    """M8 as the bench judges it: stage 1's on / off ratio ÷ (1 - hit fraction)."""
    return Metric(m8["ratio"] / (1 - m8["hit_fraction"]),
                  f"stage 1 on/off {m8['ratio']:.3f} at hit fraction {m8['hit_fraction']:.2f}; "
                  f"two stages end to end on/off {m8['e2e_ratio']:.3f}", m8["workload"])


def m5e_metric(steps: dict[str, Any]) -> Metric:
    """M5e: engine steps per second with the cache's worker ÷ vLLM's plain worker."""
    plain, cache = steps["step_s_plain"]["median"], steps["step_s_cache"]["median"]
    return Metric(1 / steps["step_ratio"],
                  f"vLLM's plain worker, median step {plain * 1e3:.2f} ms (cache's "
                  f"{cache * 1e3:.2f} ms)",
                  f"total time {1 / steps['total_ratio']:.3f}; the cache's engine-thread calls "
                  f"{steps['engine_thread_library_s_per_step'] * 1e6:.0f} µs a step; "
                  f"{steps['workload']}")


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
               "default 5 runs (three engine starts, then every run on and off).")
    parser.add_argument("--runs", type=int, default=5, help="runs per figure (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.json and (problem := unwritable(args.json)):
        parser.error(problem)
    log_path = new_log_path("pipeline-bench")
    with output_to_log(log_path) as terminal:
        def say(msg: str) -> None:
            print(f"[pipeline bench] {msg}", file=terminal, flush=True)

        try:
            m8 = measure_m8(runs=args.runs, progress=lambda msg: say(f"M8: {msg}"))
            steps = measure_step_time(runs=args.runs,
                                      progress=lambda msg: say(f"M5e: {msg}"))
        except Exception as exc:  # the traceback is in the log; the terminal gets one line
            traceback.print_exc()
            say(f"FAILED: {type(exc).__name__}: {exc} (details in {log_path})")
            return 1
    metrics = {"M8": m8_metric(m8), "M5e": m5e_metric(steps)}
    results = {"device": m8["device"], "commit": source_commit(), "machine": machine(m8["device"]),
               "metrics": {name: metric_json(PIPELINE_METRICS[name], metric, m8["device"])
                           for name, metric in metrics.items()},
               "m8": m8, "step_time": steps}
    print(report(results, PIPELINE_METRICS), flush=True)
    print(f"\nvLLM's logs and warnings: {log_path}")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
