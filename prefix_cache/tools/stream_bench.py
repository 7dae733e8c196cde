"""M9 on vLLM's real engine: what streaming stage 1's rows buys stage 2, and what it costs.

    python -m prefix_cache.tools.stream_bench [--runs N] [--json PATH] [--every N] [--only M9c]
        [--model random|small|7b] [--cudagraphs] [--profile DIR [--profile-seconds S]]

Stage 1 (the thinker, with the cache) generates 64 tokens per request; stage 2
(a plain talker on `prompt_embeds`) starts on the thinker's prompt rows, as soon
as they have arrived when stage 1 streams, else after its finish
(`prefix_cache.tools.pipelines.stream_pipeline`). Requests of two prompt families run one
at a time, so the later two of each run hit the prefix cache. Figures:

- M9: the talker's first token, from the thinker's submission, streaming on / off;
- M9h: with a prefix hit, the first chunk's arrival from submission / the thinker's first
  step (submission to its first token): within one stage-1 step is <= 1;
- M9c: stage 1's steps per second, streaming on / off, four requests decoding together, their
  rows drained in both cases by a consumer in a process of its own, as a next stage is (its
  polls and takes are not stage 1's client work). Beside it, the time stage 1's engine thread
  spent in the cache's calls (`ENGINE_THREAD_CALLS`, from its `stats()`) over each pass, a
  step on average: steadier than the steps' ratio, and without the other threads' share.

The stages are random Qwen2 models of hidden 256 and 2 layers (`--model random`, float32), or
the stage-1 models `pipeline_bench` uses (`--model small`, or `7b` with dummy weights on a
GPU; bf16 there; `pipelines.engines.MODELS`), the talker 2 layers of the thinker's width;
`--cudagraphs` runs them with CUDA graphs (vLLM's full decode graphs) instead of eager.

`--every N` streams a chunk every N positions instead of every step (the stage option
`stream: N`). `--only M9c` measures the step rate alone: no talker is started, nor M9's and
M9h's pipeline runs made. `--profile DIR` then runs M9c's decode steps again under py-spy,
streaming on and off, and prints where stage 1's threads spent them
(`prefix_cache.tools.profiling.profile`).

Each figure is the median over `runs` runs made back to back, on and off interleaved, with
the smallest and largest beside it; both thinkers and the talker are started once, warmed up,
and their prefix caches emptied before every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import multiprocessing
import queue
import statistics
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prefix_cache.channel import StageChannel
from prefix_cache.tools.reporting.bench_report import Metric, metric_json, report
from prefix_cache.tools.pipelines.engine_logs import new_log_path, output_to_log
from prefix_cache.tools.pipelines.engine_loop import EngineLoop
from prefix_cache.tools.pipelines.engines import (MODELS, Engine, EngineShape,
                                                  cache_engine_thread_s, engine_core_pid)
from prefix_cache.tools.reporting.harness import (machine, source_commit, spread, unwritable,
                                                  write_json)
from prefix_cache.tools.pipelines.pipeline import ROWS_TIMEOUT_S, greedy_params
from prefix_cache.tools.profiling.profile import ProfileSummary, format_table
from prefix_cache.tools.profiling.profile_capture import find_py_spy, profile_engine
from prefix_cache.tools.stream_demo import StreamWorkload
from prefix_cache.tools.pipelines.stream_pipeline import StreamRequest, run_stages
from prefix_cache.tools.pipelines.streaming import RowStream
from prefix_cache.tools.reporting.targets import STREAM_METRICS

WORKLOAD = StreamWorkload(num_requests=4, thinker_tokens=64, talker_tokens=4)


def mode(streaming: bool) -> str:
    return "on" if streaming else "off"


def _drain_jobs(spec: str, jobs: Any, done: Any) -> None:
    """The consumer process: for each job (request ids, streaming) from `jobs`, drain every
    request's rows at once, one thread each, then put None on `done`, or what failed."""
    from prefix_cache.channel import open_channel
    with open_channel(spec) as channel, \
            ThreadPoolExecutor(WORKLOAD.num_requests, thread_name_prefix="drain") as pool:
        while (job := jobs.get()) is not None:
            req_ids, streaming = job
            try:
                for future in [pool.submit(lambda r: list(RowStream(channel, r, streaming,
                                                                    ROWS_TIMEOUT_S)), r)
                               for r in req_ids]:
                    future.result(ROWS_TIMEOUT_S)
                done.put(None)
            except Exception as exc:
                done.put(f"{type(exc).__name__}: {exc}")


