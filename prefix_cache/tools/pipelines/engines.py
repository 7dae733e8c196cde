"""vLLM engines for a pipeline's stages: the environment they need, random models, start and stop.

A stage-1 engine ("thinker") runs the cache's worker (`worker_cls`) and
publishes each finished request's rows to the stage channel named in its
`additional_config`; a stage-2 engine ("talker") takes rows as `prompt_embeds`.
Engines run under whatever `VLLM_ENABLE_V1_MULTIPROCESSING` says (vLLM's
default: an engine-core process each); `multiprocessing_mode` sets it.
"""

from __future__ import annotations

import gc
import importlib.util
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prefix_cache.channel import StageChannel
from prefix_cache.manager import ENGINE_THREAD_CALLS

#: The environment a vLLM engine with the cache needs here, and why (set where unset):
ENGINE_ENV = {
    "VLLM_USE_V2_MODEL_RUNNER": "0",     # V1: the CPU worker hooks V1 only (GPU: both)
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",  # a process that touched CUDA cannot fork one
    "VLLM_CPU_KVCACHE_SPACE": "1",       # GiB of KV cache per CPU engine (default: most RAM)
    "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",  # a torch_npu without CANN must not break torch
    "VLLM_PLUGINS": "",                  # no out-of-tree platform may take over the CPU build
    "VLLM_HOST_IP": "127.0.0.1",         # the engines talk over loopback only
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",  # the models are written locally
}


def apply_engine_env() -> None:
    """Set what `ENGINE_ENV` names, where the environment does not already."""
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)


@contextmanager
def multiprocessing_mode(enabled: bool | None) -> Iterator[None]:
    """Run the engines built inside with `VLLM_ENABLE_V1_MULTIPROCESSING` set (None: as is).

    An in-process engine freezes vLLM's environment cache in this process;
    it is reset so the setting given here is the one vLLM reads.
    """
    if enabled is None:
        yield
        return
    from vllm import envs
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if enabled else "0"
    envs.disable_envs_cache()
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
        envs.disable_envs_cache()


def write_random_qwen2(path: Path, *, hidden_size: int = 256, num_layers: int = 2,
                       intermediate_size: int = 512, num_heads: int = 4, num_kv_heads: int = 2,
                       vocab_size: int = 1024, max_positions: int = 1024,
                       initializer_range: float = 1.0, seed: int = 0) -> Path:
    """A random Qwen2 saved with transformers (nothing is downloaded); head size hidden/heads.

    `initializer_range=1.0` (not the default 0.02, whose greedy output repeats
    one token) makes the model's tokens depend on its input.
    """
    if (path / "config.json").exists():
        return path
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=True,
                         initializer_range=initializer_range)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def write_dummy_qwen2(path: Path, *, hidden_size: int, num_layers: int, intermediate_size: int,
                      num_heads: int, num_kv_heads: int, vocab_size: int = 32000,
                      max_positions: int = 4096) -> Path:
    """A Qwen2 of this shape as its `config.json` alone, for vLLM's `load_format="dummy"`
    (random weights made at load: a 7B-class model starts without gigabytes of files)."""
    if not (path / "config.json").exists():
        from transformers import Qwen2Config
        Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size,
                    intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                    num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                    max_position_embeddings=max_positions, tie_word_embeddings=False,
                    torch_dtype="bfloat16").save_pretrained(path)
    return path


#: Share of a GPU's memory each engine takes (the demo runs two engines on one GPU).
GPU_MEMORY_FRACTION = 0.2

#: What a vLLM build without its compiled kernels (`vllm._C`) needs to run: eager, Triton
#: attention, torch-native layers (as the offline build for the H200 machine is).
PORTABLE_ENGINE_ARGS: dict[str, Any] = dict(
    enforce_eager=True, attention_config={"backend": "TRITON_ATTN"},
    compilation_config={"custom_ops": ["none"]},
    ir_op_priority={"rms_norm": ["native"], "fused_add_rms_norm": ["native"]})


