"""Profiles of an engine's timed passes: py-spy's two samplers per thread, torch's device timeline.

`profile_engine` runs a workload's passes (a callable that runs one, given a per-step callback
or None) under both tools in turn, never at once (torch's profiler slows every op it records):

- py-spy (where installed): three nonblocking samplers of the process that steps the engine (and
  its children: vLLM's workers), started before the first pass and stopped after the last;
  passes repeat until the window lasts `seconds`. Their raw outputs, which `profile.summarize`
  reads, are kept (speedscope.app opens them as collapsed stacks), with each sampler's log;
- torch's profiler (CPU, and CUDA where present) over a few steps of one more pass, written as
  a Chrome trace: it must run in the process that runs the worker, so only for an in-process
  engine core.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from prefix_cache.tools.profiling.profile import ProfileSummary, summarize

#: Samples per second of each py-spy sampler.
SAMPLE_RATE = 100
#: Seconds a sampler may take to attach, and to write its output once stopped.
ATTACH_TIMEOUT_S = 60.0
#: torch's profiler: steps skipped before it records (one: its warm-up), then steps recorded.
TRACE_WARMUP_STEPS, TRACE_STEPS = 1, 6

#: py-spy's line when a sampler falls behind its rate.
_LAG = re.compile(r"([0-9.]+)s behind in sampling")
#: One pass of a workload, calling its argument (where given) after every engine step.
Pass = Callable[[Callable[[], None] | None], None]


def find_py_spy() -> str | None:
    """py-spy beside this Python (a virtual environment's) or on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


class PySpy:
    """py-spy's samplers of `pid` for as long as the `with` block, one per kind of
    `profile.summarize`: `<prefix>.all.txt` (every thread every tick), `<prefix>.active.txt`
    (running threads), `<prefix>.gil.txt` (the GIL's holder); all have attached when the block
    starts, and have written their output when it ends."""

    KINDS = {"all": ("--idle",), "active": (), "gil": ("--idle", "--gil")}

    def __init__(self, executable: str, pid: int, prefix: Path, *, children: bool) -> None:
        self.paths = {kind: prefix.with_name(f"{prefix.name}.{kind}.txt") for kind in self.KINDS}
        self._logs = {kind: prefix.with_name(f"{prefix.name}.{kind}.log") for kind in self.KINDS}
        self._command = [executable, "record", "--nonblocking", "--threads", "--format", "raw",
                         "--rate", str(SAMPLE_RATE), "--pid", str(pid),
                         *(["--subprocesses"] if children else [])]
        self._samplers: dict[str, subprocess.Popen[bytes]] = {}
        self.seconds = 0.0

    def __enter__(self) -> PySpy:
        for kind, flags in self.KINDS.items():
            with open(self._logs[kind], "wb") as log:
                self._samplers[kind] = subprocess.Popen(
                    [*self._command, *flags, "-o", str(self.paths[kind])], stdout=log,
                    stderr=subprocess.STDOUT)
        try:
            for kind in self.KINDS:
                self._wait_attached(kind)
        except BaseException:
            self._stop()
            raise
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start
        self._stop()
        for kind, sampler in self._samplers.items():
            if sampler.returncode != 0:
                raise RuntimeError(f"py-spy ({kind}) exited {sampler.returncode}: "
                                   f"{self._log_tail(kind)}")

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def _wait_attached(self, kind: str) -> None:
        deadline = time.monotonic() + ATTACH_TIMEOUT_S
        while "Sampling process" not in self._logs[kind].read_text(errors="replace"):
            if self._samplers[kind].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"py-spy ({kind}) did not attach: {self._log_tail(kind)}")
            time.sleep(0.05)

    def _stop(self) -> None:
        for sampler in self._samplers.values():  # SIGINT: py-spy stops and writes its output
            if sampler.poll() is None:
                sampler.send_signal(signal.SIGINT)
        for sampler in self._samplers.values():
            try:
                sampler.wait(ATTACH_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                sampler.kill()
                sampler.wait()

    def _log_tail(self, kind: str) -> str:
        lines = self._logs[kind].read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no output"

    def summary(self) -> ProfileSummary:
        return summarize(*(self.paths[kind].read_text() for kind in self.KINDS), self.seconds,
                         self.lag_s())

    def lag_s(self) -> float:
        """The largest lag behind its rate that any sampler reported (py-spy logs it)."""
        return max((float(seconds) for log in self._logs.values()
                    for seconds in _LAG.findall(log.read_text(errors="replace"))), default=0.0)


def torch_trace_path(prefix: Path) -> Path:
    """Where `profile_engine` writes an in-process engine's torch trace, beside its py-spy
    outputs."""
    return prefix.with_name(f"{prefix.name}.torch-trace.json")


@contextmanager
def torch_trace(path: Path) -> Iterator[Callable[[], None]]:
    """torch's profiler (CPU, and CUDA where present) over `TRACE_STEPS` steps after
    `TRACE_WARMUP_STEPS`; yields the callback to call after every step; writes a Chrome trace
    to `path` (also when the pass ends before its last recorded step)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=0, warmup=TRACE_WARMUP_STEPS, active=TRACE_STEPS,
                                       repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule,
                                on_trace_ready=lambda p: p.export_chrome_trace(str(path))
                                ) as profiler:
        yield profiler.step


def profile_engine(run_pass: Pass, *, pid: int, prefix: Path, seconds: float,
                   in_process: bool) -> ProfileSummary | None:
    """Profile one engine's passes (see the module); the py-spy summary, or None without
    py-spy. `pid` is the process that steps the engine; `in_process`: it is this one."""
    executable = find_py_spy()
    summary = None
    if executable is not None:
        with PySpy(executable, pid, prefix, children=not in_process) as spy:
            while True:
                run_pass(None)
                if spy.elapsed >= seconds:
                    break
        summary = spy.summary()
    if in_process:
        with torch_trace(torch_trace_path(prefix)) as step:
            run_pass(step)
    return summary
