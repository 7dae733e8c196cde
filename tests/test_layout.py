"""StepLayout: each request's rows in batch order, checked against the scheduler's counts."""

from __future__ import annotations

import pytest

from prefix_cache import OmniPrefixCacheUnmatchError
from prefix_cache.core.layout import StepLayout
from prefix_cache.core.runs import slot_runs
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