#: Full CUDA graphs for decode steps, no torch.compile (what the offline build for the H200
#: machine captures and replays; it needs `torch.ops._C.weak_ref_tensor`). Two engines with
#: graphs do not share a process in vLLM 0.26: give each its own engine-core process.
@dataclass(frozen=True)
class StageModel:
    """Stage 1's model (a Qwen2): random weights written by transformers, or (`dummy`) only its
    config.json, vLLM making random weights at load (`load_format="dummy"`)."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    dummy: bool = False

    def write(self, path: Path, *, num_layers: int | None = None, seed: int = 0) -> Path:
        """The model (with `num_layers` where given: stage 2 is 2 layers of stage 1's width)."""
        shape = dict(hidden_size=self.hidden_size, num_layers=num_layers or self.num_layers,
                     intermediate_size=self.intermediate_size, num_heads=self.num_heads,
                     num_kv_heads=self.num_kv_heads)
        return write_dummy_qwen2(path, **shape) if self.dummy else \
            write_random_qwen2(path, seed=seed, **shape)

    @property
    def engine_args(self) -> dict[str, Any]:
        return {"load_format": "dummy"} if self.dummy else {}

    def describe(self, shape: EngineShape) -> str:
        return (f"hidden {self.hidden_size} x {self.num_layers} layers, {shape.dtype}"
                + (", dummy weights" if self.dummy else ""))


#: Stage-1 models by name and vLLM platform. small: prefill-dominated on a CPU (about 100 M
#: parameters; on a GPU hidden 2048, about 400 M, bf16); 7b: a 7B-class Qwen2 (about 5.9 B
#: parameters, 12 GB in bf16), GPU only; tiny: CPU only, a forward of a few hundred µs, so a
#: step is bound by the engine's own Python as a GPU decode step under CUDA graphs is (plain
#: steps of about 1.6 ms on 2 cores). Stage 2 is 2 layers of stage 1's width.
MODELS: dict[str, dict[str, StageModel]] = {
    "small": {"cpu": StageModel(1024, 8, 2816, 16, 4), "cuda": StageModel(2048, 8, 5632, 16, 4)},
    "7b": {"cuda": StageModel(4096, 32, 11008, 32, 8, dummy=True)},
    "tiny": {"cpu": StageModel(64, 1, 128, 2, 1)},
}


def platform_stage_model(name: str) -> tuple[str, StageModel, str]:
    """This machine's vLLM platform, its stage-1 model `name` and the dtype it runs in
    (float32 on the CPU, bfloat16 on a GPU); a RuntimeError, naming the platforms that have
    one, where it has none."""
    from vllm.platforms import current_platform
    device = current_platform.device_type
    if device not in MODELS[name]:
        raise RuntimeError(f"no {name} model for vLLM platform {device!r} "
                           f"({' and '.join(MODELS[name])} have one)")
    return device, MODELS[name][device], "float32" if device == "cpu" else "bfloat16"


CUDA_GRAPH_ARGS: dict[str, Any] = dict(
    enforce_eager=False,
    compilation_config={"custom_ops": ["none"], "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})


def platform_engine_args() -> dict[str, Any]:
    """Engine arguments this machine's vLLM platform needs beyond an engine's shape."""
    from vllm.platforms import current_platform
    if current_platform.device_type != "cuda":
        return {}
    args: dict[str, Any] = {"gpu_memory_utilization": GPU_MEMORY_FRACTION}
    if importlib.util.find_spec("vllm._C") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        args.update(PORTABLE_ENGINE_ARGS)
    return args


def default_worker() -> str:
    """The cache's worker class for this machine's vLLM platform."""
    from vllm.platforms import current_platform
    kind = {"cpu": "CPU", "cuda": "GPU", "npu": "NPU"}.get(current_platform.device_type)
    if kind is None:
        raise RuntimeError(f"no prefix-cache worker for vLLM platform "
                           f"{current_platform.device_type!r} (cpu, cuda and npu have one)")
    return f"prefix_cache.vllm_runners.PrefixCache{kind}Worker"


@dataclass(frozen=True)
class EngineShape:
    """An engine's batch and KV-cache sizes (small: blocks are reused, prompts are chunked)."""

    max_model_len: int = 768
    block_size: int = 32            # the CPU attention backend needs a multiple of 32
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 64
    long_prefill_token_threshold: int = 32  # a long prompt's chunk per step (0: no limit)
    num_blocks: int = 25            # 24 usable (block 0 is vLLM's null block): 768 tokens
    dtype: str = "float32"

    def engine_args(self) -> dict[str, Any]:
        return dict(max_model_len=self.max_model_len, block_size=self.block_size,
                    max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.max_num_batched_tokens,
                    long_prefill_token_threshold=self.long_prefill_token_threshold,
                    num_gpu_blocks_override=self.num_blocks, enable_chunked_prefill=True,
                    dtype=self.dtype, enforce_eager=True, seed=0, skip_tokenizer_init=True)


class Engine:
    """One vLLM engine (an `LLM`), stepped by hand; `close()` stops its processes.

    An in-process engine's shutdown tears down this process's torch.distributed
    state, which every in-process engine shares: close in-process engines only
    when no other one is still in use.
    """

    def __init__(self, model_dir: Path, shape: EngineShape, **kwargs: Any) -> None:
        apply_engine_env()
        from vllm import LLM
        self.llm = LLM(model=str(model_dir), **{**shape.engine_args(), **platform_engine_args(),
                                                **kwargs})
        self.engine = self.llm.llm_engine

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[Any]:
        """One engine step; only call it with work pending (a multiprocess engine blocks)."""
        return self.engine.step()

    @contextmanager
    def traced(self) -> Iterator[None]:
        """vLLM's worker profiler over the block; the engine was built with
        `vllm_trace_config`, and its trace is written when the block ends."""
        self.llm.start_profile()
        try:
            yield
        finally:
            self.llm.stop_profile()

    def stats(self) -> dict[str, int | float]:
        """Rank 0's counters: the rank that holds the cache without pipeline parallelism."""
        return self.rank_stats()[0]

    def rank_stats(self) -> list[dict[str, int | float]]:
        """Each worker's counters, by rank: a rank that holds no cache reports only its
        process's resident bytes (`worker_rss_bytes`)."""
        return self.llm.collective_rpc("prefix_cache_stats")

    def close(self) -> None:
        self.engine.engine_core.shutdown()
        del self.engine, self.llm
        gc.collect()


def cache_engine_thread_s(stats: Mapping[str, int | float]) -> float:
    """Seconds an engine thread has spent in the cache's calls, by its `stats()`: the sum of
    `ENGINE_THREAD_CALLS`' times."""
    return sum(stats.get(f"time_s.{call}", 0.0) for call in ENGINE_THREAD_CALLS)


def start_thinker(model_dir: Path, channel: StageChannel, *, prefix_caching: bool,
                  shape: EngineShape = EngineShape(), worker_cls: str | None = None,
                  stage_options: Mapping[str, Any] | None = None, **engine_args: Any) -> Engine:
    """Stage 1: an engine whose worker publishes every finished request's rows to `channel`
    (`stage_options`: more of `additional_config["prefix_cache"]`, e.g. `stream`)."""
    return Engine(model_dir, shape, enable_prefix_caching=prefix_caching,
                  worker_cls=worker_cls or default_worker(),
                  additional_config={"prefix_cache": {"channel": channel.spec,
                                                      **(stage_options or {})}},
                  **engine_args)


def start_talker(model_dir: Path, shape: EngineShape = EngineShape(), **engine_args: Any
                 ) -> Engine:
    """Stage 2: an engine fed the thinker's rows as `prompt_embeds`."""
    return Engine(model_dir, shape, enable_prompt_embeds=True, **engine_args)


def vllm_trace_config(trace_dir: Path) -> dict[str, Any]:
    """`profiler_config` for an engine whose worker traces itself into `trace_dir` within
    `Engine.traced` (torch's profiler with Python stacks): the way to trace an engine core that
    runs in a process of its own. The profiler is built at the first trace, so an engine
    never traced runs as without it."""
    return {"profiler": "torch", "torch_profiler_dir": str(trace_dir.resolve()),
            "torch_profiler_with_stack": True, "ignore_frontend": True}


def engine_core_pid(engine: Engine) -> int:
    """The process whose threads run `engine`'s steps: this one for an in-process engine core,
    else its engine-core process (vLLM's worker processes, where it starts any, are children
    of that one)."""
    manager = getattr(getattr(engine.engine.engine_core, "resources", None), "engine_manager",
                      None)
    if manager is None:
        return os.getpid()
    (process,) = manager.processes
    return process.pid
