"""`python -m prefix_cache soak`: a stage under a random schedule of faults; no entry wrong or lost.

Stage 1 runs on vLLM's CPU engine with the cache, prefix caching and streaming on (each request's
rows published in chunks as it runs), in an engine-core process of its own, stepped by this
process. A consumer in a process of its own (`tools.pipelines.soak_consumer`) reads each
request's entry, half whole (`get_entry`), half chunk by chunk (`stream`), most from the moment
the request is submitted, `LAZY_SHARE` of them only once vLLM reports the request ended (a
stage that reads lazily). Requests come from three prompt families sharing 64- and 96-token
prefixes (two and three KV blocks) with distinct suffixes, so prefix hits happen, and generate
greedily with `ignore_eos`, 2 to `MAX_GENERATED` tokens each, so every row is determined by the
prompt. At most `MAX_RUNNING` are in the engine and `MAX_OUTSTANDING` without an outcome, so the
engine runs on through a consumer stall. A schedule seeded by `--seed` (`FaultSchedule`: the
same seed, the same faults) injects, one at a time, the heavy faults:

- consumer stall: the consumer process is SIGSTOPped for `STALL_S`, longer than the channel's
  small capacity (`CAPACITY_BYTES`) takes to fill plus its full wait (`FULL_WAIT_S`), then
  SIGCONTinued;
- consumer kill: SIGKILL, and a new consumer process; the reads the dead one held are its,
  the new one drains what is left of those entries (chunk by chunk) so no id stays dirty;
- producer kill: once a request is in the engine (a kill that cuts none tests nothing; a
  consumer slower than the engine, the outstanding requests at `MAX_OUTSTANDING`, leaves
  none), the engine-core process SIGKILLed (`kill_test.kill_engine`) and the engine
  started again; every request the consumer then learns died with it
  (`OmniPrefixCacheChannelProducerError`) is retried under the same id and prompt, and so is
  every cut request nobody read yet, at once and unread (its dead producer's chunks are then
  in the channel before the retry's: they must never join it). A retry generates a different
  number of tokens, so rows of the first try delivered to it show as wrong. Entries of an id
  are taken in put order, so the retry of a request cut unread first reads what the dead
  producer left of it: its whole entry (checked against the first try's rows), or its death
  (which must name a process the soak killed); then the retry reads again, for its own;

and between them the light ones: an abort (vLLM's `abort_request` on a running request), an
expiry (a request whose entry is read only `CHANNEL_TTL_S + EXPIRY_MARGIN_S` after it ended,
with a short timeout), and a duplicate id (a new request, of another prompt family, under the
id of one that was delivered whole). Preemption is steady: the KV cache holds 9 blocks for 4
running requests of up to 5 blocks (`SOAK_SHAPE`); vLLM's per-request counts say how many.

The reference: each prompt's rows (prompt + `MAX_GENERATED` - 1 positions) from the same model
on an engine with prefix caching off, run once one request at a time and once all in one batch.
Where the two are identical bit for bit (vLLM's CPU engine is batch-invariant here), every
delivered row must equal its reference bit for bit; otherwise within `demo.TOLERANCE["cpu"]`
and nearer to its own prompt's row than to any other prompt's at that position (the table says
which check ran). A request of `max_tokens` m has rows for prompt + m - 1 positions: a
prefix of the reference.

Accounting: every submitted request instance ends in exactly one of
- delivered: all its rows, each right (an aborted one: a prefix of them, each right);
- failed with a named channel error: its producer died (`OmniPrefixCacheChannelProducerError`,
  only where the soak killed it or it died), or its stage could not publish (the cause
  named: channel full, ...);
- expired: a timeout or a hole, only for a request the soak read late on purpose;
- held by a killed consumer (the rows its drain got are still checked);
- wrong: a row that is not its reference's (or a chunk that does not start where the rows before
  it ended, yielded without an error), too many rows, or too few without an abort;
- lost: anything else (a timeout the soak did not cause, no answer at all).
A producer reported dead while it lived, a named failure of a cause the soak did not bring
about (a channel full is always one it may have), an error outside the channel's hierarchy,
and an engine death the soak did not cause are problems too. Exit status 1 on any problem.
At the end, the ids that still have something in the channel are listed (not a problem: a
dead producer's chunks may wait there for their expiry).

The engine thread's longest stall is what this process observes: the longest wait, while the
engine had requests, for one step's outputs from the engine-core process (its engine thread
produces them each step; a thread blocked on the stage's publishing shows as a long wait), over
the whole soak and during consumer stalls. vLLM's logs go to a file of the run's own.
"""

from __future__ import annotations

import contextlib
import queue
import random
import re
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from prefix_cache.channel import (OmniPrefixCacheChannelError,
                                  OmniPrefixCacheChannelTimeoutError, StageChannel, open_channel)
from prefix_cache.tools.pipelines.engines import EngineShape
from prefix_cache.tools.pipelines.soak_consumer import ConsumerProcess, Outcome, Read, References

