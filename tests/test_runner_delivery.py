"""The runner's way out, without vLLM: the output thread, the stage-output driver, publishing.

Real components: the manager on the CPU backend, the shared-memory stage channel.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from prefix_cache import (HIDDEN_KEY, ModelCachePolicy, OmniPrefixCacheError,
                          OmniPrefixCacheManager, PrefixCacheConfig)
from prefix_cache.channel import OmniPrefixCacheChannelError, open_channel
from prefix_cache.integration.delivery import FinishedRequest, StageDelivery
from prefix_cache.devices import get_backend
from prefix_cache.devices.base import poll_until
from prefix_cache.integration.output_thread import OutputThread
from prefix_cache.integration.stage_outputs import StageOutputDriver, StepBatch
from tests.sim import StepDriver, token_rows

HIDDEN = 8


def rows(start: int, end: int) -> dict[str, torch.Tensor]:
    positions = torch.arange(start, end, dtype=torch.float32)
    return {HIDDEN_KEY: positions[:, None].repeat(1, HIDDEN)}


# ---------------------------------------------------------------------- publishing

def test_a_finished_request_is_published_from_position_0_then_freed() -> None:
    with open_channel() as channel:
        delivery = StageDelivery(channel)
        delivery.add("a-1234abcd", 0, rows(0, 5), 5)
        delivery.add("a-1234abcd", 5, rows(5, 7), 2)
        assert delivery.stats()["delivery_requests_held"] == 1
        delivery.finish(FinishedRequest("a-1234abcd", "a", prompt_len=5))
        assert delivery.stats() == {"delivery_requests_held": 0, "delivery_bytes_held": 0,
                                    "delivery_published": 1, "delivery_chunks": 0,
                                    "delivery_rows": 7, "delivery_failed": 0,
                                    "delivery_rows_cut": 0, "delivery_full_wait_s": 0.0}
        entry = channel.get_entry("a", timeout_s=1)
    assert not entry.aborted
    assert entry.meta == {"prompt_len": 5, "num_rows": 7}
    assert torch.equal(entry.outputs[HIDDEN_KEY], rows(0, 7)[HIDDEN_KEY])


def test_a_request_short_of_its_prompt_is_published_marked_aborted() -> None:
    with open_channel() as channel:
        delivery = StageDelivery(channel)
        delivery.add("b", 0, rows(0, 64), 64)  # its first prefill chunk, then the abort
        delivery.finish(FinishedRequest("b", "b", prompt_len=160))
        delivery.finish(FinishedRequest("c", "c", prompt_len=None))  # never scheduled
        partial = channel.get_entry("b", timeout_s=1)
        empty = channel.get_entry("c", timeout_s=1)
    assert partial.aborted and partial.outputs[HIDDEN_KEY].shape == (64, HIDDEN)
    assert empty.aborted and empty.outputs == {} and empty.meta["num_rows"] == 0


def test_a_finish_the_scheduler_reported_is_published_once_and_later_rows_are_dropped() -> None:
    with open_channel() as channel:
        delivery = StageDelivery(channel)
        delivery.add("d-1", 0, rows(0, 6), 6)
        delivery.finish_early(FinishedRequest("d-1", "d", prompt_len=4))
        delivery.add("d-1", 6, rows(6, 7), 1)  # an asynchronous scheduler's stale step
        assert delivery.stats()["delivery_requests_held"] == 0
        delivery.finish(FinishedRequest("d-1", "d", prompt_len=4))  # the runner hears of it
        entry = channel.get_entry("d", timeout_s=1)
        assert delivery.stats()["delivery_published"] == 1
        with pytest.raises(OmniPrefixCacheError):  # published once, not twice
            channel.get_entry("d", timeout_s=0.2)
    assert torch.equal(entry.outputs[HIDDEN_KEY], rows(0, 6)[HIDDEN_KEY])


def test_two_live_requests_under_one_external_id_stream_two_entries_and_fail_alone() -> None:
    """A client reused an id while its first request runs: the runner's ids differ, the
    channel's does not. Each streams its own entry (in the order they started), and the one
    that fails ends its own entry alone."""
    with open_channel() as channel:
        delivery = StageDelivery(channel, external_id=lambda r: r.split("-")[0],
                                 stream_every=2)
        delivery.note_prompts({"a-1": 2, "a-2": 2})
        delivery.add("a-1", 0, rows(0, 2), 2)
        delivery.add("a-2", 0, rows(10, 12), 2)
        delivery.add("a-1", 2, rows(2, 4), 2)
        delivery.add("a-2", 2, rows(12, 13), 1)
        delivery.fail_requests(["a-2"], "its forward output could not be read")
        delivery.finish(FinishedRequest("a-1", "a", prompt_len=2))
        first = channel.get("a", timeout_s=5)[HIDDEN_KEY]
        with pytest.raises(OmniPrefixCacheChannelError,
                           match="request a: .*its forward output could not be read"):
            channel.get("a", timeout_s=5)
    assert torch.equal(first, rows(0, 4)[HIDDEN_KEY])


class FullOnce:
    """A channel whose put fails for one request id, as a full /dev/shm would."""

    def __init__(self, channel: Any, failing: str) -> None:
        self.channel, self.failing = channel, failing

    def put(self, request_id: str, *args: Any, **kwargs: Any) -> None:
        if request_id == self.failing:
            raise OSError(28, "No space left on device")
        self.channel.put(request_id, *args, **kwargs)

    def put_all(self, chunks: Sequence[tuple[str, Any]]) -> list[Exception | None]:
        others = [(request_id, chunk) for request_id, chunk in chunks
                  if request_id != self.failing]
        published = iter(self.channel.put_all(others))
        return [OSError(28, "No space left on device") if request_id == self.failing
                else next(published) for request_id, _ in chunks]

    def fail(self, request_id: str, cause: str, *, stream: str = "") -> None:
        self.channel.fail(request_id, cause, stream=stream)

    def expect_all(self, request_ids: Sequence[str]) -> None:
        self.channel.expect_all(request_ids)


def test_a_failed_publish_fails_that_entry_alone_naming_its_cause() -> None:
    with open_channel() as channel:
        delivery = StageDelivery(FullOnce(channel, "b"))
        for req in ("a", "b", "c"):
            delivery.add(f"{req}-1", 0, rows(0, 3), 3)
            delivery.finish(FinishedRequest(f"{req}-1", req, prompt_len=3))
        with pytest.raises(OmniPrefixCacheChannelError,
                           match="request b: .*publishing its 3 rows failed: .*No space left"):
            channel.get("b", timeout_s=1)
        for req in ("a", "c"):
            assert torch.equal(channel.get(req, timeout_s=1)[HIDDEN_KEY], rows(0, 3)[HIDDEN_KEY])
    assert delivery.stats()["delivery_failed"] == 1
    assert delivery.stats()["delivery_published"] == 2


def test_rows_that_would_leave_a_gap_fail_that_request_alone() -> None:
    with open_channel() as channel:
        delivery = StageDelivery(channel)
        delivery.add("g-1", 0, rows(0, 4), 4)
        delivery.add("g-1", 6, rows(6, 8), 2)  # positions 4 and 5 never came
        delivery.add("g-1", 8, rows(8, 9), 1)  # nor does anything after, for this request
        delivery.add("h-1", 0, rows(0, 2), 2)
        delivery.finish(FinishedRequest("g-1", "g", prompt_len=4))
        delivery.finish(FinishedRequest("h-1", "h", prompt_len=2))
        with pytest.raises(OmniPrefixCacheChannelError, match="positions 4..5 would be missing"):
            channel.get("g", timeout_s=1)
        assert channel.get("h", timeout_s=1)[HIDDEN_KEY].shape == (2, HIDDEN)
    assert delivery.stats()["delivery_failed"] == 1


def test_a_key_missing_from_some_steps_reads_zeros_there() -> None:
    delivery = StageDelivery()
    delivery.add("a", 0, rows(0, 3), 3)
    delivery.add("a", 3, {**rows(3, 5), "codes": torch.ones(2, 4)}, 2)
    out, positions = delivery.pop("a")
    assert positions == 5
    assert torch.equal(out["codes"], torch.cat([torch.zeros(3, 4), torch.ones(2, 4)]))
    assert torch.equal(out[HIDDEN_KEY], rows(0, 5)[HIDDEN_KEY])


def test_steps_that_emit_no_key_count_their_positions_and_leave_no_gap() -> None:
    """A stage that delivers multimodal keys only (no full hidden states) may emit none in
    some steps, a prefill say: those positions read zeros, and the request is whole."""
    with open_channel() as channel:
        delivery = StageDelivery(channel)
        delivery.add("a", 0, {}, 4)  # the prompt's step: no key
        delivery.add("a", 4, {"codes": torch.ones(2, 3)}, 2)
        delivery.add("b", 16, {}, 4)  # a prefix hit of 16 tokens, whose rows had no key
        delivery.add("b", 20, {"codes": torch.ones(1, 3)}, 1)
        delivery.add("c", 0, {}, 5)  # none at all
        for req_id, prompt_len in (("a", 4), ("b", 20), ("c", 5)):
            delivery.finish(FinishedRequest(req_id, req_id, prompt_len))
        a, b, c = (channel.get_entry(r, timeout_s=1) for r in "abc")
    assert torch.equal(a.outputs["codes"], torch.cat([torch.zeros(4, 3), torch.ones(2, 3)]))
    assert torch.equal(b.outputs["codes"], torch.cat([torch.zeros(20, 3), torch.ones(1, 3)]))
    assert not a.aborted and not b.aborted and b.meta["num_rows"] == 21
    assert c.outputs == {} and c.meta["num_rows"] == 5 and not c.aborted
    assert delivery.stats()["delivery_failed"] == 0


# ---------------------------------------------------------------------- the output thread

def test_jobs_run_in_submission_order_off_the_submitting_thread() -> None:
    seen: list[tuple[int, str]] = []
    thread = OutputThread("test-output", max_pending=4, timeout_s=5)
    for i in range(10):
        thread.submit(f"job {i}", lambda i=i: seen.append((i, threading.current_thread().name)))
    thread.close()
    assert [i for i, _ in seen] == list(range(10))
    assert {name for _, name in seen} == {"test-output"}


def test_a_failed_job_surfaces_at_the_next_submit_and_stops_later_jobs() -> None:
    ran: list[int] = []
    thread = OutputThread("test-output", max_pending=4, timeout_s=5)
    thread.submit("materialize step 3", lambda: 1 / 0)
    thread.submit("later", lambda: ran.append(1))
    with pytest.raises(OmniPrefixCacheError, match="materialize step 3 failed"):
        thread.drain()
    with pytest.raises(OmniPrefixCacheError, match="materialize step 3 failed"):
        thread.submit("next step", lambda: ran.append(2))
    assert ran == []
    with pytest.raises(OmniPrefixCacheError):
        thread.close()


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), -0.5])
def test_bounded_waits_refuse_a_timeout_that_would_never_end(timeout_s: float) -> None:
    with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds >= 0"):
        OutputThread("rows", max_pending=1, timeout_s=timeout_s)
    with pytest.raises(ValueError, match="poll_until: timeout_s must be a finite"):
        poll_until(lambda: False, timeout_s, lambda: TimeoutError("never"))
    thread = OutputThread("rows", max_pending=1, timeout_s=1.0)
    try:
        with pytest.raises(ValueError, match="rows: timeout_s"):
            thread.drain(timeout_s)
    finally:
        thread.close()


def test_submit_never_waits_and_raises_at_once_only_behind_a_stuck_job() -> None:
    """Jobs queue behind a slow one without the submitter waiting; once it has run past its
    time with more than `max_pending` jobs behind it, a submit raises at once, naming it."""
    release = threading.Event()
    thread = OutputThread("test-output", max_pending=1, timeout_s=0.2)
    thread.submit("slow copy", lambda: release.wait(10))
    for i in range(5):  # behind a job still within its time: queued, nobody waits
        thread.submit(f"step {i}", lambda: None)
    time.sleep(0.3)
    start = time.monotonic()
    with pytest.raises(OmniPrefixCacheError, match="step 9 not queued: 5 jobs wait behind "
                                                   "slow copy, which has run for .*stuck"):
        thread.submit("step 9", lambda: None)
    assert time.monotonic() - start < 2
    with pytest.raises(OmniPrefixCacheError, match="still pending"):
        thread.drain(0.1)
    release.set()
    thread.close()


# ---------------------------------------------------------------------- the driver

class OneBlockView:
    """At most one request, `a`, whose position p sits in slot 32 + p (block 1, 32 tokens)."""

    def __init__(self) -> None:
        self.batch = ["a"]
        self.computed = 0

    def batch_req_ids(self) -> list[str]:
        return self.batch

    def step_slots_cpu(self, req_ids: list[str], scheduled: dict[str, int]) -> torch.Tensor:
        n = sum(scheduled[r] for r in req_ids)
        return torch.arange(32 + self.computed, 32 + self.computed + n)

    def request_positions_runs(self, req_id: str, num_positions: int,
                               start: int = 0) -> np.ndarray | None:
        return np.array([[32 + start, 32 + num_positions]]) if req_id == "a" else None


def step(req_ids: list[str], scheduled: dict[str, int], finished: tuple[str, ...] = ()
         ) -> SimpleNamespace:
    new = [SimpleNamespace(req_id=r, num_computed_tokens=0, block_ids=([1],))
           for r in req_ids]
    return SimpleNamespace(
        finished_req_ids=set(finished), scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens=scheduled)


def prefill_decode_finish(driver: StageOutputDriver, view: Any,
                          decode_mm: dict[str, torch.Tensor] | None = None) -> None:
    """Request `a` through the driver: a 5-token prefill, one decode step (emitting
    `decode_mm` beside its hidden row), then its finish in a step without a forward."""
    driver.begin_step(step(["a"], {"a": 5}), [])
    driver.save_step(rows(0, 5)[HIDDEN_KEY], None, StepBatch(["a"], [0], [5]), 5)
    driver.end_step()
    view.computed = 5
    so = step([], {"a": 1})
    so.scheduled_cached_reqs.req_ids = ["a"]
    driver.begin_step(so, [])
    driver.save_step(rows(5, 6)[HIDDEN_KEY], decode_mm, StepBatch(["a"], [5], [1]), 1)
    driver.end_step()
    view.batch = []
    driver.begin_step(step([], {}, finished=("a",)), [FinishedRequest("a", "a", 5)])
    driver.end_step()  # no forward: zero rows saved and discarded with the cache


@pytest.mark.parametrize("cached", [True, False], ids=["cache", "no-cache"])
def test_the_driver_publishes_a_finished_requests_rows(cached: bool) -> None:
    backend = get_backend("cpu")
    view = OneBlockView()
    manager = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=4, block_size=32), view,
                                     backend=backend) if cached else None
    with open_channel() as channel:
        driver = StageOutputDriver(StageDelivery(channel), backend, cache=manager,
                                   policy=ModelCachePolicy(),
                                   empty_hidden=lambda: torch.empty(0, HIDDEN))
        prefill_decode_finish(driver, view)
        entry = channel.get_entry("a", timeout_s=5)
        driver.close()  # the output thread counts a publish after its put: join it first
        stats = driver.stats()
    assert torch.equal(entry.outputs[HIDDEN_KEY], rows(0, 6)[HIDDEN_KEY])
    assert stats["delivery_published"] == 1 and stats["delivery_requests_held"] == 0
    if cached:
        # every step discarded on the engine thread: its rows are read back at the finish
        assert stats["calls.save_outputs"] == stats["calls.new_step_starts"] == 3
        assert stats["calls.discard_step"] == 3 and stats.get("calls.materialize", 0) == 0


@pytest.mark.parametrize("cached", [True, False], ids=["cache", "no-cache"])
def test_a_stage_delivering_multimodal_keys_only_publishes_a_prefill_that_emitted_none(
        cached: bool) -> None:
    """needs_full_hidden_states=False, and the prompt's step emits no multimodal key: its
    positions read zeros, and the decode step's codes follow them."""
    backend = get_backend("cpu")
    view = OneBlockView()
    policy = ModelCachePolicy(needs_full_hidden_states=False)
    manager = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=4, block_size=32), view,
                                     backend=backend) if cached else None
    if manager is not None:
        manager.register_policy(policy)
    with open_channel() as channel:
        driver = StageOutputDriver(StageDelivery(channel), backend, cache=manager,
                                   policy=policy, empty_hidden=lambda: torch.empty(0, HIDDEN))
        prefill_decode_finish(driver, view, decode_mm={"codes": torch.full((1, 3), 7.0)})
        entry = channel.get_entry("a", timeout_s=5)
        driver.close()
    assert set(entry.outputs) == {"codes"} and not entry.aborted
    assert torch.equal(entry.outputs["codes"],
                       torch.cat([torch.zeros(5, 3), torch.full((1, 3), 7.0)]))


