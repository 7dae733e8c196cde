"""A tiny random Qwen2.5-Omni thinker stage run through vllm-omni's `Omni` on the CPU.

`write_model` writes the model's config and processor (random weights: `load_format: dummy`),
with a word tokenizer, nothing downloaded. `run_stage` runs the stage in a process of its own, with vllm-omni's prefix cache or, with
`OMNI_PREFIX_CACHE_IN_VLLM_OMNI=1` in its environment or in the stage's `env:`, this one (the
plugin acts at process start, so one process runs one cache). The stage runs `RecordingWorker`, this package's CPU worker whose
runner also builds each request's payload every step, as a thinker ahead of a talker does (so
the cache's `materialize` runs), and notes in `record_dir` each step's time and what the
cache materialized. Its rounds: a warm-up request, then each round's prompts in one
`generate` call, rounds in order, so a later round hits what an earlier one computed.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from prefix_cache.integration.vllm_omni.plugin import ENABLE_ENV

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32  # the CPU attention backend needs a multiple of 32
VOCAB = 2048
#: The tokenizer's multimodal specials (the processor reads them), ids 3 to 9.
MM_TOKENS = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
             "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
             "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
FIRST_WORD = 3 + len(MM_TOKENS)
START_TIMEOUT_S = 600.0


def write_model(path: Path) -> Path:
    """A Qwen2.5-Omni config whose thinker is 2 layers of width 128 (head_dim 64), tiny audio
    and vision towers, and its processor with a whitespace word tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (PreTrainedTokenizerFast, Qwen2_5OmniConfig, Qwen2_5OmniProcessor,
                              Qwen2VLImageProcessor, WhisperFeatureExtractor)
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    path.mkdir(parents=True, exist_ok=True)
    thinker = dict(
        text_config=dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=1024,
                         rope_scaling={"type": "mrope", "mrope_section": [16, 8, 8]}),
        audio_config=dict(encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                          d_model=32, output_dim=128, num_mel_bins=128),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=128, fullatt_block_indexes=[0]),
        image_token_index=3, audio_token_index=4, video_token_index=5, vision_start_token_id=6,
        vision_end_token_id=7, audio_start_token_id=8, audio_end_token_id=9)
    Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False).save_pretrained(path)
    words = ["<unk>", "<s>", "</s>", *MM_TOKENS.values()]
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", extra_special_tokens=MM_TOKENS)
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    Qwen2_5OmniProcessor(image_processor=Qwen2VLImageProcessor(),
                         video_processor=Qwen2VLVideoProcessor(),
                         feature_extractor=WhisperFeatureExtractor(feature_size=128),
                         tokenizer=fast, chat_template=template).save_pretrained(path)
    return path


def deploy_config(max_tokens: int, stage_env: dict[str, str]) -> dict[str, Any]:
    """vllm-omni's thinker-only deploy config for the CPU: float32, 32-token blocks, prefix
    caching on, the recording CPU worker, `stage_env` in the stage's environment."""
    return {"async_chunk": False, "pipeline": "qwen2_5_omni_thinker_only", "stages": [{
        "env": stage_env,
        "stage_id": 0, "max_num_seqs": 8, "max_num_batched_tokens": 1024, "max_model_len": 512,
        "block_size": BLOCK, "dtype": "float32", "enforce_eager": True,
        "enable_prefix_caching": True, "skip_mm_profiling": True, "mm_processor_cache_gb": 0,
        "load_format": "dummy", "worker_cls": f"{__name__}.RecordingWorker",
        "default_sampling_params": {"temperature": 0.0, "max_tokens": max_tokens}}]}


#: The stage process's entry: the checkout goes on the END of sys.path (the stage's processes
#: inherit it), so that the installed project's metadata, with its plugin's entry point, is found
#: before a stale egg-info a checkout may hold.
_STAGE_MAIN = ("import sys; sys.path.append(sys.argv[1]); "
               "from tests.vllm_omni.stage import main; sys.exit(main(sys.argv[2:]))")


def run_stage(model: Path, rounds: Sequence[Sequence[Sequence[int]]], record_dir: Path, *,
              this_cache: bool, in_deploy_config: bool = False, max_tokens: int = 4,
              timeout_s: float = 900.0) -> dict[str, Any]:
    """Run the stage over `rounds` (prompts of token ids) in a process of its own, with this
    cache if `this_cache` (asked for in the process's environment, or in the stage's `env:` of
    the deploy config if `in_deploy_config`); returns each round's outputs (`tokens`,
    `cached`: vLLM's cached prompt tokens, per request) and what `RecordingWorker` noted
    (`read_records`)."""
    record_dir.mkdir(parents=True, exist_ok=True)
    ask = {ENABLE_ENV: "1"} if this_cache else {}
    spec = record_dir / "rounds.json"
    spec.write_text(json.dumps({"model": str(model), "rounds": rounds, "max_tokens": max_tokens,
                                "stage_env": ask if in_deploy_config else {}}))
    env = {**os.environ, "OMNI_STAGE_RECORD_DIR": str(record_dir)}
    env.pop("VLLM_PLUGINS", None)  # vllm-omni's plugins and this project's load
    env.pop(ENABLE_ENV, None)
    if not in_deploy_config:
        env.update(ask)
    log = record_dir / "stage.log"
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "-c", _STAGE_MAIN, str(ROOT), str(spec)],
                              cwd=record_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout_s)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise RuntimeError(f"the stage run exited {done.returncode} (log {log}):\n{tail}")
    return {**json.loads((record_dir / "outputs.json").read_text()), **read_records(record_dir)}


