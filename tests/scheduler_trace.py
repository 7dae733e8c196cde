"""Workloads on vLLM's real Scheduler, the JSON traces they leave behind, and their replay.

One step is what a GPU model runner sees: a `SchedulerOutput`, its persistent
batch after `_update_states`, and the KV-cache slot of every row. The rows of
every output key are `token_rows` of the request's tokens, so what the next
stage must receive is known exactly: a newly scheduled request gets positions
`[0, end)` (its prefix hit included), any other scheduled request
`[num_computed_tokens, end)`.

`run_workload` drives a real Scheduler (vLLM is imported lazily, inside it) and
records a `Trace`; `replay` drives the manager from a `Trace` alone, without
vLLM, so the same checks run on every device backend. Both go through
`StepChecker`, the one place that builds a step's rows and checks what comes
back.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import numpy as np
import torch

from prefix_cache import devices
from prefix_cache import (HIDDEN_KEY, ModelCachePolicy, OmniPrefixCacheManager,
                          PrefixCacheConfig)
from tests.sim import token_rows

TRACE_DIR = Path(__file__).parent / "traces"

#: Every output key the fake model emits: width and the `token_rows` salt of its rows.
MM_KEY = "mm_tokens"      # a per-token multimodal key, written with its step
DEFERRED_KEY = "mm_codes"  # a per-token key the policy writes once, when the request ends
KEY_WIDTHS = {HIDDEN_KEY: 4, MM_KEY: 3, DEFERRED_KEY: 2}
KEY_SALTS = {HIDDEN_KEY: 0, MM_KEY: 1, DEFERRED_KEY: 2}
POLICY = ModelCachePolicy(deferred_keys=frozenset({DEFERRED_KEY}))

TokensOf = Callable[[str], Sequence[int]]


# --------------------------------------------------------------------------- workloads

@dataclass(frozen=True)
class WorkloadRequest:
    """A request added before step `arrive_at` and, if `abort_at` is set, aborted before it."""

    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrive_at: int
    abort_at: int | None = None


@dataclass(frozen=True)
class Workload:
    """A scheduler configuration plus a request schedule; `seed` orders the persistent batch."""

    name: str
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    requests: tuple[WorkloadRequest, ...]
    seed: int = 0


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """`n` token ids in 1..999 (the tiny model's vocabulary has 1024)."""
    return [rng.randrange(1, 1000) for _ in range(n)]


def random_workload(seed: int) -> Workload:
    """Prompts from a few shared-prefix families (some repeated whole), chunked prefill,
    aborts at random points, and a KV cache of 1-2x the largest request, so that a few
    concurrent requests exhaust it: the scheduler preempts, and blocks freed by finished
    requests, still holding cached prefixes, are handed to new tenants."""
    rng = random.Random(seed)
    bs = rng.choice((4, 8, 16))
    families = [random_tokens(rng, rng.randrange(2, 7) * bs) for _ in range(3)]
    requests: list[WorkloadRequest] = []
    for i in range(rng.randrange(6, 16)):
        prompt = rng.choice(families) + random_tokens(rng, rng.randrange(0, 2 * bs))
        if requests and rng.random() < 0.15:
            prompt = list(rng.choice(requests).prompt)
        arrive_at = rng.randrange(0, 10)
        abort_at = arrive_at + rng.randrange(0, 8) if rng.random() < 0.2 else None
        requests.append(WorkloadRequest(f"r{i:02d}", tuple(prompt), rng.randrange(1, 16),
                                        arrive_at, abort_at))
    largest = max(-(-(len(r.prompt) + r.max_tokens) // bs) for r in requests)
    return Workload(f"random-{seed}", bs, num_blocks=2 + int(largest * rng.uniform(1.0, 2.0)),
                    max_num_seqs=rng.randrange(2, 8),
                    max_num_batched_tokens=rng.choice((8, 2 * bs, 3 * bs, 64)),
                    requests=tuple(requests), seed=seed)


def _family_requests(rng: random.Random, prefixes: Sequence[Sequence[int]], count: int, *,
                     max_suffix: int, max_tokens: int, per_step: int) -> list[WorkloadRequest]:
    """`count` requests cycling over `prefixes`, each with a fresh suffix, `per_step` a step."""
    return [WorkloadRequest(f"r{i:02d}",
                            tuple(prefixes[i % len(prefixes)])
                            + tuple(random_tokens(rng, rng.randrange(1, max_suffix))),
                            rng.randrange(2, max_tokens), arrive_at=i // per_step)
            for i in range(count)]


def shared_prefixes() -> Workload:
    """Roomy KV cache, whole prompts per step: three prefix families, hits only, no aborts."""
    rng = random.Random(1)
    prefixes = [random_tokens(rng, n) for n in (16, 24, 32)]
    return Workload("shared_prefixes", block_size=8, num_blocks=64, max_num_seqs=4,
                    max_num_batched_tokens=128,
                    requests=tuple(_family_requests(rng, prefixes, 9, max_suffix=12,
                                                    max_tokens=6, per_step=1)),
                    seed=1)


def chunked_prefill_aborts() -> Workload:
    """16-token chunks; a long prompt aborted after its first chunk, one aborted while
    waiting, one aborted while decoding; later requests hit the aborted ones' prefixes."""
    rng = random.Random(2)
    long_prompt = tuple(random_tokens(rng, 56))
    shared = tuple(random_tokens(rng, 24))
    requests = [
        WorkloadRequest("long", long_prompt, 4, arrive_at=0, abort_at=1),        # mid-prefill
        WorkloadRequest("decoding", shared + tuple(random_tokens(rng, 5)), 8,
                        arrive_at=0, abort_at=8),                                # decoding
        WorkloadRequest("waiting", tuple(random_tokens(rng, 40)), 3,
                        arrive_at=1, abort_at=2),                                # never scheduled
        WorkloadRequest("after-long", long_prompt[:16] + tuple(random_tokens(rng, 6)), 3,
                        arrive_at=2),
        WorkloadRequest("after-decoding", shared + tuple(random_tokens(rng, 9)), 3,
                        arrive_at=4),
    ]
    return Workload("chunked_prefill_aborts", block_size=8, num_blocks=48, max_num_seqs=3,
                    max_num_batched_tokens=16, requests=tuple(requests), seed=2)


def preemption_eviction() -> Workload:
    """13 usable 4-token blocks for prompts of 13-27 tokens, two arriving a step: decodes
    preempt, freed prefix blocks go to new tenants, later requests hit re-filled blocks."""
    rng = random.Random(30)
    prefixes = [random_tokens(rng, n) for n in (12, 16)]
    return Workload("preemption_eviction", block_size=4, num_blocks=14, max_num_seqs=4,
                    max_num_batched_tokens=32,
                    requests=tuple(_family_requests(rng, prefixes, 10, max_suffix=12,
                                                    max_tokens=10, per_step=2)),
                    seed=30)


def random_mix() -> Workload:
    """`random_workload(23)`: preemptions, a mid-prefill abort and hits on reused blocks at once."""
    return dataclasses.replace(random_workload(23), name="random_mix")


#: The workloads whose traces live in tests/traces/.
TRACE_WORKLOADS: dict[str, Callable[[], Workload]] = {
    w.__name__: w
    for w in (shared_prefixes, chunked_prefill_aborts, preemption_eviction, random_mix)}


# --------------------------------------------------------------------------- scheduler output

def step_spans(so: Any) -> dict[str, tuple[int, int, int]]:
    """Per scheduled request `(first delivered, num_computed_tokens, end)` positions: a newly
    scheduled request receives `[0, end)`, its prefix hit included; any other, its own rows."""
    scheduled = so.num_scheduled_tokens
    spans = {new.req_id: (0, new.num_computed_tokens, new.num_computed_tokens
                          + scheduled[new.req_id]) for new in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    spans.update((r, (n, n, n + scheduled[r]))
                 for r, n in zip(cached.req_ids, cached.num_computed_tokens))
    return spans


def record_scheduler_output(so: Any) -> dict[str, Any]:
    """As JSON: the SchedulerOutput fields the adapter reads, and cached requests' positions."""
    cached = so.scheduled_cached_reqs
    return {
        "finished_req_ids": sorted(so.finished_req_ids),
        "preempted_req_ids": sorted(so.preempted_req_ids or ()),
        "kv_cache_block_copies": [[c.src_block_id, c.dst_block_id]
                                  for c in so.kv_cache_block_copies or ()],
        "scheduled_new_reqs": [{"req_id": new.req_id,
                                "num_computed_tokens": new.num_computed_tokens,
                                "block_ids": [list(group) for group in new.block_ids]}
                               for new in so.scheduled_new_reqs],
        "scheduled_cached_reqs": {
            "req_ids": list(cached.req_ids),
            "resumed_req_ids": sorted(cached.resumed_req_ids),
            "new_block_ids": [None if ids is None else [list(group) for group in ids]
                              for ids in cached.new_block_ids],
            "num_computed_tokens": list(cached.num_computed_tokens),
        },
        "num_scheduled_tokens": dict(so.num_scheduled_tokens),
    }


def scheduler_output_namespace(fields: Mapping[str, Any]) -> SimpleNamespace:
    """A recorded step back as a SimpleNamespace with SchedulerOutput's field names and types."""
    cached = fields["scheduled_cached_reqs"]
    return SimpleNamespace(
        finished_req_ids=set(fields["finished_req_ids"]),
        preempted_req_ids=set(fields["preempted_req_ids"]),
        kv_cache_block_copies=[SimpleNamespace(src_block_id=s, dst_block_id=d)
                               for s, d in fields["kv_cache_block_copies"]],
        scheduled_new_reqs=[SimpleNamespace(req_id=new["req_id"],
                                            num_computed_tokens=new["num_computed_tokens"],
                                            block_ids=tuple(new["block_ids"]))
                            for new in fields["scheduled_new_reqs"]],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached["req_ids"]), resumed_req_ids=set(cached["resumed_req_ids"]),
            new_block_ids=[None if ids is None else tuple(ids) for ids in cached["new_block_ids"]],
            num_computed_tokens=list(cached["num_computed_tokens"])),
        num_scheduled_tokens=dict(fields["num_scheduled_tokens"]),
    )


# --------------------------------------------------------------------------- views

def slots_of(block_ids: Sequence[int], block_size: int, start: int, count: int) -> np.ndarray:
    """Slots of positions `[start, start + count)`: `block_ids[pos // bs] * bs + pos % bs`."""
    positions = np.arange(start, start + count, dtype=np.int64)
    return np.asarray(block_ids, dtype=np.int64)[positions // block_size] * block_size \
        + positions % block_size


@dataclass
class _RunnerRequest:
    """What the runner's `CachedRequestState` holds that the view needs."""

    block_ids: list[int]
    num_computed_tokens: int


class StepView(Protocol):
    """The view protocol, plus `apply`: told each scheduler output as the runner's batch is."""

    def apply(self, so: Any) -> None: ...

    def batch_req_ids(self) -> list[str]: ...

    def step_slots_cpu(self, req_ids: Sequence[str], num_scheduled_tokens: Mapping[str, int]
                       ) -> torch.Tensor: ...


class BatchMirror:
    """The runner's request states and persistent batch, updated from each SchedulerOutput
    the way `GPUModelRunner._update_states` does, serving the view protocol.

    Finished requests leave; scheduled requests that are not (preempted ones,
    and running ones skipped this step) leave the batch but keep their state;
    new requests bring their block ids and computed tokens; cached requests
    append `new_block_ids`, or replace their block ids when resumed from
    preemption. The batch is then shuffled: the cache must follow any order.
    """

    def __init__(self, block_size: int, seed: int, group_id: int = 0) -> None:
        self.block_size = block_size
        self.group_id = group_id
        self.requests: dict[str, _RunnerRequest] = {}
        self.batch: list[str] = []
        self._rng = random.Random(seed)

    def apply(self, so: Any) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        cached = so.scheduled_cached_reqs
        resumed = set(cached.resumed_req_ids)
        self.batch = [r for r in self.batch
                      if r in so.num_scheduled_tokens and r not in resumed
                      and r not in so.finished_req_ids]
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = _RunnerRequest(list(new.block_ids[self.group_id]),
                                                       new.num_computed_tokens)
            self.batch.append(new.req_id)
        for req_id, new_ids, computed in zip(cached.req_ids, cached.new_block_ids,
                                             cached.num_computed_tokens):
            state = self.requests[req_id]
            state.num_computed_tokens = computed
            if req_id in resumed:
                state.block_ids = list(new_ids[self.group_id])
            elif new_ids is not None:
                state.block_ids.extend(new_ids[self.group_id])
            if req_id not in self.batch:
                self.batch.append(req_id)
        self._rng.shuffle(self.batch)

    def batch_req_ids(self) -> list[str]:
        return list(self.batch)

    def step_slots_cpu(self, req_ids: Sequence[str], num_scheduled_tokens: Mapping[str, int]
                       ) -> torch.Tensor:
        parts = [slots_of(self.requests[r].block_ids, self.block_size,
                          self.requests[r].num_computed_tokens, num_scheduled_tokens[r])
                 for r in req_ids]
        return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))


class RecordedView:
    """The view protocol over a trace: each `apply` moves on to the next step's batch and slots."""

    def __init__(self, steps: Sequence[TraceStep]) -> None:
        self._steps: Iterator[TraceStep] = iter(steps)
        self._step: TraceStep | None = None

    def apply(self, so: Any) -> None:
        self._step = next(self._steps)

    def batch_req_ids(self) -> list[str]:
        return list(self._step.batch)

    def step_slots_cpu(self, req_ids: Sequence[str], num_scheduled_tokens: Mapping[str, int]
                       ) -> torch.Tensor:
        assert list(req_ids) == list(self._step.batch), "the cache asks for another row order"
        return torch.tensor(self._step.slots, dtype=torch.int64)


# --------------------------------------------------------------------------- rows and checks

@dataclass(frozen=True)
class _SavedStep:
    """A step whose rows went to the cache, until its delivery is checked."""

    step_id: int | None  # None: cache off, the step's own rows go straight on
    batch: list[str]
    spans: dict[str, tuple[int, int, int]]  # req -> (first delivered, num_computed, end)
    refs: dict[str, dict[str, torch.Tensor]]  # req -> key -> reference rows [0, end)


@dataclass
class StepChecker:
    """Builds each step's rows, hands them to the manager (or, cache off, straight on, as the
    runner does) and checks every request's delivery against `token_rows` of its tokens.

    `lag` steps may be saved before the oldest is materialized, as when the
    output builder runs while the engine already schedules the next step.
    `delivered[req]` is how many leading positions the next stage holds: a
    delivery may restart lower (a resumed request recomputes) but never leave a
    gap. It also counts hits, and blocks whose rows a new tenant overwrites (a
    block's content is keyed by the tokens up to its first position).
    """

    manager: OmniPrefixCacheManager | None
    view: StepView
    tokens_of: TokensOf
    block_size: int
    device: torch.device = torch.device("cpu")
    lag: int = 0
    delivered: dict[str, int] = field(default_factory=dict)
    hit_tokens: int = 0
    hit_requests: int = 0
    hits_on_reused_blocks: int = 0
    overwritten_blocks: int = 0
    block_content: dict[int, tuple[int, ...]] = field(default_factory=dict)
    reused_blocks: set[int] = field(default_factory=set)
    saved: deque[_SavedStep] = field(default_factory=deque)

    def step(self, so: Any) -> tuple[list[str], np.ndarray]:
        """Run one step as the runner does; returns the batch order and every row's slot."""
        if self.manager is not None:
            self.manager.new_step_starts(so)
        self.view.apply(so)
        batch = self.view.batch_req_ids()
        scheduled = so.num_scheduled_tokens
        slots = self.view.step_slots_cpu(batch, scheduled).numpy()
        self._count_hits(so)
        if batch:
            spans = step_spans(so)
            refs = {r: self._reference(r, spans[r][2]) for r in batch}
            self._count_overwrites(batch, spans, slots)
            self.saved.append(self._save(batch, spans, refs))
        elif self.manager is not None:  # no forward ran; the step is still saved, empty
            self.manager.discard_step(self.manager.save_outputs(
                None, None, num_tokens_unpadded=0, num_tokens_padded=0))
        self.drain(self.lag)
        return batch, slots

    def drain(self, keep: int = 0) -> None:
        """Materialize and check saved steps, oldest first, until `keep` are left."""
        while len(self.saved) > keep:
            saved = self.saved.popleft()
            if saved.step_id is None:
                delivered = {key: {r: saved.refs[r][key][saved.spans[r][1]:]
                                   for r in saved.batch} for key in KEY_WIDTHS}
            else:
                out = self.manager.materialize(saved.step_id, saved.batch)
                delivered = {HIDDEN_KEY: out.hidden_states, **out.mm_outputs}
            for req_id in saved.batch:
                self._check(req_id, saved.spans[req_id], saved.refs[req_id],
                            {key: delivered[key][req_id] for key in KEY_WIDTHS})

    def _save(self, batch: list[str], spans: dict[str, tuple[int, int, int]],
              refs: dict[str, dict[str, torch.Tensor]]) -> _SavedStep:
        if self.manager is None:
            return _SavedStep(None, batch, spans, refs)
        own = {key: torch.cat([refs[r][key][spans[r][1]:] for r in batch]).to(self.device)
               for key in KEY_WIDTHS}
        n = own[HIDDEN_KEY].shape[0]
        step_id = self.manager.save_outputs(
            own[HIDDEN_KEY], {key: own[key] for key in (MM_KEY, DEFERRED_KEY)},
            num_tokens_unpadded=n, num_tokens_padded=n)
        return _SavedStep(step_id, batch, spans, refs)

    def _check(self, req_id: str, span: tuple[int, int, int],
               refs: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> None:
        start, _, end = span
        have = self.delivered.get(req_id, 0)
        assert start <= have, (f"{req_id}: delivers positions {start}..{end}, the next "
                               f"stage holds only {have}: {have}..{start} never arrive")
        for key, want in refs.items():
            rows = got[key]
            assert rows.device.type == "cpu" and torch.equal(rows, want[start:]), (
                f"{req_id} {key}: positions {start}..{end} differ from the reference "
                f"(got {tuple(rows.shape)}, want {tuple(want[start:].shape)})")
        self.delivered[req_id] = max(have, end)

    def _reference(self, req_id: str, end: int) -> dict[str, torch.Tensor]:
        tokens = list(self.tokens_of(req_id))[:end]
        assert len(tokens) == end, f"{req_id}: {end} positions scheduled, {len(tokens)} tokens"
        return {key: token_rows(tokens, width, salt=KEY_SALTS[key])
                for key, width in KEY_WIDTHS.items()}

    def _count_hits(self, so: Any) -> None:
        for new in so.scheduled_new_reqs:
            h = new.num_computed_tokens
            if h:
                self.hit_tokens += h
                self.hit_requests += 1
                hit_blocks = new.block_ids[0][: h // self.block_size]
                self.hits_on_reused_blocks += not self.reused_blocks.isdisjoint(hit_blocks)

    def _count_overwrites(self, batch: Sequence[str], spans: Mapping[str, tuple[int, int, int]],
                          slots: np.ndarray) -> None:
        """Note the content of every block this step writes; a change is a new tenant."""
        bs = self.block_size
        first_row = 0
        for req_id in batch:
            tokens = tuple(self.tokens_of(req_id))
            _, computed, end = spans[req_id]
            for pos in range(computed, end):
                if pos % bs and pos != computed:
                    continue  # one look per block touched
                block = int(slots[first_row + pos - computed]) // bs
                content = tokens[: pos - pos % bs + 1]
                old = self.block_content.get(block)
                if old is not None and old != content:
                    self.overwritten_blocks += 1
                    self.reused_blocks.add(block)
                self.block_content[block] = content
            first_row += end - computed


# --------------------------------------------------------------------------- traces

@dataclass(frozen=True)
class TraceStep:
    """A recorded step: the adapter's SchedulerOutput fields, the batch order, each row's slot."""

    scheduler_output: dict[str, Any]
    batch: tuple[str, ...]
    slots: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {**self.scheduler_output, "batch": list(self.batch), "slots": list(self.slots)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TraceStep:
        fields = {k: v for k, v in data.items() if k not in ("batch", "slots")}
        return cls(fields, tuple(data["batch"]), tuple(data["slots"]))


@dataclass(frozen=True)
class Trace:
    """A workload run: its configuration, every request's final tokens, and its steps."""

    workload: str
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    tokens: dict[str, list[int]]
    aborted: tuple[str, ...]
    steps: tuple[TraceStep, ...]

    def dumps(self) -> str:
        """JSON with one request's tokens or one step per line, so re-recordings diff by step."""
        head = {"workload": self.workload, "block_size": self.block_size,
                "num_blocks": self.num_blocks,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "aborted": list(self.aborted)}
        tokens = ",\n".join(f"  {json.dumps(r)}: {json.dumps(t)}" for r, t in self.tokens.items())
        steps = ",\n".join("  " + json.dumps(s.to_json(), separators=(",", ":"))
                           for s in self.steps)
        fields = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in head.items()]
        fields += [f'"tokens": {{\n{tokens}\n}}', f'"steps": [\n{steps}\n]']
        return "{\n" + ",\n".join(fields) + "\n}\n"

    @classmethod
    def loads(cls, text: str) -> Trace:
        data = json.loads(text)
        return cls(data["workload"], data["block_size"], data["num_blocks"],
                   data["max_num_batched_tokens"], data["tokens"], tuple(data["aborted"]),
                   tuple(TraceStep.from_json(s) for s in data["steps"]))

    @classmethod
    def load(cls, name: str) -> Trace:
        return cls.loads((TRACE_DIR / f"{name}.json").read_text())


def make_manager(block_size: int, num_blocks: int, max_num_batched_tokens: int, view: StepView,
                 backend: devices.DeviceBackend) -> OmniPrefixCacheManager:
    """The cache as a runner builds it for this KV cache, with `POLICY` registered."""
    manager = OmniPrefixCacheManager(
        PrefixCacheConfig(num_blocks, block_size, staging_capacity_tokens=max_num_batched_tokens,
                          staging_claim_timeout_s=10.0),
        view, backend=backend)
    manager.register_policy(POLICY)
    return manager


# --------------------------------------------------------------------------- running

@dataclass
class WorkloadRun:
    """What a workload run did: its trace and checker, the cache's stats, how many times vLLM
    preempted a request, and where each abort landed (waiting, mid_prefill, decoding)."""

    trace: Trace
    checker: StepChecker
    cache_stats: dict[str, int | float]
    preemptions: int
    aborts: Counter[str]

    @property
    def completed(self) -> dict[str, int]:
        """Requests that ran to completion and the positions each must have delivered
        (every token but the last sampled one)."""
        return {r: len(t) - 1 for r, t in self.trace.tokens.items()
                if r not in self.trace.aborted}


def _abort_kind(request: Any) -> str:
    """Where in its life a vLLM `Request` is when it gets aborted."""
    if request.num_computed_tokens == 0:
        return "waiting"
    return "mid_prefill" if request.num_computed_tokens < request.num_prompt_tokens \
        else "decoding"


def run_workload(workload: Workload, *, prefix_caching: bool = True, lag: int = 0,
                 backend: devices.DeviceBackend | None = None, max_steps: int = 500
                 ) -> WorkloadRun:
    """Drive vLLM's real Scheduler through `workload`, the cache (or, off, nothing) on a
    `BatchMirror`, checking every step; faked model steps sample `FAKE_TOKEN_ID`."""
    from vllm.v1.request import RequestStatus

    from tests.vllm_fixtures import fake_model_step, make_request, make_scheduler

    bs = workload.block_size
    scheduler = make_scheduler(workload.num_blocks, bs, workload.max_num_seqs,
                               workload.max_num_batched_tokens, prefix_caching)
    mirror = BatchMirror(bs, workload.seed)
    manager = make_manager(bs, workload.num_blocks, workload.max_num_batched_tokens, mirror,
                           backend or devices.get_backend("cpu")) if prefix_caching else None
    requests = {r.req_id: make_request(r.req_id, r.prompt, r.max_tokens, hash_block_size=bs)
                for r in workload.requests}
    checker = StepChecker(manager, mirror, lambda r: requests[r].all_token_ids, bs, lag=lag)
    steps: list[TraceStep] = []
    aborts: Counter[str] = Counter()
    aborted: list[str] = []
    try:
        for step in range(max_steps):
            for r in workload.requests:
                if r.arrive_at == step:
                    scheduler.add_request(requests[r.req_id])
                if r.abort_at == step and not requests[r.req_id].is_finished():
                    aborts[_abort_kind(requests[r.req_id])] += 1
                    aborted.append(r.req_id)
                    scheduler.finish_requests(r.req_id, RequestStatus.FINISHED_ABORTED)
            if step > max(r.arrive_at for r in workload.requests) \
                    and not scheduler.has_requests():
                break
            so = scheduler.schedule()
            batch, slots = checker.step(so)
            steps.append(TraceStep(record_scheduler_output(so), tuple(batch),
                                   tuple(slots.tolist())))
            fake_model_step(scheduler, so)
        else:
            raise AssertionError(f"{workload.name}: still running after {max_steps} steps")
        checker.drain()
        stats = manager.stats() if manager is not None else {}
    finally:
        if manager is not None:
            manager.shutdown()
    trace = Trace(workload.name, bs, workload.num_blocks, workload.max_num_batched_tokens,
                  {r: list(req.all_token_ids) for r, req in requests.items()}, tuple(aborted),
                  tuple(steps))
    return WorkloadRun(trace, checker, stats,
                       sum(req.num_preemptions for req in requests.values()), aborts)


def replay(trace: Trace, backend: devices.DeviceBackend, lag: int = 0
           ) -> tuple[StepChecker, dict[str, Any]]:
    """Drive the manager through a recorded trace (no vLLM); returns the checker and cache stats."""
    view = RecordedView(trace.steps)
    with make_manager(trace.block_size, trace.num_blocks, trace.max_num_batched_tokens, view,
                      backend) as manager:
        checker = StepChecker(manager, view, trace.tokens.__getitem__, trace.block_size,
                              backend.device, lag)
        for step in trace.steps:
            checker.step(scheduler_output_namespace(step.scheduler_output))
        checker.drain()
        return checker, manager.stats()