#: Prompt families: shared prefix lengths (whole 32-token blocks), and prompts per family.
FAMILY_PREFIXES = (64, 64, 96)
PROMPTS_PER_FAMILY = 6
SUFFIX_TOKENS = (3, 40)
MAX_GENERATED = 24
#: 9 usable blocks of 32 tokens for up to 4 running requests of up to 160 tokens: preemption.
SOAK_SHAPE = EngineShape(max_model_len=256, num_blocks=10)
CHANNEL_TTL_S = 20.0
FULL_WAIT_S = 1.5
#: Room for a few entries (the stage makes about 2.5 MB of rows a second here).
CAPACITY_BYTES = 512 << 10
#: How long a read waits for each chunk (a request queued behind others waits for its first).
READ_TIMEOUT_S = 60.0
EXPIRY_MARGIN_S = 3.0
EXPIRED_READ_TIMEOUT_S = 3.0
#: A drain of an entry whose request had ended when its consumer was killed waits this long.
DRAIN_TIMEOUT_S = 10.0
MAX_RUNNING = 6  # requests in the engine at once
#: Requests without an outcome at once: enough that the engine runs on through a consumer stall.
MAX_OUTSTANDING = 48
#: Share of requests read only once vLLM reports them ended (a stage that reads lazily).
LAZY_SHARE = 0.3
STALL_S = (6.0, 10.0)
#: How long after a stall the consumer counts as catching up (no heavy fault meanwhile).
STALL_AFTERMATH_S = 2.0
FIRST_HEAVY_AFTER_S = (8.0, 12.0)
HEAVY_EVERY_S = (10.0, 16.0)
LIGHT_EVERY_S = (2.0, 5.0)
HEAVY_FAULTS = ("consumer stall", "consumer kill", "producer kill")
LIGHT_FAULTS = ("abort", "expiry", "duplicate id")
FAULTS = HEAVY_FAULTS + LIGHT_FAULTS
PROGRESS_EVERY_S = 15.0
#: After the traffic: how long the soak waits for the last requests and their outcomes.
FINISH_WAIT_S = READ_TIMEOUT_S + 15.0
IDLE_PAUSE_S = 0.01

PRODUCER_DIED = "OmniPrefixCacheChannelProducerError"
TIMED_OUT = "OmniPrefixCacheChannelTimeoutError"


def make_prompts(seed: int) -> list[list[int]]:
    """`PROMPTS_PER_FAMILY` prompts per family: the family's prefix, then a suffix of their own."""
    rng = random.Random(seed)
    prompts = []
    for prefix_len in FAMILY_PREFIXES:
        prefix = [rng.randrange(1, 1000) for _ in range(prefix_len)]
        prompts += [prefix + [rng.randrange(1, 1000) for _ in range(rng.randint(*SUFFIX_TOKENS))]
                    for _ in range(PROMPTS_PER_FAMILY)]
    return prompts


def family(prompt: int) -> int:
    return prompt // PROMPTS_PER_FAMILY


def reference_rows(model_dir: Path, prompts: list[list[int]], say: Callable[[str], None]
                   ) -> References:
    """Each prompt's rows from an engine without prefix caching: bit-for-bit references where
    a run of one request at a time equals a run of all of them in one batch, else the demo's
    tolerance."""
    import torch

    from prefix_cache.config import HIDDEN_KEY
    from prefix_cache.tools.demo import TOLERANCE
    from prefix_cache.tools.pipelines.engines import start_thinker
    from prefix_cache.tools.pipelines.pipeline import StageRequest, run_pipeline
    requests = [StageRequest(f"reference-{i}", prompt, MAX_GENERATED)
                for i, prompt in enumerate(prompts)]
    with open_channel("shm") as channel:
        engine = start_thinker(model_dir, channel, prefix_caching=False)
        try:
            alone = [run_pipeline(engine, channel, [r]).results[r.req_id] for r in requests]
            batched = run_pipeline(engine, channel, [replace(r, req_id=f"{r.req_id}-batched")
                                                     for r in requests]).results
        finally:
            engine.close()
    rows = [result.entry.outputs[HIDDEN_KEY] for result in alone]
    together = [batched[f"{r.req_id}-batched"].entry.outputs[HIDDEN_KEY] for r in requests]
    invariant = all(torch.equal(a, b) for a, b in zip(rows, together, strict=True))
    say(f"[soak] reference rows of {len(prompts)} prompts: one at a time and batched "
        + ("identical bit for bit" if invariant else "differ (tolerance check)"))
    return References(rows, 0.0 if invariant else TOLERANCE["cpu"])


@dataclass
class Instance:
    """One submission of a request id. `state`: queued (added), running (has output),
    ended (finished, aborted or cut by its producer's death); `outcome` once its read answered."""

    key: int
    request_id: str
    prompt: int
    max_tokens: int
    prompt_len: int
    streamed: bool
    generation: int  # the producer it was submitted to
    submitted_at: float = 0.0  # time.time() just before vLLM was given it
    kind: str = "new"  # new, duplicate id, retry
    read_at: str = "submit"  # its read starts at: submit, end (vLLM says it ended), expiry
    state: str = "queued"
    ended_at: float | None = None
    aborted: bool = False  # the soak aborted it
    held: bool = False  # its consumer was killed holding its read
    preemptions: int = 0
    cached_tokens: int = 0
    read_sent: bool = False
    outcome: Outcome | None = None
    #: the instance it retries where that one was cut unread: the id's first entry is then the
    #: dead producer's (whole, or cut: its death), read by this instance's read before its own
    predecessor: Instance | None = None

    @property
    def rows_wanted(self) -> int:
        return self.prompt_len + self.max_tokens - 1

    @property
    def name(self) -> str:
        """The request and what happened to it, for a problem's line."""
        return (f"request {self.request_id} (#{self.key}: {self.kind}, generation "
                f"{self.generation}, {self.state}, read at {self.read_at}, "
                f"{'streamed' if self.streamed else 'whole'})")

    @property
    def late(self) -> bool:
        """Read once its entry expired, on purpose."""
        return self.read_at == "expiry"


