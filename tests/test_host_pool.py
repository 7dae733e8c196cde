"""The host pool made visible: its size follows vLLM's KV cache (a row per KV slot per key), the
worker logs it at start, and a pool over the host budget refuses the engine in one line."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from prefix_cache import OmniPrefixCacheUnmatchError
from prefix_cache import config as config_module
from prefix_cache.config import HIDDEN_KEY, HOST_POOL_SHARE, PrefixCacheConfig
from prefix_cache.integration import runner_mixin
from prefix_cache.integration.gate import check_host_pool, stage_options
from tests.vllm_fixtures import thinker_model_dir  # noqa: F401

GIB = 1 << 30


def test_a_keys_pool_is_a_row_for_every_kv_slot() -> None:
    config = PrefixCacheConfig(num_blocks=1000, block_size=16)
    assert config.key_bytes((256,), torch.bfloat16) == 1000 * 16 * 256 * 2
    assert config.key_bytes((4, 8), torch.float32) == 1000 * 16 * 32 * 4


def test_the_default_budget_is_a_share_of_host_memory_split_over_its_devices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "_host_memory_bytes", lambda: 64 * GIB)
    config = PrefixCacheConfig(num_blocks=10, block_size=16)
    assert config.host_budget(devices_on_host=8) == int(64 * GIB * HOST_POOL_SHARE) // 8
    assert PrefixCacheConfig(num_blocks=10, block_size=16,
                             host_budget_bytes=123).host_budget(devices_on_host=8) == 123
    monkeypatch.setattr(config_module, "_host_memory_bytes", lambda: None)
    assert config.host_budget(devices_on_host=1) is None


def test_every_keys_pool_counts_against_the_budget_before_it_is_allocated() -> None:
    """A multimodal key seen first in a step gets its pool only where every pool together stays
    within `host_budget_bytes`; else the save is refused in one line naming the key and the
    budget, nothing is allocated, and the same step saves without that key."""
    from prefix_cache import OmniPrefixCacheManager
    from tests.sim import StepDriver

    sim = StepDriver(block_size=4)
    # the hidden key: 64 slots x 8 x 4 B = 2 KiB; an mm key of 64 slots x 65,536 x 4 B = 16 MiB
    manager = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=16, block_size=4,
                                                       host_budget_bytes=1 << 20), sim)
    manager.new_step_starts(sim.step(new=[("a", list(range(8)), [1, 2], 0, 8)]))
    with pytest.raises(OmniPrefixCacheUnmatchError) as refused:
        manager.save_outputs(sim.outputs(8), {"audio": torch.zeros(8, 65_536)},
                             num_tokens_unpadded=8, num_tokens_padded=8)
    message = str(refused.value)
    assert "\n" not in message and "'audio'" in message and "host_budget_bytes" in message
    assert not manager.pool.keys  # the step's hidden key was new too: neither is allocated
    manager.save_outputs(sim.outputs(8), None, num_tokens_unpadded=8, num_tokens_padded=8)
    assert set(manager.pool.nbytes()) == {HIDDEN_KEY}
    assert sum(manager.pool.nbytes().values()) <= 1 << 20
    manager.shutdown()


@pytest.mark.parametrize("budget", [-1, 1.5, True, "1G"])
def test_a_budget_that_is_not_a_byte_count_is_refused(budget: object) -> None:
    with pytest.raises(ValueError, match="host_budget_bytes must be an int >= 0 or None"):
        PrefixCacheConfig(num_blocks=10, block_size=16, host_budget_bytes=budget)


def test_a_pool_within_budget_is_described_in_one_line() -> None:
    config = PrefixCacheConfig(num_blocks=25, block_size=32, host_budget_bytes=GIB)
    line = check_host_pool(config, keys=1, feat_shape=(256,), dtype=torch.float32,
                           device_type="cpu")
    assert line == ("0.78 MiB: 1 key(s) x 0.78 MiB (800 KV slots x 256 x 4 B of torch.float32); "
                    "host budget 1.00 GiB (host_budget_bytes)")


def test_a_pool_over_budget_is_refused_in_one_line_naming_the_knobs() -> None:
    # the H200: 14.9 GB for a 256-wide float32 model, all from the KV cache's size
    config = PrefixCacheConfig(num_blocks=910_000, block_size=16, host_budget_bytes=8 * GIB)
    with pytest.raises(OmniPrefixCacheUnmatchError) as refused:
        check_host_pool(config, keys=1, feat_shape=(256,), dtype=torch.float32,
                        device_type="cpu")
    message = str(refused.value)
    assert "\n" not in message
    assert "13.89 GiB: 1 key(s) x 13.89 GiB (14,560,000 KV slots x 256 x 4 B" in message
    assert "over the host budget of 8.00 GiB (host_budget_bytes)" in message
    for knob in ("gpu_memory_utilization", "num_gpu_blocks_override", "cache fewer keys",
                 "additional_config['prefix_cache']['host_budget_bytes']"):
        assert knob in message


def test_an_unknown_stage_option_is_refused_naming_the_known_ones() -> None:
    vllm_config = SimpleNamespace(additional_config={"prefix_cache": {"host_budget": 1}})
    with pytest.raises(OmniPrefixCacheUnmatchError,
                       match=r"unknown option\(s\) \['host_budget'\]; known: \['channel', "
                             r"'host_budget_bytes', 'stream'\]"):
        stage_options(vllm_config)


# ---------------------------------------------------------------------- the real CPU engine

@pytest.mark.vllm
def test_the_worker_logs_its_pool_at_start_and_refuses_one_over_budget(
        thinker_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    pytest.importorskip("vllm")
    from prefix_cache.channel import open_channel
    from prefix_cache.tools.pipelines.engines import (Engine, EngineShape, default_worker,
                                                      multiprocessing_mode)

    pool_bytes = EngineShape().num_blocks * EngineShape().block_size * 256 * 4

    def start(budget: int) -> Engine:
        return Engine(thinker_model_dir, EngineShape(), enable_prefix_caching=True,
                      worker_cls=default_worker(), additional_config={"prefix_cache": {
                          "channel": channel.spec, "host_budget_bytes": budget}})

    lines: list[str] = []  # vLLM's logging setup drops handlers on its child loggers: record
    monkeypatch.setattr(runner_mixin.start_logger, "info",
                        lambda message, *args: lines.append(message % args))
    with multiprocessing_mode(False), open_channel() as channel:
        with pytest.raises(Exception) as refused:
            start(pool_bytes - 1)
        start(pool_bytes).close()
    chain = [refused.value]
    while chain[-1].__cause__ or chain[-1].__context__:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    assert any(isinstance(e, OmniPrefixCacheUnmatchError) and "over the host budget" in str(e)
               for e in chain)
    [line] = [line for line in lines if "host pool" in line]
    assert line == ("omni prefix cache on cpu: 25 blocks of 32 tokens; host pool 0.78 MiB: "
                    "1 key(s) x 0.78 MiB (800 KV slots x 256 x 4 B of torch.float32); "
                    "host budget 0.78 MiB (host_budget_bytes), pageable"), line

