"""The Mooncake Store channel under races and crashes (a loopback store, real processes).

A put racing a sweeper, its handle's own or another's, survives; entries expire whoever
published them, and a closed or killed publisher's keys are reclaimed after their time to live;
a slow id stalls no other; a consumer learns within seconds that its producer died; a process
killed at any store call of a put or a take leaves the id's other entries whole and in order.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from prefix_cache.channel import (OmniPrefixCacheChannelError,
                                  OmniPrefixCacheChannelProducerError,
                                  OmniPrefixCacheChannelTimeoutError, open_channel)
from prefix_cache.channel import mooncake as mooncake_module
from prefix_cache.channel.mooncake import LEASE_S, MooncakeChannel, _Chain
from tests.mooncake_store import HOST, MooncakeStoreProcesses
from tests.test_channel import RealClient, _mark, _marked, use_client

pytestmark = pytest.mark.slow  # a store and processes killed at every store call

#: Children fork from a server that imported the channel once and never opened a store client.
_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(["torch", "prefix_cache.channel.mooncake"])


def _start(target: Callable[..., None], *args: object) -> multiprocessing.Process:
    proc = _FORKSERVER.Process(target=target, args=args)
    proc.start()
    return proc


def _drain(channel: MooncakeChannel, request_id: str) -> list[int]:
    """The marks of every entry `request_id` has now, taken in order."""
    marks = []
    while True:
        try:
            marks.append(_mark(channel.get(request_id, timeout_s=0.3)))
        except OmniPrefixCacheChannelTimeoutError:
            return marks


def _chain_keys(channel: MooncakeChannel, request_id: str) -> list[str]:
    """The keys of the entries the namespace's producers' records of `request_id` name now,
    and of the one a killed put may have left past each chain."""
    head = channel.entry_key(request_id)
    channel._leases.scan(0.0)
    keys = []
    for producer in channel._leases.producers():
        record = channel._values.get(channel._record_key(head, producer.token))
        if record is not None:
            chain = _Chain.unpack(record)
            keys += [chain.key(head, producer.token, i) for i in range(chain.first,
                                                                       chain.next + 1)]
    return keys


def _existing(channel: MooncakeChannel, keys: list[str]) -> list[str]:
    return [k for k, e in zip(keys, channel._store.batch_is_exist(keys)) if e == 1] if keys \
        else []


def test_a_put_in_the_sweepers_gap_keeps_its_entry(
        mooncake_store: MooncakeStoreProcesses) -> None:
    """The handle's chain under `r` expires; the sweeper decides to remove its record, and a
    put of `r` by the same handle lands just before the remove. The put returned: its entry
    must stay reachable."""
    with open_channel(mooncake_store.spec + "&ttl=0.5") as channel, \
            open_channel(channel.spec) as reader:
        assert isinstance(channel, MooncakeChannel)
        channel.put("r", _marked(1))
        assert _mark(reader.get("r", timeout_s=5)) == 1
        channel._stop.set()  # the keeper thread stays out of the way
        time.sleep(0.6)  # the chain under `r` expired, not yet swept
        store = channel._store
        raced: list[threading.Thread] = []

        def put_first(remove: Callable[..., Any]) -> Callable[..., Any]:
            """`remove`, with another thread's put of `r` started just before the first call
            (waited for up to 2 s: the sweep may hold what that put needs)."""
            def removing(*args: Any, **kwargs: Any) -> Any:
                if not raced:
                    raced.append(threading.Thread(target=channel.put, args=("r", _marked(2))))
                    raced[0].start()
                    raced[0].join(2)
                return remove(*args, **kwargs)
            return removing

        class PutInTheGap:
            remove = staticmethod(put_first(store.remove))
            batch_remove = staticmethod(put_first(store.batch_remove))

            def __getattr__(self, name: str) -> Any:
                return getattr(store, name)

        channel._store = PutInTheGap()
        try:
            channel._sweep()
        finally:
            channel._store = store
        raced[0].join(10)
        assert raced
        assert _mark(reader.get("r", timeout_s=5)) == 2


def test_a_sweep_racing_another_handles_put_of_the_same_id_keeps_that_entry(
        mooncake_store: MooncakeStoreProcesses) -> None:
    """Handle A's chain under `r` expires and A sweeps it; handle B (another producer) puts `r`
    between A's read of what it sweeps and A's first remove. B's put returned: its entry must
    stay reachable."""
    with open_channel(mooncake_store.spec + "&ttl=0.5") as a, \
            open_channel(a.spec.replace("ttl=0.5", "ttl=60")) as b:
        assert isinstance(a, MooncakeChannel)
        a.put("r", _marked(1))
        assert _mark(a.get("r", timeout_s=5)) == 1
        a._stop.set()  # A's keeper thread stays out of the way
        time.sleep(0.6)  # A's chain under `r` expired, not yet swept
        store, raced = a._store, []

        def put_first(remove: Callable[..., Any]) -> Callable[..., Any]:
            def removing(*args: Any, **kwargs: Any) -> Any:
                if not raced:
                    raced.append(True)
                    b.put("r", _marked(2))
                return remove(*args, **kwargs)
            return removing

        class PutInTheGap:
            remove = staticmethod(put_first(store.remove))
            batch_remove = staticmethod(put_first(store.batch_remove))

            def __getattr__(self, name: str) -> Any:
                return getattr(store, name)

        a._store = PutInTheGap()
        try:
            a._sweep()
        finally:
            a._store = store
        assert raced
        assert _mark(b.get("r", timeout_s=5)) == 2


def test_handles_publishing_under_one_id_at_once_lose_no_entry(
        mooncake_store: MooncakeStoreProcesses) -> None:
    """Three handles put under one id at once while a fourth takes: every entry whose put
    returned is taken exactly once, each handle's in its put order."""
    count = 25
    with open_channel(mooncake_store.spec) as reader:
        handles = [open_channel(reader.spec) for _ in range(3)]
        try:
            putters = [threading.Thread(target=lambda i=i, h=h: [
                h.put("r", _marked(100 * i + k)) for k in range(count)])
                for i, h in enumerate(handles)]
            for putter in putters:
                putter.start()
            taken: list[int] = []
            deadline = time.monotonic() + 60
            while len(taken) < 3 * count and time.monotonic() < deadline:
                with contextlib.suppress(OmniPrefixCacheChannelTimeoutError):
                    taken.append(_mark(reader.get("r", timeout_s=1)))
            for putter in putters:
                putter.join(30)
        finally:
            for handle in handles:
                handle.close()
    assert sorted(taken) == sorted(100 * i + k for i in range(3) for k in range(count))
    for i in range(3):
        assert [m for m in taken if m // 100 == i] == [100 * i + k for k in range(count)]


def _publish_then_end(spec: str, end: str) -> None:
    """In a child: publish two entries of `r` and one of `s`, then close or be killed."""
    channel = open_channel(spec)
    channel.put("r", _marked(1))
    channel.put("r", _marked(2))
    channel.put("s", _marked(5))
    if end == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    channel.close()  # joined, not the owner: its entries stay


@pytest.mark.parametrize("end", ["close", "kill"])
def test_a_gone_publishers_entries_expire_without_it_and_others_publish_under_its_ids(
        mooncake_store: MooncakeStoreProcesses, end: str) -> None:
    with open_channel(mooncake_store.spec + "&ttl=3") as owner:
        publisher = _start(_publish_then_end, owner.spec, end)
        publisher.join(60)
        assert publisher.exitcode == (-signal.SIGKILL if end == "kill" else 0)
        left = _chain_keys(owner, "r") + _chain_keys(owner, "s")
        assert len(_existing(owner, left)) == 3
        owner.put("r", _marked(3))  # beside the gone publisher's: taken after them
        time.sleep(3.1)
        with pytest.raises(OmniPrefixCacheChannelTimeoutError):
            owner.get("s", timeout_s=0.2)  # expired: not returned, removed
        owner.put("r", _marked(4))
        assert _drain(owner, "r") == [4]
        assert _existing(owner, left) == []


class SlowForOneId(RealClient):
    """Every call naming a key of `slow_head` takes half a second more; says when one started."""

    slow_head = "not yet"
    slowed = threading.Event()

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.real, name)

        def maybe_slow(*args: Any, **kwargs: Any) -> Any:
            if args and type(self).slow_head in str(args[0]):
                type(self).slowed.set()
                time.sleep(0.5)
            return call(*args, **kwargs)
        return maybe_slow


