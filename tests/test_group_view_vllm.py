"""FullAttentionGroupView over vLLM 0.32's real persistent batch (InputBatch, MultiGroupBlockTable).

The reference slots come from vLLM itself: `MultiGroupBlockTable.compute_slot_mapping`
launches the Triton `ComputeSlotMappingKernel`, which on this CPU-only machine (no Triton)
runs vLLM's C++ fallback `torch.ops._C.compute_slot_mapping_kernel_impl`, installed by
`CpuPlatform.register_triton_kernel_overrides()` exactly as a CPU worker does at start-up.
The inputs (`query_start_loc`, `positions = num_computed_tokens + query offset`) are built
as `GPUModelRunner._prepare_inputs` builds them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from prefix_cache import devices  # noqa: E402
import prefix_cache.devices.cuda  # noqa: E402
from prefix_cache import FullAttentionGroupView, OmniPrefixCacheUnmatchError  # noqa: E402
from prefix_cache.core.runs import runs_slots  # noqa: E402
from tests.vllm_fixtures import ensure_cpu_slot_mapping_kernel  # noqa: E402

pytestmark = pytest.mark.vllm

MAX_REQS = 8
MAX_MODEL_LEN = 2048


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cuda_rules() -> devices.DeviceBackend:
    # No GPU exists on this machine; CudaBackend.check_block_table needs no device state
    # (only the CUDA kernel-block table), so an uninitialised instance applies CUDA's rules.
    return object.__new__(devices.cuda.CudaBackend)


def make_input_batch(block_size: int, max_model_len: int = MAX_MODEL_LEN) -> Any:
    """A real vLLM 0.32 InputBatch with one KV-cache group, on CPU."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    return InputBatch(max_num_reqs=MAX_REQS, max_model_len=max_model_len,
                      max_num_batched_tokens=max_model_len, device=torch.device("cpu"),
                      vocab_size=1024, block_sizes=[block_size],
                      max_num_blocks_per_req=[cdiv(max_model_len, block_size)])


