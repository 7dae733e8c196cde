"""M8's pipelines one by one: why a cache-on two-stage run sometimes takes 0.5 s more.

    python3 benchmarks/m8_e2e_runs.py [--model 7b] [--runs 3] 2>&1 | tee m8.log

(the package installed, `pip install -e .`; on the GPU machine after `eval "$(bash
.vllm-gpu/install.sh)"`, whose PYTHONPATH a plain `PYTHONPATH=.` would replace).

Runs `measure_m8` as the bench does, prints a line as each pipeline it runs starts (stage 1
alone and both stages, caching on and off), then a table of each one's seconds and stage 1's
seconds within it. The engine-core processes write to the same output, so what vLLM reports
meanwhile falls between those lines. The engines start with `jit_monitor_verbose=True`: on a
GPU, vLLM's `jit_monitor` then warns of every Triton kernel compiled during inference ("Triton
kernel JIT compilation during inference"; without it, only a kernel's first), a latency spike
that is vLLM's, not the cache's.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from prefix_cache.tools import pipeline_bench
from prefix_cache.tools.harness import format_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rows: list[list[str]] = []
    run_pipeline = pipeline_bench.run_pipeline

    def logged(engine: Any, channel: Any, requests: Any, **kwargs: Any) -> Any:
        caching = "on" if "hit_tokens" in engine.stats() else "off"
        stages = "both" if kwargs.get("talker") is not None else "stage 1"
        print(f"[pipeline {len(rows) + 1}: caching {caching}, {stages}]", flush=True)
        run = run_pipeline(engine, channel, requests, **kwargs)
        rows.append([f"{len(rows) + 1}", caching, stages, f"{run.seconds:.3f}",
                     f"{run.thinker_seconds:.3f}"])
        sys.stdout.flush()
        return run

    pipeline_bench.run_pipeline = logged
    for name in ("start_thinker", "start_talker"):
        start = getattr(pipeline_bench, name)
        setattr(pipeline_bench, name, lambda *a, start=start, **kw: start(
            *a, **kw, jit_monitor_verbose=True))
    result = pipeline_bench.measure_m8(runs=args.runs, model=args.model, progress=print)
    print(format_table(["pipeline", "caching", "stages", "seconds", "stage 1 s"], rows))
    print(f"M8 stage 1 on/off {result['ratio']:.3f} at hit fraction "
          f"{result['hit_fraction']:.2f}, end to end {result['e2e_ratio']:.3f}")


if __name__ == "__main__":
    main()