@pytest.mark.parametrize("ending", ["close", "turn off"])
def test_requests_held_when_the_stage_stops_publishing_get_a_failure_naming_why(
        ending: str) -> None:
    """`a` has rows but its finish never comes: its consumer gets a failure naming the cause
    at once, not a timeout; `b`, finished before, keeps its entry; requests that finish after
    a turn-off get the failure too."""
    backend = get_backend("cpu")
    view = OneBlockView()
    with open_channel() as channel:
        driver = StageOutputDriver(StageDelivery(channel, external_id=lambda r: f"ext-{r}"),
                                   backend, cache=None, policy=ModelCachePolicy(),
                                   empty_hidden=lambda: torch.empty(0, HIDDEN))
        driver.begin_step(step(["a", "b"], {"a": 3, "b": 2}), [])
        driver.save_step(rows(0, 5)[HIDDEN_KEY], None, StepBatch(["a", "b"], [0, 0], [3, 5]), 5)
        driver.end_step()
        view.batch = []
        driver.begin_step(step([], {}, finished=("b",)), [FinishedRequest("b", "ext-b", 2)])
        driver.end_step()
        later = []
        if ending == "turn off":
            driver.turn_off("its forward output could not be read")
            why = "stopped publishing .* its forward output could not be read"
            # the engine runs on: a step's rows are not taken, its finishes get failures,
            # whether the runner hears of them or the scheduler reports them first
            later = ["c", "d"]
            driver.begin_step(step(["c"], {"c": 2}), [])
            driver.save_step(rows(0, 2)[HIDDEN_KEY], None, StepBatch(["c"], [0], [2]), 2)
            driver.end_step()
            driver.begin_step(step([], {}, finished=("c",)), [FinishedRequest("c", "ext-c", 2)])
            driver.end_step()
            driver.finish_now([FinishedRequest("d", "ext-d", 2)])
            # `a`, failed when the stage stopped, finishes after all: no second failure
            driver.finish_now([FinishedRequest("a", "ext-a", 3)])
            driver.begin_step(step([], {}, finished=("a",)), [FinishedRequest("a", "ext-a", 3)])
            driver.end_step()
        else:
            why = "shut down before the request finished"
        driver.close() if ending == "close" else driver._thread.drain()
        for req in ["a", *later]:
            with pytest.raises(OmniPrefixCacheChannelError, match=f"request ext-{req}: .*{why}"):
                channel.get_entry(f"ext-{req}", timeout_s=5)
        assert torch.equal(channel.get_entry("ext-b", timeout_s=5).outputs[HIDDEN_KEY],
                           rows(3, 5)[HIDDEN_KEY])
        stats = driver.stats()
        driver.close()
    assert stats["delivery_failed"] == 1 + len(later) and stats["delivery_requests_held"] == 0


