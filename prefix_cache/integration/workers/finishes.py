"""The scheduler reports each finish to the worker when it decides it, not one step later.

vLLM tells a worker that a request finished in the next step's `finished_req_ids`.
An in-process engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) runs that step only
when its caller asks for more work, so the last requests of a `generate` would
never be published. `FinishReporting`, mixed over the engine's scheduler class,
hands every id that joins the scheduler's `finished_req_ids` (a stop found in
`update_from_output`, an abort in `finish_requests`, a finish inside `schedule`)
to the worker's listener once, as soon as it joins: before vLLM returns that
request's last output.

With the finish goes how many of the request's rows stand: one per token whose
successor is known, `num_tokens - 1` once it has generated a token. An
asynchronous scheduler schedules step N+1 before it reads step N's output; when
that output stops the request, step N+1 has already fed the stop token, and its
row is one a synchronous engine never computes (an abort meanwhile likewise). The
scheduler discards such a step's output; its rows are cut from the request's
entry the same way. A synchronous engine never feeds a token past `num_tokens - 1`,
so nothing is cut there.

The worker installs it through its engine's `SchedulerConfig.scheduler_cls`,
which the engine core reads after building its executor, when the worker and the
scheduler share a process and so the config object: executors "uni" and
"external_launcher". Elsewhere the finish reaches the worker with the next step,
which a multiprocess engine core runs at once (it steps while finished requests
are pending).

With a capped host pool (`prefix_cache.core.residency`), the same scheduler class owns the map
of KV blocks to pool blocks (`PoolResidency`): it admits a request's blocks only where the pool
can hold them (vLLM then waits or preempts as for KV blocks), gives each block a request takes a
pool block, cuts each prefix hit vLLM finds to its blocks with rows, and sends the step's moves
with its scheduler output. Workers in other processes (tensor parallelism) need it named:
`scheduler_cls="prefix_cache.integration.workers.finishes.ResidentScheduler"` (a worker
that shares the scheduler's process installs it itself).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from prefix_cache.core.residency import POOL_MOVES_ATTR, BlockResidency
from prefix_cache.errors import OmniPrefixCacheUnmatchError

#: Executors that run the worker in the engine core's process (sharing its config object).
SAME_PROCESS_EXECUTORS = ("uni", "external_launcher")

#: Called with finished request ids, each with the number of its rows that stand (None: all).
FinishListener = Callable[[Mapping[str, int | None]], None]


class FinishReporting:
    """Scheduler mixin: each request id reaches `_omni_listener` once, when it joins
    `finished_req_ids` (ids already reported are kept until `schedule` hands them on)."""

    _omni_listener: Callable[[], FinishListener | None]  # a weak reference to the listener

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._omni_reported: set[str] = set()
        self._omni_rows_standing: dict[str, int] = {}  # finished, until reported

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        if request.num_output_tokens:  # the last token's row, if fed, no one will accept
            self._omni_rows_standing[request.request_id] = request.num_tokens - 1
        return super()._free_request(request, *args, **kwargs)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._omni_report(self.finished_req_ids)
        output = super().schedule(*args, **kwargs)
        self._omni_report(output.finished_req_ids)  # this schedule's own finishes
        self._omni_reported = set()  # handed on in `output`: the scheduler's set starts anew
        self._omni_report(self.finished_req_ids)
        return output

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        outputs = super().update_from_output(*args, **kwargs)
        self._omni_report(self.finished_req_ids)
        return outputs

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        result = super().finish_requests(*args, **kwargs)
        self._omni_report(self.finished_req_ids)
        return result

    def _omni_report(self, finished: set[str]) -> None:
        fresh = finished - self._omni_reported
        if not fresh:
            return
        self._omni_reported |= fresh
        rows = {req_id: self._omni_rows_standing.pop(req_id, None) for req_id in sorted(fresh)}
        listener = self._omni_listener()
        if listener is not None:
            listener(rows)


class PoolResidency:
    """Scheduler mixin: a capped host pool's map (`BlockResidency`), kept where vLLM finds
    prefix hits and allocates blocks; inactive where the pool mirrors the KV cache.

    Invariant: every block a request holds has a pool block (allocation waits, as for KV
    blocks, until one is free or held by no request), and a hit vLLM finds is cut to its
    blocks with pool blocks before the scheduler allocates from it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from prefix_cache.integration.gate import stage_pool_config
        self._omni_residency: BlockResidency | None = None
        self._omni_trimmed: dict[str, int] = {}  # hit tokens cut, this schedule
        config = stage_pool_config(  # the runner's own test of a pooling model
            self.vllm_config, self.kv_cache_config,
            device_type=self.vllm_config.device_config.device_type,
            is_pooling_model=getattr(self.vllm_config.model_config, "runner_type", None)
            == "pooling")
        if config is None or not config.capped:
            return
        self._omni_residency = BlockResidency(config.num_blocks, config.pool_blocks)
        self._omni_block_size = config.block_size
        manager = self.kv_cache_manager
        find, allocate = manager.get_computed_blocks, manager.allocate_slots
        manager.get_computed_blocks = lambda request: self._omni_resident_hit(
            request, find(request))
        manager.allocate_slots = lambda request, num_new_tokens, *args, **kwargs: \
            self._omni_allocate(allocate, request, num_new_tokens, *args, **kwargs)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self._omni_residency is None:
            return super().schedule(*args, **kwargs)
        self._omni_trimmed = {}
        output = super().schedule(*args, **kwargs)
        scheduled = output.num_scheduled_tokens
        setattr(output, POOL_MOVES_ATTR, self._omni_residency.take_moves(
            {r: n for r, n in self._omni_trimmed.items() if r in scheduled}))
        return output

    def _omni_resident_hit(self, request: Any, found: tuple[Any, ...]) -> tuple[Any, ...]:
        """vLLM's hit `found` (blocks, tokens, ...) cut to its blocks with rows. The first block
        cut loses its hash, so the block that recomputes its tokens serves the next hit."""
        blocks, num_tokens, *rest = found
        group = blocks.blocks[0]
        kept = self._omni_residency.resident_prefix([block.block_id for block in group])
        if kept * self._omni_block_size >= num_tokens:
            return found
        self._omni_trimmed[request.request_id] = num_tokens - kept * self._omni_block_size
        if group[kept].ref_cnt == 0:
            self.kv_cache_manager.block_pool.evict_blocks({group[kept].block_id})
        cut = type(blocks)(tuple(list(g[:kept]) for g in blocks.blocks))
        return (cut, kept * self._omni_block_size, *rest)

    def _omni_allocate(self, allocate: Callable[..., Any], request: Any, num_new_tokens: int,
                       *args: Any, **kwargs: Any) -> Any:
        """vLLM's `allocate_slots`, refused (None, as when KV blocks run short) where the pool
        cannot hold the request's blocks; the blocks it takes then get pool blocks."""
        manager, residency = self.kv_cache_manager, self._omni_residency
        computed_blocks = kwargs.get("new_computed_blocks")
        computed = list(computed_blocks.blocks[0]) if computed_blocks is not None else []
        tokens = min(request.num_computed_tokens + kwargs.get("num_new_computed_tokens", 0)
                     + kwargs.get("num_external_computed_tokens", 0) + num_new_tokens
                     + kwargs.get("num_lookahead_tokens", 0), manager.max_model_len)
        owned = len(manager.coordinator.single_type_managers[0].req_to_blocks.get(
            request.request_id, ()))
        added = max(-(-tokens // self._omni_block_size) - owned - len(computed), 0)
        if added or computed:
            pool = manager.block_pool
            held = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
            taken = added + sum(block.ref_cnt == 0 for block in computed)
            if held + taken > residency.capacity:
                return None
        new_blocks = allocate(request, num_new_tokens, *args, **kwargs)
        if new_blocks is not None:
            residency.use([block.block_id for block in computed])
            if new_blocks.blocks[0]:
                ref = manager.block_pool.blocks
                residency.place([block.block_id for block in new_blocks.blocks[0]],
                                lambda kv: ref[kv].ref_cnt > 0)
        return new_blocks


def check_pool_scheduler(vllm_config: Any) -> None:
    """Refuse a capped pool whose engine's scheduler does not keep its map (`PoolResidency`)."""
    if not issubclass(vllm_config.scheduler_config.get_scheduler_cls(), PoolResidency):
        raise OmniPrefixCacheUnmatchError(
            f"the host pool is capped below the KV cache (host_budget_bytes), which needs the "
            f"cache's scheduler to keep its map; with workers in processes of their own "
            f"({vllm_config.parallel_config.distributed_executor_backend!r} executor) start "
            f"the engine with scheduler_cls=\"{__name__}.ResidentScheduler\"")


class ResidentScheduler(PoolResidency):
    """What `scheduler_cls` names for a capped pool whose workers run in processes of their own:
    builds vLLM's own scheduler for the engine's config (asynchronous or not) with
    `PoolResidency`."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        base = vllm_scheduler_class(kwargs["vllm_config"].scheduler_config)
        return resident_scheduler_class(base)(*args, **kwargs)


@functools.cache
def resident_scheduler_class(base: type) -> type:
    return type(f"Resident{base.__name__}", (PoolResidency, base), {"__module__": __name__})


def vllm_scheduler_class(scheduler_config: Any) -> type:
    """vLLM's scheduler class for `scheduler_config`: the one it names, or where that is
    `ResidentScheduler`, vLLM's default for it."""
    cls = scheduler_config.get_scheduler_cls()
    if cls is not ResidentScheduler:
        return cls
    if scheduler_config.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        return AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    return Scheduler


def report_finishes(vllm_config: Any, listener: FinishListener) -> bool:
    """Have this engine's scheduler call `listener` with each finish as it happens.

    Returns False, changing nothing, where the scheduler runs in another process.
    The listener (a function or a bound method) is held weakly: the scheduler keeps no
    runner alive.
    """
    if vllm_config.parallel_config.distributed_executor_backend not in SAME_PROCESS_EXECUTORS:
        return False
    scheduler_config = vllm_config.scheduler_config
    base = vllm_scheduler_class(scheduler_config)
    base = getattr(base, "_omni_base", base)  # installed before (a worker started twice)
    ref = weakref.WeakMethod(listener) if hasattr(listener, "__func__") else weakref.ref(listener)
    mixins = (FinishReporting,) if issubclass(base, PoolResidency) \
        else (FinishReporting, PoolResidency)
    scheduler_config.scheduler_cls = type(
        f"FinishReporting{base.__name__}", (*mixins, base),
        {"__module__": __name__, "_omni_base": base, "_omni_listener": staticmethod(ref)})
    return True