@dataclass
class Verdict:
    """How an instance ended (`what`: delivered, failed, expired, held, wrong, lost, error) and
    a line for a wrong, lost or otherwise bad one."""

    what: str
    cause: str = ""
    problem: str | None = None


def judge(instance: Instance, producer_died: bool) -> Verdict:
    """The instance's outcome against its reference and what the soak did to it;
    `producer_died`: its producer was killed or died."""
    outcome = instance.outcome
    assert outcome is not None
    rows, name = outcome.rows, instance.name
    if rows.first_wrong is not None:
        owner = "" if rows.owner is None else f", prompt {rows.owner}'s row"
        return Verdict("wrong", problem=f"{name}: row {rows.first_wrong} of {rows.num_rows} is "
                       f"not prompt {instance.prompt}'s{owner} (max diff {rows.max_diff:.1e})")
    if outcome.disorder is not None:
        return Verdict("wrong", problem=f"{name}: stream yielded {outcome.disorder} and no error")
    if rows.start + rows.num_rows > instance.rows_wanted:
        return Verdict("wrong", problem=f"{name}: rows up to position "
                       f"{rows.start + rows.num_rows}, {instance.rows_wanted} expected")
    if instance.held:
        return Verdict("held")
    if outcome.error is None:  # short: aborted by the soak, or by a stage going down
        if rows.num_rows == instance.rows_wanted or instance.aborted or producer_died:
            return Verdict("delivered")
        marked = " marked aborted" if outcome.aborted else ""
        return Verdict("wrong", problem=f"{name}: {rows.num_rows} rows{marked}, "
                       f"{instance.rows_wanted} expected, and the soak did not abort it")
    if not outcome.error.startswith("OmniPrefixCacheChannel"):
        return Verdict("error", problem=f"{name}: {outcome.error}: {outcome.message}")
    if outcome.error == PRODUCER_DIED:
        if producer_died:
            return Verdict("failed", "producer died")
        return Verdict("lost", problem=f"{name}: its live producer was reported dead: "
                                       f"{outcome.message}")
    if instance.late:
        return Verdict("expired")
    if outcome.error == TIMED_OUT:
        return Verdict("lost", problem=f"{name}: {outcome.message}")
    cause = failure_cause(outcome.message)
    if cause == "channel full" or (cause == "stage shut down" and producer_died):
        return Verdict("failed", cause)
    return Verdict("failed", cause, problem=f"{name}: failed for no fault of the soak's: "
                                            f"{outcome.error}: {outcome.message}")


def read_the_predecessors(retry: Instance, outcome: Outcome, predecessor_pids: set[int]
                          ) -> bool:
    """Whether a retry's read got what the instance it retries (cut unread) left rather than
    the retry's own entry: rows published before the retry was submitted, or, where it read
    none, the death of that instance's producer alone (any of `predecessor_pids` named). The
    rest is the retry's: an entry its abort cut short, its own stage's failure."""
    if outcome.published_at is not None:
        return outcome.published_at < retry.submitted_at
    return death_of(outcome, predecessor_pids)


def death_of(outcome: Outcome, pids: set[int]) -> bool:
    """Whether `outcome` reports a producer's death naming some of `pids` and no other."""
    named = {int(pid) for pid in re.findall(r"pid (\d+)", outcome.message)}
    return outcome.error == PRODUCER_DIED and bool(named) and named <= pids


def failure_cause(message: str) -> str:
    """A named failure's cause, in a few words, from the channel error's message."""
    text = message.lower()
    for words, cause in (("full", "channel full"), ("shut down", "stage shut down"),
                         ("position", "stream broken"), ("expired", "expired")):
        if words in text:
            return cause
    return "other"