def sim_step(driver: StageOutputDriver, sim: StepDriver, so: SimpleNamespace,
             finished: list[FinishedRequest], mm: dict[str, torch.Tensor] | None = None, *,
             width: int = HIDDEN) -> None:
    """One step of `sim`'s batch through the driver, as a runner makes it (no forward where
    the batch is empty), its hidden rows `width` wide."""
    driver.begin_step(so, finished)
    if sim.batch:
        hidden = sim.outputs(width)
        starts = [sim.reqs[r].computed for r in sim.batch]
        ends = list(itertools.accumulate(sim.scheduled[r] for r in sim.batch))
        driver.save_step(hidden, mm, StepBatch(sim.batch, starts, ends), hidden.shape[0])
    driver.end_step()
    sim.advance()


def test_a_step_mixing_an_mm_key_hit_with_a_miss_publishes_both_and_the_stage_goes_on() -> None:
    """`a` wrote rows of `image`; `hit` reuses its blocks beside `text`, a miss, in a step that
    emits hidden states only. The hit's image rows come back for `hit` alone (SPEC §4 rule 5):
    `text` has no image rows, and gets its hidden rows; the stage serves the next step."""
    backend = get_backend("cpu")
    sim = StepDriver(block_size=4)
    manager = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=16, block_size=4), sim,
                                     backend=backend)
    tokens = list(range(100, 108))
    with open_channel() as channel:
        driver = StageOutputDriver(StageDelivery(channel), backend, cache=manager,
                                   policy=ModelCachePolicy(),
                                   empty_hidden=lambda: torch.empty(0, HIDDEN))

        def run(so: SimpleNamespace, finished: list[FinishedRequest],
                mm: dict[str, torch.Tensor] | None = None) -> None:
            sim_step(driver, sim, so, finished, mm)

        run(sim.step(new=[("a", tokens, [1, 2], 0, 8)]), [], mm={"image": torch.ones(8, 3)})
        run(sim.step(new=[("hit", tokens + [5, 6], [1, 2, 3], 8, 1),
                          ("text", [7, 8, 9, 10], [4], 0, 3)], finished=["a"]),
            [FinishedRequest("a", "a", 8)])
        run(sim.step(cached={"hit": 1, "text": 1}), [])
        sim.batch, sim.scheduled = [], {}
        driver.begin_step(sim.step(finished=["hit", "text"]),
                          [FinishedRequest("hit", "hit", 9), FinishedRequest("text", "text", 3)])
        driver.end_step()
        got = {r: channel.get(r, timeout_s=5) for r in ("a", "hit", "text")}
        driver.close()
    assert torch.equal(got["a"]["image"], torch.ones(8, 3))
    assert torch.equal(got["hit"][HIDDEN_KEY], token_rows(tokens + [5, 6], HIDDEN))
    assert torch.equal(got["hit"]["image"], torch.cat([torch.ones(8, 3), torch.zeros(2, 3)]))
    assert set(got["text"]) == {HIDDEN_KEY}
    assert torch.equal(got["text"][HIDDEN_KEY], token_rows([7, 8, 9, 10], HIDDEN))


