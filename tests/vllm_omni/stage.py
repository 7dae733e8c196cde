"""A tiny random Qwen2.5-Omni thinker stage (and a talker after it) run through vllm-omni's
`Omni` on the CPU.

`write_model` writes the model's config and processor (random weights: `load_format: dummy`),
with a word tokenizer, nothing downloaded. `run_stage` runs the stage in a process of its own,
with vllm-omni's prefix cache or, with `OMNI_PREFIX_CACHE_IN_VLLM_OMNI=1` in its environment or
in the stage's `env:`, this one (the plugin acts at process start, so one process runs one
cache). The thinker runs `RecordingWorker`, this package's CPU worker whose runner also builds
each request's payload every step, as a thinker ahead of a talker does (so the cache's
`materialize` runs), and notes in `record_dir` each step's time and what the cache
materialized. Each round's prompts go in one `generate` call, rounds in order, so a later round
hits what an earlier one computed.
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
#: The thinker's vocabulary beside a talker: vllm-omni's Qwen2.5-Omni talker embeds fixed
#: speaker tokens of it (ids 151870 and 151872).
TALKER_THINKER_VOCAB = 152064
#: The talker's end-of-speech token (fixed in vllm-omni's thinker-to-talker processing).
TALKER_STOP = 8294
#: vllm-omni's pipeline registry key of the two-stage thinker -> talker pipeline (registered by
#: the stage process: vllm-omni's own Qwen2.5-Omni pipeline adds a code2wav stage, which has no
#: CPU worker).
THINKER_TALKER = "tiny_qwen2_5_omni_thinker_talker"


def write_model(path: Path, *, talker: bool = False) -> Path:
    """A Qwen2.5-Omni config whose thinker is 2 layers of width 128 (head_dim 64), tiny audio
    and vision towers, with `talker` a talker of the same size, and its processor with a
    whitespace word tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (PreTrainedTokenizerFast, Qwen2_5OmniConfig, Qwen2_5OmniProcessor,
                              Qwen2VLImageProcessor, WhisperFeatureExtractor)
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    path.mkdir(parents=True, exist_ok=True)
    vocab = TALKER_THINKER_VOCAB if talker else VOCAB
    mm_ids = dict(image_token_index=3, audio_token_index=4, video_token_index=5,
                  vision_start_token_id=6, vision_end_token_id=7, audio_start_token_id=8,
                  audio_end_token_id=9)
    layers = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                  rope_scaling={"type": "mrope", "mrope_section": [16, 8, 8]})
    thinker = dict(
        text_config=dict(vocab_size=vocab, **layers),
        audio_config=dict(encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                          d_model=32, output_dim=128, num_mel_bins=128),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=128, fullatt_block_indexes=[0]),
        **mm_ids)
    speaker = dict(vocab_size=8448, embedding_size=128, head_dim=64, tts_text_start_token_id=10,
                   tts_text_end_token_id=11, tts_text_pad_token_id=12, **layers, **mm_ids)
    speech = {"talker_config": speaker} if talker else {}
    Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False,
                      **speech).save_pretrained(path)
    words = ["<unk>", "<s>", "</s>", *MM_TOKENS.values()]
    words += [f"w{i}" for i in range(vocab - len(words))]
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


def deploy_config(max_tokens: int, stage_env: dict[str, str],
                  talker_tokens: int | None = None) -> dict[str, Any]:
    """vllm-omni's deploy config for the CPU: the thinker stage (float32, 32-token blocks,
    prefix caching on, the recording CPU worker, `stage_env` in its environment), and with
    `talker_tokens` a talker stage after it (this package's CPU worker, no prefix caching)."""
    common = {"max_num_seqs": 8, "max_num_batched_tokens": 1024, "max_model_len": 512,
              "block_size": BLOCK, "dtype": "float32", "enforce_eager": True,
              "skip_mm_profiling": True, "mm_processor_cache_gb": 0, "load_format": "dummy"}
    stages = [{**common, "stage_id": 0, "env": stage_env, "enable_prefix_caching": True,
               "worker_cls": f"{__name__}.RecordingWorker",
               "default_sampling_params": {"temperature": 0.0, "max_tokens": max_tokens}}]
    if talker_tokens is None:
        return {"async_chunk": False, "pipeline": "qwen2_5_omni_thinker_only", "stages": stages}
    stages.append({**common, "stage_id": 1, "enable_prefix_caching": False,
                   "worker_cls": "prefix_cache.integration.vllm_omni.cpu_worker.OmniCPUARWorker",
                   "default_sampling_params": talker_sampling(talker_tokens)})
    return {"async_chunk": False, "pipeline": THINKER_TALKER, "stages": stages}


def talker_sampling(max_tokens: int) -> dict[str, Any]:
    """The talker's sampling: greedy up to its end-of-speech token; a repetition penalty, as
    vllm-omni's deploy config has (its talker reads the prompt ids penalties keep)."""
    return {"temperature": 0.0, "max_tokens": max_tokens, "stop_token_ids": [TALKER_STOP],
            "repetition_penalty": 1.05}