class Producer:
    """One generation of stage 1: an engine (cache, prefix caching, streaming) whose engine-core
    process the soak may kill. Invariant: `step` is only called while no kill happened, and
    returns (raising) when the engine core dies on its own."""

    def __init__(self, model_dir: Path, channel: StageChannel, generation: int) -> None:
        from prefix_cache.tools.pipelines.engines import engine_core_pid, start_thinker
        self.generation = generation
        self.engine = start_thinker(model_dir, channel, prefix_caching=True, shape=SOAK_SHAPE,
                                    stage_options={"stream": True}, disable_log_stats=False)
        import psutil  # a dependency of vLLM
        core = psutil.Process(engine_core_pid(self.engine))
        #: the engine-core process and its children (the worker, which publishes, where the
        #: executor runs one)
        self.pids = {core.pid, *(child.pid for child in core.children(recursive=True))}
        self.killed = False  # by the soak
        self.died = False  # on its own
        self.last_wait_s = 0.0
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_death, name="soak-engine-watch",
                                       daemon=True)
        self._watch.start()

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> list[Any]:
        start = time.monotonic()
        outputs = self.engine.step()
        self.last_wait_s = time.monotonic() - start
        return outputs

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        from prefix_cache.tools.pipelines.pipeline import greedy_params
        self.engine.engine.add_request(request_id, {"prompt_token_ids": prompt},
                                       greedy_params(max_tokens))

    def abort(self, request_id: str) -> None:
        self.engine.engine.abort_request([request_id])

    def kill(self) -> None:
        from prefix_cache.tools.kill_test import kill_engine
        self.killed = True
        kill_engine(self.engine)

    def close(self) -> None:
        self._stop.set()
        self._watch.join()
        self.engine.close()

    def _watch_death(self) -> None:
        """vLLM's client marks an engine core that exits dead and shuts its output thread
        down, so a step waiting for outputs would wait forever: it is handed an error."""
        core = self.engine.engine.engine_core
        resources = getattr(core, "resources", None)
        while not self._stop.wait(0.5):
            if resources is not None and resources.engine_dead and not self.killed:
                from vllm.v1.engine.exceptions import EngineDeadError
                self.died = True
                core.outputs_queue.put_nowait(EngineDeadError())
                return


class FaultSchedule:
    """When the next fault comes and of which kind (of those `enabled`): heavy faults one at a
    time, in a shuffled cycle of their kinds (a short soak meets each), light ones between.
    Each class draws from an RNG of its own seeded by the soak's seed, so a seed gives the same
    sequence of faults (kinds, stall lengths, gaps) however the requests run."""

    def __init__(self, seed: int, start: float, enabled: Collection[str]) -> None:
        self._heavy_rng = random.Random(f"heavy-{seed}")
        self._light_rng = random.Random(f"light-{seed}")
        self.heavy = [kind for kind in HEAVY_FAULTS if kind in enabled]
        self.light = [kind for kind in LIGHT_FAULTS if kind in enabled]
        self.next_heavy = start + self._heavy_rng.uniform(*FIRST_HEAVY_AFTER_S)
        self.next_light = start + self._light_rng.uniform(*LIGHT_EVERY_S)
        self._cycle: list[str] = []

    def heavy_due(self, now: float) -> str | None:
        if now < self.next_heavy or not self.heavy:
            return None
        if not self._cycle:
            self._cycle = self._heavy_rng.sample(self.heavy, len(self.heavy))
        return self._cycle[0]

    def heavy_done(self) -> float | None:
        """The heavy fault due is under way; a consumer stall's length (None for the others)."""
        kind = self._cycle.pop(0)
        return self._heavy_rng.uniform(*STALL_S) if kind == "consumer stall" else None

    def heavy_wait(self, until: float) -> None:
        """The heavy fault under way ends at `until`: the next comes after it."""
        self.next_heavy = until + self._heavy_rng.uniform(*HEAVY_EVERY_S)

    def light_due(self, now: float) -> str | None:
        if now < self.next_light or not self.light:
            return None
        self.next_light = now + self._light_rng.uniform(*LIGHT_EVERY_S)
        return self._light_rng.choice(self.light)


@dataclass
class SoakReport:
    """What a soak did and found."""

    channel: str
    seed: int
    minutes: float
    check: str = ""
    submitted: Counter[str] = field(default_factory=Counter)  # by kind: new, duplicate id, retry
    verdicts: Counter[str] = field(default_factory=Counter)
    causes: Counter[str] = field(default_factory=Counter)  # of named failures
    delivered_by: Counter[str] = field(default_factory=Counter)  # whole, streamed, aborted
    faults: Counter[str] = field(default_factory=Counter)
    expiries_planned: int = 0
    preemptions: int = 0
    preempted_requests: int = 0
    hit_requests: int = 0
    hit_tokens: int = 0
    rows_checked: int = 0
    engine_deaths: int = 0
    predecessors_read: int = 0  # entries of cut requests retried unread, met by the retry's read
    leftovers: list[str] = field(default_factory=list)  # ids with something left at the end
    longest_wait_s: float = 0.0
    longest_wait_in_stall_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def wrong(self) -> int:
        return self.verdicts["wrong"]

    @property
    def lost(self) -> int:
        return self.verdicts["lost"]

    @property
    def ok(self) -> bool:
        return not self.problems

    def progress(self, elapsed_s: float) -> str:
        v = self.verdicts
        return (f"[soak] {elapsed_s:4.0f} s: {sum(self.submitted.values())} requests, "
                f"{v['delivered']} delivered, {v['failed']} failed, {v['expired']} expired, "
                f"{v['held']} held, {v['wrong']} wrong, {v['lost']} lost; faults "
                + (", ".join(f"{k} {n}" for k, n in sorted(self.faults.items())) or "none"))

    def table(self) -> str:
        submitted = sum(self.submitted.values())
        causes = ", ".join(f"{c} {n}" for c, n in self.causes.most_common()) or "-"
        by = self.delivered_by
        rows = [
            ("requests submitted", submitted,
             f"{self.submitted['retry']} retries, {self.submitted['duplicate id']} duplicate ids"),
            ("entries delivered", self.verdicts["delivered"],
             f"{by['whole']} whole, {by['streamed']} streamed; {by['aborted']} aborted "
             f"(a correct prefix); {self.rows_checked} rows checked, {self.check}"),
            ("failed, a named error", self.verdicts["failed"],
             f"{causes}; {self.predecessors_read} retried unread met by the retry's read first"),
            ("expired, as planned", self.verdicts["expired"],
             f"of {self.expiries_planned} read late"),
            ("held by a killed consumer", self.verdicts["held"], "drained by the next one"),
            ("faults injected", sum(self.faults.values()),
             ", ".join(f"{k} {n}" for k, n in sorted(self.faults.items())) or "-"),
            ("preemptions (vLLM)", self.preemptions, f"of {self.preempted_requests} requests"),
            ("prefix hits", self.hit_requests, f"requests, {self.hit_tokens} tokens"),
            ("WRONG rows (must be 0)", self.wrong, ""),
            ("LOST entries (must be 0)", self.lost, "neither delivered nor failed"),
            ("errors outside the channel's", self.verdicts["error"], ""),
            ("engine deaths", self.engine_deaths, "not caused by the soak's kills"),
            ("ids left in the channel", len(self.leftovers),
             "at the end: " + (", ".join(self.leftovers[:4]) or "none")
             + (" ..." if len(self.leftovers) > 4 else "")),
            ("engine thread's longest stall", f"{self.longest_wait_s:.2f} s",
             f"{self.longest_wait_in_stall_s:.2f} s during consumer stalls (the longest wait "
             f"for a step's outputs)"),
        ]
        width = max(len(r[0]) for r in rows)
        head = (f"soak on {self.channel}, seed {self.seed}, {self.minutes:g} min of traffic")
        return "\n".join([head] + [f"  {what:<{width}}  {str(n):>8}  {detail}".rstrip()
                                   for what, n, detail in rows])