def test_a_slow_id_delays_no_other_ids_put_or_get(
        mooncake_store: MooncakeStoreProcesses, monkeypatch: pytest.MonkeyPatch) -> None:
    use_client(monkeypatch, SlowForOneId)
    with open_channel(mooncake_store.spec) as channel:
        SlowForOneId.slow_head = channel.entry_key("slow")
        slow_put = threading.Thread(target=channel.put, args=("slow", _marked(1)))
        slow_put.start()
        assert SlowForOneId.slowed.wait(10)
        started = time.monotonic()
        channel.put("fast", _marked(2))
        assert _mark(channel.get("fast", timeout_s=5)) == 2
        took = time.monotonic() - started
        slow_put.join(30)
        assert took < 0.4, f"a put and get of another id took {took:.2f} s behind a slow one"
        assert _mark(channel.get("slow", timeout_s=30)) == 1


def _produce(spec: str, ready: Any, publish_after_s: float) -> None:
    """In a child: a producer that expects r1 and r2, then publishes r2 after a while (longer
    than LEASE_S) and lives on until killed."""
    channel = open_channel(spec)
    channel.register_producer()
    channel.expect("r1")
    channel.expect("r2")
    ready.put(os.getpid())
    time.sleep(publish_after_s)
    channel.put("r2", _marked(2))
    time.sleep(600)


