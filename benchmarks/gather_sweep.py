"""Sweep a hit read's host gather (M3) over thread counts, against the memcpy that bounds it.

    PYTHONPATH=. python3 benchmarks/gather_sweep.py [--pinned]

Random 16-row blocks of a pool of bf16 rows 2048 wide (4 KiB), as M3 reads them, into a
resident output; each repetition reads rows the last three did not. Printed in GB/s, the
median of 20 repetitions: `_core.gather_rows` split across 1 to 16 threads, torch's
`index_select` (its own thread pool), and a contiguous memcpy of as many bytes (the limit).
`--pinned` puts the pool in page-locked memory, as the cache does on a GPU machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from prefix_cache.core import _core
from prefix_cache.devices.base import byte_rows
from prefix_cache.tools.demo import format_table

WIDTH, BLOCK, INPUT_SETS, REPEAT = 2048, 16, 4, 20
THREADS = (1, 2, 4, 8, 16)


def gb_per_s(nbytes: int, fn: Callable[[int], None]) -> float:
    fn(0)
    times = []
    for i in range(REPEAT):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def sweep(tokens: int, pinned: bool) -> list[str]:
    blocks_per_set = tokens // BLOCK
    num_blocks = INPUT_SETS * blocks_per_set + 1
    pool = torch.empty((num_blocks * BLOCK, WIDTH), dtype=torch.bfloat16, pin_memory=pinned)
    pool.normal_()
    blocks = np.random.default_rng(1).permutation(np.arange(1, num_blocks))
    slot_sets = [(b[:, None] * BLOCK + np.arange(BLOCK)).ravel().astype(np.int64)
                 for b in blocks.reshape(INPUT_SETS, blocks_per_set)]
    index_sets = [torch.from_numpy(s) for s in slot_sets]
    windows = [pool[BLOCK + i * tokens: BLOCK + (i + 1) * tokens] for i in range(INPUT_SETS)]
    out = torch.empty((tokens, WIDTH), dtype=torch.bfloat16)
    out.zero_()  # resident
    src, dst = byte_rows(pool), byte_rows(out)
    nbytes = out.numel() * out.element_size()

    def gather(threads: int) -> Callable[[int], None]:
        return lambda i: _core.gather_rows(src, slot_sets[i % INPUT_SETS], dst, threads)

    runs = [lambda i: out.copy_(windows[i % INPUT_SETS]), *map(gather, THREADS),
            lambda i: torch.index_select(pool, 0, index_sets[i % INPUT_SETS], out=out)]
    return [str(tokens), *(f"{gb_per_s(nbytes, run):.1f}" for run in runs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pinned", action="store_true")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} "
          f"threads; pool {'pinned' if args.pinned else 'pageable'}; GB/s")
    rows = [sweep(tokens, args.pinned) for tokens in (2048, 8192)]
    print(format_table(["tokens", "memcpy", *(f"gather x{t}" for t in THREADS),
                        "index_select"], rows))


if __name__ == "__main__":
    main()
