"""`python -m prefix_cache demo --stream` end to end in a short form, on vLLM's CPU engine
(an engine-core process per engine, as the demo runs them): three stages, streaming on and off by prefix caching on and off, every
configuration's thinker rows, talker tokens, talker rows and frames bitwise the plain run's."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from prefix_cache.tools import stream_demo  # noqa: E402

pytestmark = [pytest.mark.vllm]


def test_the_three_stage_streaming_demo_passes_with_outputs_identical_to_the_plain_run(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    results: list[dict] = []
    real_check = stream_demo.check

    def recording_check(result, plain):  # the figures behind the printed table
        checked = real_check(result, plain)
        results.append(vars(checked) | {"hit": result.thinker.cached_tokens > 0})
        return checked

    monkeypatch.setattr(stream_demo, "check", recording_check)
    lines: list[str] = []
    code = stream_demo.run_stream_demo(
        lambda _: None, lines.append, tmp_path / "log", "cpu",
        stream_demo.StreamWorkload(num_requests=3, thinker_tokens=32, talker_tokens=4))
    text = "\n".join(lines)
    assert code == 0, text
    assert "OK: streaming brings the talker's first token" in text
    for config in stream_demo.CONFIGS:
        assert stream_demo.config_name(*config) in text
    assert len(results) == 4 * 3 and any(r["hit"] for r in results)
    for r in results:  # bitwise on CPU
        assert r["tokens_match"] and r["shapes_match"], r
        assert r["thinker_rows_diff"] == r["talker_rows_diff"] == r["frames_diff"] == 0.0, r