class Drainer:
    """Stage 2's consumer in a process of its own, as a next stage is: it drains requests'
    rows from the channel (chunk by chunk, or whole) while stage 1 runs them."""

    def __init__(self, channel: StageChannel) -> None:
        context = multiprocessing.get_context("spawn")
        self._jobs, self._done = context.Queue(), context.Queue()
        self._process = context.Process(target=_drain_jobs, name="m9c-drainer", daemon=True,
                                        args=(channel.spec, self._jobs, self._done))
        self._process.start()

    def start(self, req_ids: Sequence[str], streaming: bool) -> None:
        self._jobs.put((list(req_ids), streaming))

    def wait(self, timeout_s: float) -> None:
        """Until the last job's rows are drained; raises what failed there, or on a timeout."""
        try:
            failure = self._done.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the drainer process did not finish within {timeout_s:g} s "
                               f"(alive: {self._process.is_alive()})") from None
        if failure is not None:
            raise RuntimeError(f"the drainer process failed: {failure}")

    def close(self) -> None:
        self._jobs.put(None)
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()


def decode_steps(thinker: Engine, drainer: Drainer, requests: Sequence[StreamRequest],
                 streaming: bool) -> list[float]:
    """Stage 1's step times with `requests` running together and `drainer` draining each
    one's rows (chunk by chunk when `streaming`, else whole)."""
    loop = EngineLoop(thinker, "thinker")
    try:
        drainer.start([r.req_id for r in requests], streaming)
        for r in requests:
            loop.submit(r.req_id, {"prompt_token_ids": r.prompt}, greedy_params(r.max_tokens))
        for r in requests:
            loop.wait(r.req_id, ROWS_TIMEOUT_S)
        drainer.wait(ROWS_TIMEOUT_S)
    finally:
        loop.close()
    return loop.step_seconds


def _stages(model: str, cudagraphs: bool, with_talker: bool, tmp: Path
            ) -> tuple[Path, Path | None, EngineShape, dict[str, Any], str]:
    """The thinker's and (`with_talker`) the talker's model folders, their engine shape and
    arguments, and what they are, for `--model` and `--cudagraphs`."""
    from prefix_cache.tools.pipelines import engines
    graphs = engines.CUDA_GRAPH_ARGS if cudagraphs else {}
    how = "CUDA graphs" if cudagraphs else "eager"
    if model == "random":
        return (engines.write_random_qwen2(tmp / "thinker", seed=0),
                engines.write_random_qwen2(tmp / "talker", seed=1) if with_talker else None,
                EngineShape(), dict(graphs),
                f"random Qwen2 (hidden 256, 2 layers) {'per stage' if with_talker else 'thinker'}"
                f", {how}")
    _, stage_model, dtype = engines.platform_stage_model(model)
    shape = EngineShape(dtype=dtype)
    talker = ", talker 2 layers of its width" if with_talker else ""
    return (stage_model.write(tmp / "thinker", seed=0),
            stage_model.write(tmp / "talker", num_layers=2, seed=1) if with_talker else None,
            shape, {**stage_model.engine_args, **graphs},
            f"thinker {stage_model.describe(shape)}{talker}, {how}")


