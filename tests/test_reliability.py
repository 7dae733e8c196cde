"""No silent wrong rows (SPEC §4 rules 3, 10, 13, 14, §9): live buffers, faults, bad input.

Every test runs on each available backend (`backend` fixture: cpu here, cuda on a GPU).
A fault that real hardware would raise is injected by `tests.faults.FaultyBackend`.
"""

from __future__ import annotations

import gc
import math
import os
import threading
import time
import tracemalloc
import weakref
from types import SimpleNamespace

import pytest
import torch

from prefix_cache import (ModelCachePolicy, OmniPrefixCacheError,
                          OmniPrefixCacheManager, OmniPrefixCacheStagingTimeoutError,
                          OmniPrefixCacheUnmatchError, PrefixCacheConfig)
from prefix_cache import devices
from prefix_cache.errors import OmniPrefixCacheInputError
from tests.faults import COMMITTER_POINTS, ENGINE_POINTS, FaultyBackend, InjectedFault, spy
from tests.sim import StepDriver, token_rows
from tests.test_manager import BS, make, run_step

DEFERRED = "codes"   # a deferred per-token key in these tests
PER_REQ = "speaker"  # a per-request key


def wait_idle(manager: OmniPrefixCacheManager, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while manager.stats()["tasks_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.005)


def full_save(manager: OmniPrefixCacheManager, d: StepDriver, device: torch.device,
              new_key: str | None = None) -> int:
    """Save the driver's step with hidden rows, an immediate and a deferred mm key, a
    per-request key and a leftover tensor: every path `save_outputs` has; `new_key` adds a
    key seen for the first time (its pool is allocated in the call)."""
    n = sum(d.scheduled.values())
    mm = {"mm_feature": d.outputs(16, salt=1).to(device), DEFERRED: d.outputs(3, salt=2).to(device),
          PER_REQ: torch.arange(float(len(d.batch))).to(device),
          "ref": torch.arange(5.0).to(device)}
    if new_key is not None:
        mm[new_key] = d.outputs(4, salt=3).to(device)
    return manager.save_outputs(d.outputs(2).to(device), mm, num_tokens_unpadded=n,
                                num_tokens_padded=n)


def check_full(out, d: StepDriver, req_ids) -> None:
    for r in req_ids:
        tokens = d.reqs[r].tokens[: d.reqs[r].computed + d.scheduled[r]]
        assert torch.equal(out.hidden_states[r], token_rows(tokens, 2)), r
        assert torch.equal(out.mm_outputs["mm_feature"][r], token_rows(tokens, 16, salt=1)), r
        assert torch.equal(out.mm_outputs[DEFERRED][r], token_rows(tokens, 3, salt=2)), r
    assert torch.equal(out.leftover["ref"], torch.arange(5.0))


def policy() -> ModelCachePolicy:
    return ModelCachePolicy(deferred_keys={DEFERRED}, per_request_keys={PER_REQ})


# --------------------------------------------------------------------------- live buffers

@pytest.mark.parametrize("write_stream", ["compute", "copy"])
def test_everything_saved_comes_back_as_it_was_when_the_caller_overwrites_it_at_once(
        backend, write_stream):
    """The forward runs on a non-default stream and is still busy when save_outputs returns;
    the caller overwrites every tensor it passed right after (the device slot mapping too);
    steps repeat past first-time allocations. Leftover and deferred copies are where this
    used to break."""
    manager, d = make(backend, num_blocks=64, block_size=16, gpu_budget_bytes=1 << 30,
                      staging_depth=8, write_stream=write_stream)
    manager.register_policy(policy())
    cuda = backend.device.type == "cuda"
    compute = torch.cuda.Stream(backend.device) if cuda else None
    big = 1 << 22  # a 16 MiB leftover: its copy outlasts the call by far
    with manager:
        results = []
        for i in range(6):
            tokens = [i * 1000 + t for t in range(32)]
            so = d.step(new=[(f"r{i}", tokens, [2 * i + 1, 2 * i + 2], 0, 32)],
                        finished=[f"r{i - 1}"] if i else [])
            manager.new_step_starts(so)
            hidden, mm_feature, codes = d.outputs(2), d.outputs(16, salt=1), d.outputs(3, salt=2)
            leftover = torch.full((big,), float(i))
            if cuda:
                with torch.cuda.stream(compute):
                    torch.cuda._sleep(50_000_000)  # the forward, still running at save time
                    slot_mapping = d.step_slots_cpu(d.batch_req_ids(), d.scheduled)
                    bufs = [t.to(backend.device, non_blocking=True)
                            for t in (hidden, mm_feature, codes, leftover, slot_mapping)]
                    sid = manager.save_outputs(
                        bufs[0], {"mm_feature": bufs[1], DEFERRED: bufs[2], "big": bufs[3]},
                        num_tokens_unpadded=32, num_tokens_padded=32, slot_mapping=bufs[4])
                    for buf in bufs:  # the next forward / a CUDA graph replay reuses them
                        buf.fill_(-1.0)
            else:
                bufs = [hidden.clone(), mm_feature.clone(), codes.clone(), leftover.clone()]
                sid = manager.save_outputs(
                    bufs[0], {"mm_feature": bufs[1], DEFERRED: bufs[2], "big": bufs[3]},
                    num_tokens_unpadded=32, num_tokens_padded=32)
                for buf in bufs:
                    buf.fill_(-1.0)
            results.append((sid, f"r{i}", hidden, mm_feature, leftover))
            d.advance()
        manager.new_step_starts(d.step(finished=["r5"]))  # deferred rows of r5 land now
        manager.discard_step(manager.save_outputs(None, None, num_tokens_unpadded=0,
                                                  num_tokens_padded=0))
        for sid, req, hidden, mm_feature, leftover in results:
            out = manager.materialize(sid, [req])
            assert torch.equal(out.hidden_states[req], hidden), req
            assert torch.equal(out.mm_outputs["mm_feature"][req], mm_feature), req
            assert torch.equal(out.leftover["big"], leftover), req
        # every deferred row landed as saved: a hit on r0..r5's first blocks reads them back
        for i in range(6):
            tokens = [i * 1000 + t for t in range(32)]
            so = d.step(new=[(f"h{i}", tokens[:16] + [7], [2 * i + 1, 40 + i], 16, 1)])
            out = run_step(manager, d, so, backend.device, mm_width=None)
            assert torch.equal(out.hidden_states[f"h{i}"][:16], token_rows(tokens, 2)[:16])
            wanted = token_rows(tokens, 3, salt=2)[:16]
            manager.new_step_starts(d.step(new=[(f"g{i}", tokens[:16] + [8], [2 * i + 1, 50 + i],
                                                 16, 1)]))
            sid = manager.save_outputs(d.outputs(2).to(backend.device),
                                       {DEFERRED: d.outputs(3, salt=2).to(backend.device)},
                                       num_tokens_unpadded=1, num_tokens_padded=1)
            got = manager.materialize(sid, [f"g{i}"]).mm_outputs[DEFERRED][f"g{i}"]
            assert torch.equal(got[:16], wanted), i
            d.advance()


# --------------------------------------------------------------------------- faults

def step_or_error(manager: OmniPrefixCacheManager, d: StepDriver, so: SimpleNamespace,
                  device: torch.device, req_id: str) -> OmniPrefixCacheError | None:
    """Run a full step of `req_id`: its rows must be exact, or the cache must say why not."""
    try:
        manager.new_step_starts(so)
    except OmniPrefixCacheError as exc:  # an earlier failure, reported once: try again
        if "earlier write failed" not in str(exc):
            raise
        manager.new_step_starts(so)
    try:
        out = manager.materialize(full_save(manager, d, device), [req_id])
    except OmniPrefixCacheError as exc:
        return exc
    finally:
        d.advance()
    for key, width, salt in ((None, 2, 0), ("mm_feature", 16, 1), (DEFERRED, 3, 2)):
        got = out.hidden_states[req_id] if key is None else out.mm_outputs[key][req_id]
        req = d.reqs[req_id]
        assert torch.equal(got, token_rows(req.tokens[: req.computed], width, salt=salt)), \
            (req_id, key)
    return None


@pytest.mark.slow  # each case waits out a stalled copy
@pytest.mark.parametrize("write_stream,point", [
    (stream, point) for stream in ("compute", "copy") for point in ENGINE_POINTS + COMMITTER_POINTS
    if (stream, point) != ("compute", "record_event")])  # in-stream saves record no ready event
def test_an_injected_fault_fails_its_own_step_only_and_later_steps_and_hits_stay_exact(
        backend, write_stream, point):
    faulty = FaultyBackend(backend)
    manager, d = make(faulty, num_blocks=32, staging_claim_timeout_s=0.5,
                      write_stream=write_stream)
    manager.register_policy(policy())
    a = list(range(100, 108))
    b = a[:4] + [9, 9, 9, 9]
    with manager:
        assert step_or_error(manager, d, d.step(new=[("a", a, [1, 2], 0, 8)]),
                             backend.device, "a") is None
        manager.new_step_starts(d.step(finished=["a"]))  # a's deferred rows land now
        manager.discard_step(manager.save_outputs(None, None, num_tokens_unpadded=0,
                                                  num_tokens_padded=0))
        wait_idle(manager)

        faulty.arm(point)
        seen: list[BaseException] = []
        manager.new_step_starts(d.step(new=[("b", b, [1, 3], 4, 4)]))
        try:
            sid = full_save(manager, d, backend.device, new_key="first_seen")
        except (InjectedFault, OmniPrefixCacheError) as exc:  # raised by the call itself
            seen.append(exc)
            sid = full_save(manager, d, backend.device, new_key="first_seen")  # saved again
        for _ in range(2):  # an earlier failure is raised once, before the call does anything
            try:
                check_full(manager.materialize(sid, ["b"]), d, ["b"])
                break
            except OmniPrefixCacheError as exc:  # the step whose write failed
                seen.append(exc)
                if "earlier write failed" not in str(exc):
                    break
        d.advance()
        wait_idle(manager)
        assert faulty.fired == 1, f"{point} was never reached"

        # hits on a's blocks and fresh requests are exact; a hit on b's blocks is exact
        # or refused by name when b's rows were lost: never wrong rows
        c = a[:4] + [5, 5, 5, 5]
        error = step_or_error(manager, d, d.step(new=[("c", c, [1, 4], 4, 4)], finished=["b"]),
                              backend.device, "c")
        assert error is None, error
        error = step_or_error(manager, d, d.step(new=[("g", b + [1], [1, 3, 5], 8, 1)]),
                              backend.device, "g")
        if error is not None:
            assert "lost to a failed write" in str(error), error
            seen.append(error)
        assert seen, f"a {point} fault went unreported"
        e = list(range(300, 308))
        assert step_or_error(manager, d, d.step(new=[("e", e, [6, 7], 0, 8)], finished=["c"]),
                             backend.device, "e") is None
        assert step_or_error(manager, d, d.step(new=[("f", e[:4] + [1], [6, 8], 4, 1)],
                                                finished=["e"]), backend.device, "f") is None
        manager.new_step_starts(d.step(finished=["f", "g"]))
        manager.discard_step(manager.save_outputs(None, None, num_tokens_unpadded=0,
                                                  num_tokens_padded=0))
        wait_idle(manager)
        stats = manager.stats()
        assert (stats["tasks_in_flight"], stats["steps_unconsumed"]) == (0, 0)
        assert all(not holders for holders in manager.staging._holders)


def test_a_failed_write_never_frees_the_staging_slot_the_next_step_holds(backend):
    """A write whose second key fails to launch after its first key's copy left: on a staged
    backend the slot stays held until that copy lands (a zero-copy write holds none), and no
    other step's hold is ever released for it."""
    faulty = FaultyBackend(backend)
    manager, d = make(faulty, staging_depth=2)
    with manager:
        manager.new_step_starts(d.step(new=[("a", list(range(4)), [1], 0, 4)]))
        faulty.delay_writes = threading.Event()
        faulty.arm("scatter_rows", nth=2)  # hidden goes out, mm_feature fails
        with pytest.raises(InjectedFault):
            manager.save_outputs(d.outputs(2).to(backend.device),
                                 {"mm_feature": d.outputs(16, salt=1).to(backend.device)},
                                 num_tokens_unpadded=4, num_tokens_padded=4)
        held = [h for h in manager.staging._holders if h]
        in_flight = [["write"]] if faulty.needs_staging else []  # its copy is in flight
        assert [[kind for kind, _ in h] for h in held] == in_flight
        faulty.delay_writes.set()
        faulty.delay_writes = None
        wait_idle(manager)
        assert all(not h for h in manager.staging._holders)
        out = manager.materialize(manager.save_outputs(  # the same step, saved again
            d.outputs(2).to(backend.device), {"mm_feature": d.outputs(16, salt=1).to(
                backend.device)}, num_tokens_unpadded=4, num_tokens_padded=4), ["a"])
        assert torch.equal(out.mm_outputs["mm_feature"]["a"], token_rows(list(range(4)), 16,
                                                                          salt=1))


def test_failed_write_is_raised_once_by_the_next_call_and_its_rows_are_never_served(backend):
    faulty = FaultyBackend(backend)
    manager, d = make(faulty)
    tokens = list(range(8))
    with manager:
        faulty.arm("finish")
        sid = run_step(manager, d, d.step(new=[("a", tokens, [1, 2], 0, 8)]), backend.device,
                       materialize=False)
        wait_idle(manager)
        with pytest.raises(OmniPrefixCacheError, match=r"write task 1 \(step 1, state FAILED"):
            manager.discard_step(sid)
        manager.discard_step(sid)  # reported once; the call itself then works
        with pytest.raises(OmniPrefixCacheUnmatchError, match="request b.*lost to a failed write"):
            run_step(manager, d, d.step(new=[("b", tokens[:4] + [1], [1, 3], 4, 1)]),
                     backend.device)


def test_a_write_failing_between_a_hits_check_and_its_read_is_never_served_as_zeros(
        backend, monkeypatch):
    """The hit passes its check while its rows' write is still in flight, then that write
    fails before the hit's reads are planned: the rows are lost, not absent, so the hit's
    materialize raises instead of returning zeros (found by the randomized schedules)."""
    import prefix_cache.core.step_table as facade
    faulty = FaultyBackend(backend)
    manager, d = make(faulty)
    tokens = list(range(8))
    checked = facade.check_hits

    in_flight = threading.Event()  # opened once b's hit was checked

    def check_then_land(*args, **kwargs):
        checked(*args, **kwargs)
        in_flight.set()
        wait_idle(manager)  # the failed write lands right after the check

    with manager:
        faulty.arm("finish")
        faulty.delay_writes = in_flight  # a's write is still in flight at b's check
        sid = run_step(manager, d, d.step(new=[("a", tokens, [1, 2], 0, 8)]), backend.device,
                       materialize=False)
        faulty.delay_writes = None
        monkeypatch.setattr(facade, "check_hits", check_then_land)
        hit = run_step(manager, d, d.step(new=[("b", tokens[:4] + [1], [1, 3], 4, 1)]),
                       backend.device, materialize=False)
        with pytest.raises(OmniPrefixCacheError, match=r"write task 1 \(step 1, state FAILED"):
            manager.discard_step(sid)  # the failure is reported once, by the next call
        with pytest.raises(OmniPrefixCacheError,
                           match=r"read of '__hidden_states__' for request b step 2 \(FAILED\): "
                                 r"write task 1 \(step 1, state FAILED\) failed"):
            manager.materialize(hit, ["b"])


def test_a_stalled_copy_raises_a_library_error_naming_the_task_instead_of_hanging(backend):
    faulty = FaultyBackend(backend)
    manager, d = make(faulty, staging_claim_timeout_s=0.3)
    with manager:
        faulty.arm("stall")
        manager.new_step_starts(d.step(new=[("a", list(range(4)), [1], 0, 4)]))
        sid = manager.save_outputs(d.outputs(2).to(backend.device), None,
                                   num_tokens_unpadded=4, num_tokens_padded=4)
        start = time.monotonic()
        with pytest.raises(OmniPrefixCacheError, match=r"write task 1 \(step 1, state") as info:
            manager.materialize(sid, ["a"])
        assert not isinstance(info.value, TimeoutError)
        assert time.monotonic() - start < 3


def test_a_stalled_copy_fails_alone_and_the_write_behind_it_lands(backend):
    faulty = FaultyBackend(backend)
    manager, d = make(faulty, staging_claim_timeout_s=0.3)
    a, b = list(range(4)), list(range(10, 14))
    with manager:
        faulty.arm("stall")  # step 1's copy never completes
        sid_a = run_step(manager, d, d.step(new=[("a", a, [1], 0, 4)]), backend.device,
                         materialize=False)
        sid_b = run_step(manager, d, d.step(new=[("b", b, [2], 0, 4)]), backend.device,
                         materialize=False)
        out = manager.materialize(sid_b, ["b"])  # lands write 2 once write 1 timed out
        assert torch.equal(out.hidden_states["b"], token_rows(b, 2))
        with pytest.raises(OmniPrefixCacheError, match=r"write task 1 \(step 1, state"):
            manager.materialize(sid_a, ["a"])


def test_block_copy_waits_for_a_write_still_landing_on_its_destination(backend):
    """A discarded step's slow write to block 5, then vLLM copies block 1 into block 5: the
    late write must not land over the copy."""
    faulty = FaultyBackend(backend)
    manager, d = make(faulty, num_blocks=8)
    a = list(range(8))
    with manager:
        run_step(manager, d, d.step(new=[("a", a, [1, 2], 0, 8)]), backend.device)
        gate = faulty.delay_writes = threading.Event()
        x = list(range(50, 54))
        manager.discard_step(run_step(manager, d, d.step(new=[("x", x, [5], 0, 4)]),
                                      backend.device, materialize=False))
        faulty.delay_writes = None
        threading.Timer(0.2, gate.set).start()
        so = d.step(new=[("b", a[:4] + [9], [5, 6], 4, 1)], finished=["a", "x"])
        so.kv_cache_block_copies = [SimpleNamespace(src_block_id=1, dst_block_id=5)]
        out = run_step(manager, d, so, backend.device)
        assert gate.is_set()
        assert torch.equal(out.hidden_states["b"], token_rows(a[:4] + [9], 2))


# --------------------------------------------------------------------------- rejected calls

def _rejections(d: StepDriver, device: torch.device):
    hidden = d.outputs(2).to(device)
    yield "too few rows", dict(hidden_states=hidden[:2], mm_outputs=None)
    yield "hidden dtype", dict(hidden_states=hidden.double(), mm_outputs=None)
    yield "mm dtype", dict(hidden_states=hidden,
                           mm_outputs={"mm_feature": d.outputs(16, salt=1).to(device).half()})
    yield "not a tensor", dict(hidden_states=hidden.tolist(), mm_outputs=None)
    yield "mm not a mapping", dict(hidden_states=hidden, mm_outputs=[1, 2])
    slots = torch.arange(16, 20, device=device)
    yield "slot mapping too short", dict(hidden_states=hidden, mm_outputs=None,
                                         slot_mapping=slots[:3])
    yield "slot mapping of floats", dict(hidden_states=hidden, mm_outputs=None,
                                         slot_mapping=slots.float())
    yield "slot mapping not a tensor", dict(hidden_states=hidden, mm_outputs=None,
                                            slot_mapping=[16, 17, 18, 19])
    if device.type != "cpu":
        yield "wrong device", dict(hidden_states=hidden.cpu(), mm_outputs=None)


def test_a_rejected_save_changes_nothing_and_the_same_step_saves_after_it(backend):
    manager, d = make(backend)
    a = list(range(20, 28))
    with manager:
        run_step(manager, d, d.step(new=[("a", a, [1, 2], 0, 8)]), backend.device)
        b = a[:4] + [3, 3, 3, 3]
        manager.new_step_starts(d.step(new=[("b", b, [1, 3], 4, 4)]))
        for what, kwargs in _rejections(d, backend.device):
            with pytest.raises(OmniPrefixCacheInputError):
                manager.save_outputs(**kwargs, num_tokens_unpadded=4, num_tokens_padded=4)
            assert manager.stats()["steps_unconsumed"] == 0, what
        for bad in (4.0, True, "4", None):
            with pytest.raises(OmniPrefixCacheInputError, match="must be an int"):
                manager.save_outputs(d.outputs(2), None, num_tokens_unpadded=bad,
                                     num_tokens_padded=4)
        sid = manager.save_outputs(d.outputs(2).to(backend.device),
                                   {"mm_feature": d.outputs(16, salt=1).to(backend.device)},
                                   num_tokens_unpadded=4, num_tokens_padded=4)
        out = manager.materialize(sid, ["b"])
        assert torch.equal(out.hidden_states["b"], token_rows(b, 2))
        assert torch.equal(out.mm_outputs["mm_feature"]["b"], token_rows(b, 16, salt=1))


def test_a_save_over_staging_capacity_or_timed_out_is_retried_as_is(backend):
    manager, d = make(backend, staging_depth=1, staging_capacity_tokens=8,
                      staging_claim_timeout_s=0.2)
    with manager:
        held = run_step(manager, d, d.step(new=[("a", list(range(4)), [1], 0, 4)]),
                        backend.device, materialize=False)
        manager.new_step_starts(d.step(new=[("b", list(range(10, 18)), [2, 3], 0, 8)]))
        with pytest.raises(OmniPrefixCacheStagingTimeoutError, match=rf"unused step ids \[{held}\]"):
            manager.save_outputs(d.outputs(2).to(backend.device), None, num_tokens_unpadded=8,
                                 num_tokens_padded=8)
        manager.discard_step(held)
        sid = manager.save_outputs(d.outputs(2).to(backend.device), None, num_tokens_unpadded=8,
                                   num_tokens_padded=8)
        assert torch.equal(manager.materialize(sid, ["b"]).hidden_states["b"],
                           token_rows(list(range(10, 18)), 2))


def test_rows_that_require_grad_never_turn_the_pool_into_an_autograd_tensor(backend):
    manager, d = make(backend)
    a = list(range(8))
    with manager:
        manager.new_step_starts(d.step(new=[("a", a, [1, 2], 0, 8)]))
        weight = torch.ones(2, device=backend.device, requires_grad=True)
        hidden = d.outputs(2).to(backend.device) * weight
        mm = d.outputs(16, salt=1).to(backend.device).requires_grad_()
        sid = manager.save_outputs(hidden, {"mm_feature": mm, "ref": hidden.sum()},
                                   num_tokens_unpadded=8, num_tokens_padded=8)
        out = manager.materialize(sid, ["a"])
        assert not out.hidden_states["a"].requires_grad
        assert not out.leftover["ref"].requires_grad
        d.advance()
        assert all(not k.flat.requires_grad for k in manager.pool.keys.values())
        out = run_step(manager, d, d.step(new=[("b", a[:4] + [1], [1, 3], 4, 1)]),
                       backend.device)
        assert torch.equal(out.hidden_states["b"], token_rows(a[:4] + [1], 2))


# --------------------------------------------------------------------------- empty steps

def test_a_step_with_no_tokens_is_a_step(backend):
    manager, d = make(backend)
    manager.register_policy(ModelCachePolicy(deferred_keys={"mm_feature"}))
    a = list(range(8))
    with manager:
        run_step(manager, d, d.step(new=[("a", a, [1, 2], 0, 8)]), backend.device)
        manager.new_step_starts(d.step(finished=["a"]))  # retires a only: no forward ran
        out = manager.materialize(manager.save_outputs(None, None, num_tokens_unpadded=0,
                                                       num_tokens_padded=0), [])
        assert out.hidden_states == {} and out.mm_outputs == {} and out.leftover == {}
        manager.new_step_starts(d.step())  # CUDA-graph padding rows only
        padding = torch.zeros(4, 2, device=backend.device)
        sid = manager.save_outputs(padding, {"mm_feature": torch.zeros(4, 16,
                                                                       device=backend.device)},
                                   num_tokens_unpadded=0, num_tokens_padded=4)
        assert manager.materialize(sid, []).hidden_states == {}
        wait_idle(manager)
        assert manager.stats()["deferred_device_bytes"] == 0  # a's deferred rows landed
        b = a[:4] + [6]
        out = run_step(manager, d, d.step(new=[("b", b, [1, 3], 4, 1)]), backend.device)
        assert torch.equal(out.mm_outputs["mm_feature"]["b"], token_rows(b, 16, salt=1))


# --------------------------------------------------------------------------- bad input

def test_bad_calls_get_one_line_library_errors_naming_what_is_wrong(backend):
    manager, d = make(backend)
    with manager:
        for so in (None, object(), SimpleNamespace(num_scheduled_tokens=[1])):
            with pytest.raises(OmniPrefixCacheInputError, match="expected a vLLM SchedulerOutput"):
                manager.new_step_starts(so)
        with pytest.raises(OmniPrefixCacheInputError, match="ModelCachePolicy"):
            manager.register_policy({"deferred_keys": ["x"]})
        manager.new_step_starts(d.step(new=[("a", list(range(4)), [1], 0, 4)]))
        with pytest.raises(OmniPrefixCacheUnmatchError, match="twice without save_outputs"):
            manager.new_step_starts(d.step())
        with pytest.raises(OmniPrefixCacheUnmatchError, match="policy is fixed"):
            manager.register_policy(ModelCachePolicy())
        with pytest.raises(OmniPrefixCacheInputError, match="req_ids must be an iterable"):
            manager.materialize(1, "a")
    with pytest.raises(OmniPrefixCacheInputError, match="lacks .*batch_req_ids"):
        OmniPrefixCacheManager(PrefixCacheConfig(8, BS), None, backend=backend)


def test_a_bad_slot_mapping_is_refused_and_the_step_saves_with_a_good_one(backend):
    manager, d = make(backend)
    a = list(range(30, 34))
    with manager:
        manager.new_step_starts(d.step(new=[("a", a, [1], 0, 4)]))
        rows = d.outputs(2)
        for bad, match in (([4, 5, 6, 7], "must be a tensor, got list"),
                           (torch.arange(4, 8).view(2, 2), r"1-D int32/int64 .* got \(2, 2\)"),
                           (torch.arange(4, 8).float(), "got \\(4,\\) torch.float32"),
                           (torch.arange(4, 7), "at least the step's 4 tokens, got \\(3,\\)")):
            with pytest.raises(OmniPrefixCacheInputError, match=match):
                manager.save_outputs(rows.to(backend.device), None, num_tokens_unpadded=4,
                                     num_tokens_padded=4, slot_mapping=bad)
        # the runner's buffer is longer than the step: its first n entries are the slots
        mapping = torch.tensor([4, 5, 6, 7, -1, -1]).to(backend.device)
        sid = manager.save_outputs(rows.to(backend.device), None, num_tokens_unpadded=4,
                                   num_tokens_padded=4, slot_mapping=mapping)
        assert torch.equal(manager.materialize(sid, ["a"]).hidden_states["a"], token_rows(a, 2))
        # an int32 mapping (vLLM's own slot_mapping dtype) is read the same way
        b = list(range(40, 44))
        manager.new_step_starts(d.step(new=[("b", b, [2], 0, 4)], finished=["a"]))
        sid = manager.save_outputs(d.outputs(2).to(backend.device), None, num_tokens_unpadded=4,
                                   num_tokens_padded=4,
                                   slot_mapping=torch.tensor([8, 9, 10, 11], dtype=torch.int32
                                                             ).to(backend.device))
        assert torch.equal(manager.materialize(sid, ["b"]).hidden_states["b"], token_rows(b, 2))


@pytest.mark.parametrize("field,value,match", [
    ("staging_claim_timeout_s", math.inf, "finite positive"),
    ("staging_claim_timeout_s", math.nan, "finite positive"),
    ("device", "tpu", "unknown device type"),
    ("device", "cpu:1", "optional accelerator index"),
    ("num_blocks", 1 << 50, "host bookkeeping"),
    ("block_size", 0, "positive int"),
])
def test_invalid_config_fields_are_refused_at_construction(field, value, match):
    kwargs = {"num_blocks": 8, "block_size": 4, field: value}
    with pytest.raises(ValueError, match=match):
        PrefixCacheConfig(**kwargs)


def test_config_device_names_are_normalized():
    assert PrefixCacheConfig(8, 4, device=" CPU ").device == "cpu"
    assert PrefixCacheConfig(8, 4, device="Cuda:1").device == "cuda:1"


def test_policy_keys_are_validated_and_a_string_is_one_key():
    assert ModelCachePolicy(deferred_keys="codes").deferred_keys == frozenset({"codes"})
    model = SimpleNamespace(deferred_prefix_cache_mm_keys="codes",
                            prefix_cache_per_request_mm_keys=["speaker"])
    policy = ModelCachePolicy.from_model(model)
    assert policy.deferred_keys == {"codes"} and policy.per_request_keys == {"speaker"}
    with pytest.raises(ValueError, match="must be a bool"):
        ModelCachePolicy(needs_full_hidden_states="yes")
    with pytest.raises(ValueError, match="non-empty strings"):
        ModelCachePolicy(deferred_keys={1})
    with pytest.raises(ValueError, match="both deferred"):
        ModelCachePolicy(deferred_keys={"a"}, per_request_keys={"a"})


def test_per_request_outputs_in_a_decode_step_are_leftover_not_token_rows(backend):
    """In a decode step num_reqs == num_tokens: a [num_reqs, D] output looks per-token."""
    manager, d = make(backend, num_blocks=16)
    manager.register_policy(ModelCachePolicy(per_request_keys={PER_REQ}))
    with manager:
        reqs = [(f"r{i}", [i] * 5, [i + 1, i + 8], 0, 4) for i in range(3)]
        run_step(manager, d, d.step(new=reqs), backend.device, mm_width=None)
        manager.new_step_starts(d.step(cached={f"r{i}": 1 for i in range(3)}))
        speaker = torch.arange(6.0).view(3, 2).to(backend.device)
        sid = manager.save_outputs(d.outputs(2).to(backend.device), {PER_REQ: speaker},
                                   num_tokens_unpadded=3, num_tokens_padded=3)
        out = manager.materialize(sid, ["r0", "r1", "r2"])
        assert torch.equal(out.leftover[PER_REQ], speaker.cpu())
        assert PER_REQ not in out.mm_outputs and PER_REQ not in manager.pool.keys


def test_finished_requests_retire_even_when_the_step_raises(backend):
    """A hit error in new_step_starts must not leave the step's finished requests live."""
    manager, d = make(backend)
    manager.register_policy(ModelCachePolicy(deferred_keys={"mm_feature"}))
    a = list(range(8))
    with manager:
        run_step(manager, d, d.step(new=[("a", a, [1, 2], 0, 8)]), backend.device)
        assert manager.stats()["deferred_device_bytes"] > 0
        with pytest.raises(OmniPrefixCacheUnmatchError, match="request x.*not aligned"):
            manager.new_step_starts(d.step(new=[("x", list(range(8)), [3, 4], 3, 5)],
                                           finished=["a"]))
        wait_idle(manager)
        stats = manager.stats()
        assert stats["deferred_device_bytes"] == 0 and stats["live_requests"] == 0


# --------------------------------------------------------------------------- growth

@pytest.mark.slow
def test_host_memory_stays_flat_over_ten_thousand_requests(backend):
    manager, d = make(backend, num_blocks=64, block_size=4)
    manager.register_policy(ModelCachePolicy(deferred_keys={"mm_feature"}))

    def burst(start: int, count: int) -> None:
        for i in range(start, start + count):
            tokens = [i % 7] * 4 + [i] * 4
            hit = 4 if i > 0 else 0
            blocks = [1, 2 + i % 60]
            so = d.step(new=[(f"q{i}", tokens, blocks, hit, 8 - hit)],
                        finished=[f"q{i - 1}"] if i else [])
            run_step(manager, d, so, backend.device)

    with manager:
        burst(0, 2000)  # warm: pools, staging, caches
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        burst(2000, 8000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert grown < 256 << 10, f"host memory grew {grown} bytes over 8000 requests"
        assert manager.stats()["live_requests"] == 1


# --------------------------------------------------------------------------- process, shutdown

def test_a_manager_used_in_a_forked_child_refuses_and_leaves_the_parent_alone(backend):
    manager, d = make(backend)
    with manager:
        run_step(manager, d, d.step(new=[("a", list(range(4)), [1], 0, 4)]), backend.device)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, never touch the device
            code = 1
            try:
                manager.new_step_starts(d.step())
            except OmniPrefixCacheError as exc:
                code = 0 if "forked child" in str(exc) else 2
            manager.shutdown()
            os.write(write, bytes([code]))
            os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        assert os.read(read, 1) == b"\x00" and status == 0
        os.close(read)
        out = run_step(manager, d, d.step(new=[("b", list(range(4)) + [5], [1, 2], 4, 1)]),
                       backend.device)
        assert torch.equal(out.hidden_states["b"], token_rows(list(range(4)) + [5], 2))


def test_shutdown_drains_the_copy_stream_before_it_releases_any_pool(backend):
    calls: list[str] = []
    backend.drain = spy(calls, "drain", backend.drain)
    manager, d = make(backend)  # a backend passed in: the manager does not own it
    run_step(manager, d, d.step(new=[("a", list(range(4)), [1], 0, 4)]), backend.device)
    for key in manager.pool.keys.values():
        key.storage.close = spy(calls, "release pool", key.storage.close)
    manager.shutdown()
    assert calls[0] == "drain" and "release pool" in calls
    manager.shutdown()  # idempotent


def test_a_shutdown_whose_copies_never_finish_keeps_the_pools_for_the_process(backend):
    """A device copy that never completes (drain times out): the pools and staging it may
    still write into are neither released nor freed, even once the manager is dropped."""
    manager, d = make(backend, staging_claim_timeout_s=0.05)
    run_step(manager, d, d.step(new=[("a", list(range(4)), [1], 0, 4)]), backend.device)
    backend.drain = lambda timeout_s: False  # as a copy stuck on the device
    storages = [weakref.ref(key.storage) for key in manager.pool.keys.values()]
    released: list[str] = []
    for key in manager.pool.keys.values():
        key.storage.close = spy(released, "release pool", key.storage.close)
    with pytest.raises(OmniPrefixCacheError, match="copies still running on .* the pools and "
                                                   "staging buffers are kept"):
        manager.shutdown()
    del manager
    gc.collect()
    assert released == [] and all(ref() is not None for ref in storages)


# --------------------------------------------------------------------------- devices

@pytest.mark.cuda
def test_rows_on_another_device_are_refused_and_the_current_device_is_kept():
    backend = devices.get_backend("cuda")
    manager, d = make(backend)
    with manager:
        manager.new_step_starts(d.step(new=[("a", list(range(4)), [1], 0, 4)]))
        with pytest.raises(OmniPrefixCacheInputError, match="are on cpu, the cache's device"):
            manager.save_outputs(d.outputs(2), None, num_tokens_unpadded=4, num_tokens_padded=4)
    backend.close()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_cache_on_the_second_gpu_works_there_and_never_moves_the_caller():
    manager, d = make(devices.get_backend("cuda:1"))
    manager.register_policy(policy())
    a = list(range(8))
    with manager:
        assert manager.backend.device == torch.device("cuda", 1)
        torch.cuda.set_device(1)
        manager.new_step_starts(d.step(new=[("a", a, [1, 2], 0, 8)]))
        sid = full_save(manager, d, torch.device("cuda", 1))
        assert torch.cuda.current_device() == 1
        check_full(manager.materialize(sid, ["a"]), d, ["a"])
        d.advance()
        torch.cuda.set_device(0)  # the caller's current device may differ from the cache's
        b = a[:4] + [2, 2]
        manager.new_step_starts(d.step(new=[("b", b, [1, 3], 4, 2)], finished=["a"]))
        sid = full_save(manager, d, torch.device("cuda", 1))
        assert torch.cuda.current_device() == 0
        check_full(manager.materialize(sid, ["b"]), d, ["b"])
        d.advance()
        manager.new_step_starts(d.step(cached={"b": 1}))
        with pytest.raises(OmniPrefixCacheInputError, match="are on cuda:0, the cache's device "
                                                            "is cuda:1"):
            manager.save_outputs(torch.zeros(1, 2, device="cuda:0"), None,
                                 num_tokens_unpadded=1, num_tokens_padded=1)
