"""The engine thread never stalls on the device (SPEC §4 rule 15, M4): once warm, its calls make
no pinned allocation, no host registration and no device synchronization."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from prefix_cache import HIDDEN_KEY, ModelCachePolicy, PrefixCacheConfig
from prefix_cache.integration.group_view import FullAttentionGroupView
from prefix_cache.manager import OmniPrefixCacheManager
from prefix_cache.tools.metrics.workload import (BLOCK, WIDTH, RunnerBatch, scheduler_step,
                                                 synchronize)
from prefix_cache.core import committer as controller
from prefix_cache.tools.metrics.stalls import engine_thread_stalls
from prefix_cache.devices.base import DeviceBackend, Transfer
from prefix_cache.devices.cpu import CpuBackend
from tests.faults import GatedEvent
from tests.sim import token_rows
from tests.test_manager import make

_COMPLETED = threading.Event()  # the gate of copies that have completed
_COMPLETED.set()


class _EventedCpu(CpuBackend):
    """The CPU backend with writes that report a completed event, as a device's do: they go
    through the committer's queue instead of landing in the call."""

    synchronous = False  # type: ignore[assignment]

    def scatter_rows(self, *args, **kwargs) -> Transfer:
        super().scatter_rows(*args, **kwargs)
        return Transfer(event=GatedEvent(None, _COMPLETED))


def _evented(backend: DeviceBackend) -> DeviceBackend:
    return _EventedCpu() if backend.name == "cpu" else backend


def _record_landings(manager) -> list[tuple[int, str]]:
    """(task id, thread name) of each write the manager lands, from now on."""
    landed: list[tuple[int, str]] = []
    on_landed = manager._launcher.committer._on_landed

    def record(task) -> None:
        landed.append((task.task_id, threading.current_thread().name))
        on_landed(task)

    manager._launcher.committer._on_landed = record
    return landed


def _save_one(manager, d, i: int, device: torch.device) -> int:
    manager.new_step_starts(d.step(new=[(f"r{i}", list(range(10 * i, 10 * i + 4)), [i + 1], 0, 4)]))
    sid = manager.save_outputs(d.outputs(2).to(device), None, num_tokens_unpadded=4,
                               num_tokens_padded=4)
    d.advance()
    return sid


def test_writes_land_in_the_next_save_or_in_their_reader_and_no_thread_wakes_for_them(
        backend, monkeypatch: pytest.MonkeyPatch):
    """With the committer's own thread asleep, each save lands the writes of the steps before
    it on the engine thread, and a reader on another thread lands the write it reads."""
    monkeypatch.setattr(controller, "_BACKSTOP_S", 3600.0)
    manager, d = make(_evented(backend))
    engine = threading.current_thread().name
    with manager:
        landed = _record_landings(manager)
        for i in range(4):
            if backend.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # the earlier steps' copies completed
            sid = _save_one(manager, d, i, backend.device)
            assert landed == [(t, engine) for t in range(1, i + 1)]
            if i < 3:
                manager.discard_step(sid)
        out = []
        reader = threading.Thread(target=lambda: out.append(manager.materialize(sid, ["r3"])),
                                  name="reader")
        reader.start()
        reader.join(10)
        assert landed[-1] == (4, "reader")
        assert torch.equal(out[0].hidden_states["r3"], token_rows(list(range(30, 34)), 2))


def test_a_write_nobody_sweeps_lands_by_the_committers_backstop(backend, monkeypatch):
    monkeypatch.setattr(controller, "_BACKSTOP_S", 0.02)
    manager, d = make(_evented(backend))
    with manager:
        landed = _record_landings(manager)
        sid = _save_one(manager, d, 0, backend.device)
        deadline = time.monotonic() + 5
        while not landed and time.monotonic() < deadline:
            time.sleep(0.005)  # no call into the cache meanwhile
        assert landed == [(1, "omni-prefix-cache-committer")]
        manager.discard_step(sid)


def test_a_warm_mixed_run_allocates_no_pinned_memory_on_the_engine_thread(backend):
    dtype = torch.float32 if backend.device.type == "cpu" else torch.bfloat16
    allocations, syncs, steps = engine_thread_stalls(backend, dtype, steps=60)
    assert (allocations, syncs, steps) == (0, 0, 60)


@pytest.mark.cuda
@pytest.mark.parametrize("write_stream,slot_dtype,dma", [
    ("compute", torch.int64, False), ("compute", torch.int32, False), ("compute", None, False),
    ("copy", None, False), ("compute", torch.int64, True), ("copy", None, True)])