def measure(*, runs: int, progress: Callable[[str], None], every: int | None = None,
            model: str = "random", cudagraphs: bool = False, m9c_only: bool = False,
            profile_dir: Path | None = None, profile_seconds: float = 10.0) -> dict[str, Any]:
    """Every run's figures, streaming on (a chunk every step, or every `every` positions)
    and off, on this machine's vLLM platform, with the stages `_stages` makes of `model`
    (M9c's alone, without a talker, when `m9c_only`). With `profile_dir`, M9c's decode steps
    are then profiled there, streaming on and off, `profile_seconds` of them each
    (`profile_capture`)."""
    from vllm.platforms import current_platform

    from prefix_cache.channel import open_channel
    from prefix_cache.tools.pipelines import engines
    from prefix_cache.tools.pipelines.stream_pipeline import start_stage
    first_token: dict[bool, list[float]] = {True: [], False: []}
    hit_chunk, hit_step, steps = [], [], {True: [], False: []}
    cache_s: dict[bool, list[float]] = {True: [], False: []}  # engine thread's, a step
    with tempfile.TemporaryDirectory(prefix="omni-prefix-cache-m9-") as tmp, \
            open_channel("shm") as channel, engines.multiprocessing_mode(True):
        thinker_dir, talker_dir, shape, engine_args, stages = _stages(
            model, cudagraphs, not m9c_only, Path(tmp))
        engines_started = ("two engines (the thinker streaming and not)" if m9c_only else
                           "three engines (the thinker streaming and not, a talker)")
        progress(f"starting {engines_started}: {stages} ...")
        thinkers = {streaming: start_stage(thinker_dir, channel, prefix_caching=True,
                                           stream=streaming and (every or True), shape=shape,
                                           **engine_args)
                    for streaming in (True, False)}
        talker = None if talker_dir is None else engines.start_talker(talker_dir, shape,
                                                                       **engine_args)
        stage_engines = [*thinkers.values(), *([talker] if talker else [])]
        drainer = Drainer(channel)
        try:
            def cold() -> None:
                for engine in stage_engines:
                    engine.engine.reset_prefix_cache()

            for streaming, thinker in thinkers.items():
                if talker:
                    run_stages(thinker, channel, talker, None, WORKLOAD.requests(
                        f"warm-up-{mode(streaming)}")[:2], streaming=streaming,
                        talker_tokens=2)
                decode_steps(thinker, drainer, WORKLOAD.requests(
                    f"warm-up-batch-{mode(streaming)}"), streaming)
            for i in range(runs):
                progress(f"run {i + 1}/{runs} ...")
                for streaming in (True, False) if i % 2 == 0 else (False, True):
                    if talker:
                        cold()
                        results = run_stages(thinkers[streaming], channel, talker, None,
                                             WORKLOAD.requests(f"m9-{i}-{mode(streaming)}"),
                                             streaming=streaming,
                                             talker_tokens=WORKLOAD.talker_tokens)
                        first_token[streaming].append(
                            statistics.median(r.talker_first_token_s for r in results))
                        if streaming:
                            hits = [r for r in results if r.thinker.cached_tokens > 0]
                            hit_chunk += [r.first_chunk_s for r in hits]
                            hit_step += [r.since_submission(r.thinker.first_token_at)
                                         for r in hits]
                    cold()
                    before = cache_engine_thread_s(thinkers[streaming].stats())
                    times = decode_steps(thinkers[streaming], drainer,
                                         WORKLOAD.requests(f"m9c-{i}-{mode(streaming)}"),
                                         streaming)
                    steps[streaming].append(statistics.median(times))
                    cache_s[streaming].append((cache_engine_thread_s(
                        thinkers[streaming].stats()) - before) / len(times))
            profiles = {} if profile_dir is None else {
                mode(streaming): _profile_decode(thinkers[streaming], drainer, streaming, cold,
                                                 profile_dir, profile_seconds, progress)
                for streaming in (True, False)}
        finally:
            drainer.close()
            for engine in stage_engines:
                engine.close()
    pipeline_figures = {} if m9c_only else {
        "talker_first_token_s": {mode(k): spread(v) for k, v in first_token.items()},
        "hit_first_chunk_s": spread(hit_chunk), "hit_first_step_s": spread(hit_step),
        "hit_ratio_per_request": spread([c / s for c, s in zip(hit_chunk, hit_step)])}
    return {"device": current_platform.device_type, "runs": runs,
            "workload": f"{WORKLOAD.num_requests} requests of two families sharing 64-token "
                        f"prefixes, {WORKLOAD.thinker_tokens} thinker tokens each; {stages}; "
                        f"a chunk every "
                        f"{f'{every} positions' if every else 'step'}",
            **pipeline_figures,
            "step_s": {mode(k): spread(v) for k, v in steps.items()},
            # the mean over a pass's steps (its prompt steps and finishes included)
            "cache_engine_thread_s_per_step": {mode(k): spread(v) for k, v in cache_s.items()},
            "profile": profiles}


def _profile_decode(thinker: Engine, drainer: Drainer, streaming: bool, cold: Callable[[], None],
                    out_dir: Path, seconds: float, progress: Callable[[str], None]
                    ) -> ProfileSummary | None:
    """M9c's decode steps, streaming on or off, run again and again for `seconds` under py-spy
    (its engine-core process and children; the drainer's process is not sampled)."""
    progress(f"profiling M9c's decode steps, streaming {mode(streaming)} ({seconds:g} s of "
             f"passes under py-spy) ...")
    passes = itertools.count()

    def run_pass(_after_step: Callable[[], None] | None) -> None:
        cold()
        decode_steps(thinker, drainer, WORKLOAD.requests(
            f"profile-{mode(streaming)}-{next(passes)}"), streaming)

    return profile_engine(run_pass, pid=engine_core_pid(thinker),
                          prefix=out_dir / f"m9c-{mode(streaming)}", seconds=seconds,
                          in_process=False)


def ms(figure: dict[str, Any]) -> str:
    return f"{figure['median'] * 1e3:.1f} ms ({figure['min'] * 1e3:.1f}-" \
           f"{figure['max'] * 1e3:.1f})"


