"""Use the cache in your own pipeline: drive OmniPrefixCacheManager by hand, without vLLM.

A toy scheduler shares full KV blocks between prompts with the same prefix, the way vLLM's
prefix caching does, and serves the view protocol. Its "model" makes row p from tokens[: p + 1],
as a causal model's hidden states depend on the prefix only. The second prompt hits the first
one's blocks, computes only its own tokens, and still gets a row for every prompt position.

Run it from anywhere once the package is installed: python examples/drive_manager.py
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from types import SimpleNamespace

import torch

from prefix_cache import OmniPrefixCacheManager, PrefixCacheConfig

BLOCK_SIZE = 4
HIDDEN_SIZE = 8


def toy_forward(tokens: Sequence[int]) -> torch.Tensor:
    """`[len(tokens), HIDDEN_SIZE]` rows; row p depends on tokens[: p + 1] only."""
    prefix_sums = torch.tensor(tokens, dtype=torch.float32).cumsum(0)
    return torch.sin(prefix_sums[:, None] * torch.arange(1, HIDDEN_SIZE + 1) / 100)


class ToyScheduler:
    """Prefills one prompt per step; a full block whose whole prefix was seen before is reused."""

    def __init__(self, num_blocks: int) -> None:
        self.free_blocks = list(range(1, num_blocks))  # block 0 stays unused, as in vLLM
        self.block_of_prefix: dict[tuple[int, ...], int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.scheduled: dict[str, int] = {}

    def schedule(self, req_id: str, prompt: list[int]) -> SimpleNamespace:
        """A scheduler output with vLLM's field names for one new request."""
        blocks: list[int] = []
        # like vLLM, at least the last prompt token is computed, so it ends any hit
        while (len(blocks) + 1) * BLOCK_SIZE < len(prompt):
            block = self.block_of_prefix.get(tuple(prompt[: (len(blocks) + 1) * BLOCK_SIZE]))
            if block is None:
                break
            blocks.append(block)
        hit_tokens = len(blocks) * BLOCK_SIZE
        while len(blocks) * BLOCK_SIZE < len(prompt):
            blocks.append(self.free_blocks.pop(0))
        for i in range(len(prompt) // BLOCK_SIZE):  # full blocks become shareable
            self.block_of_prefix.setdefault(tuple(prompt[: (i + 1) * BLOCK_SIZE]), blocks[i])
        self.blocks[req_id], self.computed[req_id] = blocks, hit_tokens
        self.scheduled = {req_id: len(prompt) - hit_tokens}
        new_request = SimpleNamespace(req_id=req_id, num_computed_tokens=hit_tokens,
                                      block_ids=(blocks,))
        return SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=[new_request],
                               scheduled_cached_reqs=None,
                               num_scheduled_tokens=dict(self.scheduled))

    # the view protocol: the row order of the step's outputs, and the slot of every row
    def batch_req_ids(self) -> list[str]:
        return list(self.scheduled)

    def step_slots_cpu(self, req_ids: Sequence[str],
                       num_scheduled_tokens: Mapping[str, int]) -> torch.Tensor:
        slots = []
        for req_id in req_ids:
            start = self.computed[req_id]
            for pos in range(start, start + num_scheduled_tokens[req_id]):
                block = self.blocks[req_id][pos // BLOCK_SIZE]
                slots.append(block * BLOCK_SIZE + pos % BLOCK_SIZE)
        return torch.tensor(slots, dtype=torch.int64)


def main() -> int:
    shared = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks
    prompts = {"a": shared + [21, 22, 23, 24], "b": shared + [31, 32, 33]}
    scheduler = ToyScheduler(num_blocks=16)
    config = PrefixCacheConfig(num_blocks=16, block_size=BLOCK_SIZE)
    with OmniPrefixCacheManager(config, scheduler) as cache:
        for req_id, prompt in prompts.items():
            cache.new_step_starts(scheduler.schedule(req_id, prompt))  # before the forward
            start = scheduler.computed[req_id]
            rows = toy_forward(prompt)[start:].to(cache.backend.device)  # only the new tokens
            step = cache.save_outputs(rows, None, num_tokens_unpadded=rows.shape[0],
                                      num_tokens_padded=rows.shape[0])
            delivered = cache.materialize(step, [req_id]).hidden_states[req_id]
            same = torch.equal(delivered, toy_forward(prompt))
            print(f"request {req_id}: {len(prompt)} prompt tokens, {start} from the prefix cache, "
                  f"{rows.shape[0]} computed, {delivered.shape[0]} rows delivered; "
                  f"equal to a run without the cache: {same}")
            if not same:
                return 1
        print(f"cache stats: {cache.stats()['hit_tokens']} hit tokens, "
              f"{cache.stats()['miss_tokens']} computed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
