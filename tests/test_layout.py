"""StepLayout: each request's rows in batch order, checked against the scheduler's counts."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from prefix_cache import OmniPrefixCacheUnmatchError, devices
from prefix_cache.core.layout import StepLayout
from prefix_cache.core.residency import PoolMap, ResidentView
from prefix_cache.integration.group_view import FullAttentionGroupView
from prefix_cache.core.runs import runs_slots, slot_runs
from tests.sim import StepDriver

BS = 4


def driver_with(scheduled: dict[str, int]) -> StepDriver:
    driver = StepDriver(block_size=BS)
    driver.step(new=[(req_id, list(range(n)), [i + 1], 0, n)
                     for i, (req_id, n) in enumerate(scheduled.items())])
    return driver


def test_rows_follow_the_batch_order_not_the_scheduler_dict() -> None:
    driver = driver_with({"a": 2, "b": 3})
    driver.batch = ["b", "a"]
    layout = StepLayout.of_step(driver, {"a": 2, "b": 3}, 5, BS, 64)
    assert layout.order == ["b", "a"]
    assert (layout.rows("b"), layout.rows("a")) == ((0, 3), (3, 5))
    assert list(layout.items()) == [("b", (0, 3)), ("a", (3, 5))]
    assert layout.slots.tolist() == [8, 9, 10, 4, 5]
    assert "a" in layout and "c" not in layout


def test_a_request_scheduled_for_zero_tokens_has_no_rows() -> None:
    driver = driver_with({"a": 2, "b": 3})
    layout = StepLayout.of_step(driver, {"a": 2, "b": 3, "idle": 0}, 5, BS, 64)
    assert layout.order == ["a", "b"]


@pytest.mark.parametrize("scheduled, num_rows", [
    ({"a": 2, "b": 3}, 4),            # fewer rows than tokens scheduled
    ({"a": 2, "b": 3, "c": 1}, 5),    # c is scheduled but not in the batch
], ids=["row-count", "missing-request"])
def test_rows_that_do_not_match_the_schedule_are_refused(scheduled: dict[str, int],
                                                         num_rows: int) -> None:
    driver = driver_with({"a": 2, "b": 3})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="save_outputs: .* rows but the batch"):
        StepLayout.of_step(driver, scheduled, num_rows, BS, 64)


def test_slots_in_the_null_block_are_refused() -> None:
    driver = StepDriver(block_size=BS)
    driver.step(new=[("a", [1, 2], [0], 0, 2)])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="null block"):
        StepLayout.of_step(driver, {"a": 2}, 2, BS, 64)


class _RunsView:
    """A view that also gives its slots as runs (as FullAttentionGroupView does)."""

    def __init__(self, driver: StepDriver) -> None:
        self.driver = driver

    def batch_req_ids(self):
        return self.driver.batch_req_ids()

    def step_slots_cpu(self, req_ids, scheduled):
        raise AssertionError("a view with runs is never asked for per-row slots")

    def step_slot_runs(self, req_ids, scheduled):
        return slot_runs(self.driver.step_slots_cpu(req_ids, scheduled).numpy())[0]


def test_a_view_with_runs_gives_the_same_layout_and_the_same_refusals() -> None:
    driver = StepDriver(block_size=BS)
    driver.step(new=[("a", list(range(6)), [1, 2], 0, 6), ("b", [7, 8, 9], [5], 0, 3),
                     ("c", [3], [4], 0, 1)])
    driver.batch = ["c", "a", "b"]
    scheduled = {"a": 6, "b": 3, "c": 1}
    by_slots = StepLayout.of_step(driver, scheduled, 10, BS, 64)
    by_runs = StepLayout.of_step(_RunsView(driver), scheduled, 10, BS, 64)

    assert by_runs.runs.tolist() == by_slots.runs.tolist() == [[16, 17], [4, 10], [20, 23]]
    assert by_runs.slots.tolist() == by_slots.slots.tolist()
    assert list(by_runs.items()) == list(by_slots.items())
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"slots outside 1..3 blocks"):
        StepLayout.of_step(_RunsView(driver), scheduled, 10, BS, 16)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="rows but the batch"):
        StepLayout.of_step(_RunsView(driver), scheduled, 9, BS, 64)


class _RunnerBatch:
    """A runner's persistent batch as FullAttentionGroupView reads it: rows of block ids, the
    computed tokens per row, and free rows (None) between requests."""

    def __init__(self, rng: random.Random, blocks_per_req: int, num_blocks: int) -> None:
        rows = rng.randint(0, 7)
        self.req_ids = [None if rng.random() < 0.2 else f"r{i}" for i in range(rows)]
        rng.shuffle(self.req_ids)
        self.req_id_to_index = {r: i for i, r in enumerate(self.req_ids) if r is not None}
        self.num_computed_tokens_cpu = np.array(
            [rng.randint(0, (blocks_per_req - 1) * BS) for _ in range(rows)], dtype=np.int32)
        ids = np.array([rng.sample(range(1, num_blocks), blocks_per_req) for _ in range(rows)],
                       dtype=np.int32).reshape(rows, blocks_per_req)
        self.block_table = [SimpleNamespace(block_size=BS, get_numpy_array=lambda: ids)]


def _layout_or_refusal(view, scheduled, num_rows, *, c_path):
    try:
        layout = StepLayout.of_step(view, scheduled, num_rows, BS, 64 * BS, c_path=c_path)
    except OmniPrefixCacheUnmatchError as exc:
        return str(exc).split(":")[0]  # the refusal's call; their details may word it apart
    return layout.order, layout.ends.tolist(), layout.runs.tolist(), layout.slots.tolist()


def _random_view(rng: random.Random, batch: _RunnerBatch, capped: bool
                 ) -> FullAttentionGroupView | ResidentView:
    """`batch`'s view, or (`capped`) a capped pool's view of it, its 63 KV blocks held at
    pool blocks in a random order."""
    view = FullAttentionGroupView(batch, BS, backend=devices.get_backend("cpu"))
    if not capped:
        return view
    pool_map = PoolMap(64, 64, BS)
    pool_map.apply(SimpleNamespace(kv_blocks=np.arange(1, 64, dtype=np.int64),
                                   pool_blocks=np.array(rng.sample(range(1, 64), 63),
                                                        dtype=np.int64)))
    return ResidentView(view, pool_map)


@pytest.mark.parametrize("capped", [False, True], ids=["mirror", "capped"])
def test_the_c_layout_is_the_reference_layout(capped: bool) -> None:
    """FullAttentionGroupView's one-call layout (`step_layout`, the C step path) against its
    rows then its slots (the Python reference), over random batches: free rows, requests
    scheduled for 0 tokens or not at all, scheduled requests the batch lacks, wrong row counts;
    through a capped pool's ResidentView too."""
    rng = random.Random(7)
    for _ in range(400):
        batch = _RunnerBatch(rng, blocks_per_req=4, num_blocks=64)
        view = _random_view(rng, batch, capped)
        present = [r for r in batch.req_ids if r is not None]
        scheduled = {r: rng.choice([0, 1, 1, 2, 3, 5]) for r in present if rng.random() < 0.9}
        if rng.random() < 0.2:
            scheduled["gone"] = rng.randint(0, 2)
        rows = sum(scheduled.get(r, 0) for r in present) + (rng.random() < 0.1)
        assert (_layout_or_refusal(view, scheduled, rows, c_path=True)
                == _layout_or_refusal(view, scheduled, rows, c_path=False)), (batch.req_ids,
                                                                              scheduled, rows)