def read_records(record_dir: Path) -> dict[str, Any]:
    """`steps`: per engine step, its seconds (execute_model + sample_tokens) and request keys;
    `materialized`: per materialize call, {request key: hidden rows}; `cache`: the manager's
    class and, where it has them, its `stats()` at the last step."""
    steps = [json.loads(line) for line in (record_dir / "steps.jsonl").read_text().splitlines()]
    materialized = [torch.load(p) for p in sorted(record_dir.glob("materialized-*.pt"))]
    return {"steps": steps, "materialized": materialized,
            "cache": json.loads((record_dir / "cache.json").read_text())}


# ---------------------------------------------------------------------- in the stage's process

def prompt_key(prompt_token_ids: Sequence[int]) -> str:
    """A request's name in the records: its prompt's digest, the same in every run (each
    prompt of a run differs)."""
    return hashlib.sha1(json.dumps(list(prompt_token_ids)).encode()).hexdigest()[:12]


def _recording_runner() -> type:
    from prefix_cache.integration.vllm_omni.cpu_worker import OmniCPUARModelRunner

    class RecordingRunner(OmniCPUARModelRunner):
        """Builds every request's payload each step (as for a downstream talker) and notes
        each step's time and each materialize's hidden rows in $OMNI_STAGE_RECORD_DIR."""

        _record = Path(os.environ["OMNI_STAGE_RECORD_DIR"])
        _materialized = 0
        _step_s = 0.0
        _step_keys: list[str] = []

        def _request_needs_downstream_stage_payload(self, req_id: str) -> bool:
            return True

        def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            output = super().execute_model(scheduler_output, *args, **kwargs)
            self._step_s = time.perf_counter() - start
            self._step_keys = sorted(self._key(r) for r in scheduler_output.num_scheduled_tokens)
            return output

        def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            output = super().sample_tokens(*args, **kwargs)
            seconds = self._step_s + time.perf_counter() - start
            with (self._record / "steps.jsonl").open("a") as steps:
                steps.write(json.dumps({"s": seconds, "requests": self._step_keys}) + "\n")
            self._note_cache()
            return output

        def _prefix_cache_materialize(self, step_id: int | None, req_ids: list[str]) -> Any:
            hidden, mm = super()._prefix_cache_materialize(step_id, req_ids)
            if hidden is not None:
                self._materialized += 1
                torch.save({self._key(r): rows.clone() for r, rows in hidden.items()},
                           self._record / f"materialized-{self._materialized:05d}.pt")
            return hidden, mm

        def _key(self, req_id: str) -> str:
            return prompt_key(self.requests[req_id].prompt_token_ids)

        def _note_cache(self) -> None:
            cache = self.omni_prefix_cache
            note = {"class": type(cache).__name__ if cache is not None else None,
                    "stats": cache.stats() if hasattr(cache, "stats") else None}
            (self._record / "cache.json").write_text(json.dumps(note))

    return RecordingRunner


def _recording_worker() -> type:
    from prefix_cache.integration.vllm_omni.cpu_worker import OmniCPUARWorker

    class RecordingWorker(OmniCPUARWorker):
        model_runner_cls = _recording_runner()

    return RecordingWorker


def __getattr__(name: str) -> Any:
    """`RecordingWorker`, built on first use (it imports vLLM and vllm-omni)."""
    if name == "RecordingWorker":
        worker = globals()["RecordingWorker"] = _recording_worker()
        return worker
    raise AttributeError(name)


def main(argv: Sequence[str]) -> int:
    """Run the rounds of the spec file `argv[0]` (written by `run_stage`)."""
    import yaml
    from vllm import SamplingParams
    from vllm_omni import Omni

    spec_path = Path(list(argv)[0])
    spec = json.loads(spec_path.read_text())
    deploy = spec_path.parent / "deploy.yaml"
    deploy.write_text(yaml.safe_dump(deploy_config(spec["max_tokens"], spec["stage_env"])))
    omni = Omni(model=spec["model"], deploy_config=str(deploy), stage_init_timeout=START_TIMEOUT_S)
    params = [SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])]
    rounds = []
    try:
        for prompts in spec["rounds"]:
            outs = omni.generate([{"prompt_token_ids": p} for p in prompts], params)
            by_prompt = {prompt_key(o.prompt_token_ids): o for o in outs}
            ordered = [by_prompt[prompt_key(p)] for p in prompts]
            rounds.append({"tokens": [list(o.outputs[0].token_ids) for o in ordered],
                           "cached": [o.num_cached_tokens for o in ordered]})
    finally:
        omni.close()
    (spec_path.parent / "outputs.json").write_text(json.dumps({"rounds": rounds}))
    return 0