@pytest.mark.parametrize("ending", ["close", "turn off"])
def test_a_cache_stage_reads_a_finished_requests_rows_back_once_and_fails_those_held(
        ending: str) -> None:
    """With the cache, a stage that does not stream reads a request's rows back whole at its
    finish. `a`, reported by the scheduler first while a step in flight already fed its stop
    token, is published once with the rows that stand (the in-flight row cut), and the
    runner's own finish later only forgets it; `b`, held when the stage stops, gets a failure
    naming why in place of its rows."""
    backend = get_backend("cpu")
    sim = StepDriver(block_size=4)
    manager = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=16, block_size=4), sim,
                                     backend=backend)
    a, b = list(range(100, 106)), list(range(200, 204))
    with open_channel() as channel:
        driver = StageOutputDriver(StageDelivery(channel), backend, cache=manager,
                                   policy=ModelCachePolicy(),
                                   empty_hidden=lambda: torch.empty(0, HIDDEN))

        def run(so: SimpleNamespace, finished: list[FinishedRequest]) -> None:
            sim_step(driver, sim, so, finished)

        run(sim.step(new=[("a", a, [1, 2], 0, 4), ("b", b, [3], 0, 3)]), [])
        run(sim.step(cached={"a": 1, "b": 1}), [])
        run(sim.step(cached={"a": 1}), [])  # in flight when `a`'s fifth token stops it
        driver.finish_now([FinishedRequest("a", "a", 4, rows_standing=5)])
        run(sim.step(finished=["a"]), [FinishedRequest("a", "a", 4)])  # the runner hears of it
        driver._thread.drain()
        entry = channel.get_entry("a", timeout_s=5)
        if ending == "turn off":
            driver.turn_off("its forward output could not be read")
            why = "stopped publishing .* its forward output could not be read"
            driver._thread.drain()
        else:
            why = "shut down before the request finished"
        stats = driver.stats()
        driver.close()
        with pytest.raises(OmniPrefixCacheChannelError, match=f"request b: .*{why}"):
            channel.get_entry("b", timeout_s=5)
    assert torch.equal(entry.outputs[HIDDEN_KEY], token_rows(a, HIDDEN)[:5])
    assert not entry.aborted and entry.meta["num_rows"] == 5
    assert stats["delivery_published"] == 1 and stats["delivery_rows_cut"] == 1
    assert stats["delivery_requests_held"] == (0 if ending == "turn off" else 1)


