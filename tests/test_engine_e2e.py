"""vLLM's real CPU engine end to end: full-prompt rows through the cache equal a cache-off run."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_engine_rows_through_the_cache_match_a_cache_off_run(tmp_path: Path) -> None:
    from prefix_cache import demo

    requests = demo.make_workload(seed=1)
    model = demo.make_tiny_model(tmp_path / "tiny-qwen2")
    on = demo.run_engine(model, requests, prefix_caching=True)
    off = demo.run_engine(model, requests, prefix_caching=False)
    checks = demo.compare(requests, on, off)
    assert [c.req_id for c in checks if not c.ok] == []
    (aborted,) = [c for c in checks if c.aborted]
    assert 0 < aborted.rows_on < aborted.prompt_len  # aborted after its first prefill chunk
    hits = [c for c in checks if c.cached_tokens > 0]
    assert len(hits) >= 4, "the workload must produce prefix hits"
    for check in hits:  # a hit still delivers every prompt row, from position 0
        assert check.rows_on >= check.prompt_len
    assert on.stats["hit_tokens"] == sum(c.cached_tokens for c in hits)
    assert off.stats == {}  # prefix caching off: the gate builds no cache


def test_demo_command_exits_zero_and_prints_the_table(capsys: pytest.CaptureFixture) -> None:
    from prefix_cache import demo

    assert demo.main() == 0
    out = capsys.readouterr().out
    assert "max |diff|" in out and "OK:" in out
