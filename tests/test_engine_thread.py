"""The engine thread never stalls on the device (SPEC §4 rule 15, M4): once warm, its calls make
no pinned allocation, no host registration and no device synchronization."""

from __future__ import annotations

import pytest
import torch

from prefix_cache import ModelCachePolicy
from prefix_cache.bench import engine_thread_stalls
from tests.sim import token_rows
from tests.test_manager import make


def test_a_warm_mixed_run_allocates_no_pinned_memory_on_the_engine_thread(backend):
    dtype = torch.float32 if backend.device.type == "cpu" else torch.bfloat16
    allocations, syncs, steps = engine_thread_stalls(backend, dtype, steps=60)
    assert (allocations, syncs, steps) == (0, 0, 60)


@pytest.mark.cuda
@pytest.mark.parametrize("write_stream,device_slots",
                         [("compute", True), ("compute", False), ("copy", False)])
def test_engine_calls_make_no_device_sync_while_the_forward_still_runs(write_stream, device_slots):
    """Under set_sync_debug_mode("error"), with the forward busy on a non-default stream and
    every buffer overwritten after the call, past the first steps (leftover and deferred keys
    on every step, requests finishing so their deferred writes go out); writes on either
    stream, with the runner's device slot mapping or the host's slots."""
    from prefix_cache import devices
    backend = devices.get_backend("cuda")
    manager, d = make(backend, num_blocks=64, block_size=16, staging_depth=4,
                      write_stream=write_stream)
    manager.register_policy(ModelCachePolicy(deferred_keys={"codes"}))
    compute = torch.cuda.Stream()
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
                    backend.device, non_blocking=True) if device_slots else None
                warm = i >= 2  # first sight sizes the arenas; from then on nothing stalls
                torch.cuda.set_sync_debug_mode("error" if warm else "default")
                try:
                    manager.new_step_starts(so)
                    sid = manager.save_outputs(hidden, {"codes": codes, "logits": logits},
                                               num_tokens_unpadded=16, num_tokens_padded=16,
                                               slot_mapping=slot_mapping)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                for buf in (hidden, codes, logits) + ((slot_mapping,) if device_slots else ()):
                    buf.fill_(-1)
            out = manager.materialize(sid, [f"r{i}"])
            assert torch.equal(out.hidden_states[f"r{i}"], token_rows(tokens, 2))
            assert torch.equal(out.mm_outputs["codes"][f"r{i}"], token_rows(tokens, 3, salt=2))
            assert torch.equal(out.leftover["logits"], torch.ones(1, 1000))
            d.advance()