@pytest.mark.parametrize("standing", [10, 9], ids=["last-row-cut", "nothing-left"])
def test_a_streaming_cache_stage_reads_each_chunk_back_when_due_and_the_rest_at_the_finish(
        monkeypatch: pytest.MonkeyPatch, standing: int) -> None:
    """With the cache and `stream: 3`, steps are only discarded: the prompt's rows go out as
    a chunk once all computed, each later chunk once 3 positions stand (read back from the
    pool, the output thread busy only in those steps), and the finish publishes the rest;
    a final chunk with no rows left still has the key."""
    backend = get_backend("cpu")
    sim = StepDriver(block_size=4)
    manager = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=16, block_size=4), sim,
                                     backend=backend)
    tokens = list(range(100, 112))
    delivery = StageDelivery(None, stream_every=3)
    published: list[list[tuple[int, int]]] = []  # each call's chunks, (start, end) positions
    publish_chunks = delivery.publish_chunks
    monkeypatch.setattr(delivery, "publish_chunks", lambda reads: (
        published.append([(r.start, r.num_rows) for r in reads]), publish_chunks(reads)))
    with open_channel() as channel:
        delivery._sink = channel
        driver = StageOutputDriver(delivery, backend, cache=manager, policy=ModelCachePolicy(),
                                   empty_hidden=lambda: torch.empty(0, HIDDEN))

        def run(so: SimpleNamespace, finished: list[FinishedRequest]) -> None:
            sim_step(driver, sim, so, finished)

        prefill = sim.step(new=[("a", tokens, [1, 2, 3], 0, 6)])
        prefill.scheduled_new_reqs[0].prompt_token_ids = tokens[:6]
        run(prefill, [])
        for _ in range(5):  # positions 6..10, fed sampled tokens
            run(sim.step(cached={"a": 1}), [])
        run(sim.step(finished=["a"]), [FinishedRequest("a", "a", 6, rows_standing=standing)])
        driver._thread.drain()
        chunks = list(channel.stream("a", timeout_s=5))
        stats = driver.stats()
        driver.close()
    assert published == [[(0, 6)], [(6, 9)]]  # no output-thread work in the other steps
    # every step discarded (the finish's, without a forward, too), none materialized
    assert stats["calls.discard_step"] == 7 and stats.get("calls.materialize", 0) == 0
    assert [(c.start, c.rows[HIDDEN_KEY].shape[0], c.final) for c in chunks] == \
        [(0, 6, False), (6, 3, False), (9, standing - 9, True)]
    assert torch.equal(torch.cat([c.rows[HIDDEN_KEY] for c in chunks]),
                       token_rows(tokens, HIDDEN)[:standing])
    assert chunks[-1].meta == {"prompt_len": 6, "num_rows": standing}