def test_a_consumer_learns_within_seconds_that_its_producer_was_killed(
        mooncake_store: MooncakeStoreProcesses) -> None:
    """Bound: LEASE_S of the consumer's clock since it first read the lease, plus a liveness
    check (0.5 s) and a lease scan interval (0.5 s): under 7 s; asserted under 10."""
    ready = _FORKSERVER.Queue()
    with open_channel(mooncake_store.spec) as consumer:
        producer = _start(_produce, consumer.spec, ready, LEASE_S + 2)
        try:
            pid = ready.get(timeout=60)
            assert _mark(consumer.get("r2", timeout_s=60)) == 2  # a live producer, late
            os.kill(pid, signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(OmniPrefixCacheChannelProducerError,
                               match=f"request r1: .* producer pid {pid} on host .* died"):
                consumer.get("r1", timeout_s=60)
            assert time.monotonic() - started < 10
            with pytest.raises(OmniPrefixCacheChannelProducerError, match=f"pid {pid}"):
                consumer.get("r3", timeout_s=60)  # not expected: all producers dead
        finally:
            producer.kill()
            producer.join(30)


def _stream_a_chunk(spec: str, ready: Any) -> None:
    """In a child: a producer that expects r1 and r2, streams r1's first chunk and lives on
    until killed."""
    channel = open_channel(spec)
    channel.expect_all(["r1", "r2"])
    channel.put("r1", _marked(5), start=0, final=False)
    ready.put(os.getpid())
    time.sleep(600)


def test_a_death_is_reported_once_and_the_ids_retry_waits_for_the_new_producer(
        mooncake_store: MooncakeStoreProcesses) -> None:
    """A stage restarted after its producer was killed registers anew and takes the retries
    of the requests the consumer just learned were cut, one mid-entry (r1), one before its
    first chunk (r2). The consumer's waits for the retries wait for the new producer, which has
    not expected them yet, and get its entries: they are not told the dead one died again
    (the soak found retries told so)."""
    ready = _FORKSERVER.Queue()
    with open_channel(mooncake_store.spec) as consumer, \
            open_channel(consumer.spec) as restarted:
        producer = _start(_stream_a_chunk, consumer.spec, ready)
        try:
            pid = ready.get(timeout=60)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(OmniPrefixCacheChannelProducerError,
                               match=f"request r1: .*stops at position 4: .*pid {pid} "):
                for _ in consumer.stream("r1", timeout_s=60):
                    pass
            with pytest.raises(OmniPrefixCacheChannelProducerError,
                               match=f"request r2: no entry .*pid {pid} .*died"):
                consumer.get("r2", timeout_s=60)
            restarted.register_producer()
            for request_id, mark in (("r1", 1), ("r2", 2)):
                with pytest.raises(OmniPrefixCacheChannelTimeoutError):
                    consumer.get(request_id, timeout_s=2)  # the retry: queued, not expected
                restarted.expect(request_id)
                restarted.put(request_id, _marked(mark))
                assert _mark(consumer.get(request_id, timeout_s=5)) == mark
        finally:
            producer.kill()
            producer.join(30)


def test_a_producer_rewriting_its_lease_is_not_taken_for_gone_while_others_died(
        mooncake_store: MooncakeStoreProcesses) -> None:
    """A slot being rewritten reads as not ready (on loopback, two reads in three while its
    lease is rewritten back to back). A consumer waiting for an id no producer expected yet,
    beside a producer that died and a live one that rewrites its lease all the while, is told
    of no death: the live one is never missed (the soak found waits for retries, queued on a
    restarted stage, told that the killed stage died)."""
    ready = _FORKSERVER.Queue()
    with open_channel(mooncake_store.spec) as consumer, \
            open_channel(consumer.spec) as restarted:
        stop = threading.Event()

        def rewrite_lease() -> None:
            counter = 1 << 32  # past the keeper's: a lease that keeps changing
            while not stop.is_set():
                restarted._values.upsert(restarted._held.slot,
                                         restarted._producer.record(counter))
                counter += 1

        rewriter = threading.Thread(target=rewrite_lease)
        producer = _start(_produce, consumer.spec, ready, 600)
        try:
            pid = ready.get(timeout=60)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(OmniPrefixCacheChannelProducerError, match=f"pid {pid}"):
                consumer.get("r1", timeout_s=60)
            restarted.register_producer()
            rewriter.start()
            with pytest.raises(OmniPrefixCacheChannelTimeoutError):
                consumer.get("r9", timeout_s=4)
        finally:
            stop.set()
            if rewriter.is_alive():
                rewriter.join(30)
            producer.kill()
            producer.join(30)


class StoppedAroundALeaseScan(RealClient):
    """Once armed, the second read of the producer slots takes LEASE_S + 1 s more: the process
    was stopped (SIGSTOP, a debugger, a frozen container) right after the store answered, with
    the leases it read growing old meanwhile (`before` off), or right before the question
    reached the store, with the leases it reads newer than its clock says (`before` on)."""

    armed: list[int] = []  # slot reads to let through before the stop
    before = False

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> Any:
        stop = False
        if self.armed and "/.producer/" in keys[0]:
            if self.armed[0] == 0:
                self.armed.clear()
                stop = True
            else:
                self.armed[0] -= 1
        if stop and self.before:
            time.sleep(LEASE_S + 1)
        read = self.real.batch_get_into(keys, ptrs, sizes)
        if stop and not self.before:
            time.sleep(LEASE_S + 1)
        return read


@pytest.mark.parametrize("stopped", ["after the store answered", "before the store was asked"])
def test_a_consumer_stopped_around_a_lease_scan_takes_no_live_producer_for_dead(
        mooncake_store: MooncakeStoreProcesses, monkeypatch: pytest.MonkeyPatch,
        stopped: str) -> None:
    """A scan's leases were current at some moment between its question and the store's
    answer: a consumer stopped after the answer (the soak's consumer stalls) judges them from
    when it asked; one stopped before the question reached the store, from when the answer
    came (the 30-minute Mooncake soak: a live producer reported dead, three times). Either
    way it waits on for the live producer's entry instead of reporting it dead."""
    use_client(monkeypatch, StoppedAroundALeaseScan)
    monkeypatch.setattr(StoppedAroundALeaseScan, "before", stopped.startswith("before"))
    with open_channel(mooncake_store.spec) as producer, \
            open_channel(producer.spec) as consumer:
        producer.expect("r")
        with pytest.raises(OmniPrefixCacheChannelTimeoutError):
            consumer.get("warm-up", timeout_s=0.3)  # the consumer has seen the leases
        StoppedAroundALeaseScan.armed.append(1)
        try:
            _gets_what_a_live_producer_puts_late(producer, consumer, LEASE_S + 3)
        finally:
            StoppedAroundALeaseScan.armed.clear()


def _gets_what_a_live_producer_puts_late(producer: MooncakeChannel, consumer: MooncakeChannel,
                                         after_s: float) -> None:
    """`producer` puts `r` (which it expected) after `after_s`; `consumer`'s wait gets it."""
    late = threading.Timer(after_s, producer.put, args=("r", _marked(7)))
    late.start()
    try:
        assert _mark(consumer.get("r", timeout_s=30)) == 7
    finally:
        late.join(30)


class SlowRemovesOnTheKeeper(RealClient):
    """Every remove the keeper thread makes takes half a second (a slow or loaded store)."""

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.real, name)

        def maybe_slow(*args: Any, **kwargs: Any) -> Any:
            if name in ("remove", "batch_remove") \
                    and threading.current_thread().name.endswith("-keeper"):
                time.sleep(0.5)
            return call(*args, **kwargs)
        return maybe_slow


