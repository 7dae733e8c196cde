"""The configuration gate every runner calls at KV-cache init: cache on, off, or refused with a reason."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from prefix_cache.config import HOST_POOL_SHARE, PrefixCacheConfig, devices_on_host
from prefix_cache.errors import OmniPrefixCacheUnmatchError

_FULL_ATTENTION_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")

#: What `vllm_config.additional_config["prefix_cache"]` may set.
STAGE_OPTIONS = ("channel", "host_budget_bytes", "stream")


#: Why a stage with speculative decoding neither caches nor publishes its rows.
_SPECULATIVE = ("speculative decoding keeps num_computed_tokens optimistic during the forward "
                "and computes rows of draft tokens it may reject")


def _refuse(reason: str) -> OmniPrefixCacheUnmatchError:
    return OmniPrefixCacheUnmatchError(f"omni prefix cache refused for this stage: {reason}")


def stage_options(vllm_config: Any) -> Mapping[str, Any]:
    """The engine's `additional_config["prefix_cache"]`, refused if it sets an unknown option."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    options = extra.get("prefix_cache") or {}
    if not isinstance(options, Mapping):
        raise _refuse(f"additional_config['prefix_cache'] must be a dict of options "
                      f"{list(STAGE_OPTIONS)}, got {options!r}")
    unknown = sorted(set(options) - set(STAGE_OPTIONS))
    if unknown:
        raise _refuse(f"additional_config['prefix_cache'] sets unknown option(s) {unknown}; "
                      f"known: {list(STAGE_OPTIONS)}")
    return options


def stream_every(options: Mapping[str, Any]) -> int | None:
    """Positions per streamed chunk from the stage option `stream` (true: every step, a whole
    number N >= 1: once N positions stand); None when it is off (whole entries at finish)."""
    value = options.get("stream", False)
    if value is False or value is None:
        return None
    if value is True:
        return 1
    if isinstance(value, int) and value >= 1:
        return value
    raise _refuse(f"additional_config['prefix_cache']['stream'] must be true (a chunk every "
                  f"step), false, or a whole number N >= 1 (a chunk every N positions), got "
                  f"{value!r}")


def check_stage_outputs(*, speculative_config: Any = None) -> None:
    """Refuse a stage whose rows cannot be published as the model's, prefix caching on or off:
    the rows of rejected draft tokens would reach the next stage as real positions."""
    if speculative_config is not None:
        raise OmniPrefixCacheUnmatchError(f"stage outputs refused: {_SPECULATIVE}")


def _is_full_attention(spec: Any) -> bool:
    """A full-attention spec by class name (vLLM's hierarchy), with no window or chunking."""
    names = [cls.__name__ for cls in type(spec).__mro__]
    if not any(name in _FULL_ATTENTION_SPECS for name in names):
        return False
    if "RSWASpec" in names or getattr(spec, "rswa_window", None) is not None:
        return False  # vLLM >= 0.32 R-SWA frees decode blocks mid-request: a sliding window
    return getattr(spec, "sliding_window", None) is None and \
        getattr(spec, "attention_chunk_size", None) is None


def stage_prefix_cache_config(*, kv_cache_config: Any, cache_config: Any,
                              kv_transfer_config: Any = None, scheduler_config: Any = None,
                              model_config: Any = None, speculative_config: Any = None,
                              parallel_config: Any = None, is_pooling_model: bool = False,
                              host_budget_bytes: int | None = None,
                              ) -> PrefixCacheConfig | None:
    """None when prefix caching is off or the stage pools; a config when supported; else raises."""
    if not getattr(cache_config, "enable_prefix_caching", False) or is_pooling_model:
        return None
    if kv_transfer_config is not None and (
            getattr(kv_transfer_config, "is_kv_consumer", False)
            or getattr(kv_transfer_config, "kv_role", None) in ("kv_consumer", "kv_both")):
        raise _refuse(f"kv_role {getattr(kv_transfer_config, 'kv_role', None)!r} receives "
                      f"remote KV, which is indistinguishable from a local prefix hit")
    if speculative_config is not None:
        raise _refuse(f"{_SPECULATIVE}, so rows would be mirrored at the wrong slots")
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) != 1 or not _is_full_attention(groups[0].kv_cache_spec):
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise _refuse(f"KV cache groups {kinds}: exactly one full-attention table is mirrored "
                      f"(hybrid, sliding-window and multi-group caches are not)")
    # the group's spec, not the cache config, is the truth for its block table
    block_size = int(groups[0].kv_cache_spec.block_size)
    match_unit = getattr(cache_config, "prefix_match_unit", None)
    if match_unit is not None and int(match_unit) < block_size:
        raise _refuse(f"prefix_match_unit {match_unit} < block_size {block_size} makes hits "
                      f"end inside a block")
    for field in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(parallel_config, field, 1) or 1)
        if size > 1:
            raise _refuse(f"{field}={size} stripes tokens across ranks")
    return PrefixCacheConfig.from_vllm_config(num_blocks=int(kv_cache_config.num_blocks),
                                              block_size=block_size,
                                              scheduler_config=scheduler_config,
                                              model_config=model_config,
                                              host_budget_bytes=host_budget_bytes)


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.2f} MiB"


