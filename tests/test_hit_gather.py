"""A prefix hit's rows gathered from the step's start: while the forward runs, never on the engine
thread, and only ever the hit's own rows."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout

import numpy as np
import pytest
import torch

from prefix_cache import (OmniPrefixCacheError, OmniPrefixCacheManager, OmniPrefixCacheUnmatchError,
                          PrefixCacheConfig)
from prefix_cache.core import reads
from prefix_cache.core.hits import StepHits, blocks_written, hit_slots
from prefix_cache.core.residency import PoolMoves
from prefix_cache.core.runs import slot_runs
from prefix_cache.devices import get_backend
from tests.sim import StepDriver, token_rows
from tests.test_capped_pool import Slots, step

BS = 4
WAIT_S = 10.0  # bound of every wait on the gate


class GatherGate:
    """Wraps a pool's `gather`: calls on the prefetch thread (the hit gathers started at a
    step's start) are counted, wait for `release` while `hold` is set, and raise `fault` if
    set; `entered` opens when one starts, `finished` when one returns (`gathered` counts
    those)."""

    def __init__(self, manager: OmniPrefixCacheManager, *, hold: bool = False,
                 fault: BaseException | None = None) -> None:
        self._gather = manager.pool.gather
        self.hold, self.fault = hold, fault
        self.entered, self.released, self.finished = (threading.Event(), threading.Event(),
                                                      threading.Event())
        self.calls = 0
        self.gathered = threading.Semaphore(0)
        manager.pool.gather = self

    def __call__(self, name: str, slots: np.ndarray, out: torch.Tensor) -> None:
        if threading.current_thread().name.startswith("omni-prefix-cache-prefetch"):
            self.calls += 1
            self.entered.set()
            if self.hold:
                assert self.released.wait(WAIT_S), "the test never released the gather"
            if self.fault is not None:
                raise self.fault
            self._gather(name, slots, out)
            self.finished.set()
            self.gathered.release()
            return
        self._gather(name, slots, out)


@pytest.fixture
def gathered_early(monkeypatch):
    """Every hit read is large enough for the prefetch thread."""
    monkeypatch.setattr(reads, "PREFETCH_MIN_BYTES", 0)


def make(backend, num_blocks: int = 16) -> tuple[OmniPrefixCacheManager, StepDriver]:
    driver = StepDriver(block_size=BS)
    return OmniPrefixCacheManager(PrefixCacheConfig(num_blocks, BS, staging_claim_timeout_s=5.0),
                                  driver, backend=backend), driver


def save(manager: OmniPrefixCacheManager, d: StepDriver, device: torch.device, *,
         plan_reads: bool = True) -> int:
    n = sum(d.scheduled.values())
    return manager.save_outputs(d.outputs(2).to(device),
                                {"mm_feature": d.outputs(16, salt=1).to(device)},
                                num_tokens_unpadded=n, num_tokens_padded=n,
                                plan_reads=plan_reads)


A = list(range(40, 48))
B = A + [5, 5, 5, 5]  # hits a's two blocks, computes a third


def hit_step(manager: OmniPrefixCacheManager, d: StepDriver, device: torch.device) -> None:
    """a computes two blocks (its step materialized); then b's step starts, hitting them."""
    manager.new_step_starts(d.step(new=[("a", A, [1, 2], 0, 8)]))
    manager.materialize(save(manager, d, device), ["a"])
    d.advance()
    manager.new_step_starts(d.step(new=[("b", B, [1, 2, 3], 8, 4)]))


def nothing_pinned(manager: OmniPrefixCacheManager) -> bool:
    return not manager.pool.any_pinned(np.arange(manager.pool.num_slots))


def test_a_hit_is_gathered_from_the_steps_start_into_the_rows_materialize_hands_out(
        backend, gathered_early):
    manager, d = make(backend)
    with manager:
        gate = GatherGate(manager)
        hit_step(manager, d, backend.device)
        for _ in range(2):  # one read per key the hit has rows of, before save_outputs: while
            assert gate.gathered.acquire(timeout=WAIT_S)  # the forward runs
        got = manager.materialize(save(manager, d, backend.device), ["b"])
        assert torch.equal(got.hidden_states["b"], token_rows(B, 2))  # bit for bit
        assert torch.equal(got.mm_outputs["mm_feature"]["b"], token_rows(B, 16, salt=1))
        assert gate.calls == 2  # none gathered again
        assert nothing_pinned(manager)


