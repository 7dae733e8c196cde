"""The configuration gate (SPEC §5) with vLLM 0.32's real config and KV-cache spec classes."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from prefix_cache import (  # noqa: E402
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    stage_prefix_cache_config,
)
from prefix_cache.integration.gate import check_stage_outputs, stream_every  # noqa: E402

pytestmark = pytest.mark.vllm

NUM_BLOCKS = 96
BLOCK_SIZE = 16
MAX_BATCHED = 384


def full_spec(block_size: int = BLOCK_SIZE) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64,
                             dtype=torch.float32)


def sliding_spec(block_size: int = BLOCK_SIZE) -> Any:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=64,
                             dtype=torch.float32, sliding_window=128)


def mla_spec(block_size: int = 64) -> Any:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576,
                            dtype=torch.bfloat16)


def kv_config(*specs: Any, num_blocks: int = NUM_BLOCKS) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def cache_config(block_size: int = BLOCK_SIZE, enable_prefix_caching: bool = True,
                 **kwargs: Any) -> Any:
    from vllm.config import CacheConfig

    return CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                       **kwargs)


def scheduler_config(max_num_batched_tokens: int = MAX_BATCHED) -> Any:
    from vllm.config import SchedulerConfig

    return SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                           max_model_len=256, enable_chunked_prefill=True,
                           is_encoder_decoder=False)


def gate(**overrides: Any) -> PrefixCacheConfig | None:
    """The gate for a supported AR stage, with some arguments replaced."""
    kwargs: dict[str, Any] = dict(kv_cache_config=kv_config(full_spec()),
                                  cache_config=cache_config(),
                                  scheduler_config=scheduler_config())
    kwargs.update(overrides)
    return stage_prefix_cache_config(**kwargs)


# --- supported and disabled stages ---------------------------------------------------------


def test_full_attention_stage_gets_a_config_sized_from_vllm() -> None:
    from vllm.config import ParallelConfig

    config = gate(parallel_config=ParallelConfig())

    assert isinstance(config, PrefixCacheConfig)
    assert (config.num_blocks, config.block_size) == (NUM_BLOCKS, BLOCK_SIZE)
    assert config.staging_capacity_tokens == MAX_BATCHED


def test_mla_stage_is_supported_with_the_group_block_size() -> None:
    config = gate(kv_cache_config=kv_config(mla_spec(64)), cache_config=cache_config(64))

    assert config is not None and (config.num_blocks, config.block_size) == (NUM_BLOCKS, 64)


def test_group_spec_block_size_wins_over_cache_config() -> None:
    config = gate(kv_cache_config=kv_config(full_spec(32)), cache_config=cache_config(16))

    assert config is not None and config.block_size == 32


def test_prefix_caching_off_returns_none() -> None:
    assert gate(cache_config=cache_config(enable_prefix_caching=False)) is None


def test_pooling_stage_returns_none() -> None:
    assert gate(is_pooling_model=True) is None


def test_pooling_stage_returns_none_even_with_a_refused_layout() -> None:
    assert gate(is_pooling_model=True, kv_cache_config=kv_config(sliding_spec())) is None


def test_kv_producer_is_allowed() -> None:
    from vllm.config import KVTransferConfig

    kv_transfer = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_producer")

    assert gate(kv_transfer_config=kv_transfer) is not None


def test_without_scheduler_config_capacity_falls_back_to_model_max_len() -> None:
    config = gate(scheduler_config=None, model_config=SimpleNamespace(max_model_len=4096))

    assert config is not None and config.staging_capacity_tokens == 4096


# --- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_remote_kv_roles_are_refused(role: str) -> None:
    from vllm.config import KVTransferConfig

    kv_transfer = KVTransferConfig(kv_connector="ExampleConnector", kv_role=role)

    with pytest.raises(OmniPrefixCacheUnmatchError, match=f"kv_role '{role}'"):
        gate(kv_transfer_config=kv_transfer)


def test_speculative_decoding_is_refused() -> None:
    from vllm.config import SpeculativeConfig

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3,
                             prompt_lookup_min=1)

    with pytest.raises(OmniPrefixCacheUnmatchError, match="speculative"):
        gate(speculative_config=spec)
    # prefix caching off: the gate has nothing to say, but the stage still must not publish
    off = cache_config(16, enable_prefix_caching=False)
    assert gate(speculative_config=spec, cache_config=off) is None
    with pytest.raises(OmniPrefixCacheUnmatchError,
                       match="stage outputs refused: speculative decoding .* draft tokens"):
        check_stage_outputs(speculative_config=spec)
    check_stage_outputs(speculative_config=None)


def test_prefix_match_unit_below_block_size_is_refused() -> None:
    # vLLM 0.32's CacheConfig has prefix_match_unit (the hash block size).
    with pytest.raises(OmniPrefixCacheUnmatchError, match="prefix_match_unit 8"):
        gate(cache_config=cache_config(16, prefix_match_unit=8))


def test_prefix_match_unit_equal_to_block_size_is_allowed() -> None:
    assert gate(cache_config=cache_config(16, prefix_match_unit=16)) is not None


def test_sliding_window_group_is_refused() -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match="full-attention.*sliding-window"):
        gate(kv_cache_config=kv_config(sliding_spec()))


def test_full_attention_spec_with_a_window_is_refused() -> None:
    windowed = dataclasses.replace(full_spec(), sliding_window=64)

    with pytest.raises(OmniPrefixCacheUnmatchError, match="full-attention"):
        gate(kv_cache_config=kv_config(windowed))


def test_chunked_local_attention_group_is_refused() -> None:
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    chunked = ChunkedLocalAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64,
                                        dtype=torch.float32, attention_chunk_size=64)

    with pytest.raises(OmniPrefixCacheUnmatchError, match="ChunkedLocalAttentionSpec"):
        gate(kv_cache_config=kv_config(chunked))


def test_two_full_attention_groups_are_refused() -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match="exactly one full-attention"):
        gate(kv_cache_config=kv_config(full_spec(), full_spec()))


def test_hybrid_full_and_sliding_groups_are_refused() -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match="SlidingWindowSpec"):
        gate(kv_cache_config=kv_config(full_spec(), sliding_spec()))


def test_no_kv_cache_group_is_refused() -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match="exactly one"):
        gate(kv_cache_config=kv_config())


def test_reference_sliding_window_group_is_refused() -> None:
    from vllm.v1.kv_cache_interface import RSWASpec

    rswa = RSWASpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.float32,
                    rswa_window=64)

    with pytest.raises(OmniPrefixCacheUnmatchError, match="full-attention"):
        gate(kv_cache_config=kv_config(rswa))


def test_decode_context_parallel_is_refused() -> None:
    from vllm.config import ParallelConfig

    # ParallelConfig 0.32 validates tp_size % dcp_size == 0.
    parallel = ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2)

    with pytest.raises(OmniPrefixCacheUnmatchError, match="decode_context_parallel_size=2"):
        gate(parallel_config=parallel)


# --- PrefixCacheConfig validation and from_vllm_config ---------------------------------------


@pytest.mark.parametrize("field,value", [
    ("num_blocks", 0),
    ("block_size", -1),
    ("staging_depth", 0),
    ("staging_capacity_tokens", True),
    ("staging_claim_timeout_s", 0),
    ("gpu_budget_bytes", -1),
    ("output_cache_bytes", -1),
    ("output_cache_bytes", 1.5),
    ("device", ""),
])
def test_invalid_field_raises_value_error_naming_it(field: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"num_blocks": 8, "block_size": 16, field: value}

    with pytest.raises(ValueError, match=field):
        PrefixCacheConfig(**kwargs)


def test_defaults_are_the_documented_ones() -> None:
    config = PrefixCacheConfig(num_blocks=8, block_size=16)

    assert (config.staging_depth, config.staging_capacity_tokens) == (4, 8192)
    assert config.staging_claim_timeout_s == 30.0 and config.gpu_budget_bytes == 512 << 20
    assert config.device is None and config.output_cache_bytes == 256 << 20


def test_from_vllm_config_applies_overrides() -> None:
    config = PrefixCacheConfig.from_vllm_config(
        num_blocks=64, block_size=32, scheduler_config=scheduler_config(512),
        staging_depth=2, device="cpu", staging_capacity_tokens=1024)

    assert (config.num_blocks, config.block_size, config.staging_depth) == (64, 32, 2)
    assert config.device == "cpu" and config.staging_capacity_tokens == 1024


def test_from_vllm_config_sizes_staging_from_max_num_batched_tokens() -> None:
    config = PrefixCacheConfig.from_vllm_config(num_blocks=64, block_size=32,
                                                scheduler_config=scheduler_config(512))

    assert config.staging_capacity_tokens == 512


def test_from_vllm_config_rejects_an_unknown_override() -> None:
    with pytest.raises(ValueError, match="staging_dept"):
        PrefixCacheConfig.from_vllm_config(num_blocks=64, block_size=32, staging_dept=2)


def test_from_vllm_config_validates_override_values() -> None:
    with pytest.raises(ValueError, match="staging_depth"):
        PrefixCacheConfig.from_vllm_config(num_blocks=64, block_size=32, staging_depth=0)


# --- ModelCachePolicy ------------------------------------------------------------------------


def test_policy_from_a_plain_model_uses_defaults() -> None:
    policy = ModelCachePolicy.from_model(torch.nn.Linear(2, 2))

    assert policy == ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=frozenset())


def test_policy_reads_the_two_model_attributes() -> None:
    model = torch.nn.Linear(2, 2)
    model.requires_full_prefix_cached_hidden_states = False
    model.deferred_prefix_cache_mm_keys = ["audio_codes", "mel"]

    policy = ModelCachePolicy.from_model(model)

    assert policy.needs_full_hidden_states is False
    assert policy.deferred_keys == frozenset({"audio_codes", "mel"})


def test_policy_with_hidden_key_deferred_raises() -> None:
    with pytest.raises(ValueError, match="deferred_keys"):
        ModelCachePolicy(deferred_keys=frozenset({HIDDEN_KEY}))


def test_model_deferring_hidden_key_raises() -> None:
    model = SimpleNamespace(deferred_prefix_cache_mm_keys=(HIDDEN_KEY,))

    with pytest.raises(ValueError, match=HIDDEN_KEY):
        ModelCachePolicy.from_model(model)


@pytest.mark.parametrize("value, every", [(False, None), (None, None), (True, 1), (1, 1),
                                          (16, 16)])
def test_the_stream_option_gives_positions_per_chunk(value: object, every: int | None) -> None:
    assert stream_every({"stream": value}) == every
    assert stream_every({}) is None


@pytest.mark.parametrize("value", [0, -2, "yes", 1.5])
def test_a_bad_stream_option_is_refused_in_one_line_naming_it(value: object) -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError,
                       match=r"additional_config\['prefix_cache'\]\['stream'\] must be true"):
        stream_every({"stream": value})