def add_request(batch: Any, req_id: str, num_computed: int, block_ids: list[int],
                num_prompt: int | None = None) -> int:
    """Add a request through InputBatch.add_request with a real CachedRequestState."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    num_prompt = num_prompt if num_prompt is not None else num_computed + 1
    state = CachedRequestState(req_id=req_id, prompt_token_ids=list(range(num_prompt)),
                               mm_features=[], sampling_params=SamplingParams(max_tokens=8),
                               generator=None, block_ids=(list(block_ids),),
                               num_computed_tokens=num_computed, output_token_ids=[])
    return batch.add_request(state)


def vllm_slot_mapping(batch: Any, num_scheduled: dict[str, int],
                      group_id: int = 0) -> torch.Tensor:
    """vLLM's own slots for the batch rows in `batch.req_ids` order (the runner's path)."""
    ensure_cpu_slot_mapping_kernel()
    req_ids = batch.req_ids
    num_reqs = len(req_ids)
    counts = np.array([num_scheduled[r] for r in req_ids], dtype=np.int64)
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.from_numpy(np.cumsum(counts).astype(np.int32))
    computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
    positions = torch.from_numpy(np.concatenate(
        [np.arange(c, c + n, dtype=np.int64) for c, n in zip(computed, counts)]))
    batch.block_table.commit_block_table(num_reqs)
    batch.block_table.compute_slot_mapping(num_reqs, query_start_loc, positions)
    return batch.block_table[group_id].slot_mapping.gpu[:int(counts.sum())].clone()


def formula_slots(blocks_of: dict[str, list[int]], computed: dict[str, int],
                  num_scheduled: dict[str, int], req_ids: list[str],
                  block_size: int) -> torch.Tensor:
    """SPEC §3: slot = blocks[pos // B] * B + pos % B."""
    out = [blocks_of[r][p // block_size] * block_size + p % block_size
           for r in req_ids for p in range(computed[r], computed[r] + num_scheduled[r])]
    return torch.tensor(out, dtype=torch.int64)


def workload(block_size: int, seed: int) -> tuple[dict[str, int], dict[str, int],
                                                   dict[str, list[int]]]:
    """Requests at different stages: fresh prefill, prefix hit, decodes on and off a block
    boundary, a chunk starting mid-block; distinct random block ids for each."""
    b = block_size
    computed = {"fresh": 0, "hit": 2 * b, "decode_end": 5 * b - 1, "decode_start": 3 * b,
                "chunk": b + 7, "tiny": 3}
    scheduled = {"fresh": 3 * b + 5, "hit": b // 2 + 3, "decode_end": 1, "decode_start": 1,
                 "chunk": 2 * b, "tiny": 2}
    rng = np.random.default_rng(seed)
    need = {r: cdiv(computed[r] + scheduled[r], b) for r in computed}
    ids = (rng.permutation(4 * sum(need.values())) + 1).tolist()  # never the null block 0
    blocks, start = {}, 0
    for r, n in need.items():
        blocks[r], start = ids[start:start + n], start + n
    return computed, scheduled, blocks


def fill_batch(batch: Any, computed: dict[str, int], blocks: dict[str, list[int]]) -> None:
    for req_id in computed:
        add_request(batch, req_id, computed[req_id], blocks[req_id])


@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_step_slots_equal_vllm_compute_slot_mapping(block_size: int) -> None:
    computed, scheduled, blocks = workload(block_size, seed=block_size)
    batch = make_input_batch(block_size)
    fill_batch(batch, computed, blocks)
    view = FullAttentionGroupView(batch, block_size, group_id=0,
                                  backend=devices.get_backend("cpu"), kernel_block_size=None)

    slots = view.step_slots_cpu(view.batch_req_ids(), scheduled)

    assert slots.dtype == torch.int64 and slots.device.type == "cpu"
    assert torch.equal(slots, vllm_slot_mapping(batch, scheduled))
    assert torch.equal(slots, formula_slots(blocks, computed, scheduled, batch.req_ids,
                                            block_size))


@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_step_slots_follow_the_requested_order_not_the_batch_order(block_size: int) -> None:
    computed, scheduled, blocks = workload(block_size, seed=7)
    batch = make_input_batch(block_size)
    fill_batch(batch, computed, blocks)
    view = FullAttentionGroupView(batch, block_size, backend=devices.get_backend("cpu"))
    order = list(reversed(batch.req_ids))

    reference = vllm_slot_mapping(batch, scheduled)
    offsets = dict(zip(batch.req_ids, np.cumsum([0] + [scheduled[r] for r in batch.req_ids])))
    expected = torch.cat([reference[offsets[r]:offsets[r] + scheduled[r]] for r in order])

    assert torch.equal(view.step_slots_cpu(order, scheduled), expected)


@pytest.mark.parametrize("block_size", [16, 32])
def test_a_requests_positions_from_0_or_from_a_start_are_its_step_slots(block_size: int) -> None:
    """What a finish reads: every position a request computed, whatever it computes now; and
    what a streamed chunk reads: its positions from where the last chunk ended, mid-block or
    not, or none."""
    computed, scheduled, blocks = workload(block_size, seed=3)
    batch = make_input_batch(block_size)
    fill_batch(batch, computed, blocks)
    view = FullAttentionGroupView(batch, block_size, backend=devices.get_backend("cpu"))
    for req_id in batch.req_ids:
        n = computed[req_id] + scheduled[req_id]
        whole = formula_slots(blocks, {req_id: 0}, {req_id: n}, [req_id], block_size)
        assert torch.equal(torch.from_numpy(runs_slots(view.request_positions_runs(req_id, n))),
                           whole)
        for start in {1, block_size, n // 2 + 1, n}:
            span = runs_slots(view.request_positions_runs(req_id, n, start))
            assert span.tolist() == whole[min(start, n):].tolist(), (req_id, start)
    assert view.request_positions_runs("never-added", 4) is None


def test_a_request_the_batch_dropped_before_its_finish_reads_from_the_runners_state() -> None:
    """An asynchronous scheduler leaves a request out of the step after its surely-last token;
    the runner drops it from the batch but keeps its state (allocator block ids) until the
    finish, which reads its positions from there: the slots its rows of a table in kernel
    units (16 within 32) gave before."""
    computed, _, blocks = workload(32, seed=5)
    kernel = make_input_batch(16)
    for req_id in computed:
        add_request(kernel, req_id, computed[req_id],
                    [k for b in blocks[req_id] for k in (2 * b, 2 * b + 1)])
    view = FullAttentionGroupView(kernel, 32, backend=devices.get_backend("cpu"),
                                  request_block_ids=lambda r: (blocks[r],) if r in blocks else None)
    dropped = kernel.req_ids[0]
    before = runs_slots(view.request_positions_runs(dropped, computed[dropped]))

    kernel.remove_request(dropped)
    kernel.condense()

    assert dropped not in kernel.req_id_to_index
    assert runs_slots(view.request_positions_runs(dropped, computed[dropped])).tolist() == \
        before.tolist() == formula_slots(blocks, {dropped: 0}, {dropped: computed[dropped]},
                                         [dropped], 32).tolist()
    assert view.request_positions_runs("never-added", 4) is None


def test_step_slots_read_num_computed_tokens_updated_in_place() -> None:
    batch = make_input_batch(16)
    add_request(batch, "a", 0, [4, 9, 2])
    view = FullAttentionGroupView(batch, 16, backend=devices.get_backend("cpu"))
    assert view.step_slots_cpu(["a"], {"a": 20}).tolist() == \
        [4 * 16 + i for i in range(16)] + [9 * 16 + i for i in range(4)]

    batch.num_computed_tokens_cpu[batch.req_id_to_index["a"]] = 20  # the runner's next step
    batch.block_table.append_row(([5],), batch.req_id_to_index["a"])

    assert view.step_slots_cpu(["a"], {"a": 1}).tolist() == [9 * 16 + 4]
    assert torch.equal(view.step_slots_cpu(["a"], {"a": 1}), vllm_slot_mapping(batch, {"a": 1}))


def test_no_scheduled_requests_give_an_empty_int64_tensor() -> None:
    batch = make_input_batch(16)
    add_request(batch, "a", 0, [1])
    view = FullAttentionGroupView(batch, 16, backend=devices.get_backend("cpu"))

    slots = view.step_slots_cpu([], {})

    assert slots.dtype == torch.int64 and slots.numel() == 0


def test_kernel_block_smaller_than_block_size_is_accepted_on_cuda_rules() -> None:
    # vLLM 0.32 keeps manager ids in BlockTable and splits only in AttentionGroup,
    # so the table's slots are manager slots whatever the kernel block is.
    computed, scheduled, blocks = workload(32, seed=3)
    batch = make_input_batch(32)
    fill_batch(batch, computed, blocks)
    view = FullAttentionGroupView(batch, 32, backend=cuda_rules(), kernel_block_size=16,
                                  attention_backend="FLASH_ATTN")

    slots = view.step_slots_cpu(batch.req_ids, scheduled)

    assert torch.equal(slots, vllm_slot_mapping(batch, scheduled))


def kernel_ids_by_vllm(manager_table: torch.Tensor, block_size: int,
                       kernel_block_size: int) -> torch.Tensor:
    """Kernel block ids from vLLM 0.32's own AttentionGroup.map_to_kernel_block_table."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import AttentionGroup

    rows, cols = manager_table.shape
    ratio = block_size // kernel_block_size
    group = AttentionGroup(
        backend=object, layer_names=[], kv_cache_group_id=0,  # backend unused by the mapping
        kv_cache_spec=FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64,
                                        dtype=torch.float32),
        kernel_block_size=kernel_block_size,
        kernel_block_table=torch.zeros(1, rows, cols * ratio, dtype=torch.int32),
        kernel_block_offsets=torch.arange(ratio, dtype=torch.int32))
    return group.map_to_kernel_block_table(manager_table).clone()


@pytest.mark.parametrize("backend_name", ["cpu", "cuda_rules"])
def test_table_in_kernel_units_gives_the_same_slots_as_manager_ids(backend_name: str) -> None:
    # vLLM 0.11.1-0.31 ("hybrid blocks"): BlockTable.block_size is the kernel size (16) and
    # its rows hold kernel ids b*2, b*2+1 for manager block b of 32 tokens.
    computed, scheduled, blocks = workload(32, seed=11)
    manager = make_input_batch(32)
    fill_batch(manager, computed, blocks)
    kernel = make_input_batch(16)
    for req_id in computed:
        kernel_ids = [k for b in blocks[req_id] for k in (2 * b, 2 * b + 1)]
        add_request(kernel, req_id, computed[req_id], kernel_ids)
    num_reqs = len(manager.req_ids)
    vllm_kernel_ids = kernel_ids_by_vllm(
        manager.block_table[0].get_cpu_tensor()[:num_reqs], 32, 16)
    for row, req_id in enumerate(manager.req_ids):  # unused (null) entries map to 0, 1 too
        used = 2 * len(blocks[req_id])
        assert kernel.block_table[0].get_numpy_array()[row, :used].tolist() == \
            vllm_kernel_ids[row, :used].tolist()
    backend = devices.get_backend("cpu") if backend_name == "cpu" else cuda_rules()

    via_kernel = FullAttentionGroupView(kernel, 32, backend=backend).step_slots_cpu(
        kernel.req_ids, scheduled)
    via_manager = FullAttentionGroupView(manager, 32, backend=backend).step_slots_cpu(
        manager.req_ids, scheduled)

    assert torch.equal(via_kernel, via_manager)
    assert torch.equal(via_kernel, vllm_slot_mapping(kernel, scheduled))  # the 0.11-0.31 path
    assert torch.equal(via_manager, vllm_slot_mapping(manager, scheduled))


@pytest.mark.parametrize("backend_name", ["cpu", "cuda_rules"])
def test_kernel_block_not_dividing_block_size_is_refused_at_first_step(
        backend_name: str) -> None:
    batch = make_input_batch(32)
    add_request(batch, "a", 0, [1, 2])
    backend = devices.get_backend("cpu") if backend_name == "cpu" else cuda_rules()
    view = FullAttentionGroupView(batch, 32, backend=backend, kernel_block_size=48)  # no raise

    with pytest.raises(OmniPrefixCacheUnmatchError, match="does not divide"):
        view.step_slots_cpu(["a"], {"a": 4})


def test_cuda_rules_refuse_a_kernel_size_the_attention_backend_does_not_use() -> None:
    batch = make_input_batch(64)
    add_request(batch, "a", 0, [1])
    view = FullAttentionGroupView(batch, 64, backend=cuda_rules(), kernel_block_size=32,
                                  attention_backend="FLASHMLA")  # FlashMLA: 64 only

    with pytest.raises(OmniPrefixCacheUnmatchError, match="FLASHMLA"):
        view.step_slots_cpu(["a"], {"a": 1})


def test_table_unit_larger_than_block_size_is_refused() -> None:
    batch = make_input_batch(32)
    add_request(batch, "a", 0, [1])
    view = FullAttentionGroupView(batch, 16, backend=devices.get_backend("cpu"))

    with pytest.raises(OmniPrefixCacheUnmatchError, match="block table unit 32"):
        view.step_slots_cpu(["a"], {"a": 1})


def test_missing_kv_cache_group_is_refused() -> None:
    batch = make_input_batch(16)
    add_request(batch, "a", 0, [1])
    view = FullAttentionGroupView(batch, 16, group_id=1, backend=devices.get_backend("cpu"))

    with pytest.raises(OmniPrefixCacheUnmatchError, match="group 1"):
        view.step_slots_cpu(["a"], {"a": 1})


def test_decode_context_parallel_table_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # BlockTable reads get_dcp_group() at construction (it falls back to 1 when no
    # distributed env exists); a DCP group of 2 is stood in for on this single process.
    import vllm.v1.worker.block_table as block_table

    monkeypatch.setattr(block_table, "get_dcp_group",
                        lambda: SimpleNamespace(world_size=2, rank_in_group=0))
    batch = make_input_batch(16)
    monkeypatch.undo()
    assert batch.block_table[0].dcp_world_size == 2
    add_request(batch, "a", 0, [1, 2])
    view = FullAttentionGroupView(batch, 16, backend=devices.get_backend("cpu"))

    with pytest.raises(OmniPrefixCacheUnmatchError, match="dcp_world_size=2"):
        view.step_slots_cpu(["a"], {"a": 4})


def test_refusal_is_not_cached_as_success() -> None:
    batch = make_input_batch(32)
    add_request(batch, "a", 0, [1])
    view = FullAttentionGroupView(batch, 32, backend=devices.get_backend("cpu"),
                                  kernel_block_size=24)
    for _ in range(2):
        with pytest.raises(OmniPrefixCacheUnmatchError):
            view.step_slots_cpu(["a"], {"a": 1})


def test_batch_req_ids_follow_condense_after_a_removal() -> None:
    batch = make_input_batch(16)
    for i, req_id in enumerate(["a", "b", "c", "d"]):
        add_request(batch, req_id, 16 * i, list(range(10 * i + 1, 10 * i + 1 + i + 2)))
    view = FullAttentionGroupView(batch, 16, backend=devices.get_backend("cpu"))
    assert view.batch_req_ids() == ["a", "b", "c", "d"]

    batch.remove_request("b")
    batch.condense()  # moves the last row ("d") into the hole

    assert batch.req_ids == ["a", "d", "c"]
    assert view.batch_req_ids() == batch.req_ids
    scheduled = {"a": 3, "d": 2, "c": 1}
    assert torch.equal(view.step_slots_cpu(view.batch_req_ids(), scheduled),
                       vllm_slot_mapping(batch, scheduled))


def test_batch_req_ids_follow_swap_states() -> None:
    batch = make_input_batch(32)
    add_request(batch, "a", 40, [3, 4])
    add_request(batch, "b", 0, [8])
    add_request(batch, "c", 33, [6, 7])
    view = FullAttentionGroupView(batch, 32, backend=devices.get_backend("cpu"))

    batch.swap_states(0, 2)  # as the runner's decode-first reorder does

    assert view.batch_req_ids() == ["c", "b", "a"] == batch.req_ids
    scheduled = {"c": 2, "b": 5, "a": 1}
    assert view.step_slots_cpu(["a"], {"a": 1}).tolist() == [4 * 32 + 8]
    assert torch.equal(view.step_slots_cpu(view.batch_req_ids(), scheduled),
                       vllm_slot_mapping(batch, scheduled))
