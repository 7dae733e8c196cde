"""M3, hit materialization: hit rows gathered per second ÷ a host memcpy of the same bytes into
an already-resident destination.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from prefix_cache.devices import get_backend
from prefix_cache.config import HIDDEN_KEY, PrefixCacheConfig
from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.output_buffers import OutputBuffers
from prefix_cache.core.reads import RowRead
from prefix_cache.tools.reporting.harness import timeit, timeit_interleaved
from prefix_cache.tools.metrics.workload import BLOCK, WIDTH


#: Input sets the reads rotate through: 8 x 32 MiB at M3's 8192 tokens of bfloat16.
HIT_INPUT_SETS = 8


#: Hit sizes of M3: judged at the first, the second reported beside it.
HIT_TOKENS = (8192, 2048)


def measure_hit(hit_tokens: int, dtype: torch.dtype, repeat: int) -> dict[str, float]:
    """GB/s of hit reads and of memcpys of the same bytes, interleaved. The two pool reads (hit,
    fresh) take turns through one rotation of HIT_INPUT_SETS block sets, the two memcpys
    through one of row windows, so no read meets rows the HIT_INPUT_SETS - 1 reads of its
    family before it read (inputs that stay in the host's caches would time the caches, not
    the memory a hit reads):
    - `hit`: random blocks of the pool into a new tensor the caller owns, whose memory the
      cache recycles once the caller drops it, as a pipeline does;
    - `fresh`: the same into fresh memory (no recycling, `output_cache_bytes=0`);
    - `memcpy`: contiguous rows of the pool into one tensor reused (resident): the limit;
    - `memcpy_new`: the same into a new tensor (paying its page faults);
    - `memcpy_hot`: the same rows again and again into the reused tensor (cache-hot), timed
      alone after the others."""
    blocks_per_set = -(-hit_tokens // BLOCK)
    num_blocks = HIT_INPUT_SETS * blocks_per_set + 1
    pool = PrefixBlockPool(num_blocks, BLOCK, get_backend("cpu"))
    pool.install(pool.allocate(HIDDEN_KEY, (WIDTH,), dtype))
    flat = pool.keys[HIDDEN_KEY].flat
    flat.normal_()
    # disjoint sets of random blocks (block 0 is vLLM's null block), and disjoint row windows
    blocks = np.random.default_rng(1).permutation(np.arange(1, num_blocks))
    slot_sets = [(b[:, None] * BLOCK + np.arange(BLOCK)).ravel()[:hit_tokens]
                 for b in blocks.reshape(HIT_INPUT_SETS, blocks_per_set)]
    windows = [flat[BLOCK + i * hit_tokens: BLOCK + (i + 1) * hit_tokens]
               for i in range(HIT_INPUT_SETS)]
    nbytes = hit_tokens * WIDTH * flat.element_size()
    recycled = OutputBuffers(PrefixCacheConfig.output_cache_bytes)  # the default
    fresh = OutputBuffers(0)  # keeps nothing: every output is new memory
    reused = torch.empty((hit_tokens, WIDTH), dtype=dtype)
    read_turns, copy_turns = itertools.count(), itertools.count()

    def read(outputs: OutputBuffers) -> None:
        slots = slot_sets[next(read_turns) % HIT_INPUT_SETS]
        RowRead("bench", HIDDEN_KEY, slots, np.ones(len(slots), bool), [], hit_tokens + 1,
                WIDTH, dtype).resolve(pool, outputs, 10, lambda r: None)

    def memcpy(out: torch.Tensor | None = None) -> None:
        out = torch.empty((hit_tokens, WIDTH), dtype=dtype) if out is None else out
        out.copy_(windows[next(copy_turns) % HIT_INPUT_SETS])

    runs = {"hit": lambda: read(recycled), "fresh": lambda: read(fresh),
            "memcpy": lambda: memcpy(reused), "memcpy_new": memcpy}
    result = {name: nbytes / seconds / 1e9
              for name, seconds in timeit_interleaved(runs, repeat).items()}
    # the same rows again and again, timed alone: nothing else may evict them between calls
    result["memcpy_hot"] = nbytes / timeit(lambda: reused.copy_(windows[0]), repeat) / 1e9
    pool.close()
    recycled.clear()
    return result
