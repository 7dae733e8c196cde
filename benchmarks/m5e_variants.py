"""M5e for copies of this tree with one part of the cache's step work taken out, to find which
part the engine step pays for.

    python3 benchmarks/m5e_variants.py [--variants full,discard,inline,off] [--runs 3]
        [--model small|tiny] [--eager] [--rounds R] [--out DIR]

Each variant is a copy of this tree's package with its C extensions built and one change, run
by `pipeline_bench --only M5e` beside vLLM's plain worker:

- `full`: the tree as it is;
- `discard`: the output thread only consumes each step (`discard_step`), delivering nothing;
- `inline`: the engine thread consumes each step itself at `end_step`: no output-thread job;
- `inline_full`: `full`, with each step's rows delivered on the engine thread at its `end_step`
  (where a synchronous backend has them landed: CPU only; finishes stay on the output thread);
- `ops20`: `full`, and 20 torch calls that do nothing (`view`) per step on the output thread:
  each releases and takes back the GIL;
- `py20`: `full`, and 20 µs of Python per step on the output thread, holding the GIL;
- `finish_reads`: issue 30's third direction, sketched for a V1 runner, a non-streaming stage
  and keys written at once (no deferred keys): the engine thread discards each step at
  `end_step` (and queues one `expect` at a request's first step); at a finish it plans a
  pinned read of the request's positions `[0, rows standing)` from its block table, which the
  output thread gathers from the pool and publishes. Not the product: no V2 runner, no
  deferred keys, no early finish followed by an in-flight step's rows, no failure paths;
- `inline_late`: `inline`, each step consumed at the next step's `end_step` (a step's record
  lives as long as the output thread kept it, with no other thread involved);
- `noop_job`: `inline`, and a job that does nothing queued for the output thread each step
  (the thread wakes every step, with no work and no record to drop);
- `batch4`: `full`, but the output thread is handed a decode step's delivery only with three
  more (one wake in four decode steps; a prompt step, a finish or shutdown hands what is held
  at once), with eight staging slots in place of four for the steps held;
- `nodev`: `discard`, and the CUDA backend's save issues no device work (a Transfer complete
  at launch): the save's bookkeeping without its kernel, event and slot page;
- `off`: no step reaches the stage (`_omni_stepping` is None): the cache's worker class alone.

On CPU, `--model tiny --eager` gives steps bound by the engine's Python, as a GPU decode step
under CUDA graphs is, and a whole call of seven variants takes under two minutes.

A variant without delivery publishes no rows, so its runs take no entries off the channel
and warm up without it. These copies are experiments, never the product: the changes live
here only. Each run's ratios move with the lent machine (`off` read 1.17 and 0.87 in two
calls of 2026-12-03), so compare variants within a call and read the decode steps' medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from prefix_cache.tools.harness import format_table
from prefix_cache.tools.pipeline_bench import decode_steps

ROOT = Path(__file__).resolve().parent.parent
PIPELINE_BENCH = "prefix_cache/tools/pipeline_bench.py"
STAGE_OUTPUTS = "prefix_cache/integration/stage_outputs.py"
GROUP_VIEW = "prefix_cache/integration/group_view.py"
MANAGER = "prefix_cache/manager.py"

#: (file, text, replacement) of a run without delivery: no channel entry is waited for.
_NO_ENTRIES = (
    (PIPELINE_BENCH, 'warm_up(engines["cache"], channel, requests=requests)',
     '_timed_steps(engines["cache"], requests)'),
    (PIPELINE_BENCH, "for request in requests if channel is not None else ():",
     "for request in ():"),
    (PIPELINE_BENCH, 'library = _library_s(stats) / stats["calls.save_outputs"]',
     'library = _library_s(stats) / stats.get("calls.save_outputs", 1)'),
)
_DISCARD = (
    (STAGE_OUTPUTS,
     "        if self._stopped_by_faults is None:\n            self._deliver(step)\n"
     "        elif step.step_id is not None:",
     "        if step.step_id is not None:  # variant: the output thread only consumes"),
)
VARIANTS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "full": (),
    "discard": _NO_ENTRIES + _DISCARD,
    "inline": _NO_ENTRIES + (
        (STAGE_OUTPUTS,
         "            if step is not None:\n                self._submit(",
         "            if step is not None and step.step_id is not None:  # variant: inline\n"
         "                self.cache.discard_step(step.step_id)\n"
         "            elif step is not None:\n                self._submit("),),
    "inline_full": (  # delivers: no _NO_ENTRIES
        (STAGE_OUTPUTS,
         "            if step is not None:\n                self._submit(",
         "            if step is not None:  # variant: inline_full\n"
         "                self._contained('delivering', list(step.batch.req_ids),\n"
         "                                lambda: self._deliver_unless_stopped(step), True)\n"
         "                (lambda *_, **__: None)("),),  # the submit's arguments, unused
    "ops20": (  # delivers: no _NO_ENTRIES
        (STAGE_OUTPUTS,
         "        batch = step.batch\n        if step.step_id is not None:\n",
         "        batch = step.batch\n        _t = torch.zeros(1)  # variant: ops20\n"
         "        for _ in range(20):\n            _t.view(-1)\n"
         "        if step.step_id is not None:\n"),),
    "py20": (  # delivers: no _NO_ENTRIES
        (STAGE_OUTPUTS,
         "        batch = step.batch\n        if step.step_id is not None:\n",
         "        batch = step.batch\n        import time as _time  # variant: py20\n"
         "        _end = _time.perf_counter() + 20e-6\n"
         "        while _time.perf_counter() < _end:\n            pass\n"
         "        if step.step_id is not None:\n"),),
    "finish_reads": (  # delivers: no _NO_ENTRIES
        (GROUP_VIEW, "def request_slot_runs(",
         "def _variant_request_runs(self, req_id, n):  # variant: finish_reads\n"
         "    table = self._table()\n"
         "    ids = table.get_numpy_array() if hasattr(table, 'get_numpy_array') \\\n"
         "        else table.get_cpu_tensor().numpy()\n"
         "    computed = np.zeros_like(np.asarray(self.input_batch.num_computed_tokens_cpu))\n"
         "    return request_slot_runs([req_id], {req_id: n}, self.input_batch.req_id_to_index,\n"
         "                             computed, ids, int(table.block_size), 'the batch')\n\n\n"
         "FullAttentionGroupView.request_runs = _variant_request_runs\n\n\n"
         "def request_slot_runs("),
        (MANAGER, "    def discard_step(self, step_id: int) -> None:",
         "    def variant_plan_request_read(self, req_id, n):  # variant: finish_reads\n"
         "        from prefix_cache.core.runs import runs_slots\n"
         "        slots = runs_slots(self.view.request_runs(req_id, n))\n"
         "        hits = StepHits.join([(req_id, n, slots)])\n"
         "        with self._lock:\n"
         "            return {key: self._reads.plan_hits(key, hits, [(req_id, 0)])[0]\n"
         "                    for key in list(self.pool.keys)\n"
         "                    if self.pool.present(key, slots).any()}\n\n"
         "    def variant_resolve(self, reads):\n"
         "        for read in reads.values():\n"
         "            self._reads.resolve(read)\n"
         "        return {key: read.out.view(read.out.shape[0], *self.pool.keys[key].feat_shape)\n"
         "                for key, read in reads.items()}\n\n"
         "    def discard_step(self, step_id: int) -> None:"),
        (STAGE_OUTPUTS,
         "        self._stopped_by_faults: str | None = None  # set by the output thread: why it "
         "stopped\n",
         "        self._stopped_by_faults: str | None = None  # set by the output thread: why it "
         "stopped\n"
         "        self._by_finish = cache is not None and not delivery.streaming  # variant\n"
         "        self._ends: dict[str, int] = {}\n"
         "        self._announced: set[str] = set()\n"),
        (STAGE_OUTPUTS,
         "        if not self._off:\n            try:\n                self._thread.check()\n",
         "        if self._by_finish and finished and not self._off:  # variant: finish_reads\n"
         "            self._finish_reads(list(finished))\n"
         "            finished = ()\n"
         "        if not self._off:\n            try:\n                self._thread.check()\n"),
        (STAGE_OUTPUTS,
         "        after every step queued so far (their last rows); `begin_step` will skip them."
         "\"\"\"\n        requests = list(finished)\n",
         "        after every step queued so far (their last rows); `begin_step` will skip them."
         "\"\"\"\n        if self._by_finish:  # variant: finish_reads\n"
         "            self._finish_reads(list(finished))\n"
         "            return\n"
         "        requests = list(finished)\n"),
        (STAGE_OUTPUTS,
         "    def save_step(",
         "    def _finish_reads(self, requests):  # variant: finish_reads\n"
         "        jobs = []\n"
         "        for request in requests:\n"
         "            if request.req_id not in self._announced:\n"
         "                continue\n"
         "            self._announced.discard(request.req_id)\n"
         "            n = self._ends.pop(request.req_id, 0)\n"
         "            if request.rows_standing is not None:\n"
         "                n = min(n, request.rows_standing)\n"
         "            jobs.append((request, n, self.cache.variant_plan_request_read(\n"
         "                request.req_id, n)))\n"
         "        def publish():\n"
         "            for request, n, reads in jobs:\n"
         "                self.delivery._sink.put(\n"
         "                    request.external_id, self.cache.variant_resolve(reads), start=0,\n"
         "                    final=True, aborted=request.prompt_len is None\n"
         "                    or n < request.prompt_len,\n"
         "                    meta={'prompt_len': request.prompt_len, 'num_rows': n})\n"
         "        if jobs:\n"
         "            self._submit('publishing', [j[0].req_id for j in jobs], publish)\n\n"
         "    def save_step("),
        (STAGE_OUTPUTS,
         "            if step is not None:\n                self._submit(",
         "            if step is not None and self._by_finish:  # variant: finish_reads\n"
         "                b = step.batch\n"
         "                self._ends.update(zip(b.req_ids, (s + e - f for s, f, e in zip(\n"
         "                    b.starts, [0, *b.ends[:-1]], b.ends))))\n"
         "                new = [r for r in b.req_ids if r not in self._announced]\n"
         "                self.cache.discard_step(step.step_id)\n"
         "                if new:\n"
         "                    self._announced.update(new)\n"
         "                    self._submit('announcing', new, lambda: [\n"
         "                        self.delivery._sink.expect(self.delivery._external_id(r))\n"
         "                        for r in new])\n"
         "            elif step is not None:\n                self._submit("),
    ),
    "inline_late": _NO_ENTRIES + (
        (STAGE_OUTPUTS,
         "            if step is not None:\n                self._submit(",
         "            if step is not None and step.step_id is not None:  # variant: a step late\n"
         "                late, self._late_step = getattr(self, '_late_step', None), step.step_id\n"
         "                if late is not None:\n"
         "                    self.cache.discard_step(late)\n"
         "            elif step is not None:\n                self._submit("),),
    "noop_job": _NO_ENTRIES + (
        (STAGE_OUTPUTS,
         "            if step is not None:\n                self._submit(",
         "            if step is not None and step.step_id is not None:  # variant: noop_job\n"
         "                self.cache.discard_step(step.step_id)\n"
         "                self._submit('nothing', (), lambda: None)\n"
         "            elif step is not None:\n                self._submit("),),
    "batch4": (  # delivers: no _NO_ENTRIES
        ("prefix_cache/config.py", "    staging_depth: int = 4",
         "    staging_depth: int = 8  # variant: room for four held steps"),
        (STAGE_OUTPUTS,
         "        self._faulted_steps = 0  # steps in a row whose rows faulted (output thread)\n",
         "        self._faulted_steps = 0  # steps in a row whose rows faulted (output thread)\n"
         "        self._held_steps: list[_SavedStep] = []  # variant: batch4\n"),
        (STAGE_OUTPUTS,
         "        if finished:\n            requests = list(finished)\n            self._submit(",
         "        if finished:\n            self._flush_steps()\n"
         "            requests = list(finished)\n            self._submit("),
        (STAGE_OUTPUTS,
         "        requests = list(finished)\n        self._submit(f\"publishing {len(requests)} "
         "requests the scheduler retired\",",
         "        self._flush_steps()\n        requests = list(finished)\n        self._submit("
         "f\"publishing {len(requests)} requests the scheduler retired\","),
        (STAGE_OUTPUTS,
         "            if step is not None:\n                self._submit(f\"delivering the rows "
         "of a {step.batch.num_rows}-row step\",\n                             step.batch.req_ids,"
         " lambda: self._deliver_unless_stopped(step),\n                             "
         "step_rows=True)\n",
         "            if step is not None:\n                self._held_steps.append(step)\n"
         "                if step.batch.num_rows == len(step.batch.req_ids) and \\\n"
         "                        len(self._held_steps) < 4:\n                    return\n"
         "                self._flush_steps()\n"),
        (STAGE_OUTPUTS,
         "    def _engine_fault(self, what: str, exc: Exception) -> None:",
         "    def _flush_steps(self) -> None:\n"
         "        steps, self._held_steps = self._held_steps, []\n"
         "        if steps:\n"
         "            self._submit(f\"delivering the rows of {len(steps)} steps\",\n"
         "                         [r for s in steps for r in s.batch.req_ids],\n"
         "                         lambda: [self._deliver_unless_stopped(s) for s in steps],\n"
         "                         step_rows=True)\n\n"
         "    def _engine_fault(self, what: str, exc: Exception) -> None:"),
        (STAGE_OUTPUTS,
         "        self._closed = True\n        try:\n            self._thread.close()",
         "        self._closed = True\n        try:\n            self._flush_steps()\n"
         "            self._thread.close()"),
    ),
    "nodev": _NO_ENTRIES + _DISCARD + (
        ("prefix_cache/devices/cuda/__init__.py",
         '        if slots.device.type == "cpu":\n            host_slots = slots.numpy()\n',
         "        return Transfer()  # variant: no device work\n"
         '        if slots.device.type == "cpu":\n            host_slots = slots.numpy()\n'),),
    "off": _NO_ENTRIES + (
        ("prefix_cache/integration/runner_mixin.py",
         "        stage = self._omni_stage\n        if stage is None or self._omni_paused",
         "        stage = None  # variant: no step reaches the stage\n"
         "        if stage is None or self._omni_paused"),),
}


#: What a variant's copy takes of this tree: the package and what builds it. From the working
#: tree, not from git: the device machine's copy carries a stale git HEAD.
TREE_FILES = ("prefix_cache", "setup.py", "pyproject.toml", "README.md")


def make_tree(name: str, into: Path) -> Path:
    """This tree's package under `into/name`, the variant's changes made (each must match
    once), its C extensions built in place."""
    tree = into / name
    tree.mkdir(parents=True)
    for entry in TREE_FILES:
        source = ROOT / entry
        if source.is_dir():
            shutil.copytree(source, tree / entry,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy2(source, tree / entry)
    for path, old, new in VARIANTS[name]:
        text = (tree / path).read_text()
        if text.count(old) != 1:
            raise SystemExit(f"variant {name}: {path} has {text.count(old)} matches of "
                             f"{old.splitlines()[0]!r}, not 1: update this script")
        (tree / path).write_text(text.replace(old, new))
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, check=True,
                   capture_output=True)
    return tree


def variant_row(name: str, data: dict) -> list[str]:
    """A variant's table row. The decode steps' mean is the figure to compare: a variant that
    moves work onto some steps only (`batch4`) lowers their median and not their cost."""
    steps = data["step_time"]
    plain, cache = ([t * 1e3 for t in decode_steps(steps[f"step_s_{engine}"]["runs"])]
                    for engine in ("plain", "cache"))
    return [name, f"{data['metrics']['M5e']['value']:.3f}", f"{statistics.mean(plain):.2f}",
            f"{statistics.mean(cache):.2f}",
            f"{statistics.mean(cache) - statistics.mean(plain):+.3f}",
            f"{statistics.median(cache) - statistics.median(plain):+.3f}",
            f"{steps['total_ratio']:.3f}",
            f"{steps['engine_thread_library_s_per_step_spread']['median'] * 1e6:.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="full,discard,inline,off")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default="small")
    parser.add_argument("--eager", action="store_true", help="without CUDA graphs")
    parser.add_argument("--timeout", type=int, default=150, help="seconds a variant")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the variants in turn this many times (a row each)")
    parser.add_argument("--out", type=Path, default=None, help="keep each variant's JSON here")
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="m5e-variants-") as tmp:
        out = (args.out or Path(tmp)).resolve()  # the runs start in their trees
        out.mkdir(parents=True, exist_ok=True)
        trees = {name: make_tree(name, Path(tmp)) for name in names}
        for round_ in range(1, args.rounds + 1):  # variants in turn: the machine drifts
            for name, tree in trees.items():
                label = name if args.rounds == 1 else f"{name} ({round_})"
                result = out / (f"m5e-{name}.json" if args.rounds == 1
                                else f"m5e-{name}-{round_}.json")
                failed = run_variant(tree, result, args)
                if failed:
                    print(f"{label}: {failed}", flush=True)
                    rows.append([label, "failed", "", "", "", "", "", ""])
                    continue
                rows.append(variant_row(label, json.loads(result.read_text())))
                print(f"{label}: M5e {rows[-1][1]}", flush=True)
    print(format_table(["variant", "M5e", "plain decode ms, mean", "cache decode ms, mean",
                        "cache - plain, mean", "cache - plain, median", "total cache / plain",
                        "cache calls µs, median step"], rows))


def run_variant(tree: Path, result: Path, args: argparse.Namespace) -> str | None:
    """M5e for the variant in `tree` into `result`; why it failed, or None."""
    command = [sys.executable, "-m", "prefix_cache.tools.pipeline_bench", "--only", "M5e",
               "--model", args.model, "--runs", str(args.runs), "--json", str(result)]
    if not args.eager:
        command.append("--cudagraphs")
    try:
        run = subprocess.run(command, cwd=tree, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(tree)}, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return f"over {args.timeout} s"
    if run.returncode == 0 and result.exists():
        return None
    return f"failed ({run.returncode}): {(run.stdout + run.stderr).strip()[-200:]}"

if __name__ == "__main__":
    main()
