"""The durable host mirror: one `(num_blocks, block_size, *feat)` tensor per key, by vLLM slot.

Slot reuse is the eviction: when vLLM hands a block to a new tenant, the
tenant's first write claims its slots and every older row there stops counting.
The bookkeeping is kept a block at a time where a write covers whole blocks, so a
step costs the host O(runs + blocks), whatever its token count.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from prefix_cache.core import _core
from prefix_cache.devices.base import DeviceBackend, HostBuffer, byte_rows
from prefix_cache.errors import OmniPrefixCacheUnmatchError

#: Threads a large gather is split across (2 MiB of rows each at least, the caller's thread
#: among them). Threads of its own, not torch's: vLLM sets torch's to 1 in serving workers
#: (0.32's GPU worker, any multiprocess executor's), where `index_select` moves 8-13 GB/s on
#: the H200 host. There 8 of these moved 28-31 GB/s at 2048 and 8192 tokens (split at 512
#: KiB), 16 start too slowly for 2048 (19 GB/s; benchmarks/gather_sweep.py); the 2-core
#: machine moves 4.1-5.4 GB/s with one, 7.1-9.5 with two.
GATHER_THREADS = min(8, os.cpu_count() or 1)


class Tiers:
    """An int64 per slot in two tiers: an entry per block, written by fills that cover the
    whole block (`prefix_cache.core._core.fill_tiers`), and one per slot, written by the others.

    Which entry a slot reads is its owner's rule. Claims and versions are claims, which
    only grow, so of the two the entry written later is the one of larger magnitude; a
    producer is read from the tier its version was (`_core.row_states`).
    """

    __slots__ = ("blocks", "slots")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.blocks = np.zeros(num_blocks, dtype=np.int64)
        self.slots = np.zeros(num_blocks * block_size, dtype=np.int64)


@dataclass
class PoolKey:
    """One cached output: its host storage and, per slot, the claim and task its rows are of."""

    name: str
    storage: HostBuffer
    feat_shape: tuple[int, ...]
    dtype: torch.dtype  # the storage's, kept as values: the engine thread reads them each step
    row_width: int      # and a torch attribute read costs it microseconds after a forward
    version: Tiers   # slot claim the rows were written under (0: none; negated: lost)
    producer: Tiers  # write task that lands those rows, beside each version entry
    #: the four tables a write of the key fills, in `_core.claim_write`'s order
    write_tables: tuple[np.ndarray, ...] = field(init=False, repr=False)
    #: bytes of one row (every save counts them)
    row_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.write_tables = (self.version.slots, self.version.blocks, self.producer.slots,
                             self.producer.blocks)
        self.row_bytes = self.row_width * self.dtype.itemsize

    @property
    def flat(self) -> torch.Tensor:
        """The storage as `[num_slots, F]`."""
        return self.storage.tensor


class PrefixBlockPool:
    """Host rows of every cached key, with a claim per slot and a version per (slot, key).

    Invariant: the rows of key k at slot s belong to the slot's current tenant
    iff `keys[k]`'s version at s equals the claim at s, and is not 0; they were
    lost to a failed write iff it equals minus that claim; anything else reads
    as absent. Claims only grow, so a version never matches a later tenant's
    claim, and of a slot's two tiered entries (`Tiers`) the later is the larger:
    a step's bookkeeping costs an entry per whole block it writes. The tables
    change only through the methods below, under the caller's lock.
    """

    def __init__(self, num_blocks: int, block_size: int, backend: DeviceBackend, *,
                 budget_bytes: int | None = None, step_path: str = "c") -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self._backend = backend
        #: what every key's storage may take together (None: unbounded), checked before each
        #: key's storage is allocated
        self.budget_bytes = budget_bytes
        #: `claim_write` in one C call ("c") or as `claim` then `record_write` ("python")
        self._c_claims = step_path == "c"
        self._next_claim = 1  # what `claim` returns next
        #: per block, the first claim its latest allocation by vLLM can carry (`mark_allocated`;
        #: 0: never seen allocated)
        self._allocated_at = np.zeros(num_blocks, dtype=np.int64)
        self._claim = Tiers(num_blocks, block_size)
        #: per block, its newest slot-tier claim since its block-tier claim (0: none)
        self._newest_slot_claim = np.zeros(num_blocks, dtype=np.int64)
        #: unresolved reads per slot, and their sum per block; a claim must first resolve the
        #: reads pinning its slots
        self._read_pins = np.zeros(self.num_slots, dtype=np.int32)
        self._block_pins = np.zeros(num_blocks, dtype=np.int32)
        self.keys: dict[str, PoolKey] = {}

    # ------------------------------------------------------------------ tenancy

    def claim(self, runs: np.ndarray) -> int:
        """A new tenant takes the slots of `runs` (prefix_cache.core.runs): every older row there
        stops counting. Returns its claim."""
        claim, self._next_claim = self._next_claim, self._next_claim + 1
        _core.fill_tiers(runs, self.block_size, self._newest_slot_claim, self._claim.slots,
                         self._claim.blocks, claim)
        return claim

    def record_write(self, keys: Iterable[str], runs: np.ndarray, claim: int,
                     producer: int) -> None:
        """`producer` will land the rows of `keys` at the slots of `runs`, written under
        `claim`."""
        for name in keys:
            key = self.keys[name]
            _core.fill_tiers(runs, self.block_size, None, key.version.slots, key.version.blocks,
                             claim, key.producer.slots, key.producer.blocks, producer)

    def claim_write(self, runs: np.ndarray, keys: Iterable[str], producer: int) -> int:
        """`claim(runs)`, then `record_write(keys, runs, claim, producer)` (no keys: the claim
        alone): a step's whole bookkeeping in the pool, in one C call on the C step path."""
        if not self._c_claims:
            claim = self.claim(runs)
            self.record_write(keys, runs, claim, producer)
            return claim
        claim, self._next_claim = self._next_claim, self._next_claim + 1
        _core.claim_write(runs, self.block_size, self._newest_slot_claim, self._claim.slots,
                          self._claim.blocks, claim,
                          [self.keys[name].write_tables for name in keys], producer)
        return claim

    def mark_allocated(self, blocks: np.ndarray) -> None:
        """vLLM gave `blocks` to new tenants, whose rows no claim made so far holds."""
        self._allocated_at[blocks] = self._next_claim

    def written_since_allocated(self, slots: np.ndarray) -> np.ndarray:
        """Mask of `slots` claimed by a write since their block's latest allocation
        (`mark_allocated`): rows of its current tenant, not of one before. A block filled in
        the step under way (a hit on it is a prefix vLLM only just cached) has none."""
        claims = self.claims_at(slots)
        return (claims >= self._allocated_at[slots // self.block_size]) & (claims != 0)

    def claims_at(self, slots: np.ndarray) -> np.ndarray:
        """The claim each of `slots` carries (0: never claimed)."""
        return self._claims_of(slots, slots // self.block_size)

    def _claims_of(self, slots: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """`claims_at(slots)`, given the slots' block indices (computed once per read)."""
        return np.maximum(self._claim.blocks[blocks], self._claim.slots[slots])

    def still_claimed(self, slots: np.ndarray, claims: np.ndarray) -> np.ndarray:
        """Mask of `slots` whose tenant is still the one that held `claims`."""
        return self.claims_at(slots) == claims

    def producer_ids(self, slots: np.ndarray, keys: Iterable[str]) -> set[int]:
        """Write tasks that produce the present rows of `keys` at `slots`."""
        return set().union(*(self.present_and_producers(name, slots)[1] for name in keys))

    # ------------------------------------------------------------------ read pins

    def pin(self, slots: np.ndarray) -> None:
        """Reads of `slots` (int64) are unresolved: one per listing of a slot."""
        _core.add_pins(slots, self.block_size, self._read_pins, self._block_pins, 1)

    def unpin(self, slots: np.ndarray) -> None:
        _core.add_pins(slots, self.block_size, self._read_pins, self._block_pins, -1)

    def any_pinned(self, slots: np.ndarray) -> bool:
        return bool(self._read_pins[slots].any())

    def any_held(self, runs: np.ndarray, held_from: int, *, pins: bool = True) -> bool:
        """Whether some slot of `runs` carries a claim >= `held_from` or (`pins`: some read
        may pin slots) is pinned."""
        return _core.any_held(runs, self.block_size, held_from, self._claim.slots,
                              self._claim.blocks, self._newest_slot_claim,
                              self._read_pins if pins else None,
                              self._block_pins if pins else None)

    def allocate(self, name: str, feat_shape: tuple[int, ...], dtype: torch.dtype,
                 allocating: int = 0) -> PoolKey:
        """Host storage for a new key, refused before it is allocated where it would bring
        every key's (and `allocating` bytes of keys allocated beside it, not installed yet)
        over the budget; does not touch shared tables, so it may run unlocked."""
        width = math.prod(feat_shape)
        nbytes = self.num_slots * width * dtype.itemsize
        # installed keys change on the allocating thread alone: read here without the lock
        held = sum(key.storage.nbytes for key in self.keys.values()) + allocating
        if self.budget_bytes is not None and held + nbytes > self.budget_bytes:
            raise OmniPrefixCacheUnmatchError(
                f"pool key {name!r}: its {nbytes:,} bytes ({self.num_slots:,} KV slots x "
                f"{width} x {dtype.itemsize} B of {dtype}) would bring the host pools to "
                f"{held + nbytes:,} bytes, over the host budget of {self.budget_bytes:,} "
                f"(host_budget_bytes); the stage cannot cache it")
        storage = self._backend.alloc_host((self.num_slots, width), dtype)
        return PoolKey(name, storage, tuple(feat_shape), dtype, width,
                       Tiers(self.num_blocks, self.block_size),
                       Tiers(self.num_blocks, self.block_size))

    def install(self, key: PoolKey) -> None:
        if key.name in self.keys:
            raise KeyError(f"pool key {key.name!r} is already installed")
        self.keys[key.name] = key

    def present(self, name: str, slots: np.ndarray) -> np.ndarray:
        """Mask of `slots` whose `name` rows belong to the slot's current tenant."""
        return self.row_states(name, slots)[0]

    def lost(self, name: str, slots: np.ndarray) -> np.ndarray:
        """Mask of `slots` whose `name` rows the current tenant wrote but a failed write lost."""
        return self.row_states(name, slots)[1]

    def present_and_producers(self, name: str, slots: np.ndarray) -> tuple[np.ndarray, set[int]]:
        """`present(name, slots)`, and the write tasks that produce those rows."""
        present, _, producers = self.row_states(name, slots)
        return present, set(np.unique(producers).tolist())

    def row_states(self, name: str, slots: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`present(name, slots)`, `lost(name, slots)`, and the write task that produces each
        present row (in the order of `slots[present]`): one pass over the slots, in C."""
        key = self.keys.get(name)
        if key is None:
            absent = np.zeros(len(slots), dtype=bool)
            return absent, absent, np.zeros(0, dtype=np.int64)
        state = np.empty(len(slots), dtype=np.int32)
        producers = np.empty(len(slots), dtype=np.int64)
        num_present, num_lost = _core.row_states(
            slots, self.block_size, self._claim.slots, self._claim.blocks, key.version.slots,
            key.version.blocks, key.producer.slots, key.producer.blocks, state, producers)
        lost = state < 0 if num_lost else np.zeros(len(slots), dtype=bool)
        return state > 0, lost, producers[:num_present]

    def mark_lost(self, producer: int) -> None:
        """Every row `producer` was to write is lost: it never landed."""
        for key in self.keys.values():
            for version, made_by in ((key.version.blocks, key.producer.blocks),
                                     (key.version.slots, key.producer.slots)):
                mine = (made_by == producer) & (version > 0)
                version[mine] = -version[mine]

    def gather(self, name: str, slots: np.ndarray, out: torch.Tensor) -> None:
        """`out[i] = rows of name at slots[i]` into `out`, a contiguous host tensor of the key's
        dtype: one copy per run of consecutive slots (`_core.gather_rows`, GIL released),
        split across GATHER_THREADS threads of its own when it is large."""
        storage = self.keys[name].storage
        if out.dtype != storage.tensor.dtype or not out.is_contiguous():
            raise TypeError(f"gather of {name!r}: out must be a contiguous "
                            f"{storage.tensor.dtype} tensor, got {out.dtype} of strides "
                            f"{out.stride()}")
        _core.gather_rows(storage.byte_rows, np.ascontiguousarray(slots, dtype=np.int64),
                          byte_rows(out), GATHER_THREADS)

    def gather_parts(self, name: str, slots: np.ndarray, outs: Sequence[torch.Tensor]) -> None:
        """`gather` into several tensors at once: `outs[0]` takes the rows of the first
        `len(outs[0])` of `slots`, and so on; each tensor a part the copy threads take as they
        go (`_core.gather_parts`)."""
        storage = self.keys[name].storage
        for out in outs:
            if out.dtype != storage.tensor.dtype or not out.is_contiguous():
                raise TypeError(f"gather of {name!r}: every out must be a contiguous "
                                f"{storage.tensor.dtype} tensor, got {out.dtype} of strides "
                                f"{out.stride()}")
        _core.gather_parts(storage.byte_rows, np.ascontiguousarray(slots, dtype=np.int64),
                           [byte_rows(out) for out in outs], GATHER_THREADS)

    def copy_block(self, src_block: int, dst_block: int) -> None:
        """Mirror vLLM's copy of block `src_block` into `dst_block`, a new tenant of `dst_block`."""
        bs = self.block_size
        src = np.arange(src_block * bs, (src_block + 1) * bs)
        dst = src - src_block * bs + dst_block * bs
        claim = self.claim(np.array([[dst[0], dst[-1] + 1]], dtype=np.int64))
        for key in self.keys.values():
            keep, lost, _ = self.row_states(key.name, src)
            key.flat[torch.from_numpy(dst)] = key.flat[torch.from_numpy(src)]
            key.version.blocks[dst_block] = key.producer.blocks[dst_block] = 0
            key.version.slots[dst] = np.where(keep, claim, np.where(lost, -claim, 0))
            key.producer.slots[dst] = 0

    def nbytes(self) -> dict[str, int]:
        return {name: key.storage.nbytes for name, key in self.keys.items()}

    def close(self) -> None:
        for key in self.keys.values():
            key.storage.close()
        self.keys.clear()
