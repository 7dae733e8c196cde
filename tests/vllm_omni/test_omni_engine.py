"""vllm-omni's `Omni` runs a tiny random Qwen2.5-Omni thinker stage on the CPU twice, with its
own prefix cache and with this one (`OMNI_PREFIX_CACHE_IN_VLLM_OMNI=1`, nothing else changed):
the same tokens, the same stage outputs (each request's hidden rows from position 0, as the
stage hands them to a talker), the same hits. Needs the vllm-omni environment
(ci/setup-vllm-omni.sh)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm_omni", reason="vllm-omni is not installed (ci/setup-vllm-omni.sh "
                                        "builds its environment)")

from tests.vllm_omni import stage  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # two engine processes, ~30 s each

#: Round 1 computes three 96-token prompts (3 blocks each); round 2 sends each again with 8
#: new tokens: 96 of its 104 tokens hit.
SEEDS = [[stage.FIRST_WORD + 100 * i + j for j in range(96)] for i in range(3)]
HITS = [prompt + [stage.FIRST_WORD + 1000 + 10 * i + j for j in range(8)]
        for i, prompt in enumerate(SEEDS)]


def rows_per_request(run: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Each request's materialized hidden rows, joined in step order: its prompt's from
    position 0, then one a decode step."""
    rows: dict[str, list[torch.Tensor]] = {}
    for step in run["materialized"]:
        for key, value in step.items():
            rows.setdefault(key, []).append(value)
    return {key: torch.cat(parts) for key, parts in rows.items()}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stage.write_model(tmp_path_factory.mktemp("omni") / "model")


@pytest.fixture(scope="module")
def runs(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    base = tmp_path_factory.mktemp("runs")
    return {name: stage.run_stage(model, [SEEDS, HITS], base / name, this_cache=name == "this")
            for name in ("vllm-omni", "this")}


def test_the_stage_runs_each_cache_and_only_the_opted_in_run_has_this_one(
        runs: dict[str, dict[str, Any]]) -> None:
    assert runs["vllm-omni"]["cache"]["class"] == "OmniPrefixCacheManager"
    assert runs["this"]["cache"]["class"] == "VllmOmniPrefixCache"


def test_the_deploy_configs_stage_env_is_the_one_setting_too(
        runs: dict[str, dict[str, Any]], model: Path, tmp_path: Path) -> None:
    """`env: {OMNI_PREFIX_CACHE_IN_VLLM_OMNI: "1"}` on the stage in vllm-omni's deploy config,
    nothing in the process's environment: the stage builds this cache, the same tokens."""
    run = stage.run_stage(model, [SEEDS, HITS], tmp_path / "run", this_cache=True,
                          in_deploy_config=True)
    assert run["cache"]["class"] == "VllmOmniPrefixCache"
    assert [r["tokens"] for r in run["rounds"]] == [r["tokens"] for r in runs["this"]["rounds"]]
    assert run["cache"]["stats"]["hit_tokens"] == 3 * 96


def test_same_tokens_and_hits_with_either_cache(runs: dict[str, dict[str, Any]]) -> None:
    theirs, ours = runs["vllm-omni"]["rounds"], runs["this"]["rounds"]
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in theirs]
    assert [r["cached"] for r in ours] == [r["cached"] for r in theirs] == [[0, 0, 0],
                                                                          [96, 96, 96]]
    stats = runs["this"]["cache"]["stats"]
    assert stats["hit_tokens"] == 3 * 96 and stats["hit_requests"] == 3
    assert stats["steps_unconsumed"] == 0


def test_same_stage_outputs_with_either_cache(runs: dict[str, dict[str, Any]]) -> None:
    """Every request's rows from position 0 (a hit's 96 from the cache) and each decode
    step's row, equal within 1e-4 in float32."""
    theirs, ours = rows_per_request(runs["vllm-omni"]), rows_per_request(runs["this"])
    assert ours.keys() == theirs.keys() and len(ours) == len(SEEDS) + len(HITS)
    max_tokens = 4
    for prompt in [*SEEDS, *HITS]:
        key = stage.prompt_key(prompt)
        assert ours[key].shape == (len(prompt) + max_tokens - 1, 128)
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The thinker stage followed by a talker stage (vllm-omni's Qwen2.5-Omni pipeline up to
    its talker), the talker fed the thinker's hidden rows from position 0 as the thinker's
    prefix cache materializes them."""
    base = tmp_path_factory.mktemp("pipeline")
    model = stage.write_model(base / "model", talker=True)
    return {name: stage.run_stage(model, [SEEDS[:2], HITS[:2]], base / name,
                                  this_cache=name == "this", talker_tokens=6)
            for name in ("vllm-omni", "this")}


def test_a_thinker_talker_pipeline_gets_the_same_rows_with_either_cache(
        pipeline_runs: dict[str, dict[str, Any]]) -> None:
    """With a talker after it, the thinker stage hands the talker the same rows with this cache
    as with vllm-omni's (every request's from position 0, a hit's 96 from the cache), with the
    same hits and thinker tokens, and the talker answers every request. The talker's tokens are
    not compared: under `load_format: dummy` vllm-omni computes the talker's speaker and
    text-start embeddings from the thinker's embedding before any weight is set (its
    `load_weights` recomputes them, which a dummy load never calls), and its tokens varied
    between runs of vllm-omni's own cache here."""
    theirs, ours = pipeline_runs["vllm-omni"], pipeline_runs["this"]
    assert ours["cache"]["class"] == "VllmOmniPrefixCache"
    assert [r["cached"] for r in ours["rounds"]] == [r["cached"] for r in theirs["rounds"]] \
        == [[0, 0], [96, 96]]
    assert [r["tokens"] for r in ours["rounds"]] == [r["tokens"] for r in theirs["rounds"]]
    assert ours["cache"]["stats"]["hit_tokens"] == 2 * 96
    our_rows, their_rows = rows_per_request(ours), rows_per_request(theirs)
    assert our_rows.keys() == their_rows.keys() and len(our_rows) == 4
    for key, rows in their_rows.items():
        torch.testing.assert_close(our_rows[key], rows, rtol=0, atol=1e-4)
    for run in (ours, theirs):
        talker = [r["talker_tokens"] for r in run["rounds"]]
        assert [len(r) for r in talker] == [2, 2] and all(t for r in talker for t in r)
