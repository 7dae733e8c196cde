"""The main job: vLLM's real engine with the prefix cache, checked row by row against a cache-off run.

A tiny random Qwen2 model is written at start (nothing is downloaded). The same
workload — requests sharing prefixes, chunked prefill, mixed prefill/decode
batches, a long prompt aborted after its first prefill chunk, a KV cache small
enough that blocks are reused — runs once with prefix caching on (the cache
delivers full-prompt rows) and once with it off (every row computed). Every
delivered row must match.
"""

from __future__ import annotations

import gc
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefix_cache.config import HIDDEN_KEY

#: float32 rows of the same tokens computed in different batch shapes (chunk
#: boundaries, batch composition) may differ in reduction order: ~1e-6 here.
TOLERANCE = 1e-4
BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
WORKER = "prefix_cache.vllm_runners.PrefixCacheCPUWorker"

ENGINE_ENV = {
    "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "VLLM_PLUGINS": "", "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


@dataclass(frozen=True)
class DemoRequest:
    req_id: str
    prompt: list[int]
    max_tokens: int
    arrive_at_step: int
    abort_at_step: int | None = None


@dataclass
class RunResult:
    rows: dict[str, Any]               # req_id -> [positions, hidden] delivered to the next stage
    cached_tokens: dict[str, int]
    stats: dict[str, int | float] = field(default_factory=dict)
    seconds: float = 0.0


def make_tiny_model(path: Path) -> Path:
    """A random 2-layer Qwen2 (hidden 256, head size 64) saved with transformers."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def make_workload(seed: int = 0, num_requests: int = 12) -> list[DemoRequest]:
    """Requests from three prompt families sharing 64- or 96-token prefixes, arriving in waves,
    after a 160-token prompt aborted mid-prefill.

    The long prompt comes first, so step 0 runs its first 64-token chunk
    (`max_num_batched_tokens`) alone in both runs; it is aborted before step 1.
    Request 7 starts with that chunk: with caching on it hits the aborted
    request's blocks.
    """
    rng = random.Random(seed)
    families = [[rng.randrange(1, 1000) for _ in range(length)] for length in (64, 96, 96)]
    families.append(families[1][:64] + [rng.randrange(1, 1000) for _ in range(32)])
    long_prompt = [rng.randrange(1, 1000) for _ in range(160)]
    requests = [DemoRequest("req-long", long_prompt, 4, arrive_at_step=0, abort_at_step=1)]
    for i in range(num_requests):
        prefix = long_prompt[:64] if i == 7 else families[i % len(families)]
        prompt = prefix + [rng.randrange(1, 1000) for _ in range(rng.randrange(3, 45))]
        requests.append(DemoRequest(f"req-{i:02d}", prompt, rng.randrange(2, 6),
                                    arrive_at_step=2 * (i // 3)))
    return requests


def run_engine(model_dir: Path, requests: list[DemoRequest], *, prefix_caching: bool,
               progress: Callable[[str], None] = lambda _: None) -> RunResult:
    """One engine, stepped by hand so arrivals and the abort land at fixed steps."""
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams

    label = "on" if prefix_caching else "off"
    progress(f"loading vLLM engine (prefix caching {label}) ...")
    start = time.perf_counter()
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, enable_prefix_caching=prefix_caching,
              dtype="float32", max_model_len=256, block_size=BLOCK_SIZE, max_num_seqs=4,
              max_num_batched_tokens=64, enforce_eager=True, seed=0,
              num_gpu_blocks_override=24, worker_cls=WORKER)
    progress(f"engine ready in {time.perf_counter() - start:.1f}s; running "
             f"{len(requests)} requests (prefix caching {label}) ...")
    engine = llm.llm_engine
    cached: dict[str, int] = {}
    step = 0
    pending = sorted(requests, key=lambda r: r.arrive_at_step)
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrive_at_step <= step:
            req = pending.pop(0)
            params = SamplingParams(max_tokens=req.max_tokens, temperature=0, ignore_eos=True,
                                    detokenize=False)
            engine.add_request(req.req_id, {"prompt_token_ids": req.prompt}, params)
        for req in requests:
            if req.abort_at_step == step:
                engine.abort_request([req.req_id])
        for out in engine.step():
            cached[out.request_id] = max(cached.get(out.request_id, 0),
                                         out.num_cached_tokens or 0)
        step += 1
    engine.step()  # one more step: the runner hears of the last finishes
    delivered = llm.collective_rpc("take_stage_outputs")[0]
    stats = llm.collective_rpc("prefix_cache_stats")[0]
    llm.collective_rpc("shutdown_prefix_cache")
    rows = {internal.rsplit("-", 1)[0]: value[HIDDEN_KEY] for internal, value in delivered.items()}
    result = RunResult(rows, cached, stats, time.perf_counter() - start)
    _close(llm)
    return result


def _close(llm: Any) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


@dataclass(frozen=True)
class RequestCheck:
    req_id: str
    prompt_len: int
    cached_tokens: int
    rows_on: int
    rows_off: int
    max_diff: float
    aborted: bool

    @property
    def ok(self) -> bool:
        if self.aborted:  # mid-prefill: the same chunk(s) ran in both runs, not the whole prompt
            return (0 < self.rows_on == self.rows_off < self.prompt_len
                    and self.max_diff <= TOLERANCE)
        return self.rows_on == self.rows_off and self.max_diff <= TOLERANCE


def compare(requests: list[DemoRequest], on: RunResult, off: RunResult) -> list[RequestCheck]:
    checks = []
    for req in requests:
        a, b = on.rows.get(req.req_id), off.rows.get(req.req_id)
        n_on = 0 if a is None else a.shape[0]
        n_off = 0 if b is None else b.shape[0]
        common = min(n_on, n_off)
        diff = float((a[:common] - b[:common]).abs().max()) if common else 0.0
        checks.append(RequestCheck(req.req_id, len(req.prompt), on.cached_tokens.get(req.req_id, 0),
                                   n_on, n_off, diff, req.abort_at_step is not None))
    return checks


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join([line, rule, *body])


def main(argv: list[str] | None = None) -> int:
    def progress(msg: str) -> None:
        print(f"[demo] {msg}", flush=True)

    requests = make_workload()
    with tempfile.TemporaryDirectory(prefix="omni-prefix-cache-demo-") as tmp:
        progress("writing a tiny random Qwen2 model (nothing is downloaded) ...")
        model_dir = make_tiny_model(Path(tmp) / "tiny-qwen2")
        on = run_engine(model_dir, requests, prefix_caching=True, progress=progress)
        off = run_engine(model_dir, requests, prefix_caching=False, progress=progress)
    checks = compare(requests, on, off)
    print()
    print(format_table(
        ["request", "prompt", "cached", "rows (cache)", "rows (no cache)", "max |diff|", "result"],
        [[c.req_id + (" (aborted mid-prefill)" if c.aborted else ""), c.prompt_len,
          c.cached_tokens, c.rows_on, c.rows_off, f"{c.max_diff:.1e}", "ok" if c.ok else "WRONG"]
         for c in checks]))
    print()
    keys = ["hit_requests", "hit_tokens", "miss_tokens", "rows_saved", "bytes_saved",
            "hit_bytes_gathered", "copy_on_write_reads", "staging_waits"]
    print(format_table(["cache stat", "value"], [[k, on.stats.get(k, 0)] for k in keys] + [
        [f"pool_bytes.{HIDDEN_KEY}", on.stats.get(f"pool_bytes.{HIDDEN_KEY}", 0)],
        ["engine-thread ms in save_outputs",
         f"{1e3 * on.stats.get('time_s.save_outputs', 0.0):.1f}"],
        ["engine-thread ms in new_step_starts",
         f"{1e3 * on.stats.get('time_s.new_step_starts', 0.0):.1f}"]]))
    wrong = [c.req_id for c in checks if not c.ok]
    hits = sum(c.cached_tokens > 0 for c in checks)
    print()
    if wrong or hits == 0:
        print(f"FAILED: wrong rows for {wrong}" if wrong else "FAILED: no prefix hit happened")
        return 1
    print(f"OK: {len(checks)} requests, {hits} with prefix hits; every delivered row matches the "
          f"cache-off run within {TOLERANCE:g} (float32).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