@pytest.mark.slow
def test_a_producer_whose_keeper_sweeps_longer_than_a_lease_is_not_judged_dead(
        mooncake_store: MooncakeStoreProcesses, monkeypatch: pytest.MonkeyPatch) -> None:
    """The keeper rewrites the producer's lease and sweeps what expired; on a slow store a
    sweep of 16 expired chains takes about 8 s, twice LEASE_S. The lease stays fresh all the
    while: the consumer waiting for the producer's expected entry gets it when it comes, and
    is never told that the producer died."""
    use_client(monkeypatch, SlowRemovesOnTheKeeper)
    with open_channel(mooncake_store.spec + "&ttl=1") as producer, \
            open_channel(producer.spec) as consumer:
        producer.register_producer()
        for i in range(16):
            producer.put(f"done-{i}", _marked(i))
            assert _mark(consumer.get(f"done-{i}", timeout_s=5)) == i
        producer.expect("r")
        _gets_what_a_live_producer_puts_late(producer, consumer, LEASE_S + 4)


def _close_with_a_promise_open(spec: str) -> None:
    with open_channel(spec) as channel:
        channel.expect("r1")


def test_a_producer_that_closed_is_not_reported_dead(
        mooncake_store: MooncakeStoreProcesses) -> None:
    with open_channel(mooncake_store.spec) as consumer:
        producer = _start(_close_with_a_promise_open, consumer.spec)
        producer.join(60)
        assert producer.exitcode == 0
        with pytest.raises(OmniPrefixCacheChannelTimeoutError):
            consumer.get("r1", timeout_s=LEASE_S + 1.5)


