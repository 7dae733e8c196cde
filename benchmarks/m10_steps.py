"""Where M10's capped stage 1 spends its time beside the uncapped one: the steps vLLM's scheduler
made, the tokens and requests of each, and the cache's engine-thread time, per run.

    PYTHONPATH=. python3 benchmarks/m10_steps.py [--model small|tiny|7b] [--runs 3] [--profile N]

The engines of `pipeline_bench --only M10` (M8's workload and stage 1; capped at a quarter of
the KV mirror, uncapped, caching off; the cache's scheduler named in all three), but in this
process, so that each scheduler step is seen: `schedule()` is wrapped to note its scheduled
tokens, its requests, and how many requests it left waiting. Runs rotate between the engines
as M10's do, each from a cold prefix cache. Prints, per engine, the median run's ms, steps,
ms in `schedule()` and in the cache's engine-thread calls, and the tokens scheduled by step.
`--profile N`: each cache engine's runs also under cProfile (the engine thread: this one), and
the N functions of `prefix_cache` with the most time of their own, capped beside uncapped (the
profiler's overhead inflates each call: compare the two, not the times with the table's).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefix_cache.tools.pipeline_bench import (M10_POOL_SHARE, RESIDENT_SCHEDULER,  # noqa: E402
                                               _cold, m8_stage_one, m8_workload)
from prefix_cache.tools.pipelines.engine_logs import new_log_path, output_to_log  # noqa: E402
from prefix_cache.tools.pipelines.engines import (cache_engine_thread_s,  # noqa: E402
                                                  multiprocessing_mode, start_thinker)
from prefix_cache.tools.pipelines.pipeline import run_pipeline  # noqa: E402
from prefix_cache.tools.reporting.harness import format_table, source_commit  # noqa: E402


class StepLog:
    """The scheduler steps of one run: (tokens, requests scheduled, requests left waiting),
    and the seconds spent in `schedule()`."""

    def __init__(self, scheduler: Any) -> None:
        self.steps: list[tuple[int, int, int]] = []
        self.seconds = 0.0
        schedule = scheduler.schedule

        def noted(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            out = schedule(*args, **kwargs)
            self.seconds += time.perf_counter() - began
            if out.total_num_scheduled_tokens:
                self.steps.append((out.total_num_scheduled_tokens,
                                   len(out.num_scheduled_tokens), len(scheduler.waiting)))
            return out

        scheduler.schedule = noted


def own_time_table(profiles: dict[str, cProfile.Profile], top: int, runs: int) -> str:
    """The `top` functions of `prefix_cache` by the capped engine's time of their own, µs a run
    and calls a run for each engine."""
    own: dict[str, dict[str, tuple[float, int]]] = {}
    for label, profile in profiles.items():
        for (path, line, name), (_, calls, tottime, _, _) in \
                pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
            if "prefix_cache" in path:
                where = f"{path.split('prefix_cache/', 1)[-1]}:{line}({name})"
                own.setdefault(where, {})[label] = (tottime / runs, calls // runs)
    ranked = sorted(own.items(), key=lambda item: -item[1].get("capped", (0.0, 0))[0])[:top]
    return format_table(
        ["function (cProfile, own time)", "capped µs/run", "calls", "uncapped µs/run", "calls"],
        [[where, *(x for label in ("capped", "uncapped") for x in (
            f"{by.get(label, (0.0, 0))[0] * 1e6:.0f}", by.get(label, (0.0, 0))[1]))]
         for where, by in ranked])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    import torch

    from prefix_cache.channel import open_channel
    device, stage_model, shape = m8_stage_one(args.model)
    requests = m8_workload()
    row_bytes = stage_model.hidden_size * getattr(torch, shape.dtype).itemsize
    budget = int(shape.num_blocks * M10_POOL_SHARE) * shape.block_size * row_bytes
    budgets = {"capped": budget, "uncapped": None, "off": None}
    rows: list[list[Any]] = []
    log_path = new_log_path("m10-steps")
    with tempfile.TemporaryDirectory() as tmp, output_to_log(log_path) as terminal, \
            multiprocessing_mode(False), open_channel() as channel:
        model_dir = stage_model.write(Path(tmp) / "thinker")
        engines = {label: start_thinker(
            model_dir, channel, prefix_caching=label != "off", shape=shape,
            stage_options=None if b is None else {"host_budget_bytes": b},
            scheduler_cls=RESIDENT_SCHEDULER, **stage_model.engine_args)
            for label, b in budgets.items()}
        logs = {label: StepLog(engine.engine.engine_core.engine_core.scheduler)
                for label, engine in engines.items()}
        try:
            for engine in engines.values():  # warm-up
                _cold(engine)
                run_pipeline(engine, channel, requests)
            runs: dict[str, list[tuple[float, list[tuple[int, int, int]], float, float]]] = {
                label: [] for label in engines}
            order = list(engines)
            profiles = {label: cProfile.Profile() for label in ("capped", "uncapped")}
            for i in range(args.runs):
                print(f"[m10 steps] run {i + 1}/{args.runs} ...", file=terminal, flush=True)
                for label in order[i % 3:] + order[:i % 3]:
                    engine, log = engines[label], logs[label]
                    _cold(engine)
                    before = cache_engine_thread_s(engine.stats()) if label != "off" else 0.0
                    log.steps, log.seconds = [], 0.0
                    profile = profiles.get(label) if args.profile else None
                    if profile is not None:
                        profile.enable()
                    seconds = run_pipeline(engine, channel, requests).seconds
                    if profile is not None:
                        profile.disable()
                    cache_s = (cache_engine_thread_s(engine.stats()) - before
                               if label != "off" else 0.0)
                    runs[label].append((seconds, log.steps, cache_s, log.seconds))
            stats = {label: engines[label].stats() for label in ("capped", "uncapped")}
        finally:
            for engine in engines.values():
                engine.close()
    for label, done in runs.items():
        seconds, steps, cache_s, schedule_s = sorted(done)[len(done) // 2]
        rows.append([label, f"{seconds * 1e3:.1f}", len(steps), f"{schedule_s * 1e3:.2f}",
                     f"{cache_s * 1e3:.2f}", " ".join(f"{t}/{r}/{w}" for t, r, w in steps)])
    print(f"M8's stage 1 on {device} ({stage_model.describe(shape)}), {len(requests)} requests; "
          f"capped at {budget:,} B ({M10_POOL_SHARE:.0%} of the mirror); commit "
          f"{source_commit()}; runs {args.runs}, the median run's")
    print(format_table(["engine", "run ms", "steps", "schedule() ms", "cache's calls ms",
                        "by step: tokens/requests scheduled/requests waiting"], rows))
    for label, s in stats.items():
        print(f"  {label}: " + ", ".join(f"{k} {s[k]}" for k in (
            "pool_blocks", "resident_blocks", "evicted_blocks", "hit_tokens",
            "hit_tokens_trimmed") if k in s))
    print("  median run ms: " + ", ".join(
        f"{label} {statistics.median(r[0] for r in done) * 1e3:.1f}"
        for label, done in runs.items()))
    if args.profile:
        print(own_time_table(profiles, args.profile, args.runs))
    print(f"vLLM's log: {log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