def test_engine_calls_make_no_device_sync_while_the_forward_still_runs(write_stream, slot_dtype,
                                                                       dma):
    """Under set_sync_debug_mode("error"), with the forward busy on a non-default stream and
    every buffer overwritten after the call, past the first steps (leftover and deferred keys
    on every step, requests finishing so their deferred writes go out); writes on either
    stream, with the runner's device slot mapping (int64 or int32) or the host's slots, by
    the scatter kernel or (`dma`: every save, however small) by the copy engine."""
    from prefix_cache import devices
    backend = devices.get_backend("cuda")
    if dma and backend._dma is None:
        pytest.fail("the cuda backend started without copy-engine saves")
    if dma:
        backend.dma_min_bytes = 0
    manager, d = make(backend, num_blocks=64, block_size=16, staging_depth=4,
                      write_stream=write_stream)
    manager.register_policy(ModelCachePolicy(deferred_keys={"codes"}))
    compute = torch.cuda.Stream()
    dma_jobs = backend._dma.submitted if dma else 0
    with manager:
        for i in range(12):
            tokens = [i * 100 + t for t in range(16)]
            so = d.step(new=[(f"r{i}", tokens, [i % 30 + 1], 0, 16)],
                        finished=[f"r{i - 1}"] if i else [])
            with torch.cuda.stream(compute):
                torch.cuda._sleep(20_000_000)
                hidden = d.outputs(2).to(backend.device, non_blocking=True)
                codes = d.outputs(3, salt=2).to(backend.device, non_blocking=True)
                logits = torch.ones(1, 1000, device=backend.device)
                slot_mapping = d.step_slots_cpu(d.batch_req_ids(), d.scheduled).to(
                    backend.device, slot_dtype, non_blocking=True) if slot_dtype else None
                warm = i >= 2  # first sight sizes the arenas; from then on nothing stalls
                torch.cuda.set_sync_debug_mode("error" if warm else "default")
                try:
                    manager.new_step_starts(so)
                    sid = manager.save_outputs(hidden, {"codes": codes, "logits": logits},
                                               num_tokens_unpadded=16, num_tokens_padded=16,
                                               slot_mapping=slot_mapping)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                for buf in (hidden, codes, logits) + ((slot_mapping,) if slot_dtype else ()):
                    buf.fill_(-1)
            out = manager.materialize(sid, [f"r{i}"])
            assert torch.equal(out.hidden_states[f"r{i}"], token_rows(tokens, 2))
            assert torch.equal(out.mm_outputs["codes"][f"r{i}"], token_rows(tokens, 3, salt=2))
            assert torch.equal(out.leftover["logits"], torch.ones(1, 1000))
            d.advance()
    if dma:  # by the copy engine, the runner's mapping or not: each step's hidden rows (12)
        # and each finished request's deferred rows (11; the last one's may go at shutdown)
        assert backend._dma.submitted - dma_jobs >= 23


class _TorchCalls(TorchFunctionMode):
    """Counts the torch calls (attribute reads included) made while it is on, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.calls[getattr(func, "__qualname__", None) or str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_a_decode_steps_engine_calls_read_each_tensor_once(backend):
    """After a forward each torch call costs the engine thread 1-3 µs (docs/benchmarks-history.md,
    2026-12-05): the cache's own calls of a 16-request decode step, saved as the runner saves a
    stage of whole entries, read the hidden rows' shape, grad flag, device and dtype once each,
    whatever the device; the backend's write is its own."""
    batch = RunnerBatch(16, 1)
    view = FullAttentionGroupView(batch, BLOCK, backend=backend)
    step = scheduler_step(dict.fromkeys(batch.req_ids, 1))
    config = PrefixCacheConfig(16 * 2 + 2, BLOCK, staging_capacity_tokens=16)
    hidden = torch.randn(16, WIDTH, device=backend.device)
    counter = _TorchCalls()
    with OmniPrefixCacheManager(config, view, backend=backend) as cache:
        cache.preallocate(HIDDEN_KEY, (WIDTH,), hidden.dtype)
        scatter = backend.scatter_rows

        def write(*args, **kwargs):
            counter.paused = True
            try:
                return scatter(*args, **kwargs)
            finally:
                counter.paused = False

        backend.scatter_rows = write
        try:
            for position in range(3):  # the last two warm
                batch.move_to(position)
                counter.calls.clear()
                with counter:
                    cache.new_step_starts(step)
                    sid = cache.save_outputs(hidden, None, num_tokens_unpadded=16,
                                             num_tokens_padded=16, plan_reads=False)
                    cache.discard_step(sid)
                synchronize(backend)
        finally:
            del backend.scatter_rows
    assert sum(counter.calls.values()) <= 4, dict(counter.calls)