class Soak:
    """The soak's state: the requests, the producer generation and consumer in use, the faults.
    Invariant: each instance without an outcome is either not read yet (`read_at` not come),
    read by the current consumer (`consumer.unanswered`), or held by a killed one and drained by
    the current one."""

    def __init__(self, model_dir: Path, channel: StageChannel, references_path: Path,
                 prompts: list[list[int]], report: SoakReport, rng: random.Random,
                 say: Callable[[str], None]) -> None:
        self.model_dir = model_dir
        self.channel = channel
        self.references_path = references_path
        self.prompts = prompts
        self.report = report
        self.rng = rng
        self.say = say
        self.instances: dict[int, Instance] = {}
        self.unanswered: set[int] = set()  # instances without an outcome
        self.latest: dict[str, Instance] = {}  # by request id: its last instance
        self.live: dict[str, Instance] = {}  # by request id: in the engine now
        self.outcomes: queue.Queue[Outcome] = queue.Queue()
        self.consumer = ConsumerProcess(channel.spec, references_path, self.outcomes)
        self.producer = Producer(model_dir, channel, generation=0)
        self.dead_generations: set[int] = set()
        #: by dead generation, its engine-core processes, which publish
        self.dead_pids: dict[int, set[int]] = {}
        self.clean_ids: list[str] = []  # ids whose last instance was delivered whole
        self.retries: list[Instance] = []
        self.late_reads: list[tuple[float, Instance]] = []
        self.stalled_until = 0.0  # consumer stall in progress (and a short while after)
        self.consumer_restarting = False
        self._next_key = 0
        self._pending_light: set[str] = set()  # expiry, duplicate id: for the next submission

    # ------------------------------------------------------------------ the run

    def run(self, minutes: float, faults: Collection[str]) -> None:
        start = time.monotonic()
        end = start + 60.0 * minutes
        schedule = FaultSchedule(self.report.seed, start, faults)
        next_progress = start + PROGRESS_EVERY_S
        while (now := time.monotonic()) < end:
            self._faults(schedule, now, end)
            self._submit()
            self._tick(now)
            if now >= next_progress:
                next_progress = now + PROGRESS_EVERY_S
                self.say(self.report.progress(now - start))
        self._finish()
        self.say(self.report.progress(time.monotonic() - start))

    def _tick(self, now: float) -> None:
        """One step of the engine (or a pause when it has none), then the outcomes so far."""
        self._send_late_reads(now)
        if self.producer.has_work():
            try:
                outputs = self.producer.step()
            except Exception as exc:  # noqa: BLE001 - the engine died under us
                self._engine_died(exc)
            else:
                self._record(outputs)
                self._note_wait()
        else:
            time.sleep(IDLE_PAUSE_S)
        self._take_outcomes()

    def _finish(self) -> None:
        """No new requests or faults: the running ones finish, every read answers (bounded)."""
        deadline = time.monotonic() + FINISH_WAIT_S + max(
            [at - time.monotonic() for at, _ in self.late_reads] + [0.0])
        while time.monotonic() < deadline and (self.producer.has_work() or self.late_reads or
                                               self.unanswered):
            self._submit_retries()
            self._tick(time.monotonic())
        self.consumer.close()
        self._take_outcomes()
        self._find_leftovers()
        for key in sorted(self.unanswered):
            instance = self.instances[key]
            self.report.verdicts["lost"] += 1
            self.report.problems.append(f"{instance.name}: no outcome {FINISH_WAIT_S:g} s after "
                                        f"the traffic ended")
        self.producer.close()

    def _find_leftovers(self) -> None:
        """Ids that still have something in the channel (an entry, a chunk, a failure marker)
        once every read answered: a later reader of the id would get it first."""
        for request_id in self.latest:
            try:
                next(iter(self.channel.stream(request_id, 0.0)))
            except OmniPrefixCacheChannelTimeoutError:
                continue
            except OmniPrefixCacheChannelError:
                pass
            self.report.leftovers.append(request_id)

    # ------------------------------------------------------------------ requests

    def _submit(self) -> None:
        self._submit_retries()
        while len(self.live) < MAX_RUNNING and len(self.unanswered) < MAX_OUTSTANDING:
            self._add(self._new_instance())

    def _submit_retries(self) -> None:
        """Each request its producer's death cut, again under its id and prompt; a new length,
        so that rows of the first try delivered to the retry show as wrong."""
        while self.retries:
            old = self.retries.pop(0)
            max_tokens = self.rng.choice([n for n in range(2, MAX_GENERATED + 1)
                                          if n != old.max_tokens])
            self._add(Instance(self._take_key(), old.request_id, old.prompt, max_tokens,
                               old.prompt_len, old.streamed, self.producer.generation,
                               kind="retry", read_at=self._read_at(),
                               predecessor=None if old.read_sent else old))

    def _read_at(self) -> str:
        return "end" if self.rng.random() < LAZY_SHARE else "submit"

    def _new_instance(self) -> Instance:
        prompt = self.rng.randrange(len(self.prompts))
        request_id, kind = f"soak-{self._next_key}", "new"
        if "duplicate id" in self._pending_light and self.clean_ids:
            self._pending_light.discard("duplicate id")
            request_id, kind = self.clean_ids.pop(self.rng.randrange(len(self.clean_ids))), \
                "duplicate id"
            while family(prompt) == family(self.latest[request_id].prompt):  # no row in common
                prompt = self.rng.randrange(len(self.prompts))
            self.report.faults["duplicate id"] += 1
        read_at = self._read_at()
        if "expiry" in self._pending_light:
            self._pending_light.discard("expiry")
            self.report.faults["expiry"] += 1
            self.report.expiries_planned += 1
            read_at = "expiry"
        return Instance(self._take_key(), request_id, prompt,
                        self.rng.randint(2, MAX_GENERATED), len(self.prompts[prompt]),
                        streamed=self.rng.random() < 0.5, generation=self.producer.generation,
                        kind=kind, read_at=read_at)

    def _take_key(self) -> int:
        self._next_key += 1
        return self._next_key

    def _add(self, instance: Instance) -> None:
        """Read it from now on (where it is read from its submission), then submit it."""
        self.instances[instance.key] = instance
        self.unanswered.add(instance.key)
        self.latest[instance.request_id] = instance
        self.report.submitted[instance.kind] += 1
        if instance.read_at == "submit":
            self._send_read(instance, READ_TIMEOUT_S)
        self.live[instance.request_id] = instance
        instance.submitted_at = time.time()
        try:
            self.producer.add(instance.request_id, self.prompts[instance.prompt],
                              instance.max_tokens)
        except Exception as exc:  # noqa: BLE001 - the engine died under us
            self._engine_died(exc)

    def _send_read(self, instance: Instance, timeout_s: float, *, drain: bool = False) -> None:
        instance.read_sent = True
        self.consumer.read(Read(instance.key, instance.request_id, instance.prompt,
                                streamed=instance.streamed or drain, timeout_s=timeout_s,
                                drain=drain))

    def _send_late_reads(self, now: float) -> None:
        due = [i for at, i in self.late_reads if at <= now]
        self.late_reads = [(at, i) for at, i in self.late_reads if at > now]
        for instance in due:
            self._send_read(instance, EXPIRED_READ_TIMEOUT_S)

    def _record(self, outputs: list[Any]) -> None:
        for out in outputs:
            instance = self.live.get(out.request_id)
            if instance is None:
                continue
            instance.state = "running"
            if out.finished:
                metrics = getattr(out, "metrics", None)
                instance.preemptions = getattr(metrics, "num_preemptions", 0) or 0
                instance.cached_tokens = out.num_cached_tokens or 0
                self._ended(instance, "finished")

    def _ended(self, instance: Instance, state: str) -> None:
        """vLLM finished or aborted it, or its producer died (`cut`): its read starts now or
        at its expiry where it has not yet; one cut unread is retried at once, unread."""
        instance.state, instance.ended_at = state, time.monotonic()
        del self.live[instance.request_id]
        report = self.report
        report.preemptions += instance.preemptions
        report.preempted_requests += instance.preemptions > 0
        report.hit_requests += instance.cached_tokens > 0
        report.hit_tokens += instance.cached_tokens
        if instance.read_sent:
            return
        if state == "cut":  # the stage after it would not read a request its producer lost
            self.unanswered.discard(instance.key)
            self._count(instance, Verdict("failed", "producer died, retried unread"))
            self.retries.append(instance)
        elif instance.late:
            self.late_reads.append((instance.ended_at + CHANNEL_TTL_S + EXPIRY_MARGIN_S,
                                    instance))
        else:
            self._send_read(instance, READ_TIMEOUT_S)

    def _take_outcomes(self) -> None:
        while True:
            try:
                outcome = self.outcomes.get_nowait()
            except queue.Empty:
                return
            self._judge(self.instances[outcome.key], outcome)

    def _judge(self, instance: Instance, outcome: Outcome) -> None:
        if (old := instance.predecessor) is not None and read_the_predecessors(
                instance, outcome, self.dead_pids.get(old.generation, set())):
            instance.predecessor = None  # its entry came first, in put order: read again
            self._judge_predecessor(old, outcome)
            self._send_read(instance, READ_TIMEOUT_S)
            return
        instance.outcome = outcome
        self.unanswered.discard(instance.key)
        verdict = judge(instance, instance.generation in self.dead_generations)
        self._count(instance, verdict)
        report = self.report
        report.rows_checked += outcome.rows.num_rows
        if verdict.what == "delivered":
            report.delivered_by["aborted" if instance.aborted and outcome.rows.num_rows <
                                instance.rows_wanted else
                                "streamed" if instance.streamed else "whole"] += 1
            if outcome.rows.num_rows == instance.rows_wanted and \
                    instance.request_id not in self.live:
                self.clean_ids.append(instance.request_id)
        if outcome.error == PRODUCER_DIED and instance.generation in self.dead_generations \
                and instance.request_id not in self.live:
            self.retries.append(instance)

    def _judge_predecessor(self, old: Instance, outcome: Outcome) -> None:
        """A retry's read met the entry of the instance it retries, cut unread (counted failed
        then): its rows are checked against that instance's, and a death it reports must be
        of a producer the soak saw die."""
        old.outcome = outcome
        self.report.predecessors_read += 1
        verdict = judge(old, producer_died=True)
        if verdict.problem is None and outcome.error == PRODUCER_DIED \
                and not death_of(outcome, set().union(*self.dead_pids.values())):
            verdict = Verdict("lost", problem=f"{old.name}: read by its retry, a producer the "
                                              f"soak did not see die was reported dead: "
                                              f"{outcome.message}")
        if verdict.problem is not None:
            self.report.problems.append(verdict.problem)
            self.say(f"[soak] PROBLEM: {verdict.problem}")

    def _count(self, instance: Instance, verdict: Verdict) -> None:
        report = self.report
        report.verdicts[verdict.what] += 1
        if verdict.what == "failed":
            report.causes[verdict.cause] += 1
        if verdict.problem is not None:
            report.problems.append(verdict.problem)
            self.say(f"[soak] PROBLEM: {verdict.problem}")

    # ------------------------------------------------------------------ faults

    def _faults(self, schedule: FaultSchedule, now: float, end: float) -> None:
        light = schedule.light_due(now)
        if light == "abort":
            self._abort()
        elif light == "expiry" and now < end - CHANNEL_TTL_S - EXPIRY_MARGIN_S and not any(
                self.instances[key].late for key in self.unanswered):
            self._pending_light.add("expiry")  # one at a time: it holds capacity until it expires
        elif light == "duplicate id":
            self._pending_light.add("duplicate id")
        if self.consumer_restarting and self.consumer.ready.is_set():
            self.consumer_restarting = False
            schedule.heavy_wait(now)
        if now < self.stalled_until or self.consumer_restarting:
            return
        heavy = schedule.heavy_due(now)
        if heavy is None or (heavy == "producer kill" and not self.live):
            return  # a producer kill waits for a request in the engine: it must cut one
        stall_s = schedule.heavy_done()
        self.report.faults[heavy] += 1
        if heavy == "consumer stall":
            assert stall_s is not None
            self._stall_consumer(stall_s, now)
            schedule.heavy_wait(self.stalled_until)
        elif heavy == "consumer kill":
            self._kill_consumer()  # the next is scheduled once the new consumer is ready
        else:
            self._kill_producer()
            schedule.heavy_wait(time.monotonic())

    def _abort(self) -> None:
        candidates = [i for i in self.live.values() if not i.aborted]
        if not candidates:
            return
        instance = self.rng.choice(candidates)
        self.report.faults["abort"] += 1
        instance.aborted = True
        try:
            self.producer.abort(instance.request_id)
        except Exception as exc:  # noqa: BLE001 - the engine died under us
            self._engine_died(exc)
            return
        self._ended(instance, "aborted")

    def _stall_consumer(self, seconds: float, now: float) -> None:
        self.consumer.stop()
        timer = threading.Timer(seconds, self.consumer.resume)
        timer.daemon = True
        timer.start()
        self.stalled_until = now + seconds + STALL_AFTERMATH_S

    def _kill_consumer(self) -> None:
        held = self.consumer.kill()
        self.consumer = ConsumerProcess(self.channel.spec, self.references_path, self.outcomes)
        self.consumer_restarting = True
        for key in held:
            instance = self.instances[key]
            instance.held = True
            self._send_read(instance, DRAIN_TIMEOUT_S if instance.ended_at is not None
                            else READ_TIMEOUT_S, drain=True)

    def _kill_producer(self) -> None:
        self.producer.kill()
        self._producer_gone()

    def _engine_died(self, exc: Exception) -> None:
        if self.producer.killed:
            raise RuntimeError("the soak stepped an engine it had killed") from exc
        self.report.engine_deaths += 1
        problem = f"engine generation {self.producer.generation} died: {type(exc).__name__}: {exc}"
        self.report.problems.append(problem)
        self.say(f"[soak] PROBLEM: {problem}")
        self._producer_gone()

    def _producer_gone(self) -> None:
        """Its requests are cut (their consumers must learn it), the engine is started again."""
        generation = self.producer.generation
        self.dead_generations.add(generation)
        self.dead_pids[generation] = self.producer.pids
        for instance in list(self.live.values()):
            self._ended(instance, "cut")
        with contextlib.suppress(Exception):  # its processes are gone; close what is left
            self.producer.close()
        self.say(f"[soak] engine generation {generation} gone; starting generation "
                 f"{generation + 1}")
        self.producer = Producer(self.model_dir, self.channel, generation + 1)

    def _note_wait(self) -> None:
        wait = self.producer.last_wait_s
        self.report.longest_wait_s = max(self.report.longest_wait_s, wait)
        if time.monotonic() < self.stalled_until:
            self.report.longest_wait_in_stall_s = max(self.report.longest_wait_in_stall_s, wait)


