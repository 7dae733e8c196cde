"""prefix_cache.core._core against the numpy it replaces, and its refusals of what would touch memory
out of bounds (raised before anything is written)."""

from __future__ import annotations

from types import MappingProxyType, SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefix_cache.config import HIDDEN_KEY, STEP_PATHS, ModelCachePolicy
from prefix_cache.core import _core, adapter
from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.outputs import OutputChecker
from prefix_cache.devices.cpu import CpuBackend
from prefix_cache.core.runs import runs_slots, slot_runs


def _numpy_slots(req_ids, scheduled, index_of, computed, table, unit):
    """The formula vLLM's runner uses (`slot = table[row, pos // unit] * unit + pos % unit`)."""
    parts = []
    for req in req_ids:
        row = index_of[req]
        positions = int(computed[row]) + np.arange(scheduled[req])
        parts.append(table[row, positions // unit].astype(np.int64) * unit + positions % unit)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@st.composite
def batches(draw):
    num_rows = draw(st.integers(1, 6))
    width = draw(st.integers(1, 8))
    unit = draw(st.sampled_from([1, 4, 16]))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    if draw(st.booleans()):  # a fresh pool: each request's blocks follow one another
        table = np.arange(1, num_rows * width + 1, dtype=dtype)
    else:
        table = np.array(draw(st.lists(st.integers(0, 1000), min_size=num_rows * width,
                                       max_size=num_rows * width)), dtype=dtype)
    rows = draw(st.permutations(range(num_rows)))
    req_ids = [f"req-{r}" for r in rows[: draw(st.integers(0, num_rows))]]
    computed = np.zeros(num_rows, dtype=dtype)
    scheduled = {}
    for req in req_ids:
        row = int(req.split("-")[1])
        computed[row] = draw(st.integers(0, width * unit - 1))
        scheduled[req] = draw(st.integers(0, width * unit - int(computed[row])))
    index_of = {f"req-{r}": r for r in range(num_rows)}
    return req_ids, scheduled, index_of, computed, table.reshape(num_rows, width), unit


@settings(max_examples=300, deadline=None)
@given(batches())
def test_request_runs_hold_the_runner_formula_slots(batch) -> None:
    req_ids, scheduled, index_of, computed, table, unit = batch
    expected = _numpy_slots(*batch)
    tokens = sum(scheduled[r] for r in req_ids)
    runs = np.full((tokens // unit + 2 * len(req_ids), 2), -7, dtype=np.int64)

    k, low, high = _core.request_runs(req_ids, scheduled, index_of, computed, table, unit, runs)

    found = runs[:k]
    assert runs_slots(found).tolist() == expected.tolist()
    assert (found[:, 1] > found[:, 0]).all() and (found[1:, 0] != found[:-1, 1]).all()
    assert (low, high) == ((expected.min(), expected.max()) if len(expected) else (0, -1))
    assert _core.run_stats(runs[:k]) == (len(expected), low, high)


def test_request_runs_refuses_positions_past_the_table_and_too_few_runs() -> None:
    table = np.arange(8, dtype=np.int32).reshape(2, 4)
    computed = np.array([14, 0], dtype=np.int32)
    index_of = {"a": 0, "b": 1}
    runs = np.zeros((8, 2), dtype=np.int64)

    with pytest.raises(IndexError, match="'a'.*14..16 need blocks past the table's 4"):
        _core.request_runs(["a"], {"a": 3}, index_of, computed, table, 4, runs)
    with pytest.raises(IndexError, match="batch row 5"):
        _core.request_runs(["a"], {"a": 1}, {"a": 5}, computed, table, 4, runs)
    with pytest.raises(KeyError, match="'c'"):
        _core.request_runs(["c"], {"c": 1}, index_of, computed, table, 4, runs)
    scattered = np.array([[7, 5, 3, 1]], dtype=np.int32)  # blocks that never touch
    with pytest.raises(ValueError, match="more than the 2 runs"):
        _core.request_runs(["b"], {"b": 12}, {"b": 0}, np.zeros(1, dtype=np.int32), scattered,
                           4, runs[:2])
    assert not runs[2:].any()


def test_row_ends() -> None:
    ends = np.zeros(3, dtype=np.int64)
    assert _core.row_ends(["a", "b", "c"], {"a": 2, "b": 0, "c": 5}, ends) == (7, 0)
    assert ends.tolist() == [2, 2, 7]
    assert _core.row_ends([], {}, np.zeros(0, dtype=np.int64)) == (0, 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 63), max_size=40))
def test_slot_runs_round_trip(slots) -> None:
    index = np.array(slots, dtype=np.int64)
    runs, low, high = slot_runs(index)

    assert runs_slots(runs).tolist() == slots
    assert ((runs[:, 1] > runs[:, 0]).all() and (runs[1:, 0] != runs[:-1, 1]).all())
    assert (low, high) == ((min(slots), max(slots)) if slots else (0, -1))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]),
       st.lists(st.lists(st.integers(0, 31), max_size=20), min_size=1, max_size=6),
       st.lists(st.integers(0, 31), max_size=4), st.integers(0, 8))