def test_the_engine_thread_never_waits_for_a_hits_gather_only_materialize_does(
        backend, gathered_early):
    manager, d = make(backend)
    with manager, ThreadPoolExecutor(1) as output_thread:
        gate = GatherGate(manager, hold=True)
        hit_step(manager, d, backend.device)  # new_step_starts returned: the gather is held
        assert gate.entered.wait(WAIT_S)
        step_id = save(manager, d, backend.device)  # returns, the gather still held
        materialized = output_thread.submit(manager.materialize, step_id, ["b"])
        with pytest.raises(FutureTimeout):
            materialized.result(timeout=0.2)  # waits for the gather
        gate.released.set()
        got = materialized.result(timeout=WAIT_S)
        assert torch.equal(got.hidden_states["b"], token_rows(B, 2))
        assert nothing_pinned(manager)


def test_discarding_the_step_drops_its_gather_at_once(backend, gathered_early):
    manager, d = make(backend)
    with manager:
        gate = GatherGate(manager, hold=True)
        hit_step(manager, d, backend.device)
        assert gate.entered.wait(WAIT_S)
        manager.discard_step(save(manager, d, backend.device))  # no wait for the held gather
        assert nothing_pinned(manager)  # its blocks may be written again at once
        gate.released.set()
        assert gate.finished.wait(WAIT_S)
        d.advance()
        manager.new_step_starts(d.step(cached={"b": 1}, new_blocks={"b": [5]}))
        d.reqs["b"].tokens.append(9)
        got = manager.materialize(save(manager, d, backend.device), ["b"])
        assert torch.equal(got.hidden_states["b"], token_rows(d.reqs["b"].tokens, 2)[12:13])
        assert nothing_pinned(manager)


def test_a_failed_gather_fails_materialize_naming_the_request_and_step(backend, gathered_early):
    manager, d = make(backend)
    with manager:
        gate = GatherGate(manager, fault=RuntimeError("injected gather fault"))
        hit_step(manager, d, backend.device)
        step_id = save(manager, d, backend.device)
        assert gate.entered.wait(WAIT_S)  # on the prefetch thread (else materialize gathers)
        with pytest.raises(OmniPrefixCacheError, match=rf"request b step {step_id} \(FAILED\)"
                                                       rf".*injected gather fault"):
            manager.materialize(step_id, ["b"])
        assert nothing_pinned(manager)
        gate.fault = None  # the cache goes on: the next hit is served
        d.advance()
        c = A + [6, 6, 6, 6]
        manager.new_step_starts(d.step(new=[("c", c, [1, 2, 4], 8, 4)]))
        got = manager.materialize(save(manager, d, backend.device), ["c"])
        assert torch.equal(got.hidden_states["c"], token_rows(c, 2))


def test_steps_read_back_at_the_finish_gather_no_hit(backend, gathered_early):
    manager, d = make(backend)
    with manager:
        gate = GatherGate(manager)
        manager.new_step_starts(d.step(new=[("a", A, [1, 2], 0, 8)]))
        manager.discard_step(save(manager, d, backend.device, plan_reads=False))
        d.advance()
        manager.new_step_starts(d.step(new=[("b", B, [1, 2, 3], 8, 4)]))
        manager.discard_step(save(manager, d, backend.device, plan_reads=False))
        assert gate.calls == 0 and nothing_pinned(manager)


def test_a_hit_on_a_block_its_own_step_computes_never_gets_the_blocks_former_rows(
        backend, gathered_early):
    """vLLM caches a block at scheduling, so a request may hit a block the same forward fills;
    until the step's write, the pool holds the block's former tenant's rows there, which read
    as present. The gather started at the step's start read those: the save drops it."""
    manager, d = make(backend)
    z, c = [7, 7, 7, 7], list(range(90, 98))
    e = c[:4] + [6, 6, 6, 6]
    with manager:
        gate = GatherGate(manager)
        manager.new_step_starts(d.step(new=[("z", z, [4], 0, 4)]))
        manager.materialize(save(manager, d, backend.device), ["z"])
        d.advance()
        # block 4, z's until now, goes to c, which fills it in this step; e hits it at once
        manager.new_step_starts(d.step(new=[("c", c, [4, 5], 0, 8), ("e", e, [4, 6], 4, 4)],
                                       finished=["z"]))
        assert gate.finished.wait(WAIT_S)  # z's rows gathered for e before the save
        got = manager.materialize(save(manager, d, backend.device), ["c", "e"])
        assert torch.equal(got.hidden_states["e"], token_rows(e, 2))
        assert torch.equal(got.mm_outputs["mm_feature"]["e"], token_rows(e, 16, salt=1))
        assert torch.equal(got.hidden_states["c"], token_rows(c, 2))
        assert nothing_pinned(manager)