class DyingAtCall(RealClient):
    """A client whose process exits at the `die_at`-th store call (from 0) the main thread
    makes once armed, before that call runs; a lease's rewrite (due by the clock) is no call
    of a put or a take."""

    die_at: int | None = None
    calls = 0

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.real, name)

        def maybe_die(*args: Any, **kwargs: Any) -> Any:
            cls = type(self)
            lease = name == "upsert_from" and "/.producer/" in args[0]
            if cls.die_at is not None and not lease \
                    and threading.current_thread() is threading.main_thread():
                if cls.calls == cls.die_at:
                    os._exit(1)
                cls.calls += 1
            return call(*args, **kwargs)
        return maybe_die


def _arm_death() -> None:
    """Channels this child opens from now on make their client a DyingAtCall."""
    DyingAtCall.real_class = mooncake_module._store_class()
    mooncake_module._store_class = lambda: DyingAtCall


def _put_dying(spec: str, die_at: int) -> None:
    """In a child: publish entries 0 and 1 of `r`, then die at store call `die_at` of the put
    of entry 2 (past its last call: right after it returns)."""
    _arm_death()
    channel = open_channel(spec)
    channel.put("r", _marked(0))
    channel.put("r", _marked(1))
    DyingAtCall.die_at = die_at
    channel.put("r", _marked(2))
    os._exit(1)


def _take_dying(spec: str, die_at: int) -> None:
    """In a child: die at store call `die_at` of a get of `r` (past its last: after it)."""
    _arm_death()
    channel = open_channel(spec)
    DyingAtCall.die_at = die_at
    channel.get("r", timeout_s=30)  # long: a loaded metadata server answers in seconds
    os._exit(1)


PUT_CALLS = 5  # existence of the chain's keys, register, entry, unregister, record
#: the first take of a handle: register the slots' buffer, read the slots, the records, ask
#: which entries exist, size, register, read, unregister, remove
TAKE_CALLS = 9


@pytest.mark.parametrize("die_at", range(PUT_CALLS + 1))
def test_a_put_killed_at_any_store_call_leaves_the_ids_other_entries_whole(
        mooncake_store: MooncakeStoreProcesses, die_at: int) -> None:
    with open_channel(mooncake_store.spec) as owner:
        child = _start(_put_dying, owner.spec, die_at)
        child.join(60)
        assert child.exitcode == 1
        assert _drain(owner, "r") == ([0, 1, 2] if die_at == PUT_CALLS else [0, 1])
        with open_channel(owner.spec) as other:
            other.put("r", _marked(3))  # a producer restarted: the id goes on
            assert _drain(owner, "r") == [3]


