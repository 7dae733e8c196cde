"""A full channel (SPEC §9): never another request's rows, never a stalled engine thread, never a
stage turned off by a slow consumer.

Real components: the manager on the CPU backend, the stage-output driver and its output thread,
the shared-memory stage channel with a small capacity, a consumer thread that catches up late.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from prefix_cache import HIDDEN_KEY, ModelCachePolicy, OmniPrefixCacheManager, PrefixCacheConfig
from prefix_cache.channel import OmniPrefixCacheChannelError, StageChunk, open_channel
from prefix_cache.core.pool_rows import PoolRows, reading
from prefix_cache.devices import get_backend
from prefix_cache.devices.base import poll_until
from prefix_cache.integration.delivery import FinishedRequest, StageDelivery
from prefix_cache.integration.stage_outputs import StageOutputDriver
from tests.sim import StepDriver, token_rows
from tests.test_runner_delivery import sim_step

HIDDEN = 64  # 256-byte rows: a few requests fill an 8,000-byte channel


def run_step(driver: StageOutputDriver, sim: StepDriver, so: SimpleNamespace,
             finished: list[FinishedRequest]) -> None:
    """One step of `sim`'s batch through the driver, as a runner makes it."""
    sim_step(driver, sim, so, finished, width=HIDDEN)


def cache_stage(channel, *, timeout_s: float = 0.5) -> tuple[StageOutputDriver, StepDriver]:
    backend = get_backend("cpu")
    sim = StepDriver(block_size=4)
    manager = OmniPrefixCacheManager(
        PrefixCacheConfig(num_blocks=32, block_size=4, staging_claim_timeout_s=timeout_s),
        sim, backend=backend)
    driver = StageOutputDriver(StageDelivery(channel), backend, cache=manager,
                               policy=ModelCachePolicy(),
                               empty_hidden=lambda: torch.empty(0, HIDDEN), timeout_s=timeout_s)
    return driver, sim


