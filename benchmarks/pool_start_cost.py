"""What the host pool costs a GPU engine at start: the mirror of every KV slot against a capped
pool (issue 57), beside vLLM's plain worker.

    python3 benchmarks/pool_start_cost.py [--model 7b] [--cap-gib 2] [--utilization 0.9]
        [--rounds 1] [--json PATH]

Each engine is vLLM's real GPU engine, its core in a process of its own, sized by vLLM at
`--utilization` of the GPU (no block override), started one at a time and closed before the
next, in the order plain, mirror, capped (`--rounds` times). Per engine: the seconds from
`LLM(...)` to a ready engine, the KV blocks vLLM allocated, the cache's pool bytes (all keys)
and blocks of rows, whether its start line says pinned, and the worker process's resident
bytes after start. Needs a CUDA build of vLLM; the 7b model is vLLM's dummy weights.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefix_cache.tools.pipeline_bench import PLAIN_WORKER  # noqa: E402
from prefix_cache.tools.pipelines.engine_logs import new_log_path, output_to_log  # noqa: E402
from prefix_cache.tools.pipelines.engines import (MODELS, Engine, EngineShape,  # noqa: E402
                                                  multiprocessing_mode, start_thinker)
from prefix_cache.tools.reporting.harness import (format_table, machine,  # noqa: E402
                                                  source_commit, write_json)

SHAPE = EngineShape(max_model_len=4096, block_size=16, max_num_seqs=64,
                    max_num_batched_tokens=2048, long_prefill_token_threshold=0,
                    num_blocks=None, dtype="bfloat16")  # type: ignore[arg-type]
START_LINE = re.compile(r"omni prefix cache on .*")


def start_one(label: str, model_dir: Path, channel: Any, *, budget: int | None,
              utilization: float, engine_args: dict[str, Any], log_path: Path
              ) -> dict[str, Any]:
    """Start `label`'s engine, read what it holds, close it."""
    args = {**engine_args, "gpu_memory_utilization": utilization}
    log_start = log_path.stat().st_size
    began = time.perf_counter()
    if label == "plain":
        engine = Engine(model_dir, SHAPE, worker_cls=PLAIN_WORKER["cuda"], **args)
    else:
        engine = start_thinker(model_dir, channel, prefix_caching=True, shape=SHAPE,
                               stage_options=None if budget is None else
                               {"host_budget_bytes": budget}, **args)
    start_s = time.perf_counter() - began
    try:
        kv_blocks = engine.engine.vllm_config.cache_config.num_gpu_blocks
        stats = {} if label == "plain" else engine.stats()
    finally:
        engine.close()
    with open(log_path, errors="replace") as log:
        log.seek(log_start)
        lines = START_LINE.findall(log.read())
    return {"engine": label, "start_s": start_s, "kv_blocks": kv_blocks,
            "pool_bytes": sum(v for k, v in stats.items() if k.startswith("pool_bytes.")),
            "pool_blocks": stats.get("pool_blocks"), "start_line": lines[-1] if lines else None,
            "pinned": bool(lines) and lines[-1].endswith("pinned"),
            "worker_rss_bytes": stats.get("worker_rss_bytes")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["small", "7b"], default="7b")
    parser.add_argument("--cap-gib", type=float, default=2.0)
    parser.add_argument("--utilization", type=float, default=0.9)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    stage_model = MODELS[args.model]["cuda"]
    budget = int(args.cap_gib * (1 << 30))
    log_path = new_log_path("pool-start-cost")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pool-start-") as tmp, \
            output_to_log(log_path) as terminal, multiprocessing_mode(True):
        from prefix_cache.channel import open_channel
        model_dir = stage_model.write(Path(tmp) / "model")
        with open_channel() as channel:
            for round_ in range(args.rounds):
                for label, cap in (("plain", None), ("mirror", None), ("capped", budget)):
                    print(f"[pool start cost] round {round_ + 1}: starting {label} ...",
                          file=terminal, flush=True)
                    rows.append({"round": round_ + 1, **start_one(
                        label, model_dir, channel, budget=cap, utilization=args.utilization,
                        engine_args=stage_model.engine_args, log_path=log_path)})
    gib = 1 << 30
    print(f"{stage_model.describe(SHAPE)}; gpu_memory_utilization {args.utilization}; cap "
          f"{args.cap_gib} GiB; {machine('cuda')}; commit {source_commit()}; vLLM log {log_path}")
    print(format_table(
        ["round", "engine", "start s", "KV blocks", "pool GiB", "pool blocks", "pinned",
         "worker RSS GiB"],
        [[r["round"], r["engine"], f"{r['start_s']:.1f}", f"{r['kv_blocks']:,}",
          f"{r['pool_bytes'] / gib:.2f}", r["pool_blocks"] or "-",
          "-" if r["engine"] == "plain" else ("yes" if r["pinned"] else "no"),
          "-" if r["worker_rss_bytes"] is None else f"{r['worker_rss_bytes'] / gib:.2f}"]
         for r in rows]))
    for r in rows:
        if r["start_line"]:
            print(f"  {r['engine']}: {r['start_line']}")
    if args.json:
        write_json(args.json, {"commit": source_commit(), "machine": machine("cuda"),
                               "model": args.model, "utilization": args.utilization,
                               "cap_bytes": budget, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
