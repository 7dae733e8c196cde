"""Stage 1 killed again and again: what the next stage sees when its producer dies (docs/api.md,
"When a producer dies").

A two-stage pipeline on vLLM's real engine. Stage 1 (the thinker, with the cache) runs in an
engine-core process of its own, whose worker publishes to the stage channel. Each round submits
requests sharing prefixes, and stage 2's side of the channel waits for every one of them from
the moment it is submitted. Mid-round, at a random moment, the engine-core process is SIGKILLed;
the engine is then started again for the next round. A last round runs without a kill. After
each round, stage 2 (the talker, an engine on `prompt_embeds`) generates from the rows that
arrived.

Checked, round by round:
- every request whose entry was published before the kill arrives exactly once, with exactly
  its rows: prompt + generated - 1 of them, equal to the same prompt's rows in every other
  round (and so the talker's tokens too);
- every other request's consumer gets a failure naming the dead producer
  (`OmniPrefixCacheChannelProducerError`) within `FAILURE_BOUND_S` of the kill. That includes
  a request vLLM had already returned as finished whose entry was not out yet: the worker
  publishes off the engine thread, a few milliseconds after the output (`slowest entry`), and
  the table counts such requests (`unpublished`);
- nothing of the channel's namespace is left after its owner closed it.

`python -m prefix_cache.tools.kill_test [--kills N] [--channel SPEC]` prints a table per round
and exits 1 on any failed check.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from prefix_cache.channel import (OmniPrefixCacheChannelError,
                                  OmniPrefixCacheChannelProducerError,
                                  OmniPrefixCacheChannelTimeoutError, StageChannel,
                                  open_channel)
from prefix_cache.config import HIDDEN_KEY

#: How soon after the kill a consumer of a cut request must have its failure.
FAILURE_BOUND_S = 8.0
#: How long a consumer waits for an entry at most (a request that never comes fails at this).
GET_TIMEOUT_S = 60.0
ROW_TOLERANCE = 1e-4
TALKER_TOKENS = 4
REQUESTS_PER_ROUND = 8
MAX_TOKENS = 12
#: A round's kill comes after a random number of request outputs below this (a round without a
#: kill reads REQUESTS_PER_ROUND * MAX_TOKENS of them).
KILL_WITHIN_OUTPUTS = 60


@dataclass
class Consumed:
    """What stage 2's side got for one request, and when (monotonic)."""

    rows: torch.Tensor | None = None
    error: Exception | None = None
    at: float = 0.0


@dataclass
class RoundReport:
    """One round: what was submitted, finished, delivered and failed, and what went wrong."""

    index: int
    killed_at_s: float | None  # seconds after the first submit; None: no kill
    submitted: int = 0
    finished: int = 0  # reported finished by stage 1 (before the kill, if one came)
    delivered: int = 0
    producer_failures: int = 0
    unpublished_at_kill: int = 0  # of those: finished, its entry not yet out at the kill
    slowest_failure_s: float = 0.0  # after the kill
    slowest_publish_s: float = 0.0  # from stage 1's finished output to the entry's arrival
    problems: list[str] = field(default_factory=list)


def prompts(seed: int) -> list[list[int]]:
    """`REQUESTS_PER_ROUND` prompts from two families sharing 64-token prefixes."""
    rng = random.Random(seed)
    families = [[rng.randrange(1, 1000) for _ in range(64)] for _ in range(2)]
    return [families[i % 2] + [rng.randrange(1, 1000) for _ in range(3 + 5 * i)]
            for i in range(REQUESTS_PER_ROUND)]


def kill_engine(engine: Any) -> None:
    """SIGKILL a multiprocess engine's engine-core process and its children (the worker that
    publishes, where the executor runs one), and wait until they are gone."""
    import psutil  # a dependency of vLLM

    from prefix_cache.tools.pipelines.engines import engine_core_pid
    pid = engine_core_pid(engine)
    if pid == os.getpid():
        raise RuntimeError("the kill test needs an engine-core process of its own, not an "
                           "in-process engine (it would kill itself)")
    core = psutil.Process(pid)
    doomed = [*core.children(recursive=True), core]
    for proc in doomed:
        proc.kill()
    psutil.wait_procs(doomed, timeout=10)


def consume(channel: StageChannel, request_id: str) -> Consumed:
    try:
        rows = channel.get(request_id, timeout_s=GET_TIMEOUT_S)[HIDDEN_KEY]
        return Consumed(rows=rows, at=time.monotonic())
    except OmniPrefixCacheChannelError as exc:
        return Consumed(error=exc, at=time.monotonic())