def register_thinker_talker() -> None:
    """vllm-omni's Qwen2.5-Omni pipeline cut after its talker, which becomes a final stage."""
    import dataclasses

    from vllm_omni.config.pipeline_registry import register_pipeline
    from vllm_omni.config.stage_config import PipelineConfig
    from vllm_omni.model_executor.models.qwen2_5_omni.pipeline import QWEN2_5_OMNI_PIPELINE

    thinker, talker = QWEN2_5_OMNI_PIPELINE.stages[:2]
    talker = dataclasses.replace(talker, final_output=True, final_output_type="text",
                                 custom_process_next_stage_input_func=None)
    register_pipeline(PipelineConfig(model_type=THINKER_TALKER,
                                     model_arch=QWEN2_5_OMNI_PIPELINE.model_arch,
                                     stages=(thinker, talker)))


#: The stage process's entry: the checkout goes on the END of sys.path (the stage's processes
#: inherit it), so that the installed project's metadata, with its plugin's entry point, is found
#: before a stale egg-info a checkout may hold.
_STAGE_MAIN = ("import sys; sys.path.append(sys.argv[1]); "
               "from tests.vllm_omni.stage import main; sys.exit(main(sys.argv[2:]))")


def run_stage(model: Path, rounds: Sequence[Sequence[Sequence[int]]], record_dir: Path, *,
              this_cache: bool, in_deploy_config: bool = False, max_tokens: int = 4,
              talker_tokens: int | None = None, timeout_s: float = 900.0) -> dict[str, Any]:
    """Run the stage over `rounds` (prompts of token ids) in a process of its own, with this
    cache if `this_cache` (asked for in the process's environment, or in the stage's `env:` of
    the deploy config if `in_deploy_config`); returns each round's outputs (`tokens`,
    `cached`: vLLM's cached prompt tokens, per request) and what `RecordingWorker` noted
    (`read_records`); with `talker_tokens` a talker stage follows (`talker_tokens` per request
    in each round's outputs)."""
    record_dir.mkdir(parents=True, exist_ok=True)
    ask = {ENABLE_ENV: "1"} if this_cache else {}
    spec = record_dir / "rounds.json"
    spec.write_text(json.dumps({"model": str(model), "rounds": rounds, "max_tokens": max_tokens,
                                "stage_env": ask if in_deploy_config else {},
                                "talker_tokens": talker_tokens}))
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
    """`steps`: per engine step, its seconds (execute_model + sample_tokens), the stage
    process's CPU seconds in them (every thread's) and its request keys;
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
        _step_s = _step_cpu_s = 0.0
        _step_keys: list[str] = []

        def _request_needs_downstream_stage_payload(self, req_id: str) -> bool:
            return True

        def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            start, start_cpu = time.perf_counter(), time.process_time()
            output = super().execute_model(scheduler_output, *args, **kwargs)
            self._step_s = time.perf_counter() - start
            self._step_cpu_s = time.process_time() - start_cpu
            self._step_keys = sorted(self._key(r) for r in scheduler_output.num_scheduled_tokens)
            return output

        def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
            start, start_cpu = time.perf_counter(), time.process_time()
            output = super().sample_tokens(*args, **kwargs)
            step = {"s": self._step_s + time.perf_counter() - start,
                    "cpu_s": self._step_cpu_s + time.process_time() - start_cpu,
                    "requests": self._step_keys}
            with (self._record / "steps.jsonl").open("a") as steps:
                steps.write(json.dumps(step) + "\n")
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
    talker_tokens = spec["talker_tokens"]
    deploy.write_text(yaml.safe_dump(deploy_config(spec["max_tokens"], spec["stage_env"],
                                                   talker_tokens)))
    params = [SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])]
    if talker_tokens is not None:
        register_thinker_talker()
        params.append(SamplingParams(**talker_sampling(talker_tokens)))
    omni = Omni(model=spec["model"], deploy_config=str(deploy), stage_init_timeout=START_TIMEOUT_S)
    rounds = []
    try:
        for prompts in spec["rounds"]:
            outs = omni.generate([{"prompt_token_ids": p} for p in prompts], params)
            thinker = {o.request_id: o for o in outs if o.stage_id == 0}
            talker = {o.request_id: o for o in outs if o.stage_id == 1}
            by_prompt = {prompt_key(o.prompt_token_ids): o for o in thinker.values()}
            ordered = [by_prompt[prompt_key(p)] for p in prompts]
            rounds.append({"tokens": [list(o.outputs[0].token_ids) for o in ordered],
                           "cached": [o.num_cached_tokens for o in ordered],
                           "talker_tokens": [list(talker[o.request_id].outputs[0].token_ids)
                                             for o in ordered if o.request_id in talker]})
    finally:
        omni.close()
    (spec_path.parent / "outputs.json").write_text(json.dumps({"rounds": rounds}))
    return 0

