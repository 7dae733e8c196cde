"""Where the cache's engine steps lose time, by phase of a pass: the prompt steps, the decode
steps and the steps where the requests finish, against vLLM's plain worker in the same
process, with one part of the stage's work taken out (`--variant`).

    PYTHONPATH=. python3 benchmarks/step_phases.py [--model tiny|small] [--passes 10]
        [--variant full|noannounce|noput|noread]

Both engines run M8's stage-1 workload (16 requests of 256 tokens, 16 generated) from a cold
prefix cache, pass for pass in turn, in-process; each step's time is the median over passes of
the step at that index. A pass of the cache's engine ends once its entries are taken off the
channel, so none is put while the plain engine runs. Variants, applied after the warm-up (they
are measurements, not a delivery):

- `full`: the stage as it is;
- `noannounce`: a request's first step tells the channel nothing (no expectation recorded);
- `noput`: a finished request's rows are read back, and no entry is put on the channel;
- `noread`: nor are they read back (the finish only lets go of its pinned rows).

On CPU, `--model tiny` gives steps bound by the engine's Python, as a GPU decode step under
CUDA graphs is.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from prefix_cache.channel import open_channel
from prefix_cache.integration.delivery import StageDelivery
from prefix_cache.tools import pipeline_bench as pb
from prefix_cache.tools.engines import multiprocessing_mode, start_thinker
from prefix_cache.tools.pipeline import StageRequest, warm_up

VARIANTS = ("full", "noannounce", "noput", "noread")


def take_out(variant: str) -> None:
    """Patch the stage's delivery for `variant` (in this process only)."""
    if variant in ("noannounce", "noput", "noread"):
        StageDelivery.announce = lambda self, req_ids: None
    if variant == "noput":
        StageDelivery._put_entry = lambda self, *args, **kwargs: None
    if variant == "noread":
        def let_go(self, request, rows, *, early=False):
            if rows is not None:
                rows.cancel()
        StageDelivery.publish_read = let_go


def phases(steps: list[float], prompt_steps: int, finish_steps: int) -> dict[str, float]:
    return {"prompt": sum(steps[:prompt_steps]),
            "decode": sum(steps[prompt_steps:len(steps) - finish_steps]),
            "finish": sum(steps[len(steps) - finish_steps:]), "pass": sum(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--variant", default="full", choices=VARIANTS)
    parser.add_argument("--prompt-steps", type=int, default=4,
                        help="the first steps of a pass counted as its prompt steps")
    parser.add_argument("--finish-steps", type=int, default=3,
                        help="the last steps of a pass counted as its finish steps")
    args = parser.parse_args()
    device, stage_model, shape = pb.m8_stage_one(args.model)
    requests = [StageRequest(r.req_id, r.prompt, 16) for r in pb.m8_workload()]
    # in-process: a step is the engine's own work, and the variants patch this process
    with tempfile.TemporaryDirectory(prefix="omni-prefix-cache-phases-") as tmp, \
            multiprocessing_mode(False), open_channel() as channel:
        model_dir = stage_model.write(Path(tmp) / "thinker")
        engines = {"plain": start_thinker(model_dir, channel, prefix_caching=True, shape=shape,
                                          worker_cls=pb.PLAIN_WORKER[device],
                                          **stage_model.engine_args),
                   "cache": start_thinker(model_dir, channel, prefix_caching=True, shape=shape,
                                          **stage_model.engine_args)}
        try:
            warm_up(engines["cache"], channel, requests=requests)
            pb._timed_steps(engines["plain"], requests)
            take_out(args.variant)
            puts = args.variant in ("full", "noannounce")  # the entries a pass takes off
            channels = {"plain": None, "cache": channel if puts else None}
            passes: dict[str, list[list[float]]] = {"plain": [], "cache": []}
            for _ in range(args.passes):
                for name, engine in engines.items():
                    passes[name].append(pb._cold_pass(engine, requests, channels[name]))
        finally:
            for engine in engines.values():
                engine.close()
    length = min(len(p) for runs in passes.values() for p in runs)
    median = {name: [statistics.median(p[i] for p in runs) * 1e3 for i in range(length)]
              for name, runs in passes.items()}
    print(f"{stage_model.describe(shape)} on {device}, variant {args.variant}, "
          f"{args.passes} passes; ms, the median over passes of each step")
    print("| step | plain | cache | cache - plain |\n| --- | --- | --- | --- |")
    for i in range(length):
        plain, cache = median["plain"][i], median["cache"][i]
        print(f"| {i} | {plain:.2f} | {cache:.2f} | {cache - plain:+.2f} |")
    plain, cache = (phases(median[name], args.prompt_steps, args.finish_steps)
                    for name in ("plain", "cache"))
    print("\n| phase | plain ms | cache ms | cache - plain |\n| --- | --- | --- | --- |")
    for phase in plain:
        print(f"| {phase} | {plain[phase]:.2f} | {cache[phase]:.2f} | "
              f"{cache[phase] - plain[phase]:+.2f} |")
    print(f"\ncache / plain, the pass: {cache['pass'] / plain['pass']:.3f}")


if __name__ == "__main__":
    main()