class KillRun:
    """Rounds of stage 1 against one channel; `reference` holds each prompt's first rows and
    talker tokens, which every later round must reproduce."""

    def __init__(self, thinker_dir: Path, talker: Any, channel: StageChannel, *,
                 rng: random.Random, say: Callable[[str], None]) -> None:
        self.thinker_dir = thinker_dir
        self.talker = talker
        self.channel = channel
        self.rng = rng
        self.say = say
        self.prompts = prompts(seed=7)
        self.rows: dict[int, torch.Tensor] = {}
        self.tokens: dict[int, list[int]] = {}

    def round(self, index: int, kill: bool) -> RoundReport:
        from vllm import SamplingParams

        from prefix_cache.tools.pipelines.engines import start_thinker
        thinker = start_thinker(self.thinker_dir, self.channel, prefix_caching=True)
        report = RoundReport(index, None)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        ids = {f"round{index}-{i}": i for i in range(len(self.prompts))}
        finished: dict[str, float] = {}  # request -> when stage 1 reported it finished
        killed_at: float | None = None
        with ThreadPoolExecutor(len(ids)) as pool:
            start = time.monotonic()
            waits: dict[str, Future[Consumed]] = {}
            for request_id, i in ids.items():
                thinker.engine.add_request(request_id, {"prompt_token_ids": self.prompts[i]},
                                           params)
                waits[request_id] = pool.submit(consume, self.channel, request_id)
            # the engine core runs on its own between the outputs read here: a kill after a
            # random number of them lands at a random point of its work (and ends the round:
            # vLLM's client waits forever for a step of a killed engine)
            kill_after = self.rng.randrange(1, KILL_WITHIN_OUTPUTS) if kill else None
            outputs = 0
            while thinker.has_work():
                if kill_after is not None and outputs >= kill_after:
                    killed_at = time.monotonic()
                    kill_engine(thinker)
                    report.killed_at_s = killed_at - start
                    break
                for out in thinker.step():
                    outputs += 1
                    if out.finished:
                        finished[out.request_id] = time.monotonic()
            if kill and killed_at is None:
                raise RuntimeError(f"round {index} ended after {outputs} outputs, before its "
                                   f"kill after {kill_after}")
            got = {request_id: wait.result() for request_id, wait in waits.items()}
        thinker.close()
        report.submitted, report.finished = len(ids), len(finished)
        self._check(report, ids, finished, got, killed_at)
        return report

    def _check(self, report: RoundReport, ids: dict[str, int], finished: dict[str, float],
               got: dict[str, Consumed], killed_at: float | None) -> None:
        """Delivered rows exact and once; every other request failed naming its dead producer
        in time. A request stage 1 reported finished may be one of those: its worker publishes
        off the engine thread, so a kill can come between vLLM's output and the entry."""
        delivered: dict[str, torch.Tensor] = {}
        for request_id, consumed in got.items():
            if consumed.rows is not None:
                delivered[request_id] = consumed.rows
                if request_id in finished:
                    report.slowest_publish_s = max(report.slowest_publish_s,
                                                   consumed.at - finished[request_id])
            elif isinstance(consumed.error, OmniPrefixCacheChannelProducerError) \
                    and killed_at is not None:
                report.producer_failures += 1
                report.unpublished_at_kill += request_id in finished
                late = consumed.at - killed_at
                report.slowest_failure_s = max(report.slowest_failure_s, late)
                if late > FAILURE_BOUND_S:
                    report.problems.append(f"{request_id}: its failure came {late:.1f} s after "
                                           f"the kill (bound {FAILURE_BOUND_S:g} s)")
            else:
                report.problems.append(f"{request_id}: {type(consumed.error).__name__}: "
                                       f"{consumed.error}")
        report.delivered = len(delivered)
        for request_id in delivered:  # exactly once: nothing more under the id
            try:
                self.channel.get(request_id, timeout_s=0.05)
                report.problems.append(f"{request_id}: delivered twice")
            except OmniPrefixCacheChannelTimeoutError:
                pass
        for request_id, rows in delivered.items():
            self._check_rows(report, request_id, ids[request_id], rows)
        if delivered:
            self._check_talker(report, {r: ids[r] for r in delivered}, delivered)

    def _check_rows(self, report: RoundReport, request_id: str, prompt: int,
                    rows: torch.Tensor) -> None:
        want = len(self.prompts[prompt]) + MAX_TOKENS - 1
        if rows.shape[0] != want:
            report.problems.append(f"{request_id}: {rows.shape[0]} rows, expected {want}")
            return
        reference = self.rows.setdefault(prompt, rows)
        diff = (rows - reference).abs().max().item()
        if diff > ROW_TOLERANCE:
            report.problems.append(f"{request_id}: rows differ from prompt {prompt}'s in an "
                                   f"earlier round by {diff:.1e}")

    def _check_talker(self, report: RoundReport, prompt_of: dict[str, int],
                      delivered: dict[str, torch.Tensor]) -> None:
        from prefix_cache.tools.pipelines.pipeline import talk
        spoken = talk(self.talker, delivered, TALKER_TOKENS)
        for request_id, (tokens, _margin) in spoken.items():
            reference = self.tokens.setdefault(prompt_of[request_id], list(tokens))
            if list(tokens) != reference:
                report.problems.append(f"{request_id}: stage 2's tokens {list(tokens)} differ "
                                       f"from {reference}, prompt {prompt_of[request_id]}'s in "
                                       f"an earlier round")


