"""`benchmarks/peer_vllm_omni.py` (M11) runs a tiny version of its comparison beside the peer's
own prefix cache, from vllm-omni 0.30.0's wheel: fetched once with `pip download --no-deps`
(about a second) into the bench's cache folder, and skipped with the reason where that fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import peer_vllm_omni

pytestmark = pytest.mark.slow  # the peer imported from its wheel, both caches run

TINY = ["--runs", "1", "--width", "64", "--decode-steps", "3", "--prefill-steps", "2",
        "--hit-steps", "2", "--forward-ms", "1"]


@pytest.fixture(scope="module")
def wheel() -> Path:
    try:
        return peer_vllm_omni.peer_wheel(download_timeout_s=60)
    except RuntimeError as exc:
        pytest.skip(f"vllm-omni {peer_vllm_omni.PEER_VERSION}'s wheel is not here and could "
                    f"not be fetched: {exc}")


def test_both_caches_give_every_row_of_a_run_without_prefix_caching(
        wheel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every step runs through both managers, each step's rows read back bit for bit, and the
    table gives each metric's figures and ratio beside its target."""
    out = tmp_path / "m11.json"
    assert peer_vllm_omni.main([*TINY, "--peer-wheel", str(wheel), "--json", str(out)]) == 0

    result = json.loads(out.read_text())
    rows = result["rows"]
    assert rows["this"]["checked"] == rows["peer"]["checked"] > 0
    assert rows["this"]["mismatched_requests"] == rows["peer"]["mismatched_requests"] == []
    for metric, figures in result["metrics"].items():
        assert figures["us"]["this"]["median"] > 0 and figures["us"]["peer"]["median"] > 0
        assert figures["ratio"] == pytest.approx(
            figures["us"]["this"]["median"] / figures["us"]["peer"]["median"])
    assert result["host_bytes"]["peer"]["pool"]["median"] > 0
    table = capsys.readouterr().out
    assert "vllm-omni 0.30.0 (eager)" in table
    for name in peer_vllm_omni.METRIC_NAMES.values():
        assert name in table
    assert "all equal" in table.split("rows vs no prefix caching")[1]


def test_a_row_the_peer_returns_wrong_is_named(
        wheel: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    """The check is bit for bit: one element off in one request's rows fails the run and the
    table names that request."""
    peer = peer_vllm_omni.import_peer(wheel)
    materialize = peer.OmniPrefixCacheManager.materialize

    def off_by_one_ulp(self, step_id: int, req_ids: list[str]):
        outputs = materialize(self, step_id, req_ids)
        if "prefill-1" in outputs.hidden_states:
            rows = outputs.hidden_states["prefill-1"].clone()  # its own are inference tensors
            rows[-1, -1] = torch.nextafter(rows[-1, -1], torch.tensor(2.0))
            outputs.hidden_states["prefill-1"] = rows
        return outputs

    monkeypatch.setattr(peer.OmniPrefixCacheManager, "materialize", off_by_one_ulp)
    assert peer_vllm_omni.main([*TINY, "--peer-wheel", str(wheel)]) == 1
    table = capsys.readouterr().out
    assert "1 requests differ, first prefill-1" in table.split("rows vs no prefix caching")[1]
