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
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

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


def report_finishes(vllm_config: Any, listener: FinishListener) -> bool:
    """Have this engine's scheduler call `listener` with each finish as it happens.

    Returns False, changing nothing, where the scheduler runs in another process.
    The listener (a function or a bound method) is held weakly: the scheduler keeps no
    runner alive.
    """
    if vllm_config.parallel_config.distributed_executor_backend not in SAME_PROCESS_EXECUTORS:
        return False
    scheduler_config = vllm_config.scheduler_config
    base = scheduler_config.get_scheduler_cls()
    base = getattr(base, "_omni_base", base)  # installed before (a worker started twice)
    ref = weakref.WeakMethod(listener) if hasattr(listener, "__func__") else weakref.ref(listener)
    scheduler_config.scheduler_cls = type(
        f"FinishReporting{base.__name__}", (FinishReporting, base),
        {"__module__": __name__, "_omni_base": base, "_omni_listener": staticmethod(ref)})
    return True
