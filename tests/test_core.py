"""prefix_cache._core against the numpy it replaces, and its refusals of what would touch memory
out of bounds (raised before anything is written)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_cache import _core
from prefix_cache.runs import runs_slots, slot_runs


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


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 63), max_size=40), st.integers(0, 9), st.integers(-3, 12),
       st.lists(st.integers(0, 63), max_size=3))
def test_fill_and_any_held_match_numpy(slots, value, held_from, pinned) -> None:
    rng = np.random.default_rng(len(slots))
    table, other = rng.integers(0, 10, 64), rng.integers(0, 10, 64)
    pins = np.zeros(64, dtype=np.int32)
    pins[pinned] = 1
    index = np.array(slots, dtype=np.int64)
    runs = slot_runs(index)[0]

    claimed = bool(len(index)) and bool((table[index] >= held_from).any())
    assert _core.any_held(table, None, runs, held_from) is claimed
    assert _core.any_held(table, pins, runs, held_from) is (
        claimed or bool(len(index)) and bool(pins[index].any()))
    expected, expected_other = table.copy(), other.copy()
    expected[index] = value
    expected_other[index] = -value
    _core.fill_runs(runs, table, value, other, -value)
    assert table.tolist() == expected.tolist()
    assert other.tolist() == expected_other.tolist()


def test_bad_runs_and_wrong_arrays_are_refused_before_any_write() -> None:
    table = np.zeros(16, dtype=np.int64)
    pins = np.zeros(16, dtype=np.int32)
    for bad in ([[3, 4], [15, 17]], [[-1, 2]], [[5, 5]], [[6, 4]]):
        with pytest.raises(IndexError, match="not a range within 0..15"):
            _core.fill_runs(np.array(bad), table, 5)
        with pytest.raises(IndexError, match="not a range within 0..15"):
            _core.any_held(table, pins, np.array(bad), 1 << 40)
    assert not table.any()
    with pytest.raises(TypeError, match="int64"):
        _core.fill_runs(np.array([[1, 2]], dtype=np.int32), table, 5)
    with pytest.raises(ValueError, match=r"\[k, 2\] runs"):
        _core.fill_runs(np.array([[1, 2, 3]]), table, 5)
    with pytest.raises(TypeError, match="C-contiguous writable"):
        _core.fill_runs(np.array([[1, 2]]), table, 1, table[::2], 5)
    with pytest.raises(TypeError, match="1-D int64 array, got format 'd'"):
        _core.fill_runs(np.array([[1, 2]]), table.astype(np.float64), 5)
    with pytest.raises(ValueError, match="tables of 16 and 3 slots"):
        _core.fill_runs(np.array([[1, 2]]), table, 1, table[:3], 5)
    with pytest.raises(ValueError, match="3 pins for 16 slots"):
        _core.any_held(table, pins[:3], np.array([[1, 2]]), 0)
    with pytest.raises(ValueError, match="runs must be"):
        _core.slot_runs(np.arange(4), np.empty((3, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="hold 3 slots, out has room for 2"):
        _core.runs_slots(np.array([[1, 4]]), np.empty(2, dtype=np.int64))
    with pytest.raises(ValueError, match="run 1, 6..6, is empty"):
        _core.run_stats(np.array([[1, 4], [6, 6]]))
    assert not table.any()


def test_add_counts_adds_into_totals() -> None:
    totals = {"a": 3, "b": 1}
    _core.add_counts(totals, {"b": 2, "c": 5})
    assert totals == {"a": 3, "b": 3, "c": 5}
    with pytest.raises(TypeError, match="must be dicts"):
        _core.add_counts(totals, [("a", 1)])
