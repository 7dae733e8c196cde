"""`python -m prefix_cache demo --stream`: three stages, streamed and not, prefix caching on and off.

Thinker (vLLM with the cache) -> talker (vLLM on `prompt_embeds`, with the cache)
-> codec (`Code2WavLike`, no cache), as `prefix_cache.tools.pipelines.stream_pipeline`
runs them, in four configurations: streaming on and off (both vLLM stages publish
chunks while a request runs, or whole entries at its finish: an engine pair each)
by prefix caching on and off (off: both engines' prefix caches are emptied before
each request, so every row is computed). Requests from two prompt families
sharing 64-token prefixes run one at a time. The demo prints the time from the thinker's
submission to the talker's first token and to the codec's first frame, and checks
that every configuration's thinker rows, talker tokens, talker rows and frames
are those of the plain run (streaming off, caching off).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from prefix_cache.channel import StageChannel
from prefix_cache.tools.pipelines.codec_stage import Code2WavLike
from prefix_cache.tools.demo import DEFAULT_TOLERANCE, TOLERANCE, format_table
from prefix_cache.tools.pipelines.engines import Engine
from prefix_cache.tools.pipelines.stream_pipeline import StreamRequest, StreamResult

#: The configurations, in table order: (streaming, prefix caching); the first is the plain run.
CONFIGS = ((False, False), (False, True), (True, False), (True, True))


@dataclass(frozen=True)
class StreamWorkload:
    """Requests of two prompt families sharing 64-token prefixes (two 32-token blocks), each
    thinker request generating `thinker_tokens`, each talker request `talker_tokens`."""

    num_requests: int = 6
    thinker_tokens: int = 32
    talker_tokens: int = 16
    seed: int = 0

    def requests(self, prefix: str = "req") -> list[StreamRequest]:
        rng = random.Random(self.seed)
        families = [[rng.randrange(1, 1000) for _ in range(64)] for _ in range(2)]
        return [StreamRequest(f"{prefix}-{i:02d}", families[i % 2] + [
            rng.randrange(1, 1000) for _ in range(rng.randrange(8, 40))], self.thinker_tokens)
            for i in range(self.num_requests)]


@dataclass(frozen=True)
class Check:
    """One request of one configuration against the plain run."""

    thinker_rows_diff: float
    tokens_match: bool
    talker_rows_diff: float
    frames_diff: float
    shapes_match: bool

    def ok(self, tolerance: float) -> bool:
        return self.shapes_match and self.tokens_match and max(
            self.thinker_rows_diff, self.talker_rows_diff, self.frames_diff) <= tolerance


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.shape == b.shape and a.numel() else 0.0


def check(result: StreamResult, plain: StreamResult) -> Check:
    pairs = [(result.thinker_rows, plain.thinker_rows), (result.talker_rows, plain.talker_rows),
             (result.frames, plain.frames)]
    return Check(max_diff(*pairs[0]), result.talker.tokens == plain.talker.tokens,
                 max_diff(*pairs[1]), max_diff(*pairs[2]),
                 all(a.shape == b.shape for a, b in pairs))


def config_name(streaming: bool, caching: bool) -> str:
    return f"streaming {'on' if streaming else 'off'}, caching {'on' if caching else 'off'}"


def ms(seconds: list[float]) -> str:
    """Median milliseconds, with the range over requests."""
    return f"{statistics.median(seconds) * 1e3:.0f} ({min(seconds) * 1e3:.0f}-" \
           f"{max(seconds) * 1e3:.0f})"


def run_config(stages: tuple[Engine, StageChannel, Engine, StageChannel],
               requests: list[StreamRequest], streaming: bool, caching: bool,
               workload: StreamWorkload, codec: Code2WavLike) -> list[StreamResult]:
    """`requests` through the stages from empty prefix caches; without `caching`, the caches
    are emptied before every request, so no request finds another's blocks."""
    from prefix_cache.tools.pipelines.stream_pipeline import run_stages
    batches = [requests] if caching else [[r] for r in requests]
    results = []
    for batch in batches:
        for engine in (stages[0], stages[2]):
            engine.engine.reset_prefix_cache()
        results += run_stages(*stages, batch, streaming=streaming,
                              talker_tokens=workload.talker_tokens, codec=codec)
    return results


COLUMNS = """\
  times are from the thinker's submission of a request, in ms: median over the requests
  (fastest-slowest); requests run one at a time, so each time is that request's own
  1st chunk   the thinker's first rows reached the talker's side (streaming off: all of them,
              at the thinker's finish)
  talker 1st  the talker's first token (it starts once the thinker's prompt rows are all in)
  1st frame   the codec's first frame (from the talker's rows, as they arrive)
  hits        requests whose thinker / talker found prompt tokens in vLLM's prefix cache
  caching off both engines' prefix caches emptied before each request: every row computed"""


