"""Randomized schedules checked against a reference model (SPEC §4), on every available backend.

A miniature vLLM v1 scheduler with a hashed, ref-counted block allocator drives
the manager through hypothesis-drawn workloads: shared prefixes, chunked
prefill, decode, finishes and aborts at any point, preemption under block
pressure, a shuffled batch order, padded outputs, a deferred key under a small
device budget, steps whose forward omits an mm key (a text-only step after an
image prefix), and each step materialized at once, one step late, in part or
not at all. Rows are a pure function of the tokens (`token_rows`), so the
reference is simple: a request's hidden rows of a step are `token_rows(tokens)`
of the positions the step covers (from 0 on a prefix hit); its rows of an mm key
are those too, except that positions whose rows were never written under that key
read zeros: computed positions of a step that omits the key, and hit positions
whose slot's last write omitted it (SPEC §4 rules 5 and 6). The reference keeps,
per slot, which mm keys its last write held.

The same workloads also run under both step paths (`PrefixCacheConfig.step_path`), seen
through a runner's view (`RunnerView`): the C path must leave the pool's tables after every
step, its rows and the stats bit for bit as the Python reference leaves them.

More examples: PREFIX_CACHE_HYPOTHESIS_EXAMPLES=2000 pytest tests/test_manager_random.py
"""

from __future__ import annotations

import itertools
import os
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install .[test])")
from hypothesis import HealthCheck, Phase, event, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from prefix_cache import devices  # noqa: E402
from prefix_cache import (HIDDEN_KEY, ModelCachePolicy, OmniPrefixCacheManager,  # noqa: E402
                          PrefixCacheConfig, StageCacheOutputs)
from prefix_cache.errors import OmniPrefixCacheError, OmniPrefixCacheInputError  # noqa: E402
from prefix_cache.config import STEP_PATHS, WRITE_STREAMS  # noqa: E402
from prefix_cache.core import reads  # noqa: E402
from prefix_cache.integration.group_view import FullAttentionGroupView  # noqa: E402
from tests.faults import COMMITTER_POINTS, ENGINE_POINTS, FaultyBackend, InjectedFault  # noqa
from tests.sim import token_rows  # noqa: E402