def test_tiered_fills_and_any_held_match_a_table_per_slot(block_size, writes, pinned,
                                                          held_from) -> None:
    # claims only grow: fill i writes claim i + 1, and a second table (a producer) beside it
    claims, producers = np.zeros(32, dtype=np.int64), np.zeros(32, dtype=np.int64)
    slot_tier, block_tier = np.zeros(32, dtype=np.int64), np.zeros(32 // block_size, np.int64)
    made_slots, made_blocks = slot_tier.copy(), block_tier.copy()
    newest = block_tier.copy()
    for i, slots in enumerate(writes):
        index = np.array(slots, dtype=np.int64)
        claims[index], producers[index] = i + 1, 100 + i
        _core.fill_tiers(slot_runs(index)[0], block_size, newest, slot_tier, block_tier, i + 1,
                         made_slots, made_blocks, 100 + i)

    blocks = np.arange(32) // block_size
    from_block = block_tier[blocks] > slot_tier
    assert np.maximum(block_tier[blocks], slot_tier).tolist() == claims.tolist()
    assert np.where(from_block, made_blocks[blocks], made_slots).tolist() == producers.tolist()
    pins = np.zeros(32, dtype=np.int32)
    pins[pinned] = 1
    block_pins = np.bincount(blocks, weights=pins).astype(np.int32)
    for slots in writes:
        index = np.array(slots, dtype=np.int64)
        runs = slot_runs(index)[0]
        held = bool(len(index)) and bool((claims[index] >= held_from).any())
        assert _core.any_held(runs, block_size, held_from, slot_tier, block_tier, newest, None,
                              None) is held
        assert _core.any_held(runs, block_size, held_from, slot_tier, block_tier, newest, pins,
                              block_pins) is (held or bool(len(index)) and bool(pins[index].any()))


def test_whole_blocks_take_one_entry_each() -> None:
    slot_tier, block_tier, newest = (np.zeros(n, np.int64) for n in (16, 4, 4))
    _core.fill_tiers(np.array([[2, 13]]), 4, newest, slot_tier, block_tier, 7)
    assert block_tier.tolist() == [0, 7, 7, 0]
    assert slot_tier.tolist() == [0, 0, 7, 7] + [0] * 8 + [7, 0, 0, 0]
    assert newest.tolist() == [7, 0, 0, 7]


def test_pins_count_per_slot_and_per_block() -> None:
    pins, block_pins = np.zeros(16, dtype=np.int32), np.zeros(4, dtype=np.int32)
    _core.add_pins(np.array([1, 2, 9, 15]), 4, pins, block_pins, 1)
    _core.add_pins(np.array([2, 3]), 4, pins, block_pins, 1)
    _core.add_pins(np.array([1, 2]), 4, pins, block_pins, -1)
    assert pins.nonzero()[0].tolist() == [2, 3, 9, 15] and pins[2] == 1
    assert block_pins.tolist() == [2, 0, 1, 1]
    with pytest.raises(IndexError, match="slot 16 .index 1. is outside 0..15"):
        _core.add_pins(np.array([0, 16]), 4, pins, block_pins, 1)
    with pytest.raises(TypeError, match="int32 counts"):
        _core.add_pins(np.array([0]), 4, pins.astype(np.int64), block_pins, 1)
    assert pins[0] == 0 and block_pins.tolist() == [2, 0, 1, 1]


def test_bad_runs_and_wrong_arrays_are_refused_before_any_write() -> None:
    table, blocks, newest = (np.zeros(n, np.int64) for n in (16, 4, 4))
    pins, block_pins = np.zeros(16, dtype=np.int32), np.zeros(4, dtype=np.int32)

    def fill(runs, *tables, value=5, block_size=4):
        _core.fill_tiers(np.array(runs), block_size, newest, *tables, value)

    def held(runs, *, pins=pins, block_pins=block_pins, block_size=4, claims=table):
        return _core.any_held(np.array(runs), block_size, 1 << 40, claims, blocks, newest, pins,
                              block_pins)

    for bad in ([[3, 4], [15, 17]], [[-1, 2]], [[5, 5]], [[6, 4]]):
        with pytest.raises(IndexError, match="not a range within 0..15"):
            fill(bad, table, blocks)
        with pytest.raises(IndexError, match="not a range within 0..15"):
            held(bad)
    assert not (table.any() or blocks.any() or newest.any())
    with pytest.raises(TypeError, match="int64"):
        _core.fill_tiers(np.array([[1, 2]], dtype=np.int32), 4, newest, table, blocks, 5)
    with pytest.raises(ValueError, match=r"\[k, 2\] runs"):
        fill([[1, 2, 3]], table, blocks)
    with pytest.raises(TypeError, match="C-contiguous writable"):
        fill([[1, 2]], table[::2], blocks)
    with pytest.raises(TypeError, match="1-D int64 array, got format 'd'"):
        fill([[1, 2]], table.astype(np.float64), blocks)
    with pytest.raises(ValueError, match="do not make blocks of 3 slots"):
        fill([[1, 2]], table, blocks, block_size=3)
    with pytest.raises(ValueError, match="a slot tier of 16 and a block tier of 3"):
        fill([[1, 2]], table, blocks[:3])
    with pytest.raises(ValueError, match="tables of 16 and 8 slots"):
        _core.fill_tiers(np.array([[1, 2]]), 4, newest, table, blocks, 1, table[:8], blocks[:2], 5)
    with pytest.raises(TypeError, match="1 to 2 .slots, blocks, value. triples"):
        _core.fill_tiers(np.array([[1, 2]]), 4, newest, table, blocks)
    with pytest.raises(ValueError, match="newest has 2 entries for 4 blocks"):
        _core.fill_tiers(np.array([[1, 2]]), 4, newest[:2], table, blocks, 5)
    with pytest.raises(ValueError, match="both given or both None"):
        held([[1, 2]], block_pins=None)
    with pytest.raises(ValueError, match=r"read_pins \(3\)"):
        held([[1, 2]], pins=pins[:3])
    with pytest.raises(ValueError, match="slot tier of 12"):
        held([[1, 2]], claims=table[:12])
    with pytest.raises(ValueError, match="runs must be"):
        _core.slot_runs(np.arange(4), np.empty((3, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="hold 3 slots, out has room for 2"):
        _core.runs_slots(np.array([[1, 4]]), np.empty(2, dtype=np.int64))
    with pytest.raises(ValueError, match="run 1, 6..6, is empty"):
        _core.run_stats(np.array([[1, 4], [6, 6]]))
    assert not (table.any() or blocks.any() or newest.any())


def test_row_states_refuses_a_slot_outside_the_tables_before_writing() -> None:
    tiers = [np.zeros(n, dtype=np.int64) for n in (16, 4) * 3]
    state, producers = np.full(3, 7, dtype=np.int32), np.full(3, 7, dtype=np.int64)
    with pytest.raises(IndexError, match="slot 16 outside the pool's 16"):
        _core.row_states(np.array([1, 16, 2]), 4, *tiers, state, producers)
    with pytest.raises(IndexError, match="slot -1 outside"):
        _core.row_states(np.array([-1]), 4, *tiers, state[:1], producers)
    assert (state == 7).all() and (producers == 7).all()
    with pytest.raises(ValueError, match="state .int32. of 3"):
        _core.row_states(np.array([1, 2, 3]), 4, *tiers, state.astype(np.int64), producers)
    with pytest.raises(ValueError, match="producers of 2 for 3 slots"):
        _core.row_states(np.array([1, 2, 3]), 4, *tiers, state, producers[:2])
    with pytest.raises(ValueError, match="a slot tier of 16 and a block tier of 3"):
        _core.row_states(np.array([1]), 4, tiers[0], tiers[1][:3], *tiers[2:], state[:1],
                         producers)


def test_add_counts_adds_into_totals() -> None:
    totals = {"a": 3, "b": 1}
    _core.add_counts(totals, {"b": 2, "c": 5})
    assert totals == {"a": 3, "b": 3, "c": 5}
    with pytest.raises(TypeError, match="must be dicts"):
        _core.add_counts(totals, [("a", 1)])


def _step(**fields):
    base = dict(scheduled_new_reqs=[], finished_req_ids=set(), preempted_req_ids=set(),
                kv_cache_block_copies=[], num_scheduled_tokens={"a": 1, "b": 2},
                scheduled_cached_reqs=SimpleNamespace(req_ids=["a", "b"], resumed_req_ids=set()))
    base.update(fields)
    return SimpleNamespace(**{k: v for k, v in base.items() if v is not MISSING})


MISSING = object()


@pytest.mark.parametrize("step, running", [
    (_step(), True),
    (_step(scheduled_cached_reqs=None, finished_req_ids=None, kv_cache_block_copies=MISSING),
     True),
    (_step(scheduled_cached_reqs=SimpleNamespace(req_ids=["a"], resumed_req_ids=None,
                                                 resumed_from_preemption=[])), True),
    (_step(scheduled_new_reqs=[SimpleNamespace(req_id="c")]), False),
    (_step(finished_req_ids={"c"}), False),
    (_step(preempted_req_ids={"c"}), False),
    (_step(kv_cache_block_copies=[(1, 2)]), False),
    (_step(scheduled_cached_reqs=SimpleNamespace(req_ids=["a"], resumed_req_ids={"a"})), False),
    # an older vLLM's flags, and a resumed_req_ids no truth test can tell: field by field
    (_step(scheduled_cached_reqs=SimpleNamespace(req_ids=["a"], resumed_req_ids=None,
                                                 resumed_from_preemption=[False])), None),
    (_step(scheduled_cached_reqs=SimpleNamespace(req_ids=["a"], resumed_req_ids=iter(()))),
     None),
    (_step(num_scheduled_tokens=MappingProxyType({"a": 1})), None),  # not a dict
    (_step(num_scheduled_tokens=MISSING), None),
])
def test_running_step_takes_the_steps_of_running_requests_only(step, running) -> None:
    """A step of running requests only (what `translate_step` finds so): its scheduled tokens
    copied and each request's progress advanced; any other, and one it cannot tell, is left to
    the caller, the progress unchanged."""
    if running is not None:
        assert adapter._only_running(step) is running
    progress = {"a": 5, "z": 1}
    got = _core.running_step(step, progress)
    if not running:
        assert got is None and progress == {"a": 5, "z": 1}
        return
    assert got == step.num_scheduled_tokens and got is not step.num_scheduled_tokens
    assert progress == {"a": 6, "b": 2, "z": 1}
    with pytest.raises(TypeError, match="progress must be a dict"):
        _core.running_step(step, [])
    with pytest.raises(TypeError):  # a count that is no number, as add_counts refuses it
        _core.running_step(_step(num_scheduled_tokens={"a": None}), {"a": 1})


def _checkers(capacity: int = 8):
    """An output checker of each step path over one pool holding [4] float32 hidden rows."""
    backend = CpuBackend()
    pool = PrefixBlockPool(4, 4, backend)
    pool.install(pool.allocate(HIDDEN_KEY, (4,), torch.float32))
    return {path: OutputChecker(backend, pool, capacity, step_path=path) for path in STEP_PATHS}


def _checked(checker, hidden, mm, unpadded, padded, policy):
    """What a check gives (count, immediate rows, shapes, the rest) or the error it raises."""
    try:
        n, out, new_keys = checker.step_outputs(hidden, mm, unpadded, padded, policy)
    except Exception as exc:  # noqa: BLE001 - both paths must refuse alike
        return type(exc), str(exc)
    rows = {k: (v.data_ptr(), tuple(v.shape), v.requires_grad) for k, v in out.immediate.items()}
    return n, rows, out.shapes, out.deferred, out.leftover, new_keys


HIDDEN = torch.arange(24.0).view(6, 4)


@pytest.mark.parametrize("hidden, unpadded, padded", [
    (HIDDEN, 6, 6), (HIDDEN, 4, 6), (HIDDEN, 4, 4), (HIDDEN[:2], 2, 8),
    (HIDDEN, 0, 6), (None, 0, 0), (HIDDEN, 7, 7), (HIDDEN, 5, 4), (HIDDEN, -1, 6),
    (HIDDEN, True, 6), (HIDDEN, np.int64(3), 6), (HIDDEN, 3, 2**70), (HIDDEN, 2**70, 2**71),
    (HIDDEN, 9, 9), (HIDDEN.requires_grad_(False).clone().requires_grad_(True), 6, 6),
    (HIDDEN.double(), 6, 6), (torch.zeros(6, 5), 6, 6), (torch.zeros(6, 2, 2), 6, 6),
    (torch.zeros(6, 4, device="meta"), 6, 6), (torch.zeros(()), 1, 1), (HIDDEN.numpy(), 6, 6),
    (None, 3, 3), (HIDDEN.t(), 4, 4),
])
def test_hidden_rows_checks_a_step_of_hidden_states_as_the_reference_does(
        hidden, unpadded, padded) -> None:
    """`_core.hidden_rows`, the C step path's check of a step of hidden states alone, hands
    over the same rows and shapes as the reference's checks, or leaves the step to them:
    each refusal is theirs, by name."""
    checkers = _checkers()
    policy = ModelCachePolicy()
    got = {path: _checked(checker, hidden, None, unpadded, padded, policy)
           for path, checker in checkers.items()}
    assert got["c"] == got["python"]


def test_hidden_rows_leaves_every_other_step_to_the_reference() -> None:
    """Only a plain int count, a tensor of the pool's device, rows and dtype, within capacity,
    not requiring grad, is taken; anything else is None: nothing checked."""
    args = (torch.Tensor, torch.device("cpu"), (4,), torch.float32, 8)
    rows, shape = _core.hidden_rows(HIDDEN, 4, 6, *args)
    assert shape == (4, 4) and rows.data_ptr() == HIDDEN.data_ptr() and rows.shape[0] == 4
    assert _core.hidden_rows(HIDDEN, 6, 6, *args)[0] is HIDDEN
    for hidden, unpadded, padded in [(HIDDEN, 0, 6), (HIDDEN, 7, 7), (HIDDEN, 5, 4),
                                     (HIDDEN, True, 6), (HIDDEN, 9, 9), (HIDDEN.double(), 6, 6),
                                     (torch.zeros(6, 4, device="meta"), 6, 6),
                                     (HIDDEN.numpy(), 6, 6), (HIDDEN, 2**70, 2**71)]:
        assert _core.hidden_rows(hidden, unpadded, padded, *args) is None
    with pytest.raises(TypeError, match="tensor_type must be a type"):
        _core.hidden_rows(HIDDEN, 6, 6, torch.Tensor, torch.device("cpu"), [4], torch.float32, 8)


# --------------------------------------------------------------------------- extreme inputs

I64 = np.iinfo(np.int64)
EXTREMES = st.sampled_from([I64.min, I64.min + 1, -(2**31), -1, 0, 1, 2**31 - 1, 2**31,
                            I64.max - 1, I64.max])
REFUSED = (ValueError, IndexError, KeyError, OverflowError, TypeError)


@settings(max_examples=300, deadline=None)
@example(count=1, first=0, block=1, unit=int(I64.max))  # the slot fits, its run's end does not
@given(count=EXTREMES | st.integers(0, 40), first=EXTREMES | st.integers(0, 40),
       block=EXTREMES | st.integers(0, 9), unit=EXTREMES | st.integers(1, 8))
def test_request_runs_refuses_extreme_values_instead_of_wrapping(count, first, block,
                                                                 unit) -> None:
    table = np.full((1, 4), block, dtype=np.int64)
    runs = np.zeros((64, 2), dtype=np.int64)
    try:
        k, low, high = _core.request_runs(["r"], {"r": count}, {"r": 0},
                                          np.array([first], dtype=np.int64), table, unit, runs)
    except REFUSED:
        return
    # accepted: the runs hold the formula's slots (block * unit + p % unit), none wrapped;
    # worked out a block at a time, as a count near 2**63 cannot be listed
    want: list[list[int]] = []
    for b in range(first // unit, (first + count - 1) // unit + 1) if count else ():
        start, end = max(first, b * unit), min(first + count, (b + 1) * unit)
        run = [block * unit + start - b * unit, block * unit + end - b * unit]
        if want and want[-1][1] == run[0]:
            want[-1][1] = run[1]
        else:
            want.append(run)
    assert runs[:k].tolist() == want
    assert (low, high) == ((min(r[0] for r in want), max(r[1] for r in want) - 1)
                           if want else (0, -1))


@settings(max_examples=200, deadline=None)
@given(st.lists(EXTREMES | st.integers(0, 9), min_size=1, max_size=4))
def test_row_ends_refuses_counts_that_are_negative_or_overflow(counts) -> None:
    names = [f"r{i}" for i in range(len(counts))]
    ends = np.zeros(len(counts), dtype=np.int64)
    try:
        total, _ = _core.row_ends(names, dict(zip(names, counts, strict=True)), ends)
    except REFUSED:
        assert any(c < 0 for c in counts) or sum(counts) > I64.max
        return
    assert total == sum(counts) and ends.tolist() == np.cumsum(counts).tolist()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(EXTREMES, EXTREMES), min_size=1, max_size=3))
def test_run_stats_refuses_negative_empty_or_overflowing_runs(pairs) -> None:
    runs = np.array(pairs, dtype=np.int64)
    try:
        count, low, high = _core.run_stats(runs)
    except REFUSED:
        assert any(a < 0 or a >= b for a, b in pairs) or sum(b - a for a, b in pairs) > I64.max
        return
    assert count == sum(b - a for a, b in pairs)
    assert (low, high) == (min(a for a, _ in pairs), max(b for _, b in pairs) - 1)


def test_a_lookup_that_mutates_the_request_list_cannot_pull_it_from_under_the_loop() -> None:
    req_ids = ["a", "b", "c"]

    class Shrinking(dict):
        def __getitem__(self, key: str) -> int:
            req_ids.clear()  # Python code run mid-call; the call works on its own snapshot
            return super().__getitem__(key)

    ends = np.zeros(3, dtype=np.int64)
    assert _core.row_ends(req_ids, Shrinking(a=1, b=2, c=3), ends) == (6, 1)
    req_ids[:] = ["a", "b"]
    runs = np.zeros((8, 2), dtype=np.int64)
    k, _, _ = _core.request_runs(req_ids, Shrinking(a=2, b=2), {"a": 0, "b": 1},
                                 np.zeros(2, dtype=np.int64),
                                 np.array([[1, 2], [3, 4]], dtype=np.int64), 4, runs)
    assert runs_slots(runs[:k]).tolist() == [4, 5, 12, 13]


def test_claim_write_fills_what_claim_then_record_write_fill() -> None:
    """One call: the claim's tiers (and `newest`), then each write's version and producer
    tiers, as the Python reference's three fill_tiers calls leave them."""
    rng = np.random.default_rng(5)
    block_size, num_blocks = 4, 8
    c_tables = [np.zeros(n, np.int64) for n in (num_blocks, num_blocks * block_size, num_blocks)
                + (num_blocks * block_size, num_blocks) * 4]
    py_tables = [t.copy() for t in c_tables]
    for claim in range(1, 40):
        slots = np.unique(rng.integers(0, num_blocks * block_size, rng.integers(1, 20)))
        runs, producer = slot_runs(slots)[0], 100 + claim
        newest, slots_c, blocks_c, *writes = c_tables
        _core.claim_write(runs, block_size, newest, slots_c, blocks_c, claim,
                          [tuple(writes[:4]), tuple(writes[4:])], producer)
        newest, slots_c, blocks_c, *writes = py_tables
        _core.fill_tiers(runs, block_size, newest, slots_c, blocks_c, claim)
        for w in (writes[:4], writes[4:]):
            _core.fill_tiers(runs, block_size, None, w[0], w[1], claim, w[2], w[3], producer)
        assert all((c == p).all() for c, p in zip(c_tables, py_tables)), f"claim {claim}"
    _core.claim_write(runs, block_size, c_tables[0], c_tables[1], c_tables[2], 40, [], 0)
    _core.fill_tiers(runs, block_size, py_tables[0], py_tables[1], py_tables[2], 40)
    assert all((c == p).all() for c, p in zip(c_tables, py_tables))


def test_claim_write_refuses_a_bad_table_before_any_write() -> None:
    newest, slots, blocks = np.zeros(4, np.int64), np.zeros(16, np.int64), np.zeros(4, np.int64)
    good = tuple(np.zeros(n, np.int64) for n in (16, 4, 16, 4))
    runs = np.array([[1, 9]])
    bad_writes = ([good, good[:3]], [good, (*good[:3], np.zeros(3, np.int64))],
                  [good, (good[0][:8], good[1][:2], good[2], good[3])],
                  [good, (*good[:3], np.zeros(4, np.int32))], [good, list(good)])
    for writes, error in zip(bad_writes, (TypeError, ValueError, ValueError, TypeError,
                                          TypeError)):
        with pytest.raises(error):
            _core.claim_write(runs, 4, newest, slots, blocks, 3, writes, 7)
    with pytest.raises(IndexError, match="not a range within 0..15"):
        _core.claim_write(np.array([[9, 17]]), 4, newest, slots, blocks, 3, [good], 7)
    assert not any(t.any() for t in (newest, slots, blocks, *good))