def run_stream_demo(progress: Callable[[str], None], say: Callable[[str], None], log_path: Path,
                    device: str = "cpu", workload: StreamWorkload = StreamWorkload()) -> int:
    """Every configuration, the tables and the verdict; 0 when every check holds."""
    from prefix_cache.channel import open_channel
    from prefix_cache.tools.pipelines import engines
    from prefix_cache.tools.pipelines import stream_pipeline as sp

    progress(f"thinker and talker run on vLLM's {device} engine, the codec on torch")
    requests = workload.requests()
    warm_up = workload.requests("warm-up")[:1]
    runs: dict[tuple[bool, bool], list[StreamResult]] = {}
    with tempfile.TemporaryDirectory(prefix="omni-prefix-cache-stream-demo-") as tmp, \
            open_channel("shm") as thinker_channel, open_channel("shm") as talker_channel, \
            engines.multiprocessing_mode(True):
        progress("writing two random Qwen2 models (hidden 256, 2 layers, init range 1.0; "
                 "nothing downloaded)")
        thinker_dir = engines.write_random_qwen2(Path(tmp) / "thinker", seed=0)
        talker_dir = engines.write_random_qwen2(Path(tmp) / "talker", seed=1)
        codec = Code2WavLike(hidden_size=256)
        for streaming in (False, True):
            progress(f"streaming {'on' if streaming else 'off'}: starting the thinker and the "
                     f"talker ...")
            start = time.perf_counter()
            thinker = sp.start_stage(thinker_dir, thinker_channel, prefix_caching=True,
                                     stream=streaming)
            talker = sp.start_stage(talker_dir, talker_channel, prefix_caching=True,
                                    stream=streaming, prompt_embeds=True)
            progress(f"engines ready in {time.perf_counter() - start:.0f}s; a warm-up request, "
                     f"then {len(requests)} requests one at a time, prefix caching off and on")
            try:
                stages = (thinker, thinker_channel, talker, talker_channel)
                run_config(stages, warm_up, streaming, True, workload, codec)
                for caching in (False, True):
                    runs[(streaming, caching)] = run_config(stages, requests, streaming, caching,
                                                            workload, codec)
            finally:
                thinker.close()
                talker.close()

    plain = {r.req_id: r for r in runs[CONFIGS[0]]}
    tolerance = TOLERANCE.get(device, DEFAULT_TOLERANCE)
    say("")
    lengths = [len(r.prompt) for r in requests]
    say(f"{len(requests)} requests: thinker prompts of {min(lengths)}-{max(lengths)} tokens, "
        f"{workload.thinker_tokens} "
        f"thinker tokens, {workload.talker_tokens} talker tokens and codec frames each")
    say("")
    say(format_table(
        ["configuration", "1st chunk", "talker 1st", "1st frame", "hits"],
        [[config_name(*config), ms([r.first_chunk_s for r in results]),
          ms([r.talker_first_token_s for r in results]),
          ms([r.first_frame_s for r in results]),
          f"{sum(r.thinker.cached_tokens > 0 for r in results)} / "
          f"{sum(r.talker.cached_tokens > 0 for r in results)}"]
         for config, results in sorted(runs.items())]))
    say("")
    say(COLUMNS)
    say("")
    checks = {config: [check(r, plain[r.req_id]) for r in results]
              for config, results in runs.items()}
    say(format_table(
        ["against the plain run", "thinker rows", "talker tokens", "talker rows", "frames"],
        [[config_name(*config),
          f"{max(c.thinker_rows_diff for c in cs):.1e}",
          f"{sum(c.tokens_match for c in cs)}/{len(cs)} same",
          f"{max(c.talker_rows_diff for c in cs):.1e}",
          f"{max(c.frames_diff for c in cs):.1e}"]
         for config, cs in sorted(checks.items()) if config != CONFIGS[0]]))
    say("  (largest |difference| over the requests; rows and frames of the same shape as the "
        "plain run's)")
    distinct = len({tuple(r.talker.tokens) for r in plain.values()})
    say(f"the talker depends on its input: {len(plain)} requests, {distinct} distinct token "
        f"sequences")
    say(f"vLLM's logs and warnings: {log_path}")
    say("")
    wrong = sorted({f"{r.req_id} ({config_name(*config)})"
                    for config, cs in checks.items()
                    for r, c in zip(runs[config], cs, strict=True) if not c.ok(tolerance)})
    streamed = statistics.median(r.talker_first_token_s for r in runs[(True, True)])
    whole = statistics.median(r.talker_first_token_s for r in runs[(False, True)])
    problems = ([f"differs from the plain run: {', '.join(wrong)}"] if wrong else []) + \
        ([f"streaming did not bring the talker's first token earlier ({streamed * 1e3:.0f} vs "
          f"{whole * 1e3:.0f} ms)"] if streamed >= whole else [])
    if problems:
        say("FAILED: " + "; ".join(problems))
        return 1
    say(f"OK: streaming brings the talker's first token from {whole * 1e3:.0f} to "
        f"{streamed * 1e3:.0f} ms (median, caching on);\n    every configuration's thinker rows, "
        f"talker tokens, talker rows and frames are the plain run's\n    (within {tolerance:g}, "
        f"float32 on {device}).")
    return 0