def test_a_request_finished_before_its_step_is_materialized_still_gets_its_own_rows(
        backend, gathered_early):
    """The output thread may materialize a step after the next one retired a request of it
    and gave its blocks to a new tenant, who writes them: the hit's rows stay the request's."""
    manager, d = make(backend, num_blocks=8)
    with manager:
        gate = GatherGate(manager)
        hit_step(manager, d, backend.device)
        step_id = save(manager, d, backend.device)
        for _ in range(2):  # b's hit rows of both keys gathered during the forward
            assert gate.gathered.acquire(timeout=WAIT_S)
        d.advance()
        f = list(range(200, 212))
        manager.new_step_starts(d.step(new=[("f", f, [1, 2, 3], 0, 12)], finished=["a", "b"]))
        later = save(manager, d, backend.device)  # f overwrites b's blocks
        got = manager.materialize(step_id, ["b"])
        assert torch.equal(got.hidden_states["b"], token_rows(B, 2))
        assert torch.equal(manager.materialize(later, ["f"]).hidden_states["f"],
                           token_rows(f, 2))
        assert nothing_pinned(manager)


def test_blocks_under_a_gather_are_not_written_again_until_it_is_done(backend, gathered_early):
    """A wait on a gather outside materialize: a request finished before its step was
    materialized, and the next step writes its blocks again (vLLM gave them to a new tenant; a
    capped pool's eviction is the same write). The write waits for the gather under way
    (bounded, as a copy-on-write), so the gather never reads rows being overwritten."""
    manager, d = make(backend, num_blocks=8)
    with manager, ThreadPoolExecutor(1) as engine_thread:
        gate = GatherGate(manager, hold=True)
        hit_step(manager, d, backend.device)
        step_id = save(manager, d, backend.device)
        assert gate.entered.wait(WAIT_S)
        d.advance()
        f = list(range(200, 212))
        manager.new_step_starts(d.step(new=[("f", f, [1, 2, 3], 0, 12)], finished=["a", "b"]))
        saving = engine_thread.submit(save, manager, d, backend.device)  # f writes b's blocks
        with pytest.raises(FutureTimeout):
            saving.result(timeout=0.2)
        gate.released.set()
        later = saving.result(timeout=WAIT_S)
        assert torch.equal(manager.materialize(step_id, ["b"]).hidden_states["b"],
                           token_rows(B, 2))
        assert torch.equal(manager.materialize(later, ["f"]).hidden_states["f"],
                           token_rows(f, 2))
        assert nothing_pinned(manager)


def test_a_steps_hit_slots_in_one_pass_equal_each_hits_own_and_refuse_by_name() -> None:
    hits = [("x", 8, (3, 1, 9)), ("y", 4, (2,)), ("z", 12, (5, 6, 7, 8))]
    joined = StepHits.of_blocks(hits, BS, 16)
    assert joined.req_ids == ("x", "y", "z") and joined.tokens == (8, 4, 12)
    for i, (req_id, h, blocks) in enumerate(hits):
        assert np.array_equal(joined.slots_of(i), hit_slots(req_id, h, blocks, BS, 16))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="request y: prefix hit of 6 tokens"):
        StepHits.of_blocks([hits[0], ("y", 6, (2, 4))], BS, 16)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"request z: hit block ids \[5, 16\]"):
        StepHits.of_blocks([hits[0], ("z", 8, (5, 16))], BS, 16)


