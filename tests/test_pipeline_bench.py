"""pipeline_bench's arguments: what cannot run here is refused in one line, exit 2, before any
engine starts; and the stage-1 models it offers."""

from __future__ import annotations

import pytest
import torch

from prefix_cache.tools import pipeline_bench


def _refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        pipeline_bench.main(argv)
    out, err = capsys.readouterr()
    assert done.value.code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("python -m prefix_cache.tools.pipeline_bench: error: ")
    return err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this process sees a GPU")
@pytest.mark.parametrize("argv", [["--model", "7b"], ["--cudagraphs"],
                                  ["--model", "7b", "--cudagraphs", "--only", "M5e"]])
def test_gpu_only_options_are_refused_without_a_gpu(argv, capsys) -> None:
    assert "NVIDIA GPU only" in _refusal(argv, capsys)


@pytest.mark.parametrize("argv, says", [
    (["--only", "M8", "--profile", "{tmp}/profile"], "--profile profiles M5e's step comparison"),
    (["--runs", "0"], "--runs 0: at least 1 run"),
    (["--quick", "--runs", "3"], "--quick is one run per figure: not with --runs"),
    (["--profile", "{tmp}/a-file/profile"], "cannot make that folder"),
    (["--json", "{tmp}/missing/x.json"], "cannot write there"),
])
def test_arguments_that_cannot_run_are_one_line(argv, says, tmp_path, capsys) -> None:
    (tmp_path / "a-file").write_text("")
    assert says in _refusal([a.format(tmp=tmp_path) for a in argv], capsys)
    assert not (tmp_path / "profile").exists() and not (tmp_path / "missing").exists()


@pytest.mark.parametrize("argv, runs", [([], 5), (["--runs", "3"], 3), (["--quick"], 1)])
def test_quick_is_one_run_per_figure(argv, runs, monkeypatch) -> None:
    asked: list[int] = []

    def measure_m8(*, runs: int, **_: object) -> dict[str, object]:
        asked.append(runs)
        raise RuntimeError("measured no further")  # reported in one line, exit status 1

    monkeypatch.setattr(pipeline_bench, "measure_m8", measure_m8)
    assert pipeline_bench.main([*argv, "--only", "M8"]) == 1
    assert asked == [runs]


def test_the_7b_model_is_7b_class_and_written_as_a_config_alone(tmp_path) -> None:
    pytest.importorskip("transformers")
    model = pipeline_bench.MODELS["7b"]["cuda"]
    assert model.dummy and model.engine_args == {"load_format": "dummy"}
    path = model.write(tmp_path / "m")
    assert [p.name for p in path.iterdir()] == ["config.json"]
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path)
    params = config.num_hidden_layers * (
        2 * config.hidden_size ** 2 * (1 + config.num_key_value_heads / config.num_attention_heads)
        + 3 * config.hidden_size * config.intermediate_size) \
        + 2 * config.vocab_size * config.hidden_size
    assert 5e9 < params < 8e9 and config.hidden_size == 4096 and config.num_hidden_layers == 32


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the tiny model is CPU only")
def test_m5e_on_the_tiny_model_measures_python_bound_steps_of_both_workers(tmp_path,
                                                                          capsys) -> None:
    """`--model tiny` is the CPU's stand-in for a GPU step under CUDA graphs: the real CPU
    engine, steps of a few ms bound by the engine's own Python, both workers measured; then
    profiled, each traced by torch's profiler, whose device side a CPU run leaves empty."""
    pytest.importorskip("vllm")
    import json
    out, profiles = tmp_path / "m5e.json", tmp_path / "profiles"
    assert pipeline_bench.main(["--only", "M5e", "--model", "tiny", "--runs", "1",
                                "--json", str(out), "--profile", str(profiles),
                                "--profile-seconds", "1"]) == 0
    assert "no device work in the traces" in capsys.readouterr().out
    assert {p.name for p in profiles.glob("*.torch-trace.json")} == {
        "plain.torch-trace.json", "cache.torch-trace.json"}
    data = json.loads(out.read_text())
    steps = data["step_time"]
    plain, cache = steps["step_s_plain"]["median"], steps["step_s_cache"]["median"]
    assert plain > 0 and cache > 0, (plain, cache)  # how long they are: the bench's to say
    assert data["metrics"]["M5e"]["value"] == pytest.approx(plain / cache, rel=0.05)
    assert steps["engine_thread_library_s_per_step"] > 0
    decode = steps["decode_step_s_mean"]  # the prompt steps left out
    assert decode["plain"] > 0 and decode["cache"] > 0
    assert "hidden 64 x 1 layers" in steps["workload"]
    assert data["device_work"] == {name: {"counts": {}, "busy_us": {}, "d2h_during_h2d_us": 0.0}
                                   for name in ("plain", "cache")}
