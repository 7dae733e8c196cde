"""The command line: help that explains the metrics, one-line errors with exit code 2 before any
benchmark work, and a report that fits in 100 columns."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from prefix_cache import devices
from prefix_cache.tools import bench
from prefix_cache.tools.reporting import bench_report, harness
from prefix_cache.__main__ import main
from prefix_cache.tools.reporting.targets import METRICS, Target

ROOT = Path(__file__).resolve().parents[1]


def _exit(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    captured = capsys.readouterr()
    return stop.value.code, captured.out, captured.err


@pytest.fixture
def no_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any measurement started fails the test: errors must come before the benchmark."""
    def run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the benchmark started")
    monkeypatch.setattr(bench, "run", run)


def test_bench_help_explains_each_metric_and_the_device_default(capsys) -> None:
    code, out, _ = _exit(["bench", "--help"], capsys)
    assert code == 0
    for name, spec in METRICS.items():
        (line,) = [ln for ln in out.splitlines() if ln.split()[:1] == [name]]
        assert spec.target.text in line and spec.summary in line
    assert "default: the first present of npu, cuda, cpu" in " ".join(out.split())
    assert max(map(len, out.splitlines())) <= 100


def test_device_not_present_is_one_line_exit_2(capsys, no_benchmark) -> None:
    absent = [n for n in devices.backend_classes() if n not in devices.available()]
    if not absent:
        pytest.skip("every known device type is present in this process")
    code, out, err = _exit(["bench", "--device", absent[0], "--quick"], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and f"device {absent[0]!r} is not present" in err


def test_unknown_device_is_one_line_exit_2(capsys, no_benchmark) -> None:
    code, _, err = _exit(["bench", "--device", "tpu"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "unknown device 'tpu'; known: cpu, cuda, npu" in err


@pytest.mark.parametrize("where", ["missing/dir/out.json", "."])
def test_unwritable_json_path_is_one_line_exit_2(where, tmp_path, capsys, no_benchmark) -> None:
    path = tmp_path / where
    code, out, err = _exit(["bench", "--device", "cpu", "--json", str(path)], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and f"--json {path}: cannot write there" in err
    assert not (tmp_path / "missing").exists()


def test_writable_json_path_passes_the_check_and_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    assert harness.unwritable(str(path)) is None
    assert not path.exists()


def test_usage_errors_are_one_line_exit_2(capsys) -> None:
    for argv in (["bench", "--bogus"], ["frobnicate"]):
        code, _, err = _exit(argv, capsys)
        assert code == 2 and err.count("\n") == 1 and "error:" in err, argv


def test_the_module_entry_point_reports_an_absent_device_in_one_line() -> None:
    absent = [n for n in ("cuda", "npu") if n not in devices.available()]
    if not absent:
        pytest.skip("cuda and npu are both present in this process")
    run = subprocess.run([sys.executable, "-m", "prefix_cache", "bench", "--device", absent[0]],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [
        f"python -m prefix_cache bench: error: device {absent[0]!r} is not present in this "
        f"process; available here: {', '.join(devices.available())}"]


def test_table_wraps_its_last_column_to_fit_the_width() -> None:
    words = ("contiguous pinned D2H 53.4 GB/s; 2048 tok x 2048, 4 in flight: scatter 34.4 GB/s, "
             "staged design 13.1 GB/s (0.25)")
    table = harness.format_table(["metric", "value", "detail"], [["M1", "0.642", words]], width=60)
    lines = table.splitlines()
    assert max(map(len, lines)) <= 60 and len(lines) > 3
    assert " ".join(" ".join(ln[15:].split()) for ln in lines[2:]) == words


def test_targets_judge_values_and_say_where_they_apply() -> None:
    assert Target(">=", 0.85).met_by(0.85) and not Target(">=", 0.85).met_by(0.84)
    assert Target("<=", 100, "µs", gpu_only=True).text == "<= 100 µs (GPU)"
    assert Target("==", 0).met_by(0.0) and not Target("==", 0).met_by(1.0)
    gpu = Target("<=", 1.03, gpu_only=True)
    assert gpu.applies_to("cuda") and not gpu.applies_to("cpu") and not gpu.applies_to("npu")
    with pytest.raises(ValueError, match="Target.op"):
        Target(">", 1.0)


def test_report_fits_100_columns_and_says_pass_miss_gpu_only_or_not_run() -> None:
    def metric(value: float, passed: bool | None) -> dict[str, object]:
        return {"value": value, "target": "", "pass": passed, "note": "new_step_starts + "
                "save_outputs, 64 requests of one token each, median of 30 steps after warm-up",
                "reference": "contiguous pinned D2H of the same bytes in the same process"}

    machine = "a-rather-long-host-name.example x86_64 16 cpus, torch 2.13.0, NVIDIA H200 " * 2
    cases = {"cuda": ({"M1": metric(0.64, False), "M2": metric(90.0, True)}, "MISS", "pass"),
             "cpu": ({"M1": metric(0.9, None), "M2": metric(900.0, None)}, "GPU only",
                     "GPU only")}
    for device, (measured, m1_result, m2_result) in cases.items():
        measured["M3"] = metric(0.5, False)
        text = bench_report.report({"device": device, "machine": machine, "metrics": measured})
        lines = text.splitlines()
        assert max(map(len, lines)) <= 100
        rows = {ln.split()[0]: ln for ln in lines if ln.startswith("M")}
        assert m1_result in rows["M1"]
        assert m2_result in rows["M2"] and f"{measured['M2']['value']:.0f} µs" in rows["M2"]
        assert "MISS" in rows["M3"]  # a target for every device is judged on CPU too
        assert "not run" in rows["M2p"] and "not run" in rows["M4"]


def test_cpu_report_says_which_rows_are_expected_there() -> None:
    measured = {"M1": {"value": 0.8, "pass": None, "note": "", "reference": "memcpy"},
                "M5": {"value": 0.82, "pass": False, "note": "", "reference": "cache off"}}
    text = bench_report.report({"device": "cpu", "machine": "host", "metrics": measured})
    rows = {ln.split()[0]: ln for ln in text.splitlines() if ln.startswith("M")}
    assert "GPU only" in rows["M1"] and "MISS, expected" in rows["M5"]
    notes = " ".join(text.split("\n\n")[-2:]).replace("\n", " ")
    assert "GPU only: these targets hold on an NVIDIA GPU" in notes
    assert "Expected on CPU: M5's MISS; " + METRICS["M5"].cpu_miss in notes


def test_a_cpu_miss_below_its_floor_is_a_plain_miss() -> None:
    """A value far under what the design allows is a regression: no "expected" beside it."""
    low = METRICS["M5"].cpu_floor - 0.1
    measured = {"M5": {"value": low, "pass": False, "note": "", "reference": "cache off"}}
    text = bench_report.report({"device": "cpu", "machine": "host", "metrics": measured})
    row = next(ln for ln in text.splitlines() if ln.startswith("M5"))
    assert "MISS" in row and "expected" not in row and "Expected on CPU" not in text


def test_runs_judge_an_exact_target_on_every_run_and_the_others_on_their_median(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """M4 (== 0) with stalls in one of three runs misses; M3 is judged on its median. Each
    shows the reference and note of the run it stands by, whichever run came last."""
    values = iter([(0.0, 0.8), (3.0, 0.5), (0.0, 0.9)])
    run_numbers = itertools.count()

    def run(device: str | None, quick: bool) -> dict:
        m4, m3 = next(values)
        n = next(run_numbers)
        return {"device": "cpu", "metrics": {
            "M4": {"value": m4, "pass": m4 == 0, "note": f"n{n}", "reference": f"r{n}"},
            "M3": {"value": m3, "pass": m3 >= 0.7, "note": f"n{n}", "reference": f"r{n}"}}}

    monkeypatch.setattr(bench, "run", run)
    metrics = bench.run_many("cpu", True, 3)["metrics"]
    assert metrics["M4"]["value"] == 3.0 and metrics["M4"]["pass"] is False
    assert metrics["M4"]["note"].startswith("largest of 3 runs")
    assert metrics["M4"]["note"].endswith("n1") and metrics["M4"]["reference"] == "r1"
    assert metrics["M3"]["value"] == 0.8 and metrics["M3"]["pass"] is True
    assert metrics["M3"]["note"].endswith("n0") and metrics["M3"]["reference"] == "r0"
    assert metrics["M3"]["runs"] == [0.8, 0.5, 0.9]


def test_bench_help_lines_up_each_metric_and_its_target(capsys) -> None:
    _, out, _ = _exit(["bench", "--help"], capsys)
    starts = {ln.index(spec.summary) for name, spec in METRICS.items()
              for ln in out.splitlines() if ln.split()[:1] == [name]}
    assert len(starts) == 1, out


def test_each_demo_run_logs_to_a_file_of_its_own() -> None:
    from prefix_cache.tools.pipelines.engine_logs import new_log_path
    first, second = new_log_path("demo"), new_log_path("demo")
    try:
        assert first != second and first.exists() and second.exists()
        assert first.name.startswith("omni-prefix-cache-demo-")
    finally:
        first.unlink()
        second.unlink()


def test_demo_for_a_device_vllm_does_not_run_on_is_one_line_exit_2() -> None:
    pytest.importorskip("vllm")
    done = subprocess.run([sys.executable, "-m", "prefix_cache", "demo", "--device", "npu"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    [line] = done.stdout.strip().splitlines()
    assert line.startswith("the demo was asked for --device npu, but the installed vLLM runs on ")
    assert line.endswith(": install vLLM's npu build")


def test_pipeline_bench_help_says_what_it_measures_and_how_long_it_takes(capsys) -> None:
    from prefix_cache.tools import pipeline_bench
    with pytest.raises(SystemExit) as done:
        pipeline_bench.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "M8" in text and "plain worker" in text and "minutes" in text


def test_cpu_m5_is_judged_against_the_cpu_target() -> None:
    m5 = METRICS["M5"]
    assert m5.target_on("cuda").bound == 0.99 and m5.target_on("cpu").bound == 0.95
    assert bench_report.judge(m5, 0.96, "cpu") and not bench_report.judge(m5, 0.96, "cuda")
    assert "CPU >= 0.95" in m5.summary


def test_no_subcommand_lists_what_there_is_to_run_then_says_what_is_wrong(capsys) -> None:
    code, _, listed = _exit([], capsys)
    assert code == 2
    for command in ("demo", "bench", "soak", "channel"):
        assert f"    {command} " in listed
    assert listed.splitlines()[-1] == ("python -m prefix_cache: error: name a command: demo, "
                                       "bench, soak, channel (see --help)")


@pytest.mark.parametrize("argv, error", [
    (["channel"], "python -m prefix_cache channel: error: the following arguments are "
                  "required: COMMAND (see --help)"),
    (["channel", "gc", "--dir", "/nonexistent"],
     "python -m prefix_cache channel gc: error: --dir /nonexistent is not a directory"),
])
def test_channel_usage_errors_name_what_is_missing_in_one_line(argv, error, capsys) -> None:
    code, out, err = _exit(argv, capsys)
    assert (code, out, err.splitlines()) == (2, "", [error])


def test_every_command_says_what_it_does_in_its_help(capsys) -> None:
    for command in ("demo", "bench", "soak", "channel"):
        code, out, _ = _exit([command, "--help"], capsys)
        what = out.split("\n\n")[1]  # after the usage
        assert code == 0 and not what.startswith(("positional", "options")), (command, out)