def channel_spec(name: str, stack: contextlib.ExitStack, say: Callable[[str], None]) -> str:
    """The spec of a new namespace for the soak: small capacity, short full wait and ttl.
    `name`: shm, mooncake (a loopback Mooncake Store started here, from this checkout's
    tests/mooncake_store.py) or a mooncake:// spec of a running store."""
    options = f"capacity={CAPACITY_BYTES}&ttl={CHANNEL_TTL_S:g}&wait={FULL_WAIT_S:g}"
    if name == "shm":
        return f"shm://?{options}"
    if name == "mooncake":
        try:
            from tests.mooncake_store import MooncakeStoreProcesses
        except ImportError as exc:
            raise RuntimeError(f"--channel mooncake starts a loopback Mooncake Store with the "
                               f"checkout's tests/mooncake_store.py, which is not importable "
                               f"here ({exc}): run from the checkout, or pass the "
                               f"mooncake://HOST:PORT?metadata=URL of a running store") from None
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="omni-prefix-cache-soak-mooncake-")))
        store = stack.enter_context(MooncakeStoreProcesses(log_dir))
        say(f"[soak] a Mooncake Store on loopback: master {store.master}")
        return f"{store.spec}&{options}"
    if name.startswith("mooncake://"):
        return f"{name}&{options}"
    raise ValueError(f"unknown channel {name!r}: expected shm, mooncake or mooncake://...")


