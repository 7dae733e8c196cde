"""Where an engine thread spent its steps, from the Chrome trace of vLLM's worker profiler.

vLLM's worker profiles itself when its engine was built with `profiler_config` (see
`engines.vllm_trace_config`) and `LLM.start_profile` / `stop_profile` frame the steps: the one
way to trace an engine core that runs in a process of its own, as it does with CUDA graphs.

The engine thread is the thread with vLLM's step annotations (`execute_...`, category
`user_annotation`). Its decode steps (vLLM names them `execute_context_0(0)_generation_...`) are
each from its annotation's start to the next annotation's: prompt steps, whose number and
size vary from pass to pass under asynchronous scheduling, are left out. A
function's self time is its events' time less their children's (events nest by time on a
thread). With Python stacks recorded, a Python function's self time includes any wait for the
GIL inside it, so vLLM's own functions taking longer on the cache engine's thread than on the
plain engine's, while they run the same code, is time that the cache's other threads held the
GIL. The profiler inflates every Python call: compare two engines traced alike, never against
an untraced step.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefix_cache.tools.harness import format_table

#: Event categories that run on a CPU thread.
CPU_CATEGORIES = frozenset({"python_function", "cpu_op", "cuda_runtime", "cuda_driver",
                            "user_annotation"})
#: The prefix of vLLM's step annotation on the engine thread, and that of a decode step's.
STEP_ANNOTATION, DECODE_ANNOTATION = "execute_", "execute_context_0(0)_"
#: The cache's own code (its tools drive the engine and are not part of it).
CACHE_PATH, TOOLS_PATH = "prefix_cache/", "prefix_cache/tools/"

_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


@dataclass(frozen=True)
class StepTrace:
    """One engine's traced steps, per step: the engine thread's self µs by function, and on each
    of the process's other threads the cache's outermost functions' µs (waits included)."""

    steps: int
    step_us: float
    engine_self_us: dict[str, float]
    other_threads_cache_us: dict[str, float]


def function_name(event_name: str) -> str:
    """The event's name, a builtin's without its address (which differs between processes)."""
    return _ADDRESS.sub("", event_name)


def is_cache(event_name: str) -> bool:
    return CACHE_PATH in event_name and TOOLS_PATH not in event_name


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The trace's events (`.json` or `.json.gz`)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def step_trace(events: Iterable[dict[str, Any]]) -> StepTrace:
    """Per-step times of the trace's decode steps that another step follows."""
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in CPU_CATEGORIES]
    marks = sorted((e for e in spans if e["cat"] == "user_annotation"
                    and e["name"].startswith(STEP_ANNOTATION)), key=lambda e: e["ts"])
    windows = [(mark["ts"], after["ts"]) for mark, after in zip(marks, marks[1:])
               if mark["name"].startswith(DECODE_ANNOTATION)]
    if not windows:
        raise ValueError(f"the trace has no decode step ({DECODE_ANNOTATION}...) that another "
                         f"step ({STEP_ANNOTATION}...) follows: {len(marks)} step annotation(s)")
    engine = (marks[0]["pid"], marks[0]["tid"])
    threads: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for e in spans:
        if e["pid"] == engine[0] and any(begin <= e["ts"] < end for begin, end in windows):
            threads.setdefault((e["pid"], e["tid"]), []).append(e)
    steps = len(windows)
    engine_self = _self_times(threads.pop(engine, []))
    other: Counter[str] = Counter()
    for thread_events in threads.values():
        other.update(_outermost_cache_times(thread_events))
    return StepTrace(steps=steps, step_us=sum(end - begin for begin, end in windows) / steps,
                     engine_self_us={k: v / steps for k, v in engine_self.items()},
                     other_threads_cache_us={k: v / steps for k, v in other.items()})


def _nested(events: list[dict[str, Any]]) -> Iterable[tuple[dict[str, Any],
                                                            list[dict[str, Any]]]]:
    """Each event with the events it runs inside, outermost first."""
    stack: list[dict[str, Any]] = []
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
            stack.pop()
        yield e, stack
        stack.append(e)


def _self_times(events: list[dict[str, Any]]) -> Counter[str]:
    self_us: Counter[str] = Counter()
    for e, parents in _nested(events):
        self_us[function_name(e["name"])] += e["dur"]
        if parents:
            self_us[function_name(parents[-1]["name"])] -= e["dur"]
    return self_us


def _outermost_cache_times(events: list[dict[str, Any]]) -> Counter[str]:
    times: Counter[str] = Counter()
    for e, parents in _nested(events):
        if is_cache(e["name"]) and not any(is_cache(p["name"]) for p in parents):
            times[function_name(e["name"])] += e["dur"]
    return times


def compare_table(plain: StepTrace, cache: StepTrace, *, top: int = 12) -> str:
    """The two engines' steps side by side: the step, the engine thread's self time in the
    cache's functions and in everyone else's, the `top` functions the cache's engine spent
    longest more in, and the cache's work on other threads."""
    def split(trace: StepTrace) -> tuple[float, float]:
        mine = sum(v for k, v in trace.engine_self_us.items() if is_cache(k))
        return mine, sum(trace.engine_self_us.values()) - mine

    (plain_cache, plain_rest), (cache_cache, cache_rest) = split(plain), split(cache)
    rows: list[list[Any]] = [
        ["step (interval between step starts)", _us(plain.step_us), _us(cache.step_us),
         _us(cache.step_us - plain.step_us)],
        ["engine thread, self, the cache's functions", _us(plain_cache), _us(cache_cache),
         _us(cache_cache - plain_cache)],
        ["engine thread, self, vLLM's, torch's and others", _us(plain_rest), _us(cache_rest),
         _us(cache_rest - plain_rest)],
    ]
    others = [k for k in set(plain.engine_self_us) | set(cache.engine_self_us) if not is_cache(k)]
    longer = sorted(others, key=lambda k: plain.engine_self_us.get(k, 0.0)
                    - cache.engine_self_us.get(k, 0.0))[:top]
    rows += [[f"  {k}", _us(plain.engine_self_us.get(k, 0.0)),
              _us(cache.engine_self_us.get(k, 0.0)),
              _us(cache.engine_self_us.get(k, 0.0) - plain.engine_self_us.get(k, 0.0))]
             for k in longer]
    rows += [[f"other threads: {k}", "-", _us(v), "-"] for k, v in
             sorted(cache.other_threads_cache_us.items(), key=lambda kv: -kv[1])[:top]]
    return format_table(["µs per step (traced)", "plain", "cache", "cache - plain"], rows)


def _us(value: float) -> str:
    return f"{value:,.0f}"
