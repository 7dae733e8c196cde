"""Where a vLLM engine's threads spent a profiled window, from py-spy's collapsed stacks.

Three samplers run over the same window at the same rate (`profile_capture.PySpy`):

- `all` (`py-spy record --threads --idle`): every thread at every tick, whatever it is doing,
  so a thread alive for the whole window has one sample a tick; the window's ticks are the
  largest sample count of any thread;
- `active` (without `--idle`): the threads py-spy finds running at each tick (on a CPU by the
  OS's account, and not in a Python function it knows to wait);
- `gil` (`--idle --gil`): at each tick, only the thread that holds the GIL.

Shares are of the window's ticks. The engine thread is the one with the most samples inside
a step (a frame named `execute_model` or `sample_tokens`, the model runner's and the cache's
runner mixin's). A sample is charged to the cache when the innermost frame that belongs to
the cache or to vLLM is the cache's (`prefix_cache/`, its tools excepted: they drive the
engine): the cache's calls into vLLM count as vLLM's, vLLM's calls into the cache as the
cache's. The cache's scheduler mixin is `prefix_cache/integration/workers/finishes.py`.

The GIL wait is bounded, not sampled: a thread waits for the GIL only while another thread
of its process holds it (each process has its own GIL: a multiprocess engine's engine-core
process and its workers', sampled together, do not wait for each other's), so the share of
ticks at which a thread of the engine thread's process other than itself holds the GIL bounds
the engine thread's wait from above (it waits less where it was in GIL-free native
code, a kernel launch or a torch op, meanwhile). py-spy cannot tell a thread waiting for the
GIL from one in GIL-free native code, nor does its `--idle` mark which samples were idle.

Input: lines of `[process PID:"CMD";...]thread (TID)[: NAME];FN (FILE:LINE);... COUNT`, root first.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

#: Functions that make a frame part of an engine step (the runner's, the worker's, the mixin's).
STEP_FUNCTIONS = ("execute_model", "sample_tokens")
#: The cache's scheduler mixin (`FinishReporting`).
SCHEDULER_MIXIN_FILE = "prefix_cache/integration/workers/finishes.py"
#: The cache's own threads, by the name each is started with.
CACHE_THREADS = {"output": "omni-stage-outputs", "prefetch": "omni-prefix-cache-prefetch",
                 "committer": "omni-prefix-cache-committer"}

_COMMAND = r':"(?:(?!";).)*";'  # a process frame's command line runs up to '";'
_LINE = re.compile(rf'^(?:process \d+{_COMMAND})*?(?:process (?P<pid>\d+){_COMMAND})?'
                   r'thread \((?P<tid>[^)]*)\)(?:: (?P<name>[^;]*))?(?P<frames>(?:;.*)?) '
                   r'(?P<count>\d+)$')
_FRAME = re.compile(r"^(?P<function>.*?)(?: \((?P<file>[^()]*?)(?::\d+)?\))?$")


@dataclass(frozen=True)
class Frame:
    function: str
    file: str

    @property
    def owner(self) -> str | None:
        """'cache' or 'vllm' for a frame of either package (the cache's tools: neither)."""
        path = "/" + self.file
        if "/prefix_cache/tools/" in path:
            return None
        if "/prefix_cache/" in path:
            return "cache"
        return "vllm" if "/vllm/" in path else None

    @property
    def in_step(self) -> bool:
        return self.function.rsplit(".", 1)[-1] in STEP_FUNCTIONS


@dataclass(frozen=True)
class Stack:
    """`count` samples of one thread (`pid/tid`, or `tid` for a single process) at `frames`,
    root first."""

    thread: str
    thread_name: str
    frames: tuple[Frame, ...]
    count: int

    @property
    def owner(self) -> str | None:
        """Who the sample is charged to: the innermost frame's of the cache or vLLM."""
        return next((f.owner for f in reversed(self.frames) if f.owner), None)

    @property
    def in_step(self) -> bool:
        return any(f.in_step for f in self.frames)

    @property
    def in_scheduler_mixin(self) -> bool:
        return self.owner == "cache" and any(
            ("/" + f.file).endswith("/" + SCHEDULER_MIXIN_FILE) for f in self.frames)


def parse_frame(text: str) -> Frame:
    match = _FRAME.match(text)
    assert match is not None  # the pattern matches any string
    return Frame(match["function"], match["file"] or "")


def parse_collapsed(text: str) -> list[Stack]:
    """py-spy's raw output (`--threads`, one or more processes) as stacks; a line without a
    thread frame is refused (the profile was recorded without `--threads`)."""
    stacks = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"line {number} is not py-spy's raw output with --threads: "
                             f"{line[:80]!r}")
        thread = f"{match['pid']}/{match['tid']}" if match["pid"] else match["tid"]
        frames = tuple(parse_frame(f) for f in match["frames"].split(";")[1:])
        stacks.append(Stack(thread, match["name"] or "", frames, int(match["count"])))
    return stacks


