"""The cache's figures in `vllm serve`'s Prometheus `/metrics` (`omni_prefix_cache_*`), written
by the worker through vLLM's multiprocess directory (`prefix_cache.integration.prometheus`): after
a prefix hit, the hit tokens, the pool's bytes and blocks and the entries delivered are there."""

from __future__ import annotations

import os
import re
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from prefix_cache import HIDDEN_KEY  # noqa: E402
from prefix_cache.channel import open_channel  # noqa: E402
from prefix_cache.integration.serving import served_channel_keys  # noqa: E402
from prefix_cache.tools.pipelines.served import serving, write_word_tokenizer  # noqa: E402
from tests.vllm_fixtures import thinker_model_dir  # noqa: E402,F401

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
PREFIX = " ".join(f"w{i}" for i in range(10, 80))  # 70 tokens: two full blocks shared
GREEDY = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}


def scrape(port: int) -> dict[str, float]:
    """`/metrics`' omni_prefix_cache_* samples, by name with their labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {m["name"]: float(m["value"]) for m in re.finditer(
        r"^(?P<name>omni_prefix_cache_\S+) (?P<value>\S+)$", text, re.MULTILINE)}


def test_served_metrics_show_the_caches_figures_after_a_hit(
        thinker_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    from transformers import AutoConfig
    vocab_size = AutoConfig.from_pretrained(thinker_model_dir).vocab_size
    tokenizer_dir = write_word_tokenizer(tmp_path / "tokenizer", vocab_size)
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    with open_channel() as channel, serving(thinker_model_dir, tokenizer_dir, channel.spec,
                                            tmp_path / "server.log", env) as server:
        first = server.post("/v1/completions", {**GREEDY, "prompt": PREFIX + " w5"})
        second = server.post("/v1/completions", {**GREEDY, "prompt": PREFIX + " w7"})
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        rows = sum(channel.get(served_channel_keys(response)[0], timeout_s=30)[HIDDEN_KEY]
                   .shape[0] for response in (first, second))
        deadline = time.monotonic() + 30
        while True:  # the worker writes its figures every second
            figures = scrape(server.port)
            if figures.get("omni_prefix_cache_entries_delivered_total", 0) >= 2 \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert figures["omni_prefix_cache_hit_tokens_total"] == 64, figures
    assert figures["omni_prefix_cache_entries_delivered_total"] == 2
    assert figures["omni_prefix_cache_entries_failed_total"] == 0
    assert figures["omni_prefix_cache_rows_delivered_total"] == rows
    assert figures["omni_prefix_cache_channel_full_wait_seconds_total"] == 0
    assert figures["omni_prefix_cache_hit_tokens_trimmed_total"] == 0
    assert figures["omni_prefix_cache_evicted_blocks_total"] == 0
    assert figures['omni_prefix_cache_pool_bytes{key="__hidden_states__"}'] > 0
    assert figures["omni_prefix_cache_resident_blocks"] == \
        figures["omni_prefix_cache_pool_blocks"] > 0
