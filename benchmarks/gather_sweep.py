"""Sweep a hit read's host gather (M3) over torch's thread count, against the memcpy that bounds
it at the same count.

    PYTHONPATH=. python3 benchmarks/gather_sweep.py [--pinned]

Random 16-row blocks of a pool of bf16 rows 2048 wide (4 KiB), as M3 reads them, into a
resident output, by the pool's own gather (`PrefixBlockPool.gather`); each repetition reads
rows the last three did not. Printed in GB/s, the median of 20 repetitions, beside a
contiguous memcpy of as many bytes (torch's `copy_`, the limit). Both split across torch's
threads, which an engine may have set lower (vLLM's multiprocess executor runs GPU workers
with one). `--pinned` puts the pool in page-locked memory, as the cache does on a GPU machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from prefix_cache import devices
from prefix_cache.core.block_pool import PrefixBlockPool
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


def sweep(tokens: int, pinned: bool) -> list[list[str]]:
    blocks_per_set = tokens // BLOCK
    num_blocks = INPUT_SETS * blocks_per_set + 1
    backend = devices.get_backend("cuda" if pinned else "cpu")
    pool = PrefixBlockPool(num_blocks, BLOCK, backend)
    pool.install(pool.allocate("hidden", (WIDTH,), torch.bfloat16))
    flat = pool.keys["hidden"].flat
    flat.normal_()
    blocks = np.random.default_rng(1).permutation(np.arange(1, num_blocks))
    slot_sets = [(b[:, None] * BLOCK + np.arange(BLOCK)).ravel()
                 for b in blocks.reshape(INPUT_SETS, blocks_per_set)]
    windows = [flat[BLOCK + i * tokens: BLOCK + (i + 1) * tokens] for i in range(INPUT_SETS)]
    out = torch.zeros((tokens, WIDTH), dtype=torch.bfloat16)  # resident
    nbytes = out.numel() * out.element_size()
    rows = []
    for threads in THREADS:
        torch.set_num_threads(threads)
        memcpy = gb_per_s(nbytes, lambda i: out.copy_(windows[i % INPUT_SETS]))
        gather = gb_per_s(nbytes, lambda i: pool.gather("hidden", slot_sets[i % INPUT_SETS], out))
        rows.append([str(tokens), str(threads), f"{memcpy:.1f}", f"{gather:.1f}",
                     f"{gather / memcpy:.2f}"])
    pool.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pinned", action="store_true")
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__} ({default_threads} threads by "
          f"default); pool {'pinned' if args.pinned else 'pageable'}; GB/s")
    rows = [row for tokens in (2048, 8192) for row in sweep(tokens, args.pinned)]
    torch.set_num_threads(default_threads)
    print(format_table(["tokens", "torch threads", "memcpy", "pool gather", "gather ÷ memcpy"],
                       rows))


if __name__ == "__main__":
    main()
