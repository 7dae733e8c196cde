"""M9c's consumer (`stream_bench.Drainer`): a process of its own that drains requests' rows,
streamed or whole, as a next stage does, and reports what failed there to the bench; and one
run of the bench on this machine's real engine."""

from __future__ import annotations

import json

import pytest
import torch

from prefix_cache import HIDDEN_KEY
from prefix_cache.channel import open_channel
from prefix_cache.tools import stream_bench
from prefix_cache.tools.stream_bench import Drainer


def test_the_drainer_process_takes_every_chunk_and_whole_entry_and_names_a_failure() -> None:
    with open_channel("shm") as channel:
        drainer = Drainer(channel)
        try:
            for start in (0, 3):
                channel.put("streamed", {HIDDEN_KEY: torch.ones(3, 4)}, start=start,
                            final=start == 3)
            channel.put("whole", {HIDDEN_KEY: torch.ones(5, 4)})
            drainer.start(["streamed"], True)
            drainer.wait(60)
            drainer.start(["whole"], False)
            drainer.wait(60)
            assert channel.used_bytes() == 0  # every entry taken, none left behind
            channel.fail("failed", "the stage broke")
            drainer.start(["failed"], False)
            with pytest.raises(RuntimeError, match="drainer process failed: .*the stage broke"):
                drainer.wait(60)
        finally:
            drainer.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_one_run_measures_m9_and_the_engine_threads_time_in_the_cache(tmp_path) -> None:
    """Every figure from a run on the real engine: M9, M9h, M9c, and the engine thread's
    seconds a step in the cache's calls, streaming and not (each stage makes some)."""
    pytest.importorskip("vllm")
    out = tmp_path / "m9.json"
    assert stream_bench.main(["--runs", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["metrics"]) == {"M9", "M9h", "M9c"}
    for streaming in ("on", "off"):
        assert 0 < data["m9"]["step_s"][streaming]["median"] < 1
        assert 0 < data["m9"]["cache_engine_thread_s_per_step"][streaming]["median"] \
            < data["m9"]["step_s"][streaming]["median"]


@pytest.mark.vllm
@pytest.mark.slow
def test_only_m9c_measures_the_step_rate_without_a_talker(tmp_path, capsys) -> None:
    """`--only M9c`: the two thinkers' step rates and the engine thread's time in the cache,
    and no pipeline figure; the table says why M9 and M9h have no value."""
    pytest.importorskip("vllm")
    out = tmp_path / "m9c.json"
    assert stream_bench.main(["--runs", "1", "--only", "M9c", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["metrics"]) == {"M9c"}
    assert "talker_first_token_s" not in data["m9"]
    assert "random Qwen2 (hidden 256, 2 layers) thinker, eager" in data["m9"]["workload"]
    assert data["m9"]["step_s"]["on"]["median"] > 0 < data["m9"]["step_s"]["off"]["median"]
    assert "not measured (--only M9c)" in capsys.readouterr().out


def test_a_run_on_pipeline_bench_s_small_model_names_its_stages(tmp_path) -> None:
    """`--model small`: the M8 model's thinker (hidden 1024 on the CPU) and a talker of its
    width, eager; every figure measured."""
    pytest.importorskip("vllm")
    out = tmp_path / "m9.json"
    assert stream_bench.main(["--runs", "1", "--model", "small", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert "thinker hidden 1024 x 8 layers" in data["m9"]["workload"]
    assert data["m9"]["step_s"]["on"]["median"] > 0 < data["m9"]["step_s"]["off"]["median"]
