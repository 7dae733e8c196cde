"""Where an engine thread spent its steps, from the Chrome trace of vLLM's worker profiler.

vLLM's worker profiles itself when its engine was built with `profiler_config` (see
`engines.vllm_trace_config`) and `LLM.start_profile` / `stop_profile` frame the steps: the one
way to trace an engine core that runs in a process of its own, as it does with CUDA graphs.

The engine thread is the thread with vLLM's step annotations (`execute_...`, category
`user_annotation`). Its decode steps (vLLM names them `execute_context_0(0)_generation_...`) are
each from its annotation's start to the next annotation's: prompt steps, whose number and size
vary from pass to pass under asynchronous scheduling, are left out, and a figure is the median
over the steps (a pass's last step, which runs into the next pass, is an outlier it drops).

A call's self time is its span less its children's (calls nest by time on a thread), split
over the steps it overlaps, so a thread's self times add up to the step. A builtin or torch op
that the cache's Python code calls counts as the cache's. With Python stacks recorded, self
time includes any wait for the GIL: vLLM's own functions taking longer on the cache engine's
thread than on the plain engine's, while they run the same code, is time that another thread
held the GIL (or a lock of the device driver). A thread of the cache's is busy outside its
waits (`WAITS`), GIL waits included. The profiler inflates every Python call and varies from
pass to pass: compare two engines traced over alternating passes, never against an untraced
step.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefix_cache.tools.reporting.harness import format_table

#: Categories of the calls a CPU thread makes (annotations mark steps: they need not nest).
CALL_CATEGORIES = frozenset({"python_function", "cpu_op", "cuda_runtime", "cuda_driver"})
#: The prefix of vLLM's step annotation on the engine thread, and a decode step's (one token or
#: more, no prompt token).
STEP_ANNOTATION = "execute_"
DECODE_ANNOTATION = re.compile(r"execute_context_0\(0\)_generation_[1-9]")
#: Words naming the calls in which a thread waits rather than works.
WAITS = ("acquire", "sleep", "synchronize", "threading.py", "queue.py(", "_queue.")
#: Names in the table are cut to this many characters.
NAME_WIDTH = 72
#: The cache's own code (its tools drive the engine and are not part of it).
CACHE_PATH, TOOLS_PATH = "prefix_cache/", "prefix_cache/tools/"

_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
_PYTHON = re.compile(r"\.py\(\d+\): ")
#: The mark of a call (a builtin, a torch op) that the cache's Python code makes.
CALLED_BY_CACHE = " (the cache's call)"


@dataclass(frozen=True)
class StepTrace:
    """Engines' decode steps, each figure the median over `steps` steps, in µs: the interval
    between step starts; the engine thread's self time in the cache's functions, in everyone
    else's, and by function; the busy time of each of the cache's other threads (its self time
    outside waits, GIL waits included), under the name of its loop."""

    steps: int
    step_us: float
    engine_cache_us: float
    engine_others_us: float
    engine_self_us: dict[str, float]
    cache_threads_busy_us: dict[str, float]


def function_name(event_name: str) -> str:
    """The event's name, a builtin's without its address (which differs between processes),
    cut to `NAME_WIDTH` characters."""
    name = _ADDRESS.sub("", event_name)
    return name if len(name) <= NAME_WIDTH else name[:NAME_WIDTH - 3] + "..."


def is_cache(event_name: str) -> bool:
    """The cache's own function, or a call the cache's code makes (`CALLED_BY_CACHE`)."""
    return (CACHE_PATH in event_name and TOOLS_PATH not in event_name
            or event_name.endswith(CALLED_BY_CACHE))


def is_wait(name: str) -> bool:
    """A call that parks its thread (a lock, a condition, a sleep, a device event)."""
    return any(word in name for word in WAITS)


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The trace's events (`.json` or `.json.gz`)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def step_trace(traces: Iterable[list[dict[str, Any]]]) -> StepTrace:
    """The median decode step of `traces` (each the events of one or more traced passes), over
    the decode steps that another step follows; an event's time counts in the steps it spans."""
    steps: list[tuple[float, Counter[str], Counter[str]]] = []
    for events in traces:
        steps += _decode_steps([e for e in events if e.get("ph") == "X"])
    if not steps:
        raise ValueError(f"no decode step ({DECODE_ANNOTATION.pattern}) that another step "
                         f"({STEP_ANNOTATION}...) follows in the trace(s)")
    engine = [own for _, own, _ in steps]
    other = [theirs for _, _, theirs in steps]

    def median_of(counters: list[Counter[str]]) -> dict[str, float]:
        return {name: statistics.median(c[name] for c in counters)
                for name in set().union(*counters)}

    return StepTrace(
        steps=len(steps), step_us=statistics.median(interval for interval, _, _ in steps),
        engine_cache_us=statistics.median(sum(v for k, v in c.items() if is_cache(k))
                                          for c in engine),
        engine_others_us=statistics.median(sum(v for k, v in c.items() if not is_cache(k))
                                           for c in engine),
        engine_self_us=median_of(engine), cache_threads_busy_us=median_of(other))