@pytest.mark.parametrize("capped", [False, True], ids=["mirror", "capped"])
def test_all_requests_positions_in_one_call_are_each_ones_end_to_end(capped: bool) -> None:
    """FullAttentionGroupView's positions of every request at once (`requests_positions_runs`,
    a step's chunks) against each request's alone, over random batches and spans (empty ones,
    mid-block starts); None where the batch lacks one of them; through a capped pool's
    ResidentView too."""
    rng = random.Random(11)
    for _ in range(400):
        batch = _RunnerBatch(rng, blocks_per_req=4, num_blocks=64)
        view = _random_view(rng, batch, capped)
        req_ids = [r for r in batch.req_ids if r is not None and rng.random() < 0.8]
        rng.shuffle(req_ids)
        starts = [rng.randint(0, 4 * BS) for _ in req_ids]
        ends = [rng.randint(start, 4 * BS) for start in starts]
        if rng.random() < 0.1:
            req_ids, starts, ends = [*req_ids, "gone"], [*starts, 0], [*ends, 1]
            assert view.requests_positions_runs(req_ids, starts, ends) is None
            continue
        each = [runs_slots(view.request_positions_runs(r, end, start))
                for r, start, end in zip(req_ids, starts, ends)]
        assert runs_slots(view.requests_positions_runs(req_ids, starts, ends)).tolist() == \
            (np.concatenate(each).tolist() if each else []), (req_ids, starts, ends)