def metrics(m: dict[str, Any]) -> dict[str, Metric]:
    """The figures `m` holds: M9c always, M9 and M9h unless it was measured alone."""
    step_on, step_off = m["step_s"]["on"], m["step_s"]["off"]
    cache = m["cache_engine_thread_s_per_step"]
    figures: dict[str, Metric] = {}
    if "talker_first_token_s" in m:
        on, off = m["talker_first_token_s"]["on"], m["talker_first_token_s"]["off"]
        figures["M9"] = Metric(on["median"] / off["median"], f"on {ms(on)}, off {ms(off)}",
                               m["workload"])
        figures["M9h"] = Metric(
            m["hit_ratio_per_request"]["median"],
            f"first chunk {ms(m['hit_first_chunk_s'])} after submission; stage 1's first step "
            f"{ms(m['hit_first_step_s'])}",
            f"per hit request (median, min-max over {m['runs']} runs)")
    figures["M9c"] = Metric(step_off["median"] / step_on["median"],
                            f"median step on {ms(step_on)}, off {ms(step_off)}; the cache's "
                            f"engine-thread calls {cache['on']['median'] * 1e6:.0f} µs a step "
                            f"on, {cache['off']['median'] * 1e6:.0f} off",
                            f"{WORKLOAD.num_requests} requests decoding together"
                            + ("" if "M9" in figures else f"; {m['workload']}"))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prefix_cache.tools.stream_bench",
        description="Measures M9 on vLLM's real engine of this machine: stage 2's first token "
                    "with stage 1 streaming on / off, a prefix hit's first chunk against stage "
                    "1's first step, and stage 1's step rate streaming on / off. Prints a table "
                    "with a pass/MISS column (vLLM's logs go to a file it names). Exit status: 0 "
                    "when it measured, whatever the table says, 1 when a run failed, 2 on a "
                    "usage error.")
    parser.add_argument("--runs", type=int, default=5, help="runs per figure (default 5)")
    parser.add_argument("--every", type=int, metavar="N",
                        help="stream a chunk every N positions (the stage option stream: N) "
                             "instead of every step")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--only", choices=["M9c"],
                        help="measure this figure only: two thinkers, no talker, no pipeline "
                             "runs (default: M9, M9h and M9c)")
    parser.add_argument("--model", choices=["random", *MODELS], default="random",
                        help="the stages' models: random Qwen2s of hidden 256 (default), or "
                             "pipeline_bench's stage-1 model of that name")
    parser.add_argument("--cudagraphs", action="store_true",
                        help="run the engines with CUDA graphs (vLLM's full decode graphs)")
    parser.add_argument("--profile", metavar="DIR",
                        help="after the runs, profile M9c's decode steps, streaming on and off, "
                             "into DIR: py-spy per thread of stage 1's engine-core process "
                             "(needs py-spy); prints where its threads spent the window")
    parser.add_argument("--profile-seconds", type=float, default=10.0, metavar="S",
                        help="seconds of decode passes each mode runs under py-spy (default 10)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    if args.every is not None and args.every < 1:
        parser.error(f"--every must be >= 1, got {args.every}")
    if args.json and (problem := unwritable(args.json)):
        parser.error(problem)
    if args.profile:
        if find_py_spy() is None:
            parser.error("--profile needs py-spy, beside this Python or on PATH")
        try:
            Path(args.profile).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--profile {args.profile}: cannot make that folder ({exc.strerror})")
    log_path = new_log_path("stream-bench")
    with output_to_log(log_path) as terminal:
        def say(msg: str) -> None:
            print(f"[stream bench] {msg}", file=terminal, flush=True)

        try:
            m9 = measure(runs=args.runs, progress=say, every=args.every, model=args.model,
                         cudagraphs=args.cudagraphs, m9c_only=args.only == "M9c",
                         profile_dir=args.profile and Path(args.profile),
                         profile_seconds=args.profile_seconds)
        except Exception as exc:  # the traceback is in the log; the terminal gets one line
            traceback.print_exc()
            say(f"FAILED: {type(exc).__name__}: {exc} (details in {log_path})")
            return 1
    profiles = m9.pop("profile")
    results = {"device": m9["device"], "commit": source_commit(), "machine": machine(m9["device"]),
               "metrics": {name: metric_json(STREAM_METRICS[name], metric, m9["device"])
                           for name, metric in metrics(m9).items()},
               "m9": m9}
    if profiles:
        results["profile"] = {name: summary and dataclasses.asdict(summary)
                              for name, summary in profiles.items()}
    print(report(results, STREAM_METRICS, not_measured=f"not measured (--only {args.only})"),
          flush=True)
    if profiles:
        print(f"\nwhere stage 1's threads spent M9c's decode steps, streaming on and off "
              f"(py-spy, share of its ticks; see prefix_cache/tools/profiling/profile.py):\n"
              f"{format_table(profiles)}\nprofiles (raw py-spy stacks): {args.profile}",
              flush=True)
    print(f"\nvLLM's logs and warnings: {log_path}")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
