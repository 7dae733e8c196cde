"""What a user sees when the engine is refused at start: a script creating `LLM(...)` with a bad
stage configuration ends on one line naming the setting and the fix.

In-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) the refusal is the script's last line. Under
vLLM's default multiprocessing the engine core reports no cause to its caller (vLLM 0.32's
`wait_for_engine_startup` raises "Engine core initialization failed. See root cause above."
after the engine process exits), so the refusal is the last line before that traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from prefix_cache.tools.pipelines.engines import ENGINE_ENV  # noqa: E402
from tests.vllm_fixtures import thinker_model_dir  # noqa: E402,F401

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]

#: A user's script: argv is the model directory and the engine's additional_config (JSON).
SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM
    from prefix_cache.tools.pipelines.engines import EngineShape

    if __name__ == "__main__":
        LLM(model=sys.argv[1], **EngineShape().engine_args(), enable_prefix_caching=True,
            worker_cls="prefix_cache.vllm_runners.PrefixCacheCPUWorker",
            additional_config=json.loads(sys.argv[2]))
""")

NO_CHANNEL = ("OmniPrefixCacheUnmatchError: no stage channel is configured, so no consumer "
              "could read this stage's outputs: open one where they are consumed")
BAD_SHM = ("OmniPrefixCacheUnmatchError: additional_config['prefix_cache']['channel'] "
           "'shm://nonexistent-ns' cannot be opened: shm channel namespace "
           "/dev/shm/nonexistent-ns does not exist")


def run_script(tmp_path: Path, model_dir: Path, additional_config: dict, *,
               multiprocessing: bool) -> list[str]:
    """The script's stderr lines, vLLM's closing resource-tracker warnings left out."""
    script = tmp_path / "stage.py"
    script.write_text(SCRIPT)
    env = {**os.environ, **ENGINE_ENV,
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("PREFIX_CACHE_CHANNEL", None)
    process = subprocess.Popen([sys.executable, str(script), str(model_dir),
                                json.dumps(additional_config)], env=env, text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=300)
    finally:  # vLLM's engine processes too, should any outlive the script
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    assert process.returncode != 0
    lines = stderr.splitlines()
    while lines and ("resource_tracker" in lines[-1] or not lines[-1].strip()):
        lines.pop()  # multiprocessing's exit warnings about vLLM's semaphores
    return lines


@pytest.mark.parametrize("additional_config, cause", [
    ({}, NO_CHANNEL),
    ({"prefix_cache": {"channel": "shm://nonexistent-ns"}}, BAD_SHM),
], ids=["no-channel", "bad-shm-spec"])
def test_an_in_process_engine_ends_on_the_one_line_cause(
        tmp_path: Path, thinker_model_dir: Path, additional_config: dict,  # noqa: F811
        cause: str) -> None:
    lines = run_script(tmp_path, thinker_model_dir, additional_config, multiprocessing=False)
    assert cause in lines[-1], "\n".join(lines[-20:])
    assert sum("Traceback (most recent call last)" in line for line in lines) == 1


def test_a_multiprocess_engine_ends_on_vllms_summary_right_under_the_cause(
        tmp_path: Path, thinker_model_dir: Path) -> None:  # noqa: F811
    lines = run_script(tmp_path, thinker_model_dir, {}, multiprocessing=True)
    assert "Engine core initialization failed. See root cause above." in lines[-1]
    summary = max(i for i, line in enumerate(lines) if "Traceback (most recent" in line)
    assert "no stage channel is configured" in lines[summary - 1], "\n".join(lines[-40:])