def fill(channel, nbytes: int) -> None:
    """An entry of about `nbytes` nobody has read yet."""
    channel.put("filler", {HIDDEN_KEY: torch.zeros(nbytes // (4 * HIDDEN), HIDDEN)})


def consume_after(channel, delay_s: float, started: threading.Event) -> threading.Thread:
    """A consumer that wakes after `delay_s` and reads the filler: room for what waits."""
    def late() -> None:
        time.sleep(delay_s)
        started.set()
        channel.get("filler", timeout_s=5)

    thread = threading.Thread(target=late, daemon=True)
    thread.start()
    return thread


def output_thread_busy(driver: StageOutputDriver) -> None:
    """Wait until the output thread runs the job queued last (it holds the rows it puts)."""
    poll_until(lambda: driver._thread._pending() <= 1 or None, 5.0,
               lambda: AssertionError("the output thread never took its job"))
    time.sleep(0.2)  # into the put's wait for room


def test_a_block_reused_while_its_entry_waits_for_room_never_lends_it_the_new_rows() -> None:
    """A and B finish together into a full channel; N takes B's blocks and saves its rows while
    B's entry still waits for room. B's entry is B's rows, published once the consumer reads,
    and N's save never waits for that consumer."""
    a, b, n = list(range(100, 108)), list(range(200, 208)), list(range(300, 308))
    with open_channel("shm://?capacity=8000&wait=5") as channel:
        driver, sim = cache_stage(channel)
        fill(channel, 6000)
        run_step(driver, sim, sim.step(new=[("a", a, [1, 2], 0, 8), ("b", b, [3, 4], 0, 8)]),
                 [])
        run_step(driver, sim, sim.step(finished=["a", "b"]),
                 [FinishedRequest("a", "a", 8), FinishedRequest("b", "b", 8)])
        output_thread_busy(driver)
        started = threading.Event()
        consumer = consume_after(channel, 1.5, started)
        run_step(driver, sim, sim.step(new=[("n", n, [3, 4], 0, 8)]), [])  # B's blocks
        saved_before_the_consumer_woke = not started.is_set()
        consumer.join(10)
        got = {r: channel.get(r, timeout_s=10)[HIDDEN_KEY] for r in ("a", "b")}
        driver.close()
    assert torch.equal(got["a"], token_rows(a, HIDDEN))
    assert torch.equal(got["b"], token_rows(b, HIDDEN)), "B's entry carries another's rows"
    assert saved_before_the_consumer_woke, "N's save waited for the channel's consumer"


def test_a_consumer_that_lags_never_turns_the_stage_off_and_what_comes_after_is_delivered(
        ) -> None:
    """Sixty requests finish, six a step, while nobody reads a full channel. The engine
    thread never waits and the stage stays on: each entry fails alone, naming the full channel,
    the first after one full wait and the rest at once. Once the consumer reads, the next
    requests are delivered."""
    with open_channel("shm://?capacity=8000&wait=1") as channel:
        driver, sim = cache_stage(channel)
        fill(channel, 6000)
        lagged = [f"r{i}" for i in range(60)]
        prompts = {r: list(range(1000 * i, 1000 * i + 8)) for i, r in enumerate(lagged)}
        blocks = itertools.cycle([[2 * i, 2 * i + 1] for i in range(1, 8)])
        for group in (lagged[i:i + 6] for i in range(0, len(lagged), 6)):  # one put of six
            run_step(driver, sim, sim.step(new=[(r, prompts[r], next(blocks), 0, 8)
                                                for r in group]), [])
            run_step(driver, sim, sim.step(finished=group),
                     [FinishedRequest(r, r, 8) for r in group])
        assert driver.active, "a lagging consumer turned the stage off"
        outcomes = {}
        for r in lagged:
            try:
                outcomes[r] = channel.get(r, timeout_s=10)[HIDDEN_KEY]
            except OmniPrefixCacheChannelError as exc:  # a timeout would be an entry lost
                assert "stayed full" in str(exc) and f"request {r}" in str(exc), exc
                outcomes[r] = None
        channel.get("filler", timeout_s=5)  # the consumer catches up
        late = {f"late{i}": list(range(90_000 + 100 * i, 90_000 + 100 * i + 8)) for i in range(3)}
        for r, prompt in late.items():
            run_step(driver, sim, sim.step(new=[(r, prompt, next(blocks), 0, 8)]), [])
            run_step(driver, sim, sim.step(finished=[r]), [FinishedRequest(r, r, 8)])
        delivered = {r: channel.get(r, timeout_s=10)[HIDDEN_KEY] for r in late}
        stats = driver.stats()
        driver.close()
    assert stats["delivery_full_wait_s"] >= 0.9  # its one full wait (1 s), in the figures
    assert stats["delivery_rows"] == 8 * (len(delivered) + sum(
        rows is not None for rows in outcomes.values()))
    assert any(rows is None for rows in outcomes.values())
    for r, rows in outcomes.items():
        assert rows is None or torch.equal(rows, token_rows(prompts[r], HIDDEN)), r
    for r, rows in delivered.items():
        assert torch.equal(rows, token_rows(late[r], HIDDEN)), r


class HungSink:
    """A channel whose puts hang until released, as a stuck /dev/shm would; failures go
    through."""

    def __init__(self, channel) -> None:
        self.channel, self.release = channel, threading.Event()

    def put_all(self, chunks):
        self.release.wait(30)
        return self.channel.put_all(chunks)

    def fail(self, request_id: str, cause: str, *, stream: str = "") -> None:
        self.channel.fail(request_id, cause, stream=stream)

    def expect_all(self, request_ids) -> None:
        self.channel.expect_all(request_ids)


def test_a_stage_turned_off_behind_a_stuck_output_thread_fails_later_requests_by_name() -> None:
    """The output thread hangs in a put; the stage turns off (a fault of the engine thread) and
    cannot queue its stop behind it: a request that finishes later gets a failure naming why at
    once, never an empty entry nor silence."""
    backend = get_backend("cpu")
    with open_channel() as channel:
        sink = HungSink(channel)
        driver = StageOutputDriver(StageDelivery(sink), backend, cache=None,
                                   policy=ModelCachePolicy(),
                                   empty_hidden=lambda: torch.empty(0, HIDDEN), timeout_s=0.2)
        sim = StepDriver(block_size=4)
        run_step(driver, sim, sim.step(new=[("a", [1, 2, 3], [1], 0, 3)]), [])
        run_step(driver, sim, sim.step(finished=["a"]), [FinishedRequest("a", "a", 3)])
        run_step(driver, sim, sim.step(new=[("b", list(range(4, 30)), list(range(2, 9)), 0, 1)]),
                 [])
        time.sleep(0.3)  # the put of `a` hangs past the thread's time
        for _ in range(20):  # more than its jobs' room behind a stuck one
            run_step(driver, sim, sim.step(cached={"b": 1}), [])
        driver.turn_off("its forward output could not be read")
        run_step(driver, sim, sim.step(new=[("c", [8, 9], [9], 0, 2)]), [])
        run_step(driver, sim, sim.step(finished=["c"]), [FinishedRequest("c", "c", 2)])
        with pytest.raises(OmniPrefixCacheChannelError, match="request c: .*stuck"):
            channel.get("c", timeout_s=5)
        sink.release.set()
        assert torch.equal(channel.get("a", timeout_s=5)[HIDDEN_KEY], token_rows([1, 2, 3], HIDDEN))
        driver.close()


def pool_rows_over(pool: torch.Tensor, slots: list[int]) -> tuple[PoolRows, threading.Event]:
    """Rows of `pool` at `slots` held for a writer, and the event their let-go sets."""
    let_go = threading.Event()
    byte_pool = pool.view(torch.uint8).numpy().reshape(len(pool), -1)
    return PoolRows(byte_pool, np.array(slots, dtype=np.int64), (len(slots), pool.shape[1]),
                    pool.dtype, let_go.set), let_go


@pytest.mark.parametrize("chunks", [1, 2], ids=["entry", "step-of-chunks"])
def test_a_put_waiting_for_a_stopped_consumers_namespace_lock_never_holds_the_pool(
        chunks: int) -> None:
    """A consumer process stopped (SIGSTOP, a debugger) while it holds the shm namespace lock
    makes every put wait for it. The rows a waiting put reads from the pool are not held
    meanwhile: the engine thread moves them out at once (`evict`) and overwrites their slots,
    and the entries, once the consumer goes on, carry the rows as they were (the 30-minute
    soak's engine thread waited 9.3 s on a consumer so)."""
    pool = torch.arange(40.0).reshape(10, 4)
    expected = [pool[[7, 2]].clone(), pool[[3]].clone()]
    pieces = [pool_rows_over(pool, [7, 2])[0], pool_rows_over(pool, [3])[0]][:chunks]
    with open_channel("shm") as channel:
        channel.put("earlier", {HIDDEN_KEY: pool[:1]})  # the handle's first sweep is past
        consumer_lock = os.open(channel.directory / ".lock", os.O_RDWR)
        fcntl.flock(consumer_lock, fcntl.LOCK_EX)  # the stopped consumer's
        put = threading.Thread(target=channel.put_all, args=(
            [(f"r{i}", StageChunk({HIDDEN_KEY: rows}, 0, final=True))
             for i, rows in enumerate(pieces)],))
        try:
            put.start()
            time.sleep(0.3)  # the put waits for the namespace lock
            assert all(rows.evict(timeout_s=1.0) for rows in pieces), \
                "the engine thread waited for a put that waits for a consumer"
            pool.fill_(-1.0)  # the slots' new tenants
        finally:
            fcntl.flock(consumer_lock, fcntl.LOCK_UN)
            os.close(consumer_lock)
            put.join(10)
        for i in range(chunks):
            assert torch.equal(channel.get(f"r{i}", timeout_s=5)[HIDDEN_KEY], expected[i])


def test_rows_moved_out_of_the_pool_read_as_they_were_and_free_their_slots() -> None:
    """`evict` copies held rows (and every span's) into memory of their own: the pool's slots
    may be overwritten at once, and a writer reading them later reads the rows as they were."""
    pool = torch.arange(40.0).reshape(10, 4)
    rows, let_go = pool_rows_over(pool, [7, -1, 2, 3])
    before = rows.byte_copy()  # a writer's copy lets the rows go
    assert let_go.is_set()
    rows, _ = pool_rows_over(pool, [7, -1, 2, 3])
    span = rows.span(2, 4, lambda: None)
    assert rows.evict(timeout_s=1)
    pool.fill_(-1)  # a new tenant's write
    assert (rows.byte_copy() == before).all()
    assert (span.byte_copy() == before[2:]).all()


def test_a_writer_reading_held_rows_delays_their_move_and_may_copy_them_itself() -> None:
    """While a writer reads held rows in place (`reading`), a move waits for it (bounded:
    False after its timeout); inside `reading` the writer may copy them too (no deadlock)."""
    pool = torch.arange(40.0).reshape(10, 4)
    rows, _ = pool_rows_over(pool, [1, 2])
    copied = []
    with reading([rows]):
        mover = threading.Thread(target=lambda: copied.append(rows.evict(timeout_s=0.2)))
        mover.start()
        mover.join(5)
        assert copied == [False]  # the writer still reads them: not moved
        copied.append(rows.byte_copy())  # the same thread: reentrant
    assert (copied[1].view(np.float32) == pool[[1, 2]].numpy()).all()
    assert rows.evict(timeout_s=1)