def _decode_steps(events: list[dict[str, Any]]) -> list[tuple[float, Counter[str],
                                                              Counter[str]]]:
    """Each decode step of one trace: its interval, the engine thread's self time by function
    within it, and the busy time within it of the cache's other threads."""
    marks = sorted((e for e in events if e.get("cat") == "user_annotation"
                    and e["name"].startswith(STEP_ANNOTATION)), key=lambda e: e["ts"])
    starts = [mark["ts"] for mark in marks]
    decode = {i for i, mark in enumerate(marks[:-1]) if DECODE_ANNOTATION.match(mark["name"])}
    if not decode:
        return []
    own: dict[int, Counter[str]] = {i: Counter() for i in decode}
    theirs: dict[int, Counter[str]] = {i: Counter() for i in decode}  # by the thread's loop

    def add(into: dict[int, Counter[str]], name: str, begin: float, end: float) -> None:
        """`name`'s time from `begin` to `end`, split over the decode steps it overlaps."""
        i = max(bisect.bisect_right(starts, begin) - 1, 0)
        while i < len(starts) - 1 and starts[i] < end:
            if i in decode:
                into[i][name] += min(end, starts[i + 1]) - max(begin, starts[i])
            i += 1

    pid, engine = marks[0]["pid"], marks[0]["tid"]
    threads: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("cat") in CALL_CATEGORIES and e["pid"] == pid:
            threads.setdefault(e["tid"], []).append(e)
    for tid, thread_events in threads.items():
        selves: dict[int, Counter[str]] = {i: Counter() for i in decode}
        children: dict[int, list[dict[str, Any]]] = {}
        cache_owned: dict[int, bool] = {}  # the innermost Python function at it is the cache's
        for e, parents in _nested(thread_events):
            children[id(e)] = []
            if parents:
                children[id(parents[-1])].append(e)
            cache_owned[id(e)] = is_cache(e["name"]) if _PYTHON.search(e["name"]) else (
                bool(parents) and cache_owned[id(parents[-1])])
        for e in thread_events:  # self time: the gaps between its children, in its own span
            now, name = e["ts"], function_name(e["name"])
            if cache_owned[id(e)] and not is_cache(name):
                name += CALLED_BY_CACHE
            for child in children[id(e)]:
                add(selves, name, now, child["ts"])
                now = max(now, child["ts"] + child["dur"])
            add(selves, name, now, e["ts"] + e["dur"])
        if tid == engine:
            own = selves
            continue
        loops = [e for e in thread_events if is_cache(e["name"])]
        if loops:  # a thread of the cache's: its busy time under the name of its longest call
            loop = function_name(max(loops, key=lambda e: e["dur"])["name"])
            for i, self_us in selves.items():
                theirs[i][loop] += sum(v for k, v in self_us.items() if not is_wait(k))
    return [(starts[i + 1] - starts[i], own[i], theirs[i]) for i in sorted(decode)]


def _nested(events: list[dict[str, Any]]) -> Iterable[tuple[dict[str, Any],
                                                            list[dict[str, Any]]]]:
    """Each event with the events it runs inside, outermost first."""
    stack: list[dict[str, Any]] = []
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
            stack.pop()
        yield e, stack
        stack.append(e)


def compare_table(plain: StepTrace, cache: StepTrace, *, top: int = 12) -> str:
    """The two engines' steps side by side: the step, the engine thread's self time in the
    cache's functions and in everyone else's, the `top` functions the cache's engine spent
    longest more in, and the busy time of the cache's other threads."""
    rows: list[list[Any]] = [
        [f"steps (median of {plain.steps} / {cache.steps}): interval", _us(plain.step_us),
         _us(cache.step_us), _us(cache.step_us - plain.step_us)],
        ["engine thread, self, the cache's functions", _us(plain.engine_cache_us),
         _us(cache.engine_cache_us), _us(cache.engine_cache_us - plain.engine_cache_us)],
        ["engine thread, self, vLLM's, torch's and others", _us(plain.engine_others_us),
         _us(cache.engine_others_us), _us(cache.engine_others_us - plain.engine_others_us)],
    ]
    others = [k for k in set(plain.engine_self_us) | set(cache.engine_self_us) if not is_cache(k)]
    longer = sorted(others, key=lambda k: plain.engine_self_us.get(k, 0.0)
                    - cache.engine_self_us.get(k, 0.0))[:top]
    rows += [[f"  {k}", _us(plain.engine_self_us.get(k, 0.0)),
              _us(cache.engine_self_us.get(k, 0.0)),
              _us(cache.engine_self_us.get(k, 0.0) - plain.engine_self_us.get(k, 0.0))]
             for k in longer]
    rows += [[f"busy thread: {k}", "-", _us(v), "-"] for k, v in
             sorted(cache.cache_threads_busy_us.items(), key=lambda kv: -kv[1])[:top]]
    return format_table(["µs per step (traced)", "plain", "cache", "cache - plain"], rows)


def _us(value: float) -> str:
    return f"{value:,.0f}"
