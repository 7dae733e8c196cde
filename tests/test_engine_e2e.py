"""The two-stage pipeline end to end on vLLM's real CPU engines: a thinker with the cache, the
stage channel, a talker fed the rows as prompt_embeds; under both multiprocessing settings and
with both channel backends, checked against a run with the thinker's prefix caching off."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest

from prefix_cache.tools import demo
from prefix_cache.channel import open_channel
from tests.vllm_fixtures import (cpu_async_scheduling, engine_runner,  # noqa: F401
                                 talker_model_dir, thinker_model_dir)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def talker(talker_model_dir: Path) -> Iterator[Any]:
    """Stage 2, shared by every run; in a process of its own, since in-process thinkers tear
    down this process's torch.distributed state when they close."""
    from prefix_cache.tools.pipelines.engines import multiprocessing_mode, start_talker
    with multiprocessing_mode(True):
        engine = start_talker(talker_model_dir)
    yield engine
    engine.close()


def run_once(thinker_model_dir: Path, talker: Any, spec: str, *, prefix_caching: bool,
             multiprocessing: bool, asynchronous: bool = False
             ) -> tuple[Any, dict[str, int | float]]:
    from prefix_cache.tools.pipelines.engines import multiprocessing_mode, start_thinker
    from prefix_cache.tools.pipelines.pipeline import run_pipeline
    with multiprocessing_mode(multiprocessing), open_channel(spec) as channel:
        # in-process only: the patch does not reach an engine core process
        with cpu_async_scheduling() if asynchronous else nullcontext():
            thinker = start_thinker(thinker_model_dir, channel, prefix_caching=prefix_caching)
        try:
            if asynchronous:
                assert engine_runner(thinker).vllm_config.scheduler_config.async_scheduling
            run = run_pipeline(thinker, channel, demo.make_workload(seed=1), talker=talker,
                               talker_tokens=demo.TALKER_TOKENS)
            stats = thinker.stats()
        finally:
            thinker.close()
            talker.engine.reset_prefix_cache()
    return run, stats


@pytest.fixture(scope="module")
def cache_off_run(thinker_model_dir: Path, talker: Any) -> Any:
    run, stats = run_once(thinker_model_dir, talker, "shm", prefix_caching=False,
                          multiprocessing=False)
    assert "hit_tokens" not in stats  # prefix caching off: the gate builds no cache
    assert stats["delivery_published"] == len(run.results)  # rows are still delivered
    return run


@pytest.mark.parametrize("multiprocessing, backend, asynchronous", [
    pytest.param(False, "shm", False, id="in-process-shm"),
    # a request whose last token is surely sampled is dropped from the runner's batch a step
    # before its finish; its rows are read back from the runner's state of it
    pytest.param(False, "shm", True, id="in-process-shm-async-scheduling"),
    pytest.param(False, "mooncake", False, id="in-process-mooncake"),
    pytest.param(True, "mooncake", False, id="multiprocess-mooncake"),
    # multiprocess with shared memory: the demo command below
])
def test_stage_two_tokens_match_with_stage_one_prefix_caching_on_and_off(
        thinker_model_dir: Path, talker: Any, cache_off_run: Any, backend: str,
        multiprocessing: bool, asynchronous: bool, request: pytest.FixtureRequest) -> None:
    spec = "shm" if backend == "shm" else request.getfixturevalue("mooncake_store").spec
    run, stats = run_once(thinker_model_dir, talker, spec, prefix_caching=True,
                          multiprocessing=multiprocessing, asynchronous=asynchronous)
    checks = demo.compare(run, cache_off_run, demo.TOLERANCE["cpu"])
    assert [c for c in checks if not c.ok] == []
    (aborted,) = [c for c in checks if c.aborted]
    assert run.results[aborted.req_id].aborted  # published marked aborted, never sent on
    assert run.results[aborted.req_id].tokens == []
    hits = [c for c in checks if c.cached_tokens > 0]
    assert len(hits) >= 6
    assert stats["hit_tokens"] == sum(c.cached_tokens for c in hits)
    for check in checks:  # every finished request reached stage 2 with all of its rows
        if not check.aborted:
            assert check.rows_on >= check.prompt_len
            assert len(run.results[check.req_id].tokens) == demo.TALKER_TOKENS
    assert stats["delivery_requests_held"] == 0 and stats["delivery_bytes_held"] == 0


def test_demo_command_runs_both_stages_multiprocess_and_prints_only_the_report() -> None:
    # even where the environment asks for in-process engines, which cannot share the demo's
    # process: stopping one tears down vLLM's parallel state under the other
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-m", "prefix_cache", "demo"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
    out = proc.stdout
    assert "max|diff|" in out and "margin" in out and "aborted mid-prefill" in out
    assert "end to end, engines up: prefix caching on" in out
    assert out.rstrip().splitlines()[-2].startswith("OK:")  # the verdict ends the report
    for noise in ("Traceback", "WARNING", "INFO", "Warning"):
        assert noise not in out
    log = Path(next(line.split(": ", 1)[1] for line in out.splitlines()
                    if line.startswith("vLLM's logs")))
    assert "EngineCore" in log.read_text()  # the engines ran in processes of their own


def test_demo_without_vllm_names_what_to_install() -> None:
    code = ("import sys; sys.modules['vllm'] = None\n"
            "from prefix_cache.tools import demo; sys.exit(demo.main())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "the demo needs vllm" in proc.stderr and "ci/setup-cpu.sh" in proc.stderr
    assert "Traceback" not in proc.stderr
