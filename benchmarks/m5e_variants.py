"""M5e for copies of this tree with one part of the cache's step work taken out, to find which
part the engine step pays for.

    python3 benchmarks/m5e_variants.py [--variants full,nodev,off] [--runs 3]
        [--model small|tiny] [--eager] [--rounds R] [--out DIR]

Each variant is a copy of this tree's package with its C extensions built and one change, run
by `pipeline_bench --only M5e` beside vLLM's plain worker:

- `full`: the tree as it is;
- `nodev`: the CUDA backend's save issues no device work (a Transfer complete at launch): the
  save's bookkeeping without its kernel, event and slot page (the rows read back at a finish
  are then whatever the pool held: a measurement, not a delivery);
- `off`: no step reaches the stage (`_omni_stepping` is None): the cache's worker class alone.

The variants that took the per-step hand-over to the output thread apart (`discard`,
`inline`, `inline_full`, `inline_late`, `noop_job`, `batch4`, `ops20`, `py20`, and
`finish_reads`, the sketch of what 7d6ec91 built) patched that hand-over, which the stage of
a non-streaming cache engine no longer makes: they run from 45145e1's tree, where their
results in docs/benchmarks-history.md were measured.

On CPU, `--model tiny --eager` gives steps bound by the engine's Python, as a GPU decode step
under CUDA graphs is, and a variant's run takes about 20 s.

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

from prefix_cache.tools.reporting.harness import format_table
from prefix_cache.tools.pipeline_bench import decode_steps

ROOT = Path(__file__).resolve().parent.parent
PIPELINE_BENCH = "prefix_cache/tools/pipeline_bench.py"
#: (file, text, replacement) of a run without delivery: no channel entry is waited for.
_NO_ENTRIES = (
    (PIPELINE_BENCH, 'warm_up(engines["cache"], channel, requests=requests)',
     '_timed_steps(engines["cache"], requests)'),
    (PIPELINE_BENCH, "for request in requests if channel is not None else ():",
     "for request in ():"),
    (PIPELINE_BENCH, 'library = _library_s(stats) / stats["calls.save_outputs"]',
     'library = _library_s(stats) / stats.get("calls.save_outputs", 1)'),
)
VARIANTS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "full": (),
    "nodev": (  # delivers: no _NO_ENTRIES
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
    parser.add_argument("--variants", default="full,off")
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