settings.register_profile(
    "prefix-cache-random",
    max_examples=int(os.environ.get("PREFIX_CACHE_HYPOTHESIS_EXAMPLES", "200")),
    deadline=None, derandomize=True, database=None, print_blob=True,
    phases=[phase for phase in Phase if phase is not Phase.explain],  # fast failure reports
    # the backend fixture only names the device; each example builds its own backend
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

#: width and `token_rows` salt of each per-token output; "codes.audio" is saved nested
#: (`{"codes": {"audio": ...}}`) and is the key a deferred policy defers.
KEYS = {HIDDEN_KEY: (3, 0), "mm_feature": (5, 1), "codes.audio": (4, 2)}
MM_KEYS = tuple(k for k in KEYS if k != HIDDEN_KEY)
DEFERRED_KEY = "codes.audio"
PER_REQUEST_KEY = "speaker"  # [num_reqs, 2]: in a decode step it looks per-token, it is not
RESUME_FLAVORS = ("resumed_req_ids", "resumed_from_preemption", "new_reqs")
CONSUME_MODES = ("now", "after_next_start", "after_next_save", "discard")


# --------------------------------------------------------------------------- the workload

@dataclass(frozen=True)
class StepOps:
    """One engine step's random choices, read against whatever state the step finds."""

    arrivals: int              # requests that join the waiting queue before scheduling
    abort: int | None          # a live request (index mod count) aborted before scheduling
    chunks: tuple[int, ...]    # per request considered, in order: 0 skips it, k > 0 offers
                               # up to k tokens; past the end: as many as fit
    shuffle_seed: int          # the persistent batch's row order, finished_req_ids' order
    pad: int                   # garbage rows after the real ones (CUDA-graph padding)
    consume: str               # when this step is materialized (CONSUME_MODES)
    drop_mask: int             # bit i: batch row i's request is left out of materialize
    reject: bool = False       # a save with bad input comes first, then the same save again
    copy_hit: bool = False     # admitted hits get a copy of their last hit block (block copy)
    omit: frozenset[str] = frozenset()  # mm keys this step's forward does not emit


@dataclass(frozen=True)
class Arrival:
    """A request submitted to the engine."""

    prompt: tuple[int, ...]
    max_tokens: int
    reuse_id: bool  # take the id of the request that finished last (vLLM ids are the client's)


@dataclass(frozen=True)
class Workload:
    """One example: the stage's cache geometry and policy, who arrives, and what each step does."""

    block_size: int
    num_blocks: int
    token_budget: int          # max_num_batched_tokens, also the staging capacity
    staging_depth: int
    hidden: bool               # ModelCachePolicy.needs_full_hidden_states
    deferred: bool             # DEFERRED_KEY is written once per request (or under budget)
    gpu_budget_bytes: int
    resume_flavor: str         # how a resumed request shows up (RESUME_FLAVORS)
    arrivals: tuple[Arrival, ...]
    steps: tuple[StepOps, ...]
    fault: tuple[str, int] | None = None  # (injection point, step it is armed at)
    write_stream: str = "compute"         # PrefixCacheConfig.write_stream
    mm: bool = True  # the forward emits mm outputs (False: hidden states alone, mm_outputs None)


#: a step where nothing arrives and every request is offered as much as fits
IDLE = StepOps(arrivals=0, abort=None, chunks=(), shuffle_seed=0, pad=0, consume="now",
               drop_mask=0)
TOKENS = st.integers(1, 999)


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    """Prompts built from a few shared prefixes (or repeating an earlier prompt) plus tails.

    Sizes keep any single request within the KV cache on its own (prompt <= 5 blocks,
    at most 3 decode tokens computed, num_blocks >= 8), so preemption always frees enough.
    """
    bs = draw(st.integers(2, 4))
    prefixes = draw(st.lists(st.lists(TOKENS, max_size=3 * bs), min_size=1, max_size=3))
    specs = draw(st.lists(st.tuples(
        st.integers(0, 2),                             # which shared prefix (mod count)
        st.lists(TOKENS, min_size=1, max_size=2 * bs),  # the request's own tail
        st.sampled_from([None] * 4 + list(range(4))),  # or: repeat an earlier prompt
        st.integers(1, 4),                             # max_tokens
        st.sampled_from([False] * 3 + [True]),         # reuse_id
    ), min_size=4, max_size=16))
    arrivals: list[Arrival] = []
    for prefix, tail, repeat, max_tokens, reuse_id in specs:
        if repeat is not None and arrivals:
            prompt = arrivals[repeat % len(arrivals)].prompt
        else:
            prompt = tuple(prefixes[prefix % len(prefixes)] + tail)
        arrivals.append(Arrival(prompt, max_tokens, reuse_id))
    num_steps = draw(st.integers(1, 40))
    steps = st.builds(
        StepOps,
        arrivals=st.integers(0, 3),
        abort=st.sampled_from([None] * 12 + list(range(4))),
        chunks=st.lists(st.integers(0, 3 * bs), max_size=6).map(tuple),
        shuffle_seed=st.integers(0, 2**16),
        pad=st.integers(0, 3),
        consume=st.sampled_from(CONSUME_MODES),
        drop_mask=st.just(0) | st.integers(0, 15),  # half the steps materialize every row
        reject=st.sampled_from([False] * 5 + [True]),
        copy_hit=st.sampled_from([False] * 3 + [True]),
        # each mm key is left out of 30% of the steps (hits included): shrinks to emitting all
        omit=st.tuples(*(st.sampled_from([False] * 7 + [True] * 3) for _ in MM_KEYS)).map(
            lambda bits: frozenset(k for k, b in zip(MM_KEYS, bits) if b)),
    )
    return Workload(
        block_size=bs,
        num_blocks=draw(st.integers(8, 16)),
        token_budget=draw(st.integers(bs, 16)),
        staging_depth=draw(st.integers(2, 4)),
        hidden=not draw(st.booleans()),  # shrinks towards caching hidden states
        deferred=draw(st.booleans()),
        gpu_budget_bytes=draw(st.sampled_from([512 << 20, 0, 48, 200])),
        resume_flavor=draw(st.sampled_from(RESUME_FLAVORS)),
        arrivals=tuple(arrivals),
        steps=tuple(draw(st.lists(steps, min_size=num_steps, max_size=num_steps))),
        fault=draw(st.sampled_from([None] * 3) | st.tuples(
            st.sampled_from([p for p in ENGINE_POINTS + COMMITTER_POINTS if p != "stall"]),
            st.integers(0, num_steps))),
        write_stream=draw(st.sampled_from(WRITE_STREAMS)),
        mm=draw(st.sampled_from([True] * 3 + [False])),
    )


# --------------------------------------------------------------------------- the vLLM model

def next_token(tokens: Sequence[int]) -> int:
    """The token sampled after `tokens`: a pure function of the sequence."""
    return hash(tuple(tokens)) % 999 + 1


class BlockAllocator:
    """vLLM's BlockPool in miniature.

    Blocks 1..num_blocks-1 (0 is the null block) are ref counted. A freed block
    joins the tail of an LRU free queue and keeps its hash, so it can still be hit
    until the queue's head hands it to a new tenant: that reallocation is the
    eviction. A full block's hash is its request's whole token prefix up to the
    block's end.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.ref_cnt = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.hash_of: dict[int, tuple[int, ...]] = {}
        self.by_hash: dict[tuple[int, ...], dict[int, None]] = {}
        # since the last step ended, for hypothesis events only
        self.published_this_step: set[int] = set()
        self.released_this_step: set[int] = set()

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """The longest cached run of leading full blocks, leaving >= 1 token to compute."""
        bs = self.block_size
        hit = []
        for i in range((len(tokens) - 1) // bs):
            holders = self.by_hash.get(tuple(tokens[: (i + 1) * bs]))
            if not holders:
                break
            hit.append(next(iter(holders)))
        return hit

    def can_take(self, hit: Sequence[int], num_new: int) -> bool:
        """Whether `hit` plus `num_new` new blocks fit (free hit blocks count as taken)."""
        return num_new + sum(self.ref_cnt[b] == 0 for b in hit) <= len(self.free)

    def take(self, hit: Sequence[int], num_new: int) -> list[int]:
        """Share `hit`, then hand out `num_new` blocks from the free queue's head."""
        for block in hit:
            if self.ref_cnt[block] == 0:
                del self.free[block]
            self.ref_cnt[block] += 1
        new = []
        for _ in range(num_new):
            block, _ = self.free.popitem(last=False)
            assert self.ref_cnt[block] == 0, f"block {block} handed out while in use"
            key = self.hash_of.pop(block, None)
            if key is not None:  # evicted: from now on the block holds the new tenant's rows
                del self.by_hash[key][block]
                if not self.by_hash[key]:
                    del self.by_hash[key]
                event("eviction of a cached block")
            if block in self.released_this_step:
                event("a block freed since the last step goes to a new tenant in this one")
            self.ref_cnt[block] = 1
            new.append(block)
        return [*hit, *new]

    def publish(self, block: int, prefix: Sequence[int]) -> None:
        """`block` is full: later requests with this token prefix may share it."""
        key = tuple(prefix)
        self.hash_of[block] = key
        self.by_hash.setdefault(key, {})[block] = None
        self.published_this_step.add(block)

    def end_step(self) -> None:
        self.published_this_step, self.released_this_step = set(), set()

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference; tail blocks first, so they are evicted first (as vLLM frees)."""
        for block in reversed(blocks):
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.free[block] = None
                self.released_this_step.add(block)


@dataclass(eq=False)
class SimRequest:
    """A request as the scheduler tracks it (vLLM's Request); one object per life of an id."""

    req_id: str
    tokens: list[int]
    prompt_len: int
    max_tokens: int
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    num_published: int = 0  # leading blocks whose hash the allocator holds
    preempted: bool = False  # waiting again after losing its blocks
    reached: int = 0  # where its last scheduled step ended: the rows it was handed go that far


class MiniScheduler:
    """vLLM's v1 scheduler in miniature, plus the view protocol over the step's batch.

    Running requests first, in order, each offered a chunk; one that needs blocks
    while none are free preempts the running queue's tail (itself, at worst). Then,
    unless this step preempted, waiting requests in order, each with the prefix hit
    the allocator grants, until one does not fit (FCFS). Blocks are hashed when
    scheduled, so a later request of the same step may hit them.
    """

    def __init__(self, w: Workload) -> None:
        self.block_size = w.block_size
        self.token_budget = w.token_budget
        self.resume_flavor = w.resume_flavor
        self.allocator = BlockAllocator(w.num_blocks, w.block_size)
        self.requests: dict[str, SimRequest] = {}    # id -> its latest incarnation
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.finished: list[str] = []                # since the last scheduler output
        self.last_finished: str | None = None
        self.scheduled: dict[str, int] = {}
        self.spans: dict[str, tuple[SimRequest, int, int]] = {}  # positions its rows cover
        self.batch: list[str] = []
        self.granted_hits: list[int] = []            # hit tokens of first admissions
        self.block_copies: list[tuple[int, int]] = []  # (src, dst) of this step

    def add(self, arrival: Arrival) -> None:
        """Queue a request: a fresh id, or the id of the request that finished last."""
        if arrival.reuse_id and self.last_finished is not None:
            req_id, self.last_finished = self.last_finished, None
        else:
            req_id = f"r{len(self.requests)}"
        req = SimRequest(req_id, list(arrival.prompt), len(arrival.prompt), arrival.max_tokens)
        self.requests[req_id] = req
        self.waiting.append(req)

    def live_ids(self) -> list[str]:
        return [r.req_id for r in self.running + self.waiting]

    def abort(self, req_id: str) -> None:
        req = self.requests[req_id]
        if req in self.running and req.computed < req.prompt_len:
            event("abort mid-prefill")
        self._finish(req)

    def schedule(self, ops: StepOps) -> SimpleNamespace:
        """The step's SchedulerOutput (field names as vLLM's)."""
        chunks = iter(ops.chunks)
        budget = self.token_budget
        self.scheduled, self.spans, self.block_copies = {}, {}, []
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget:
            req = self.running[i]
            n = min(next(chunks, budget), len(req.tokens) - req.computed, budget)
            if n == 0:
                i += 1
                continue
            num_new = self._blocks_for(req.computed + n) - len(req.blocks)
            while num_new > len(self.allocator.free):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.req_id)
                if victim is req:
                    break
            if req.preempted:
                break
            req.blocks += self.allocator.take([], num_new)
            self._schedule(req, n, start=req.computed)
            budget -= n
            i += 1
        new_reqs: list[SimRequest] = []
        resumed: list[SimRequest] = []
        while self.waiting and budget and not preempted:
            req = self.waiting[0]
            hit = self.allocator.lookup(req.tokens)
            h = len(hit) * self.block_size
            n = min(next(chunks, budget), len(req.tokens) - h, budget)
            num_new = self._blocks_for(h + n) - len(hit)
            if n == 0 or not self.allocator.can_take(hit, num_new):
                break
            if set(hit) & self.allocator.published_this_step:
                event("same-step hit on blocks computed in this forward")
            self.waiting.pop(0)
            self.running.append(req)
            if (ops.copy_hit and hit and hit[-1] not in self.allocator.published_this_step
                    and self.allocator.can_take(hit, num_new + 1)):
                # the KV of its last hit block is copied into a block of its own (vLLM's
                # kv_cache_block_copies): that block's rows must be the source's
                blocks = self.allocator.take(hit, num_new + 1)
                src, dst = hit[-1], blocks[len(hit)]
                self.allocator.release([src])
                req.blocks = [*hit[:-1], *blocks[len(hit):]]
                self.block_copies.append((src, dst))
                event("block copy of a hit block")
            else:
                req.blocks = self.allocator.take(hit, num_new)
            req.computed, req.num_published = h, len(hit)
            if req.preempted:
                req.preempted = False
                resumed.append(req)
                if h > req.reached:  # its hit goes past its own rows: all rows up to the hit
                    self.granted_hits.append(h)
                    event("resume hits past its own rows")
                    self._schedule(req, n, start=0)
                else:
                    self._schedule(req, n, start=h)  # only what it recomputes
            else:
                new_reqs.append(req)
                if h:
                    self.granted_hits.append(h)
                    event("prefix hit")
                self._schedule(req, n, start=0)  # hit rows, then the scheduled ones
            budget -= n
        self.allocator.end_step()
        rng = random.Random(ops.shuffle_seed)
        self.batch = list(self.scheduled)
        rng.shuffle(self.batch)
        # vLLM sends a set, in any order: a drawn order keeps examples reproducible
        finished, self.finished = sorted(set(self.finished)), []
        rng.shuffle(finished)
        return self._scheduler_output(finished, new_reqs, resumed, preempted)

    def outputs(self, pad: int, device: torch.device, omit: frozenset[str] = frozenset()
                ) -> tuple[torch.Tensor, dict[str, object]]:
        """This step's rows in batch order, then `pad` garbage rows, for every key but the mm
        keys in `omit` (the model emits none this step)."""
        def rows(key: str) -> torch.Tensor:
            width, salt = KEYS[key]
            parts = [token_rows(self.requests[r].tokens, width, salt=salt)[
                     self.requests[r].computed: self.requests[r].computed + self.scheduled[r]]
                     for r in self.batch]
            return torch.cat([*parts, torch.full((pad, width), -7.0)]).to(device)

        per_request = torch.arange(2.0 * len(self.batch)).view(-1, 2) + len(self.requests)
        mm: dict[str, object] = {}
        if "mm_feature" not in omit:
            mm["mm_feature"] = rows("mm_feature")
        if DEFERRED_KEY not in omit:
            mm["codes"] = {"audio": rows(DEFERRED_KEY)}
        mm[PER_REQUEST_KEY] = per_request.to(device)
        mm["ref"] = [len(self.batch), torch.ones(3, device=device)]
        return rows(HIDDEN_KEY), mm

    def finish_step(self) -> None:
        """After the forward: advance, sample when all known tokens are computed, finish."""
        for req_id, n in self.scheduled.items():
            req = self.requests[req_id]
            req.computed += n
            if req.computed == len(req.tokens):
                req.tokens.append(next_token(req.tokens))
                if len(req.tokens) - req.prompt_len >= req.max_tokens:
                    self._finish(req)

    # the view protocol
    def batch_req_ids(self) -> list[str]:
        return list(self.batch)

    def step_slots_cpu(self, req_ids: Sequence[str], num_scheduled_tokens: dict[str, int]
                       ) -> torch.Tensor:
        bs = self.block_size
        slots = []
        for req_id in req_ids:
            req = self.requests[req_id]
            for pos in range(req.computed, req.computed + num_scheduled_tokens[req_id]):
                slots.append(req.blocks[pos // bs] * bs + pos % bs)
        return torch.tensor(slots, dtype=torch.int64)

    # internals
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _schedule(self, req: SimRequest, n: int, *, start: int) -> None:
        """Schedule `n` tokens of `req` and publish the blocks they fill."""
        self.scheduled[req.req_id] = n
        self.spans[req.req_id] = (req, start, req.computed + n)
        req.reached = req.computed + n
        bs = self.block_size
        for i in range(req.num_published, (req.computed + n) // bs):
            self.allocator.publish(req.blocks[i], req.tokens[: (i + 1) * bs])
        req.num_published = max(req.num_published, (req.computed + n) // bs)

    def _preempt(self, req: SimRequest) -> None:
        event("preemption")
        self.allocator.release(req.blocks)
        req.blocks, req.computed, req.num_published, req.preempted = [], 0, 0, True
        self.waiting.insert(0, req)

    def _finish(self, req: SimRequest) -> None:
        """Finished or aborted: its blocks are freed now, the worker hears of it next step."""
        self.allocator.release(req.blocks)
        req.blocks = []
        (self.running if req in self.running else self.waiting).remove(req)
        self.finished.append(req.req_id)
        self.last_finished = req.req_id

    def _scheduler_output(self, finished: list[str], new_reqs: list[SimRequest],
                          resumed: list[SimRequest], preempted: list[str]) -> SimpleNamespace:
        if resumed and self.resume_flavor == "new_reqs":  # vLLM's v2 model runner
            new_reqs, resumed = new_reqs + resumed, []
        new_ids = {r.req_id for r in new_reqs}
        cached_ids = [r for r in self.scheduled if r not in new_ids]
        resumed_ids = {r.req_id for r in resumed}
        reqs = {r.req_id: r for r in self.running}
        # every version carries computed tokens; a resume's new block ids are all its blocks
        cached = SimpleNamespace(
            req_ids=cached_ids, num_computed_tokens=[reqs[r].computed for r in cached_ids],
            new_block_ids=[(list(reqs[r].blocks),) if r in resumed_ids else None
                           for r in cached_ids])
        if self.resume_flavor == "resumed_from_preemption":  # vLLM < 0.11.1
            cached.resumed_from_preemption = [r in resumed_ids for r in cached_ids]
        else:
            cached.resumed_req_ids = resumed_ids
        if new_ids & set(finished):
            event("a finished request's id starts again in the same step")
        return SimpleNamespace(
            finished_req_ids=finished,
            preempted_req_ids=set(preempted),
            kv_cache_block_copies=list(self.block_copies),
            scheduled_new_reqs=[SimpleNamespace(req_id=r.req_id, num_computed_tokens=r.computed,
                                                block_ids=(list(r.blocks),)) for r in new_reqs],
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(self.scheduled))


# --------------------------------------------------------------------------- the reference

@dataclass(frozen=True)
class Expected:
    """A request's rows of one key in one step, positions `start` on; where `lenient`, zeros
    or the positions' own rows (`true_rows`) are right too: a fault may have lost the rows."""

    start: int
    rows: torch.Tensor = field(repr=False)
    optional: bool = False                # a fault may have lost every row it had: may be absent
    lenient: torch.Tensor | None = field(default=None, repr=False)  # bool per row
    true_rows: torch.Tensor | None = field(default=None, repr=False)


@dataclass
class SavedStep:
    """A saved step until it is consumed: what materialize must hand each request."""

    step_id: int
    req_ids: list[str]  # what materialize asks for
    consume: str        # CONSUME_MODES
    leftover: dict[str, object] | None  # what it must hand back unsplit (None: no mm outputs)
    emitted: frozenset[str]      # the mm keys its forward emitted
    want: dict[str, dict[str, Expected | None]]  # req -> key -> its rows (None: no such key)


class Reference:
    """Which mm keys each slot's last write held, and from that what a saved step must hand over.

    A step's write claims every slot it computes, for every key: from then on a key
    it did not emit has no rows there, whatever the slot held before (rule 8). A
    block copy gives its destination the source's rows. The slots of a save lost to a
    fault hold unknown rows. Expectations are taken when the step is saved, which is
    when the manager plans its hit reads (a same-step hit sees this step's write).
    """

    def __init__(self, keys: Sequence[str], block_size: int) -> None:
        self.keys = list(keys)
        self.block_size = block_size
        self.slot_keys: dict[int, frozenset[str] | None] = {}  # None: unknown (a lost save)

    def _slots(self, req: SimRequest, start: int, end: int) -> list[int]:
        bs = self.block_size
        return [req.blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        bs = self.block_size
        for src, dst in copies:
            for i in range(bs):
                self.slot_keys[dst * bs + i] = self.slot_keys.get(src * bs + i, frozenset())

    def save(self, sched: MiniScheduler, emitted: frozenset[str] | None) -> None:
        """The step's write: `emitted` at every position it computes (None: the save was lost)."""
        for req_id, n in sched.scheduled.items():
            req = sched.requests[req_id]
            for slot in self._slots(req, req.computed, req.computed + n):
                self.slot_keys[slot] = emitted

    def expect(self, sched: MiniScheduler, req_ids: Sequence[str], emitted: frozenset[str]
               ) -> dict[str, dict[str, Expected | None]]:
        """What `req_ids` of the step just saved are handed (rules 5, 6): hidden rows and each
        emitted key's, from position 0 on a hit; a key the step omits only where a hit's
        slots hold rows of it. Positions with no rows of a key read zeros: computed ones of
        a key the step omits, hit ones whose slot's last write omitted it. Rows a failed write
        lost are never read, for any key: the read raises, and the step is not delivered.
        Only slots whose save raised in the engine thread (`None` in `slot_keys`) are
        unknown."""
        want: dict[str, dict[str, Expected | None]] = {}
        for req_id in req_ids:
            req, start, end = sched.spans[req_id]
            h = req.computed if start == 0 else 0  # hit positions [0, h), computed [h, end)
            states = [self.slot_keys.get(s, frozenset()) for s in self._slots(req, 0, h)]
            unknown = torch.tensor([s is None for s in states] + [False] * (end - start - h),
                                   dtype=torch.bool)
            per_key: dict[str, Expected | None] = {}
            for key in self.keys:
                width, salt = KEYS[key]
                true = token_rows(req.tokens, width, salt=salt)[start:end]
                if key == HIDDEN_KEY:  # always emitted; a hit on unwritten rows is refused
                    per_key[key] = Expected(start, true)
                    continue
                emits = key in emitted
                has = torch.tensor([s is not None and key in s for s in states]
                                   + [emits] * (end - start - h), dtype=torch.bool)
                lenient = unknown
                if not (emits or (has | lenient).any()):
                    per_key[key] = None  # no rows of it anywhere: absent, as without the cache
                    continue
                if h and not emits and has.any():
                    event("a hit keeps its cached rows of an mm key its step omits")
                if h and emits and not has[:h].all():
                    event("a hit reads zeros where its cached prefix has no rows of a key")
                per_key[key] = Expected(
                    start, torch.where(has[:, None], true, torch.zeros(())),
                    optional=not (emits or (has & ~lenient).any()),
                    lenient=lenient if lenient.any() else None, true_rows=true)
            want[req_id] = per_key
        return want

    def check(self, step: SavedStep, out: StageCacheOutputs) -> None:
        assert (out.hidden_states is None) == (HIDDEN_KEY not in self.keys)
        if step.leftover is None:
            assert not out.leftover and not out.mm_outputs
        else:
            assert torch.equal(out.leftover[PER_REQUEST_KEY],
                               step.leftover[PER_REQUEST_KEY].cpu())
            count, ones = out.leftover["ref"]
            assert count == step.leftover["ref"][0] and torch.equal(ones, torch.ones(3))
        # every key the step emits; another one only where some request's hit has its rows
        assert step.emitted <= set(out.mm_outputs), \
            f"step {step.step_id}: mm keys {sorted(out.mm_outputs)}, emitted {sorted(step.emitted)}"
        for key, per_req in out.mm_outputs.items():
            assert key in step.emitted or per_req, f"step {step.step_id}: empty {key!r}"
            assert set(per_req) <= set(step.req_ids), \
                f"step {step.step_id} {key!r}: rows of {sorted(per_req)}, asked {step.req_ids}"
        for req_id in step.req_ids:
            for key, want in step.want[req_id].items():
                got = (out.hidden_states[req_id] if key == HIDDEN_KEY
                       else out.mm_outputs.get(key, {}).get(req_id))
                what = f"step {step.step_id} request {req_id} {key!r}"
                if got is None:
                    assert want is None or want.optional, \
                        f"{what}: no rows, want positions [{want.start}, " \
                        f"{want.start + len(want.rows)})"
                    continue
                assert want is not None, f"{what}: {got.shape[0]} rows of a key it has none of"
                assert got.device.type == "cpu"
                assert_rows(got, want, what)


def assert_rows(got: torch.Tensor, want: Expected, what: str) -> None:
    rows = want.rows
    what = f"{what} positions [{want.start}, {want.start + rows.shape[0]})"
    assert got.shape == rows.shape, f"{what}: got {got.shape[0]} rows, want {rows.shape[0]}"
    ok = (got == rows).all(dim=1)
    if want.lenient is not None:
        ok |= want.lenient & ((got == want.true_rows).all(dim=1) | (got == 0).all(dim=1))
    if not ok.all():
        row = int((~ok).nonzero()[0])
        raise AssertionError(f"{what}: row {row} is {got[row].tolist()}, "
                             f"want {rows[row].tolist()}")


# --------------------------------------------------------------------------- the test

def wait_for_writes(manager: OmniPrefixCacheManager, timeout_s: float = 1.0
                    ) -> dict[str, int | float]:
    """The manager's stats once its launched writes landed (the committer lands them)."""
    deadline = time.monotonic() + timeout_s
    while (stats := manager.stats())["tasks_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.001)
    return stats


class FaultTolerantCalls:
    """Manager calls as a runner makes them once a fault was injected: an earlier failure
    reported by a call is taken and the call made again; a save whose rows cannot be had, or
    a step whose rows were lost, is a step not delivered. Without a fault, every error raises."""

    def __init__(self, armed: bool) -> None:
        self.armed = armed
        self.errors: list[BaseException] = []

    def __call__(self, call, *, may_lose: bool = False):
        for _ in range(3):
            try:
                return call()
            except OmniPrefixCacheInputError:
                raise  # the caller's own mistake, fault or no fault
            except (InjectedFault, OmniPrefixCacheError) as exc:
                if not self.armed:
                    raise
                self.errors.append(exc)
                retry = isinstance(exc, InjectedFault) or "earlier write failed" in str(exc)
                if not retry:
                    if may_lose:
                        return None  # never wrong rows: this step is simply not delivered
                    raise
        return call()


class SchedulerBatch:
    """MiniScheduler's step as a runner's persistent batch, as FullAttentionGroupView reads it:
    the batch's rows, each request's computed tokens and its row of block ids."""

    def __init__(self, sched: MiniScheduler) -> None:
        self._sched = sched

    @property
    def req_ids(self) -> list[str | None]:
        return [*self._sched.batch, None]  # a free row, as a runner's batch may have

    @property
    def req_id_to_index(self) -> dict[str, int]:
        return {r: i for i, r in enumerate(self._sched.batch)}

    @property
    def num_computed_tokens_cpu(self) -> np.ndarray:
        return np.array([self._sched.requests[r].computed for r in self._sched.batch] + [0],
                        dtype=np.int32)

    @property
    def block_table(self) -> list[SimpleNamespace]:
        rows = [self._sched.requests[r].blocks for r in self._sched.batch] + [[]]
        ids = np.zeros((len(rows), max(map(len, rows))), dtype=np.int32)
        for i, blocks in enumerate(rows):
            ids[i, :len(blocks)] = blocks
        return [SimpleNamespace(block_size=self._sched.block_size, get_numpy_array=lambda: ids)]


class RunnerView:
    """The view a runner's cache has (FullAttentionGroupView's layout: its slots as runs, and
    on the C step path in one call) over MiniScheduler's batch. It checks the table by the CPU
    runner's rules on every device: the schedules' blocks of a few tokens are smaller than any
    CUDA or Ascend attention kernel's block (those rules have tests of their own)."""

    def __init__(self, sched: MiniScheduler) -> None:
        self._view = FullAttentionGroupView(SchedulerBatch(sched), sched.block_size,
                                            backend=devices.get_backend("cpu"))
        self.batch_req_ids = self._view.batch_req_ids
        self.step_slots_cpu = self._view.step_slots_cpu
        self.step_slot_runs = self._view.step_slot_runs
        self.step_layout = self._view.step_layout


def pool_tables(manager: OmniPrefixCacheManager) -> dict[str, object]:
    """The pool's bookkeeping, copied: every table a step's claims and writes fill; and where
    each live request stands (its progress, which a step's start advances)."""
    pool = manager.pool
    tables: dict[str, object] = {
        "progress": dict(manager._rows._progress),
        "next_claim": pool._next_claim, "claim.slots": pool._claim.slots.copy(),
        "claim.blocks": pool._claim.blocks.copy(),
        "newest_slot_claim": pool._newest_slot_claim.copy(),
        "allocated_at": pool._allocated_at.copy(), "read_pins": pool._read_pins.copy()}
    for name, key in pool.keys.items():
        for table, array in zip(("version.slots", "version.blocks", "producer.slots",
                                 "producer.blocks"), key.write_tables):
            tables[f"{name}.{table}"] = array.copy()
    return tables


def pool_contents(manager: OmniPrefixCacheManager) -> dict[str, object]:
    """The pool's present rows of every key (the others were never written: their bytes are
    the allocation's), and the stats but the times, once the writes landed."""
    stats = wait_for_writes(manager)
    contents: dict[str, object] = {
        f"stats.{k}": v for k, v in stats.items() if not k.startswith("time_s")}
    slots = np.arange(manager.pool.num_slots, dtype=np.int64)
    for name, key in manager.pool.keys.items():
        present = manager.pool.present(name, slots)
        contents[f"{name}.rows"] = key.flat.cpu()[torch.from_numpy(present)].clone()
    return contents


def run_workload(backend: devices.DeviceBackend, w: Workload, *, step_path: str = "c",
                 runner_view: bool = False) -> list[dict[str, object]]:
    """Drive the manager through `w` the way a runner does, checking every materialized step;
    the pool's tables after each step (`pool_tables`), then its contents (`pool_contents`).
    `runner_view`: the manager sees the steps through `RunnerView`, not the scheduler's own."""
    faulty = FaultyBackend(backend) if w.fault is not None else None
    backend = faulty or backend
    calls = FaultTolerantCalls(faulty is not None)
    sched = MiniScheduler(w)
    config = PrefixCacheConfig(w.num_blocks, w.block_size, staging_depth=w.staging_depth,
                               staging_capacity_tokens=w.token_budget,
                               staging_claim_timeout_s=5.0, gpu_budget_bytes=w.gpu_budget_bytes,
                               write_stream=w.write_stream, step_path=step_path)
    policy = ModelCachePolicy(needs_full_hidden_states=w.hidden,
                              deferred_keys=frozenset({DEFERRED_KEY} if w.deferred else ()),
                              per_request_keys={PER_REQUEST_KEY})
    reference = Reference([k for k in KEYS if (w.hidden if k == HIDDEN_KEY else w.mm)],
                          w.block_size)
    arrivals = iter(w.arrivals)
    late: SavedStep | None = None  # saved last step, consumed during this one
    saved_tokens = 0
    states: list[dict[str, object]] = []
    view = RunnerView(sched) if runner_view else sched
    with OmniPrefixCacheManager(config, view, backend=backend) as manager:
        manager.register_policy(policy)

        def consume(step: SavedStep | None) -> None:
            if step is None:
                return
            if step.consume == "discard":
                calls(lambda: manager.discard_step(step.step_id))
                return
            out = calls(lambda: manager.materialize(step.step_id, step.req_ids), may_lose=True)
            if out is not None:
                reference.check(step, out)

        for index, ops in enumerate((*w.steps, None)):
            if faulty is not None and index == w.fault[1]:
                faulty.arm(w.fault[0])
            if ops is None:  # drain: every request retires, so all its writes must land
                for req_id in sched.live_ids():
                    sched.abort(req_id)
                ops = IDLE
            for arrival in itertools.islice(arrivals, ops.arrivals):
                sched.add(arrival)
            live = sched.live_ids()
            if ops.abort is not None and live:
                sched.abort(live[ops.abort % len(live)])
            so = sched.schedule(ops)
            calls(lambda: manager.new_step_starts(so))
            reference.copy_blocks(sched.block_copies)
            if late is not None and (late.consume == "after_next_start" or not sched.scheduled):
                consume(late)
                late = None
            if not sched.scheduled:
                event("a step with no tokens (finishes only, or padding only)")
            n = sum(sched.scheduled.values())
            hidden, mm = sched.outputs(ops.pad, backend.device, ops.omit)
            if not w.mm:
                mm = None
            if ops.reject:  # a rejected save changes nothing: the same save then goes through
                event("a rejected save, retried")
                with pytest.raises(OmniPrefixCacheInputError):
                    calls(lambda: manager.save_outputs(hidden, mm, num_tokens_unpadded=n + ops.pad
                                                       + 1, num_tokens_padded=n + ops.pad))
                with pytest.raises(OmniPrefixCacheInputError):
                    calls(lambda: manager.save_outputs(hidden, list((mm or {}).values()),
                                                       num_tokens_unpadded=n,
                                                       num_tokens_padded=n + ops.pad))
            step_id = calls(lambda: manager.save_outputs(hidden, mm, num_tokens_unpadded=n,
                                                         num_tokens_padded=n + ops.pad),
                            may_lose=True)
            emitted = frozenset(MM_KEYS) - ops.omit if w.mm else frozenset()
            reference.save(sched, None if step_id is None else emitted)
            if step_id is None:
                step = None
            else:
                req_ids = [r for i, r in enumerate(sched.batch) if not ops.drop_mask >> i & 1]
                want = reference.expect(sched, req_ids if ops.consume != "discard" else (),
                                        emitted)
                step = SavedStep(step_id, req_ids, ops.consume, mm, emitted, want)
            saved_tokens += n
            if late is not None:
                consume(late)
            late = step if step is not None and step.consume.startswith("after_next") else None
            if late is None:
                consume(step)
            sched.finish_step()
            states.append(pool_tables(manager))
        states.append(pool_contents(manager))
        stats = wait_for_writes(manager)
        if stats.get("copy_on_write_reads"):
            event("a planned read kept its rows while a new tenant took its slots")
        if faulty is not None and faulty.fired:
            event(f"an injected {w.fault[0]} fault")
            so = sched.schedule(IDLE)  # one more step: a failure is raised by the next call
            calls(lambda: manager.new_step_starts(so))
            calls(lambda: manager.discard_step(manager.save_outputs(
                None, None, num_tokens_unpadded=0, num_tokens_padded=0)))
            assert calls.errors, f"an injected {w.fault[0]} fault went unreported"
            assert (stats["tasks_in_flight"], stats["deferred_device_bytes"]) == (0, 0)
            return states  # lost steps make the hit counts differ from the sim's; rows checked
        assert stats["steps_unconsumed"] == 0
        assert (stats["tasks_in_flight"], stats["deferred_device_bytes"]) == (0, 0), \
            "writes still held after every request retired"
        counted = {k: stats.get(k, 0) for k in ("hit_tokens", "hit_requests", "miss_tokens")}
        assert counted == {"hit_tokens": sum(sched.granted_hits),
                           "hit_requests": len(sched.granted_hits), "miss_tokens": saved_tokens}
    return states


#: Rare for the generator, so pinned: r1 computes 9 tokens, its deferred write open; r0
#: needs blocks, preempts r1 and takes r1's freed tail blocks; r2 hits r1's surviving head
#: blocks, which forces r1's write out, and that write must drop the rows of the slots r0
#: holds now (r2 reads one of them).
PREEMPTED_WITH_OPEN_DEFERRED_WRITE = Workload(
    block_size=2, num_blocks=8, token_budget=10, staging_depth=2, hidden=True, deferred=True,
    gpu_budget_bytes=512 << 20, resume_flavor="resumed_req_ids",
    arrivals=(Arrival((7,) * 9, 1, False), Arrival((7,) * 10, 1, False),
              Arrival((7,) * 7, 1, False)),
    steps=(StepOps(arrivals=3, abort=None, chunks=(1,), shuffle_seed=0, pad=0, consume="now",
                   drop_mask=0), IDLE, IDLE))


#: The cached prefix holds rows of both mm keys; the step of a request that hits it emits
#: `mm_feature` only (the deferred key's rows still wait on the device when it is saved):
#: its hit rows of the omitted key come back, its computed positions read zeros (rule 5).
HIT_BY_A_STEP_THAT_OMITS_A_KEY = Workload(
    block_size=2, num_blocks=8, token_budget=4, staging_depth=2, hidden=True, deferred=True,
    gpu_budget_bytes=512 << 20, resume_flavor="resumed_req_ids",
    arrivals=(Arrival((5, 6, 7), 2, False), Arrival((5, 6, 8), 1, False)),
    steps=(StepOps(arrivals=1, abort=None, chunks=(), shuffle_seed=0, pad=0, consume="now",
                   drop_mask=0),
           StepOps(arrivals=1, abort=None, chunks=(0,), shuffle_seed=0, pad=1, consume="now",
                   drop_mask=0, omit=frozenset({DEFERRED_KEY})),
           IDLE))


#: Two requests prefill, then decode a token a step: steps of running requests only (the C
#: step path's start in one call, `_core.running_step`), their deferred writes still open.
DECODING_BATCH = Workload(
    block_size=2, num_blocks=8, token_budget=8, staging_depth=2, hidden=True, deferred=True,
    gpu_budget_bytes=512 << 20, resume_flavor="resumed_req_ids",
    arrivals=(Arrival((3, 4, 5), 4, False), Arrival((3, 4, 6, 7), 4, False)),
    steps=(StepOps(arrivals=2, abort=None, chunks=(), shuffle_seed=0, pad=0, consume="now",
                   drop_mask=0),
           IDLE, StepOps(arrivals=0, abort=None, chunks=(), shuffle_seed=1, pad=1,
                         consume="after_next_save", drop_mask=1), IDLE, IDLE))
#: ... handing over hidden states alone (the C step path checks those steps in one call,
#: `_core.hidden_rows`), padded rows among them.
DECODING_HIDDEN_STATES = replace(DECODING_BATCH, deferred=False, mm=False)


@settings(settings.get_profile("prefix-cache-random"))
@pytest.mark.slow
@given(workload=workloads())
@example(workload=PREEMPTED_WITH_OPEN_DEFERRED_WRITE)
@example(workload=HIT_BY_A_STEP_THAT_OMITS_A_KEY)
def test_random_schedules_match_the_reference_model(backend: devices.DeviceBackend,
                                                    workload: Workload) -> None:
    if workload.deferred and workload.gpu_budget_bytes < 1 << 20:
        event("deferred key under a small device budget")
    run_workload(devices.get_backend(backend.name), workload)


def assert_same_states(got: list[dict[str, object]], want: list[dict[str, object]]) -> None:
    """Step for step, the same tables, bit for bit, then the same rows and stats."""
    assert len(got) == len(want), f"{len(got)} steps against {len(want)}"
    for step, (mine, theirs) in enumerate(zip(got, want)):
        assert mine.keys() == theirs.keys(), f"step {step}: {sorted(mine)} != {sorted(theirs)}"
        for name, value in theirs.items():
            if isinstance(value, torch.Tensor):
                same = torch.equal(mine[name].view(torch.uint8), value.view(torch.uint8))
            elif hasattr(value, "shape"):
                same = (mine[name] == value).all()
            else:
                same = mine[name] == value
            assert same, f"step {step}: {name} differs: {mine[name]} against {value}"


def step_paths_agree(backend: devices.DeviceBackend, workload: Workload, *,
                     runner_view: bool = True) -> None:
    """`workload` under each step path: the C path keeps what the Python reference keeps."""
    states = {path: run_workload(devices.get_backend(backend.name), workload, step_path=path,
                                 runner_view=runner_view)
              for path in STEP_PATHS}
    for path in STEP_PATHS[:-1]:
        assert_same_states(states[path], states["python"])


@settings(settings.get_profile("prefix-cache-random"), phases=[Phase.explicit])
@given(workload=workloads())
@example(workload=PREEMPTED_WITH_OPEN_DEFERRED_WRITE)
@example(workload=HIT_BY_A_STEP_THAT_OMITS_A_KEY)
@example(workload=DECODING_BATCH)
@example(workload=DECODING_HIDDEN_STATES)
def test_step_paths_agree_on_pinned_schedules(backend: devices.DeviceBackend,
                                              workload: Workload) -> None:
    step_paths_agree(backend, workload, runner_view=False)
    step_paths_agree(backend, workload)


@settings(settings.get_profile("prefix-cache-random"),
          max_examples=max(1, settings.get_profile("prefix-cache-random").max_examples // 4))
@pytest.mark.slow
@given(workload=workloads().map(lambda w: replace(w, fault=None)))
def test_step_paths_agree_on_random_schedules(backend: devices.DeviceBackend,
                                              workload: Workload) -> None:
    """The same random schedule under the C step path and the Python reference: the pool's
    tables after every step, its rows and the stats equal bit for bit (and each run's
    materialized rows match the reference model). Without faults: when the committer's
    thread lands a failed write, and which call reports it, is the threads' timing."""
    step_paths_agree(backend, workload)


@settings(settings.get_profile("prefix-cache-random"),
          max_examples=max(1, settings.get_profile("prefix-cache-random").max_examples // 4))
@pytest.mark.slow
@given(workload=workloads())
@example(workload=PREEMPTED_WITH_OPEN_DEFERRED_WRITE)
@example(workload=HIT_BY_A_STEP_THAT_OMITS_A_KEY)
def test_random_schedules_with_every_hit_gathered_during_the_forward(
        backend: devices.DeviceBackend, workload: Workload,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The random schedules with every hit read, however small, gathered on the prefetch
    thread from its step's start (the reference model's rows, as in-line gathers give)."""
    monkeypatch.setattr(reads, "PREFETCH_MIN_BYTES", 0)
    run_workload(devices.get_backend(backend.name), workload)