def run(kills: int, spec: str | None, *, seed: int = 0,
        say: Callable[[str], None] = print) -> tuple[list[RoundReport], list[str]]:
    """`kills` rounds with a kill, then one without; per round its report, and what of the
    channel is left after its owner closed it (a shared-memory namespace's directory)."""
    from prefix_cache.tools.pipelines import engines
    reports = []
    with tempfile.TemporaryDirectory(prefix="omni-prefix-cache-kill-") as tmp, \
            engines.multiprocessing_mode(True):
        say("[kill] writing two random Qwen2 models")
        thinker_dir = engines.write_random_qwen2(Path(tmp) / "thinker", seed=0)
        talker_dir = engines.write_random_qwen2(Path(tmp) / "talker", seed=1)
        talker = engines.start_talker(talker_dir)
        try:
            with open_channel(spec) as channel:
                kill_run = KillRun(thinker_dir, talker, channel, rng=random.Random(seed),
                                   say=say)
                for index in range(kills + 1):
                    reports.append(kill_run.round(index, kill=index < kills))
                    say(f"[kill] round {index}: {describe(reports[-1])}")
        finally:
            talker.close()
    directory = getattr(channel, "directory", None)  # Mooncake's owner removes its keys
    return reports, [str(directory)] if directory is not None and directory.exists() else []


def describe(report: RoundReport) -> str:
    killed = "no kill" if report.killed_at_s is None else f"killed at {report.killed_at_s:.2f} s"
    return (f"{killed}, {report.finished} finished before it, "
            f"{report.delivered}/{report.submitted} delivered, {report.producer_failures} "
            f"producer failures, {len(report.problems)} problems")


def table(reports: list[RoundReport]) -> str:
    """A row per round; `unpublished`: finished by vLLM, its entry not yet out at the kill."""
    head = (f"{'round':>5}  {'killed at':>9}  {'finished':>8}  {'delivered':>9}  "
            f"{'failed':>6}  {'unpublished':>11}  {'slowest failure':>15}  "
            f"{'slowest entry':>13}  problems")
    lines = [head]
    for r in reports:
        killed = "-" if r.killed_at_s is None else f"{r.killed_at_s:.2f} s"
        failure = "-" if not r.producer_failures else f"{r.slowest_failure_s:.2f} s"
        entry = "-" if not r.delivered else f"{1e3 * r.slowest_publish_s:.0f} ms"
        lines.append(f"{r.index:>5}  {killed:>9}  {r.finished:>8}  "
                     f"{r.delivered:>6}/{r.submitted:<2}  {r.producer_failures:>6}  "
                     f"{r.unpublished_at_kill:>11}  {failure:>15}  {entry:>13}  "
                     f"{len(r.problems)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefix_cache.tools.kill_test",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=5, help="rounds with a kill (default 5)")
    parser.add_argument("--channel", metavar="SPEC", default=None,
                        help="the stage channel (default: a new shared-memory namespace)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill times")
    args = parser.parse_args(argv)
    from prefix_cache.tools.pipelines.engine_logs import new_log_path, output_to_log
    log_path = new_log_path("kill")
    with output_to_log(log_path) as terminal:
        def say(line: str) -> None:
            print(line, file=terminal, flush=True)
        reports, left = run(args.kills, args.channel, seed=args.seed, say=say)
        say(table(reports))
        problems = [p for r in reports for p in r.problems]
        problems += [f"left after the channel's close: {name}" for name in left]
        for problem in problems:
            say(f"PROBLEM: {problem}")
        say("failure: after the kill, until the consumer's get raised; entry: from vLLM's "
            "finished output to the consumer's get returning the entry")
        say(f"vLLM's logs: {log_path}")
        kills = sum(r.killed_at_s is not None for r in reports)
        say(("FAILED" if problems else "OK") + f": {kills} kills survived, "
            f"{sum(r.delivered for r in reports)} entries delivered, "
            f"{sum(r.producer_failures for r in reports)} producer failures, "
            f"{len(left)} namespaces left behind")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