@pytest.mark.slow
def test_a_killed_producers_keys_are_reclaimed_once_its_entries_expired(
        mooncake_store: MooncakeStoreProcesses) -> None:
    """A producer killed mid-put (its entry stored, its record not) leaves nothing behind once
    its slot stayed unchanged for LEASE_S plus the time to live: a handle that reads the slots
    then removes its records, its entries (that one too) and its slot."""
    with open_channel(mooncake_store.spec + "&ttl=1") as owner:
        child = _start(_put_dying, owner.spec, 3)  # before the entry's buffer is unregistered
        child.join(60)
        assert child.exitcode == 1
        head = owner.entry_key("r")
        left = _chain_keys(owner, "r") + owner._leases.slots + [
            owner._record_key(head, p.token) for p in owner._leases.producers()]
        assert len(_existing(owner, left)) == 5  # 3 entries, the record, the slot
        deadline = time.monotonic() + LEASE_S + 30
        while _existing(owner, left) and time.monotonic() < deadline:
            owner._leases.scan(0.0)
            time.sleep(0.2)
        assert _existing(owner, left) == []


@pytest.mark.parametrize("die_at", range(TAKE_CALLS + 1))
def test_a_take_killed_at_any_store_call_leaves_the_ids_other_entries_whole(
        mooncake_store: MooncakeStoreProcesses, die_at: int) -> None:
    with open_channel(mooncake_store.spec) as owner:
        for i in range(3):
            owner.put("r", _marked(i))
        child = _start(_take_dying, owner.spec, die_at)
        child.join(60)
        assert child.exitcode == 1
        taken_by_the_dead = die_at == TAKE_CALLS  # it died after its remove claimed entry 0
        assert _drain(owner, "r") == ([1, 2] if taken_by_the_dead else [0, 1, 2])
        with open_channel(owner.spec) as other:
            other.put("r", _marked(3))
            assert _drain(owner, "r") == [3]



def _registered_client_port(store: MooncakeStoreProcesses, port: int) -> bool:
    """Whether the metadata server holds a client's registration on loopback `port`."""
    key = urllib.parse.quote(f"mooncake/rpc_meta/{HOST}:{port}", safe="")
    try:
        with urllib.request.urlopen(f"{store.metadata_url}?key={key}", timeout=5):
            return True
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return False
        raise


def _free_port_pair() -> int:
    """P, with P and P + 1 free on loopback, inside Mooncake's accepted client port range."""
    for _ in range(100):
        first = random.randrange(12400, 14200)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind((HOST, first))
                b.bind((HOST, first + 1))
            return first
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports in 12400..14200")


def test_a_client_that_draws_a_killed_clients_port_still_connects(
        mooncake_store: MooncakeStoreProcesses, monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed client's port stays registered with the metadata server. Two killed clients
    hold both ports of a two-port range, so a new client's first draw is refused there:
    connecting must try again on another draw, not fail (as a restarted producer would)."""
    first = _free_port_pair()
    ports = {"MC_STORE_CLIENT_MIN_PORT": str(first), "MC_STORE_CLIENT_MAX_PORT": str(first + 1)}
    holder = ("import sys, time; from prefix_cache.channel import open_channel\n"
              "channel = open_channel(sys.argv[1]); print('open', flush=True); time.sleep(600)")
    holders = [subprocess.Popen([sys.executable, "-c", holder, mooncake_store.spec],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, **ports})
               for _ in range(2)]
    try:
        assert [h.stdout.readline().strip() for h in holders] == ["open", "open"]
    finally:
        for h in holders:
            h.kill()
            h.wait(30)
            h.stdout.close()
    assert _registered_client_port(mooncake_store, first)
    assert _registered_client_port(mooncake_store, first + 1)
    for name, value in ports.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MC_STORE_CLIENT_SETUP_RETRIES", raising=False)
    for _ in range(2):
        with open_channel(mooncake_store.spec) as channel:
            channel.put("r", _marked(1))
            assert _mark(channel.get("r", timeout_s=5)) == 1
