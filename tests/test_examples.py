"""The examples run as written: a script outside the package, started from another directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # this checkout's prefix_cache, whether or not the interpreter has the package installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, str(ROOT / "examples" / name)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


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