@pytest.mark.parametrize("pinned_at", ["finish", "preemption"])
def test_a_request_whose_rows_cannot_be_pinned_turns_the_stage_off_and_fails_it_by_name(
        monkeypatch: pytest.MonkeyPatch, pinned_at: str) -> None:
    """Pinning a request's rows fails on the engine thread, at its finish (the read-back) or at
    the step that preempts it: the stage turns off naming why, the request gets that failure
    in place of its rows, and steps go on."""
    backend = get_backend("cpu")
    sim = StepDriver(block_size=4)
    manager = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=16, block_size=4), sim,
                                     backend=backend)

    def refused(requests: Any, starts: Any = None) -> Any:
        raise OmniPrefixCacheError(f"the pool is gone (requests {sorted(requests)})")

    monkeypatch.setattr(manager, "plan_request_rows", refused)
    with open_channel() as channel:
        driver = StageOutputDriver(StageDelivery(channel), backend, cache=manager,
                                   policy=ModelCachePolicy(),
                                   empty_hidden=lambda: torch.empty(0, HIDDEN))
        driver.begin_step(sim.step(new=[("a", list(range(100, 104)), [1], 0, 4)]), [])
        hidden = sim.outputs(HIDDEN)
        driver.save_step(hidden, None, StepBatch(["a"], [0], [4]), 4)
        driver.end_step()
        sim.advance()
        what = "reading back finished requests' rows"
        if pinned_at == "preemption":  # a step without `a`, which vLLM preempted
            preempting = sim.step()
            preempting.preempted_req_ids = {"a"}
            driver.begin_step(preempting, [])
            driver.end_step()
            what = "pinning preempted requests' rows"
        driver.begin_step(sim.step(finished=["a"]), [FinishedRequest("a", "a", 4)])
        driver.end_step()
        assert not driver.active
        with pytest.raises(OmniPrefixCacheChannelError,
                           match=rf"request a: .*{what} failed: "
                                 r"OmniPrefixCacheError: the pool is gone \(requests \['a'\]\)"):
            channel.get_entry("a", timeout_s=5)
        driver.close()
