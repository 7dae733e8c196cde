"""The stage's output thread in a real engine: its jobs' time per engine step, and a cProfile of
them by self time.

    PYTHONPATH=. python3 benchmarks/output_jobs_profile.py [--model tiny|small] [--passes 20]
        [--top 30] [--stream]

The cache's engine runs M8's stage-1 workload (16 requests of 256 tokens, 16 generated) from a
cold prefix cache, in-process, `--passes` times after a warm-up; every job of the output thread
(announcing requests, reading back and publishing finished ones; with `--stream`, the stage
streams: reading back and publishing each step's chunks) runs under cProfile. Printed:
the jobs' wall time per engine step and per publishing job (profiled, so read them side by
side with another tree's, not as absolute costs), then the `--top` functions by self time, µs
per engine step.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

from prefix_cache.channel import open_channel
from prefix_cache.integration import stage_outputs
from prefix_cache.tools import pipeline_bench as pb
from prefix_cache.tools.engines import start_thinker
from prefix_cache.tools.pipeline import StageRequest, warm_up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--stream", action="store_true", help="a streaming stage (a chunk a step)")
    args = parser.parse_args()
    profile = cProfile.Profile()
    jobs = {"on": False, "count": 0, "s": 0.0, "publishing": 0, "publishing_s": 0.0}
    contained = stage_outputs.StageOutputDriver._contained

    def profiled(self, what, req_ids, job, step_rows):  # the output thread's every job
        if not jobs["on"]:
            return contained(self, what, req_ids, job, step_rows)
        start = time.perf_counter()
        profile.enable()
        try:
            return contained(self, what, req_ids, job, step_rows)
        finally:
            profile.disable()
            seconds = time.perf_counter() - start
            jobs["count"] += 1
            jobs["s"] += seconds
            if step_rows:
                jobs["publishing"] += 1
                jobs["publishing_s"] += seconds

    stage_outputs.StageOutputDriver._contained = profiled
    _, model, shape = pb.m8_stage_one(args.model)
    requests = [StageRequest(r.req_id, r.prompt, 16) for r in pb.m8_workload()]
    steps = 0
    with tempfile.TemporaryDirectory() as tmp, open_channel() as channel:
        engine = start_thinker(model.write(Path(tmp) / "thinker"), channel, prefix_caching=True,
                               shape=shape, stage_options={"stream": args.stream})
        warm_up(engine, channel, requests=requests)
        jobs["on"] = True
        for _ in range(args.passes):
            pb._cold(engine)
            steps += len(pb._timed_steps(engine, requests))
            for request in requests:
                channel.get(request.req_id)
        jobs["on"] = False
        engine.close()
    print(f"{steps} engine steps, {jobs['count']} output-thread jobs: "
          f"{jobs['s'] / steps * 1e6:.0f} µs a step; {jobs['publishing']} publishing jobs, "
          f"{jobs['publishing_s'] / max(1, jobs['publishing']) * 1e6:.0f} µs each (profiled)")
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = sorted(((own / steps * 1e6, total / steps * 1e6, calls / steps,
                    f"{path.split('prefix_cache/')[-1]}:{line} {name}")
                   for (path, line, name), (_, calls, own, total, _) in stats.items()),
                  reverse=True)
    print("| self µs a step | cumulative µs | calls a step | function |")
    print("| --- | --- | --- | --- |")
    for own, total, calls, where in rows[:args.top]:
        print(f"| {own:.1f} | {total:.1f} | {calls:.1f} | {where} |")


if __name__ == "__main__":
    main()