def _process(thread: str | None) -> str:
    """The process of a `Stack.thread` ("" in a single process's profile)."""
    return (thread or "").rpartition("/")[0]


def _by_thread(stacks: Iterable[Stack]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for stack in stacks:
        counts[stack.thread] += stack.count
    return counts


@dataclass(frozen=True)
class ThreadShare:
    """One of the cache's threads: the share of ticks it was running and the share it held the
    GIL."""

    active: float
    gil: float


@dataclass(frozen=True)
class ProfileSummary:
    """One engine's profiled window; every share is of `ticks`."""

    ticks: int
    seconds: float
    lag_s: float          # the samplers' largest lag behind their rate (py-spy's own count)
    engine_thread: str | None
    in_step: float        # the engine thread inside a step
    hooks: float          # charged to the cache inside a step, any thread
    scheduler_mixin: float
    engine_gil: float | None  # None where the GIL sampler saw no holder at all
    others_gil: float | None  # bounds the engine thread's wait for the GIL
    cache_threads: dict[str, ThreadShare]


def summarize(all_text: str, active_text: str, gil_text: str, seconds: float,
              lag_s: float = 0.0) -> ProfileSummary:
    """The shares of one window from its three samplers' raw outputs (see the module); the
    active and GIL shares are exact only while no sampler lags (`lag_s`, py-spy's count)."""
    stacks, holders = parse_collapsed(all_text), parse_collapsed(gil_text)
    active = _by_thread(parse_collapsed(active_text))
    ticks = max(_by_thread(stacks).values(), default=0)
    if ticks == 0:
        raise ValueError("the all-threads profile holds no samples")
    stepping = _by_thread(s for s in stacks if s.in_step)
    engine = stepping.most_common(1)[0][0] if stepping else None
    held = _by_thread(holders)

    def share(stacks_: Iterable[Stack]) -> float:
        return sum(s.count for s in stacks_) / ticks

    gil_seen = bool(held)
    names = {s.thread: s.thread_name for s in stacks}
    cache_threads = {}
    for role, name in CACHE_THREADS.items():
        threads = {t for t, n in names.items() if n == name}
        if threads:
            cache_threads[role] = ThreadShare(sum(active[t] for t in threads) / ticks,
                                              sum(held[t] for t in threads) / ticks)
    return ProfileSummary(
        ticks=ticks, seconds=seconds, lag_s=lag_s, engine_thread=engine,
        in_step=stepping[engine] / ticks if engine else 0.0,
        hooks=share(s for s in stacks if s.in_step and s.owner == "cache"),
        scheduler_mixin=share(s for s in stacks if s.in_scheduler_mixin),
        engine_gil=held[engine] / ticks if gil_seen and engine else None,
        others_gil=sum(n for t, n in held.items() if t != engine
                       and _process(t) == _process(engine)) / ticks if gil_seen else None,
        cache_threads=cache_threads)


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def format_table(summaries: dict[str, ProfileSummary]) -> str:
    """A table of shares, one column per engine."""
    rows: list[tuple[str, list[str]]] = [
        ("window: ticks / seconds", [f"{s.ticks} / {s.seconds:.1f} s"
                                     for s in summaries.values()]),
        ("samplers' largest lag (0: shares exact)", [f"{s.lag_s:.1f} s"
                                                     for s in summaries.values()]),
        ("engine thread inside a step", [_percent(s.in_step) for s in summaries.values()]),
        ("  in the cache's hooks", [_percent(s.hooks) for s in summaries.values()]),
        ("in the scheduler mixin (finishes)",
         [_percent(s.scheduler_mixin) for s in summaries.values()]),
        ("engine thread holds the GIL", [_percent(s.engine_gil) for s in summaries.values()]),
        ("other threads hold it (bounds its wait)",
         [_percent(s.others_gil) for s in summaries.values()]),
    ]
    for role, name in CACHE_THREADS.items():
        rows.append((f"{role} thread ({name}) active / GIL",
                     [f"{_percent(s.cache_threads[role].active)} / "
                      f"{_percent(s.cache_threads[role].gil)}"
                      if role in s.cache_threads else "-" for s in summaries.values()]))
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(name), *(len(cells[i]) for _, cells in rows))
              for i, name in enumerate(summaries)]
    lines = ["  ".join([" " * label_width, *(n.rjust(w) for n, w in zip(summaries, widths))])]
    lines += ["  ".join([label.ljust(label_width),
                         *(c.rjust(w) for c, w in zip(cells, widths))]) for label, cells in rows]
    return "\n".join(lines)
