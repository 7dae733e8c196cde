"""Where a fresh cache-on engine's first runs spend their time: the demo's stage-1 workload run
three times on one in-process engine (prefix cache emptied between runs), caching on and off,
with the cache's per-call timers after each run.

    python benchmarks/gpu_first_run.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from prefix_cache.tools import demo
from prefix_cache.channel import open_channel
from prefix_cache.tools.engines import multiprocessing_mode, start_thinker, write_random_qwen2
from prefix_cache.tools.pipeline import run_pipeline, warm_up


def main() -> None:
    requests = demo.make_workload()
    with tempfile.TemporaryDirectory() as tmp, multiprocessing_mode(False), \
            open_channel() as channel:
        model = write_random_qwen2(Path(tmp) / "thinker")
        for caching in (True, False):
            engine = start_thinker(model, channel, prefix_caching=caching)
            warm_up(engine, channel)
            before = engine.stats()
            for run in range(3):
                start = time.perf_counter()
                run_pipeline(engine, channel, requests)
                seconds = time.perf_counter() - start
                stats = engine.stats()
                timers = {k: round(stats[k] - before.get(k, 0), 4) for k in stats
                          if k.startswith("time_s.") and stats[k] - before.get(k, 0) > 1e-3}
                print(f"caching {'on ' if caching else 'off'} run {run}: {seconds:.3f} s {timers}",
                      flush=True)
                before = stats
                engine.engine.reset_prefix_cache()
            engine.close()


if __name__ == "__main__":
    main()