def test_blocks_written_marks_exactly_the_blocks_a_run_touches() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        slots = np.unique(rng.integers(0, 64 * BS, rng.integers(0, 40)))
        runs = slot_runs(slots)[0] if len(slots) else np.zeros((0, 2), dtype=np.int64)
        runs = runs[rng.permutation(len(runs))]  # a step's runs come in batch order
        blocks = rng.integers(0, 64, 20)
        expected = np.isin(blocks, slots // BS)
        assert np.array_equal(blocks_written(runs, blocks, BS), expected)


def test_a_capped_pools_eviction_waits_for_a_hit_gather_and_the_hit_keeps_its_rows(
        gathered_early) -> None:
    """A capped pool's eviction is a new tenant's write: it resolves the pinned read first. b's hit on KV block 7 (pool block 1) is gathered from
    its step's start (held); the next step evicts pool blocks 1 and 2 for f, whose save waits
    for the gather; b's step, materialized after, still gets a's rows."""

    bs, width = 4, 8
    view = Slots(bs)
    config = PrefixCacheConfig(num_blocks=16, block_size=bs, pool_blocks=4,
                               staging_claim_timeout_s=5.0)
    with OmniPrefixCacheManager(config, view, backend=get_backend("cpu")) as manager, \
            ThreadPoolExecutor(1) as engine_thread:
        gate = GatherGate(manager, hold=True)

        def start(req_id, tokens, blocks, hit, moves, finished=()):
            view.blocks[req_id], view.computed[req_id], view.batch = blocks, hit, [req_id]
            manager.new_step_starts(step([(req_id, hit, blocks)], {req_id: len(tokens) - hit},
                                         moves, finished))

        def save_rows(tokens, hit):
            rows = token_rows(tokens, width)[hit:]
            return manager.save_outputs(rows, None, num_tokens_unpadded=len(rows),
                                        num_tokens_padded=len(rows))

        a = list(range(1, 9))
        start("a", a, [7, 8], 0, PoolMoves(np.array([7, 8]), np.array([1, 2])))
        manager.materialize(save_rows(a, 0), ["a"])
        b = a[:4] + [50, 51, 52, 53]
        start("b", b, [7, 9], 4, PoolMoves(np.array([9]), np.array([3])))
        assert gate.entered.wait(WAIT_S)  # b's hit gather, held
        sid_b = save_rows(b, 4)
        f = list(range(100, 108))
        start("f", f, [10, 11], 0, PoolMoves(np.array([10, 11]), np.array([1, 2]), evicted=2),
              finished=("a", "b"))
        saving = engine_thread.submit(save_rows, f, 0)  # f's write takes pool blocks 1 and 2
        with pytest.raises(FutureTimeout):
            saving.result(timeout=0.2)  # waits for the gather under way (bounded)
        gate.released.set()
        sid_f = saving.result(timeout=WAIT_S)
        assert torch.equal(manager.materialize(sid_b, ["b"]).hidden_states["b"],
                           token_rows(b, width))
        assert torch.equal(manager.materialize(sid_f, ["f"]).hidden_states["f"],
                           token_rows(f, width))
        assert nothing_pinned(manager)


def test_a_block_copy_onto_a_block_under_a_hit_gather_waits_for_it(backend, gathered_early):
    """BlockCopyMirror's destination is a write too: a copy onto a block b's held gather reads
    (b finished before its step was materialized) waits for the gather; b keeps its rows."""
    manager, d = make(backend, num_blocks=8)
    with manager, ThreadPoolExecutor(1) as engine_thread:
        gate = GatherGate(manager, hold=True)
        hit_step(manager, d, backend.device)
        sid_b = save(manager, d, backend.device)
        assert gate.entered.wait(WAIT_S)
        d.advance()
        so = d.step(finished=["a", "b"])
        so.kv_cache_block_copies = [(3, 1)]  # block 3's rows (b's own) copied onto block 1
        starting = engine_thread.submit(manager.new_step_starts, so)
        with pytest.raises(FutureTimeout):
            starting.result(timeout=0.2)
        gate.released.set()
        starting.result(timeout=WAIT_S)
        manager.discard_step(manager.save_outputs(
            torch.empty((0, 2), device=backend.device), None, num_tokens_unpadded=0,
            num_tokens_padded=0))
        got = manager.materialize(sid_b, ["b"])
        assert torch.equal(got.hidden_states["b"], token_rows(B, 2))
        assert torch.equal(got.mm_outputs["mm_feature"]["b"], token_rows(B, 16, salt=1))
        assert nothing_pinned(manager)