def host_pool_blocks(config: PrefixCacheConfig, *, token_bytes: int, max_model_len: int,
                     device_type: str) -> int | None:
    """Blocks of rows the stage's host pool holds, at `token_bytes` a token: None (one per KV
    block, the mirror) where the mirror fits the host budget, else as many as fit it (block 0
    unused, as vLLM's null block is). Refused in one line, naming the knobs, where they cannot
    hold the blocks of one request of `max_model_len` tokens: a running request's rows stay in
    the pool until it finishes. The scheduler side and the worker both size the pool here."""
    budget = config.host_budget(devices_on_host(device_type))
    block_bytes = config.block_size * token_bytes
    if budget is None or not block_bytes or config.num_blocks * block_bytes <= budget:
        return None
    pool = budget // block_bytes
    need = -(-max_model_len // config.block_size) + 1
    if pool < need:
        source = "host_budget_bytes" if config.host_budget_bytes is not None else "default"
        raise _refuse(
            f"one request of max_model_len={max_model_len} tokens holds the rows of {need} "
            f"blocks while it runs (block 0 unused), {_size(need * block_bytes)} at "
            f"{config.block_size} tokens x {token_bytes} B, over the host budget of "
            f"{_size(budget)} ({source}); raise additional_config['prefix_cache']"
            f"['host_budget_bytes'], lower max_model_len, or cache fewer keys")
    return pool


def check_host_pool(config: PrefixCacheConfig, *, keys: int, feat_shape: Sequence[int],
                    dtype: torch.dtype, device_type: str) -> str:
    """What the stage's pools take at start (`keys` keys of rows of `feat_shape`), as a line for
    the log: how many KV blocks' rows they hold where the pool is capped (`pool_blocks`); refused
    in one line, naming the knobs, when that is over the host budget."""
    devices = devices_on_host(device_type)
    budget = config.host_budget(devices)
    pool_config = config.pool_config()
    per_key = pool_config.key_bytes(feat_shape, dtype)
    pool = (f"{_size(keys * per_key)}: {keys} key(s) x {_size(per_key)} "
            f"({pool_config.num_slots:,} {'pool' if config.capped else 'KV'} slots x "
            f"{math.prod(feat_shape)} x {dtype.itemsize} B of {dtype})")
    if config.capped:
        pool += (f", capped: rows of {config.pool_blocks - 1:,} of the {config.num_blocks - 1:,}"
                 f" KV blocks, least recently used evicted")
    source = ("host_budget_bytes" if config.host_budget_bytes is not None else
              f"default: {HOST_POOL_SHARE:.0%} of host memory over {devices} {device_type} "
              f"device(s)")
    if budget is None:
        return f"{pool}; host budget unknown (this host's memory size is not readable)"
    if keys * per_key > budget:
        raise _refuse(f"its host pool would take {pool}, over the host budget of {_size(budget)} "
                      f"({source}). The pool mirrors every KV slot, so its size follows vLLM's KV "
                      f"cache, not the model: lower gpu_memory_utilization or set "
                      f"num_gpu_blocks_override, cache fewer keys, or raise "
                      f"additional_config['prefix_cache']['host_budget_bytes']")
    return f"{pool}; host budget {_size(budget)} ({source})"


def stage_pool_config(vllm_config: Any, kv_cache_config: Any, *, device_type: str,
                      is_pooling_model: bool = False) -> PrefixCacheConfig | None:
    """The stage's cache config (`stage_prefix_cache_config`, its stage options applied) with its
    host pool sized (`host_pool_blocks`, a row of the model's hidden size a token): what the
    worker builds and what the scheduler side caps, from the same engine config."""
    options = stage_options(vllm_config)
    config = stage_prefix_cache_config(
        kv_cache_config=kv_cache_config, cache_config=vllm_config.cache_config,
        kv_transfer_config=vllm_config.kv_transfer_config,
        scheduler_config=vllm_config.scheduler_config, model_config=vllm_config.model_config,
        speculative_config=vllm_config.speculative_config,
        parallel_config=vllm_config.parallel_config, is_pooling_model=is_pooling_model,
        host_budget_bytes=options.get("host_budget_bytes"))
    if config is None:
        return None
    model = vllm_config.model_config
    token_bytes = model.get_hidden_size() * model.dtype.itemsize
    return replace(config, pool_blocks=host_pool_blocks(
        config, token_bytes=token_bytes, max_model_len=int(model.max_model_len),
        device_type=device_type))
