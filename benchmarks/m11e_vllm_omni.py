"""M11e: inside vllm-omni's engine, the thinker stage's step, this cache ÷ vllm-omni's own.

    .venv-omni/bin/python benchmarks/m11e_vllm_omni.py [--runs 5] [--requests 8] [--json PATH]

Needs the vllm-omni environment (`bash ci/setup-vllm-omni.sh`). Each run starts vllm-omni's
`Omni` with the tiny random Qwen2.5-Omni thinker of `tests/vllm_omni/stage.py` (2 layers,
width 128, float32, 32-token blocks) on the CPU worker, in a process of its own, prefix caching
on, with vllm-omni 0.30.0's prefix cache or with this one (`OMNI_PREFIX_CACHE_IN_VLLM_OMNI=1`,
nothing else changed); runs alternate between the two. The stage runner builds every request's
payload each step, as a thinker ahead of a talker does, so each step saves, and materializes,
its rows. The rounds, each one `generate` call: a warm-up request; `--requests` 64-token
prompts (the prefixes the hit round finds); then, timed, the miss round (`--requests` new
96-token prompts: 0% of prompt tokens hit) and the hit round (each prefix with 32 new tokens:
64 of 96, 66%, hit). A step is the runner's `execute_model` + `sample_tokens`: the forward,
sampling, and the cache's `new_step_starts`, `save_outputs` and `materialize`. Per round and
cache: the median step of each run, the round's first step (its prompts' prefill), and the
median step in CPU time (the stage process's, every thread's: what the step costs, less
sensitive to other load on the machine than its wall time); the figure is the median over
runs with the runs' spread, and the ratio is this cache's ÷ vllm-omni's, run by run. Tokens
of both caches are checked equal, run by run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefix_cache.tools.reporting.harness import (  # noqa: E402
    format_table, machine, source_commit, spread, write_json)
from tests.vllm_omni import stage  # noqa: E402

CACHES = ("this", "vllm-omni")
PREFIX, PROMPT, MAX_TOKENS = 64, 96, 8


def workload(requests: int) -> dict[str, list[list[int]]]:
    """The rounds' prompts, every token id distinct between prompts except a hit's prefix."""
    word = stage.FIRST_WORD

    def tokens(start: int, count: int) -> list[int]:
        return [word + (start + i) % (stage.VOCAB - word) for i in range(count)]

    seeds = [tokens(1000 + 100 * i, PREFIX) for i in range(requests)]
    return {"warm-up": [tokens(0, 48)], "prefixes": seeds,
            "miss": [tokens(1000 + 100 * (requests + i), PROMPT) for i in range(requests)],
            "hit": [seed + tokens(60 + 40 * i, PROMPT - PREFIX) for i, seed in enumerate(seeds)]}


def round_steps(steps: list[dict[str, Any]], prompts: list[list[int]],
                clock: str) -> list[float]:
    """`clock` ("s": wall, "cpu_s": the stage process's CPU) seconds of the steps that ran a
    request of `prompts` (and no other)."""
    keys = {stage.prompt_key(p) for p in prompts}
    return [step[clock] for step in steps if step["requests"] and set(step["requests"]) <= keys]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rounds = workload(args.requests)
    timed = ("miss", "hit")
    #: Per figure: which clock, which of the round's steps (its median or its first), the label.
    parts = {"median": ("s", statistics.median, "median step"),
             "first": ("s", lambda steps: steps[0], "first step (prefill)"),
             "cpu_median": ("cpu_s", statistics.median, "median step, CPU time")}
    figures: dict[str, dict[str, dict[str, list[float]]]] = {
        name: {cache: {part: [] for part in parts} for cache in CACHES} for name in timed}
    hits: dict[str, list[list[int]]] = {}
    print(f"(load average before: {os.getloadavg()})")
    with tempfile.TemporaryDirectory(prefix="m11e-") as tmp:
        model = stage.write_model(Path(tmp) / "model")
        for run in range(args.runs):
            tokens = {}
            for cache in CACHES if run % 2 == 0 else CACHES[::-1]:
                result = stage.run_stage(model, list(rounds.values()),
                                         Path(tmp) / f"{cache}-{run}", this_cache=cache == "this",
                                         max_tokens=MAX_TOKENS)
                tokens[cache] = [r["tokens"] for r in result["rounds"]]
                hits[cache] = [r["cached"] for r in result["rounds"]]
                for name in timed:
                    for part, (clock, pick, _) in parts.items():
                        seconds = round_steps(result["steps"], rounds[name], clock)
                        figures[name][cache][part].append(pick(seconds) * 1e3)
            if tokens["this"] != tokens["vllm-omni"]:
                print(f"run {run}: the two caches' tokens differ")
                return 1
    names = list(rounds)
    hit_share = {name: sum(hits["this"][names.index(name)]) / sum(map(len, rounds[name]))
                 for name in timed}
    print(f"\nM11e on cpu: the thinker stage inside vllm-omni 0.30.0's Omni, this cache ÷ "
          f"vllm-omni's own prefix cache; {args.requests} requests a round, {MAX_TOKENS} tokens "
          f"each; medians of {args.runs} runs [their spread], runs alternating.")
    print(f"{machine('cpu')}, commit {source_commit()}\n")
    rows = []
    result: dict[str, Any] = {"runs": args.runs, "requests": args.requests, "metrics": {}}
    for name in timed:
        for part, (_, _, label) in parts.items():
            this = spread(figures[name]["this"][part])
            peer = spread(figures[name]["vllm-omni"][part])
            ratios = spread([a / b for a, b in zip(this["runs"], peer["runs"])])
            result["metrics"][f"{name}.{part}"] = {"this_ms": this, "vllm_omni_ms": peer,
                                                   "ratio": ratios}
            rows.append([f"{name} round ({hit_share[name]:.0%} hits), {label}",
                         f"{this['median']:.2f} [{this['min']:.2f}-{this['max']:.2f}]",
                         f"{peer['median']:.2f} [{peer['min']:.2f}-{peer['max']:.2f}]",
                         f"{ratios['median']:.3f} [{ratios['min']:.3f}-{ratios['max']:.3f}]"])
    print(format_table(["metric", "this cache ms", "vllm-omni ms", "this / vllm-omni"], rows))
    print(f"\ntokens: equal in every run; prompt tokens vLLM found cached per round "
          f"(this = vllm-omni): {dict(zip(names, map(sum, hits['this'])))}")
    print(f"(load average after: {os.getloadavg()})")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
