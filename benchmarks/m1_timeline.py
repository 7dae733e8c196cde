"""Where M1's time goes on a GPU: its loop of saves (SAVES_IN_FLIGHT back to back, then landed)
under the torch profiler, read back as a timeline of the device's copies.

    PYTHONPATH=. python3 benchmarks/m1_timeline.py [--tokens 2048] [--iterations 20]

For each way of saving (the backend's save, by copy engine where it takes one; the scatter
kernel; one contiguous D2H as M1's reference) it prints, per loop iteration (medians):
the wall time of the iteration; from its start to the device's first copy (or kernel) start;
the copies' span from the first start to the last end; the busy time inside that span (the
gaps between copies are the rest); and from the last copy's end to the iteration's end (the
host seeing the copies done). M1 is the reference's wall time over the save's.

The profiler slows the host's calls, so the walls are longer than M1's unprofiled loop; the
device's span and gaps are what to read. On an H100 (2026-12-06, `benchmarks/gpu_2026-12-06b/`
at c6ed058) the kernel's row found no device events in the trace (not understood; the bench
times that path without the profiler). Since that run its loop is the bench's own
(`pipelined`), where it had a copy of it; not run on a GPU since.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from prefix_cache import devices
from prefix_cache.devices.base import Transfer
from prefix_cache.tools.profiling.device_trace import merged_spans
from prefix_cache.tools.reporting.harness import format_table
from prefix_cache.tools.metrics.save import SAVES_IN_FLIGHT, pipelined, saves_by_dma, without_dma
from prefix_cache.tools.metrics.workload import BLOCK, WIDTH, bench_dtype, random_slots


def _timeline(trace_path: str, label: str) -> list[dict[str, float]]:
    """Per iteration annotated `label`: its µs figures, from the trace's device events."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events  # the host's, not the GPU's
                   if e.get("ph") == "X" and e.get("name") == label
                   and e.get("cat") == "user_annotation")
    device = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("ph") == "X" and e.get("cat") in ("gpu_memcpy", "kernel"))
    rows = []
    for start, end in spans:
        inside = [(s, e) for s, e in device if start <= s <= end]
        if not inside:
            continue
        first, last = inside[0][0], max(e for _, e in inside)
        busy = sum(e - s for s, e in merged_spans(inside))
        rows.append({"wall": end - start, "to_first": first - start, "span": last - first,
                     "busy": busy, "after_last": end - last, "copies": len(inside)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    backend = devices.get_backend("cuda")
    dtype = bench_dtype(backend)
    num_blocks = 4 * args.tokens // BLOCK
    pool = backend.alloc_host((num_blocks * BLOCK, WIDTH), dtype)
    rows = torch.randn(args.tokens, WIDTH, device=backend.device).to(dtype)
    slots = random_slots(num_blocks, args.tokens, np.random.default_rng(0))
    stagings = [backend.alloc_host((args.tokens, WIDTH), dtype) for _ in range(SAVES_IN_FLIGHT)]
    turn = itertools.count()

    def save() -> Transfer:
        return backend.scatter_rows(rows, slots, pool, ready=backend.record_event(),
                                    staging=stagings[next(turn) % SAVES_IN_FLIGHT].tensor)

    def contiguous() -> None:
        stagings[next(turn) % SAVES_IN_FLIGHT].tensor.copy_(rows, non_blocking=True)

    ways = {"save": pipelined(backend, save),
            "kernel": lambda: without_dma(backend, pipelined(backend, save)),
            "contiguous D2H": pipelined(backend, contiguous)}
    for run in ways.values():  # warm-up: compiled kernels, the issuer's first jobs
        for _ in range(3):
            run()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace, \
            profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iterations):
            for label, run in ways.items():
                with record_function(label):
                    run()
    prof.export_chrome_trace(trace.name)
    table = []
    walls = {}
    for label in ways:
        found = _timeline(trace.name, label)
        if not found:
            table.append([label, "no device events", "", "", "", "", ""])
            continue
        med = {k: statistics.median(r[k] for r in found) for k in found[0]}
        walls[label] = med["wall"]
        table.append([label, f"{med['wall']:.0f}", f"{med['to_first']:.0f}",
                      f"{med['span']:.0f}", f"{med['busy']:.0f}", f"{med['after_last']:.0f}",
                      f"{med['copies']:.0f}"])
    nbytes = rows.numel() * rows.element_size()
    print(f"{torch.cuda.get_device_name(backend.device)}: {SAVES_IN_FLIGHT} saves of "
          f"{args.tokens} rows x {WIDTH} {dtype} ({nbytes >> 20} MiB each), {args.iterations} "
          f"iterations profiled; the save by copy engine: {saves_by_dma(backend, nbytes)}")
    print(format_table(["way", "wall µs", "to first copy", "copies' span", "busy",
                        "after last", "device events"], table))
    if "save" in walls and "contiguous D2H" in walls:
        print(f"M1 from the profiled walls: {walls['contiguous D2H'] / walls['save']:.3f} "
              f"(kernel {walls['contiguous D2H'] / walls.get('kernel', float('nan')):.3f})")
    pool.close()
    for buffer in stagings:
        buffer.close()


if __name__ == "__main__":
    main()