def run(minutes: float, channel: str = "shm", *, seed: int = 0,
        faults: Collection[str] = FAULTS, say: Callable[[str], None] = print) -> SoakReport:
    """A soak of `minutes` of traffic (after the reference run and the first engine start),
    injecting the kinds of `faults`."""
    from prefix_cache.tools.pipelines import engines
    report = SoakReport(channel, seed, minutes)
    with contextlib.ExitStack() as stack:
        stack.enter_context(engines.multiprocessing_mode(True))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="omni-prefix-cache-soak-")))
        spec = channel_spec(channel, stack, say)
        say("[soak] writing a random Qwen2 model (nothing downloaded)")
        model_dir = engines.write_random_qwen2(tmp / "thinker", seed=0)
        prompts = make_prompts(seed)
        references = reference_rows(model_dir, prompts, say)
        report.check = ("bit for bit" if references.tolerance == 0 else
                        f"within {references.tolerance:g}, nearest its own prompt")
        references_path = tmp / "references.pt"
        references.save(references_path)
        stage_channel = stack.enter_context(open_channel(spec))
        say(f"[soak] channel {stage_channel.spec}")
        say("[soak] starting the stage (prefix caching and streaming on) and the consumer ...")
        soak = Soak(model_dir, stage_channel, references_path, prompts, report,
                    random.Random(seed), say)
        say(f"[soak] {minutes:g} min of traffic under faults")
        soak.run(minutes, faults)
    return report


