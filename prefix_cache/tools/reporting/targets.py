"""The benches' metrics: what each one measures, in one line, and the target it must reach.

Plain data with no torch import, so `python -m prefix_cache bench --help` can list it. A new
row of the bench table (M8, say) is one entry in `METRICS` plus its measurement in `bench.run`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

_COMPARE = {">=": operator.ge, "<=": operator.le, "==": operator.eq}


@dataclass(frozen=True)
class Target:
    """`value <op> bound`; a GPU-only target is judged on CUDA only, elsewhere it is shown."""

    op: str
    bound: float
    unit: str = ""
    gpu_only: bool = False

    def __post_init__(self) -> None:
        if self.op not in _COMPARE:
            raise ValueError(f"Target.op must be one of {sorted(_COMPARE)}, got {self.op!r}")

    @property
    def text(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        return f"{self.op} {self.bound:g}{unit}" + (" (GPU)" if self.gpu_only else "")

    def applies_to(self, device: str) -> bool:
        return not self.gpu_only or device == "cuda"

    def met_by(self, value: float) -> bool:
        return _COMPARE[self.op](value, self.bound)


@dataclass(frozen=True)
class MetricSpec:
    """One metric of a bench: what it measures, in one line, and its target (on the CPU backend
    `cpu_target` where one is set); `cpu_miss`, where set, says why the CPU backend misses the
    target by design, for values at or above `cpu_floor` (the report says so beside the row;
    a lower value is a plain MISS: a regression, not the design)."""

    what: str
    target: Target
    cpu_target: Target | None = None
    cpu_miss: str = ""
    cpu_floor: float = 0.0

    def target_on(self, device: str) -> Target:
        return self.cpu_target if device == "cpu" and self.cpu_target is not None \
            else self.target

    @property
    def targets_text(self) -> str:
        """The help's target column (one short cell): the target off the CPU backend."""
        return self.target.text

    @property
    def summary(self) -> str:
        """The help's line: what the metric measures, and its CPU target where it differs."""
        return self.what + ("" if self.cpu_target is None else f" (CPU {self.cpu_target.text})")


#: In table order; a gpu_only target is set for an NVIDIA GPU (measured on an H200).
METRICS: dict[str, MetricSpec] = {
    "M1": MetricSpec("save: rows written into pool slots per s / one contiguous D2H",
                     Target(">=", 0.95, gpu_only=True)),
    "M2": MetricSpec("engine-thread time of a 64-request decode step (new_step_starts + save)",
                     Target("<=", 100, "µs", gpu_only=True)),
    "M2p": MetricSpec("engine-thread time of a 2048-token prefill step",
                      Target("<=", 150, "µs", gpu_only=True)),
    "M3": MetricSpec("hit: hit rows delivered per s / host memcpy into a resident destination",
                     Target(">=", 0.7)),
    "M4": MetricSpec("engine-thread stalls after warm-up (pinned allocs, registrations, syncs)",
                     Target("==", 0)),
    "M5": MetricSpec("0%-hit overhead: steps per s with the cache / without",
                     Target(">=", 0.99), cpu_target=Target(">=", 0.95),
                     cpu_floor=0.75,
                     cpu_miss="the host that runs the forward also runs the cache's calls and "
                              "makes the step's two copies of its rows (into the pool, into the "
                              "caller's tensor); a py-spy profile of this loop on a 2-core "
                              "machine puts 9% of a step in the cache's calls and slows the "
                              "forward itself by 10% (the cache's threads idle: most likely "
                              "the copies evict its weights from the processor's caches): "
                              "0.80-0.87 measured there, below 0.75 a regression"),
    "M6": MetricSpec("host memory: bytes resident / bytes the cache holds (pools, staging)",
                     Target("<=", 1.05)),
    "M7": MetricSpec("interference: GEMM loop time with concurrent saves / alone",
                     Target("<=", 1.03, gpu_only=True)),
    "M8": MetricSpec("stage 1 time, prefix caching on / off, / (1 - hit fraction); real engine",
                     Target("<=", 1.15)),
}

#: The pipeline bench's figures on vLLM's real engine, in table order.
PIPELINE_METRICS: dict[str, MetricSpec] = {
    "M8": METRICS["M8"],
    "M5e": MetricSpec("real engine steps per s, the cache's worker / vLLM's plain worker",
                      Target(">=", 0.98, gpu_only=True)),
}

#: The streaming bench's figures (`python -m prefix_cache.tools.stream_bench`), in table order.
STREAM_METRICS: dict[str, MetricSpec] = {
    "M9": MetricSpec("stage 2's first token from stage-1 submission, streaming on / off "
                     "(stage 1 generating 64 tokens; real engine)", Target("<=", 0.25)),
    "M9h": MetricSpec("with a prefix hit: stage 2's first chunk from stage-1 submission / "
                      "stage 1's first step", Target("<=", 1.0)),
    "M9c": MetricSpec("streaming's cost: stage-1 steps per s, streaming on / off",
                      Target(">=", 0.98)),
}
