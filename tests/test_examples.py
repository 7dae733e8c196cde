"""The examples run as written: a script outside the package, started from another directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, cwd: Path, timeout_s: float = 120
                ) -> subprocess.CompletedProcess[str]:
    # this checkout's prefix_cache, whether or not the interpreter has the package installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, str(ROOT / "examples" / name)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def test_drive_manager_example_delivers_full_prompt_rows_on_a_prefix_hit(tmp_path: Path) -> None:
    run = run_example("drive_manager.py", tmp_path)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("request a: 12 prompt tokens, 0 from the prefix cache, 12 computed")
    assert lines[1] == ("request b: 11 prompt tokens, 8 from the prefix cache, 3 computed, "
                        "11 rows delivered; equal to a run without the cache: True")
    assert lines[2] == "cache stats: 8 hit tokens, 15 computed"


def test_channel_example_hands_rows_from_a_producer_process_to_the_consumer(
        tmp_path: Path) -> None:
    run = run_example("channel_two_processes.py", tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "req-0: 5 rows of 4, as published: True; meta {'num_rows': 5}",
        "req-1: 9 rows of 4, as published: True; meta {'num_rows': 9}"]


@pytest.mark.slow
@pytest.mark.vllm
def test_thinker_talker_example_hits_the_shared_prefix_submitted_first(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    run = run_example("thinker_talker.py", tmp_path, timeout_s=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = {ln.split(":")[0]: ln for ln in run.stdout.splitlines()
             if ln.split(":")[0] in ("first", "second", "third")}
    assert lines["first"].startswith("first: 69 prompt tokens, 0 from the prefix cache, "
                                     "69 rows to the talker, talker tokens [")
    assert lines["second"].startswith("second: 67 prompt tokens, 64 from the prefix cache, "
                                      "67 rows to the talker")
    assert lines["third"].startswith("third: 68 prompt tokens, 64 from the prefix cache, "
                                     "68 rows to the talker")
    # its own lines alone on the terminal; vLLM's logs in the file the last line names
    assert len(run.stdout.splitlines()) == 4 and run.stderr == ""
    assert Path(run.stdout.splitlines()[-1].removeprefix("vLLM's logs: ")).stat().st_size > 0


@pytest.mark.slow
@pytest.mark.vllm
def test_serve_stage_example_serves_a_hit_and_its_rows_under_the_responses_keys(
        tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    run = run_example("serve_stage.py", tmp_path, timeout_s=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0] == "first: 72 prompt tokens, 0 from the prefix cache; 74 rows under " \
        "'cmpl-first-0'"
    assert lines[1] == "second: 71 prompt tokens, 64 from the prefix cache; 73 rows under " \
        "'cmpl-second-0'"
    assert lines[2].startswith("the server's log: ") and len(lines) == 3 and run.stderr == ""