def fault_kinds(text: str) -> list[str]:
    """`--faults`: kinds separated by commas, or `none`; a ValueError naming the known ones."""
    if text.strip() == "none":
        return []
    kinds = [kind.strip().replace("-", " ") for kind in text.split(",") if kind.strip()]
    if not kinds or any(kind not in FAULTS for kind in kinds):
        raise ValueError(f"expected none or kinds separated by commas of {', '.join(FAULTS)}; "
                         f"got {text!r}")
    return kinds


def main(minutes: float, channel: str, seed: int, faults: Collection[str] = FAULTS) -> int:
    """The soak with vLLM's logs in a file of its own; the table; 1 on any problem."""
    from prefix_cache.tools.pipelines.engine_logs import new_log_path, output_to_log
    log_path = new_log_path("soak")
    with output_to_log(log_path) as terminal:
        def say(line: str) -> None:
            print(line, file=terminal, flush=True)
        report = run(minutes, channel, seed=seed, faults=faults, say=say)
        say(report.table())
        for problem in report.problems:
            say(f"PROBLEM: {problem}")
        say(f"vLLM's logs: {log_path}")
        say(("FAILED" if report.problems else "OK") + f": {report.wrong} wrong, {report.lost} "
            f"lost, {report.engine_deaths} engine deaths, {len(report.problems)} problems")
    return 0 if report.ok else 1

