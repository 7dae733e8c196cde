"""The durable host mirror: one `(num_blocks, block_size, *feat)` tensor per key, indexed by vLLM slot.

Slot reuse is the eviction: when vLLM hands a block to a new tenant, the
tenant's first write claims its slots and every older row there stops counting.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from prefix_cache import _core
from prefix_cache.devices.base import DeviceBackend, HostBuffer

#: Gathers at least this large are split across GATHER_THREADS (torch copies release the GIL):
#: on an H200 host one index_select moves 1.4-9.5 GB/s, four moving quarters 3.9-15 GB/s.
PARALLEL_GATHER_BYTES = 4 << 20
GATHER_THREADS = min(4, (os.cpu_count() or 1) // 4)


@dataclass
class PoolKey:
    """One cached output: its host storage and, per slot, which claim and task its rows belong to."""

    name: str
    storage: HostBuffer
    feat_shape: tuple[int, ...]
    version: np.ndarray   # int64[num_slots]: slot claim the rows were written under (0: none)
    producer: np.ndarray  # int64[num_slots]: write task that lands those rows

    @property
    def flat(self) -> torch.Tensor:
        """The storage as `[num_slots, F]`."""
        return self.storage.tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.tensor.dtype

    @property
    def row_width(self) -> int:
        return self.storage.tensor.shape[1]


class PrefixBlockPool:
    """Host rows of every cached key, with a claim per slot and a version per (slot, key).

    Invariant: the rows of key k at slot s belong to the slot's current tenant
    iff `keys[k].version[s] == slot_claim[s] != 0`; they were lost to a failed
    write iff `version[s] == -slot_claim[s] != 0`; anything else reads as absent.
    Claims only grow, so a version never matches a later tenant's claim. The
    tables change only through the methods below, under the caller's lock.
    """

    def __init__(self, num_blocks: int, block_size: int, backend: DeviceBackend) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self._backend = backend
        self._claims = itertools.count(1)
        self._slot_claim = np.zeros(self.num_slots, dtype=np.int64)
        #: unresolved reads per slot; a claim must first resolve the reads pinning its slots
        self._read_pins = np.zeros(self.num_slots, dtype=np.int32)
        self.keys: dict[str, PoolKey] = {}
        self._gather_threads: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ tenancy

    def claim(self, runs: np.ndarray) -> int:
        """A new tenant takes the slots of `runs` (prefix_cache.runs): every older row there
        stops counting. Returns its claim."""
        claim = next(self._claims)
        _core.fill_runs(runs, self._slot_claim, claim)
        return claim

    def record_write(self, keys: Iterable[str], runs: np.ndarray, claim: int,
                     producer: int) -> None:
        """`producer` will land the rows of `keys` at the slots of `runs`, written under
        `claim`."""
        for name in keys:
            key = self.keys[name]
            _core.fill_runs(runs, key.version, claim, key.producer, producer)

    def claims_at(self, slots: np.ndarray) -> np.ndarray:
        """The claim each of `slots` carries (0: never claimed)."""
        return self._slot_claim[slots]

    def still_claimed(self, slots: np.ndarray, claims: np.ndarray) -> np.ndarray:
        """Mask of `slots` whose tenant is still the one that held `claims`."""
        return self._slot_claim[slots] == claims

    def producer_ids(self, slots: np.ndarray, keys: Iterable[str]) -> set[int]:
        """Write tasks that produce the present rows of `keys` at `slots`."""
        ids: set[int] = set()
        for name in keys:
            present = self.present(name, slots)
            ids.update(np.unique(self.keys[name].producer[slots[present]]).tolist())
        return ids

    # ------------------------------------------------------------------ read pins

    def pin(self, slots: np.ndarray) -> None:
        self._read_pins[slots] += 1

    def unpin(self, slots: np.ndarray) -> None:
        self._read_pins[slots] -= 1

    def any_pinned(self, slots: np.ndarray) -> bool:
        return bool(self._read_pins[slots].any())

    def any_held(self, runs: np.ndarray, held_from: int, *, pins: bool = True) -> bool:
        """Whether some slot of `runs` carries a claim >= `held_from` or (`pins`: some read
        may pin slots) is pinned."""
        return _core.any_held(self._slot_claim, self._read_pins if pins else None, runs,
                              held_from)

    def allocate(self, name: str, feat_shape: tuple[int, ...], dtype: torch.dtype) -> PoolKey:
        """Host storage for a new key; does not touch shared tables, so it may run unlocked."""
        width = math.prod(feat_shape)
        storage = self._backend.alloc_host((self.num_slots, width), dtype)
        return PoolKey(name, storage, tuple(feat_shape),
                       np.zeros(self.num_slots, dtype=np.int64),
                       np.zeros(self.num_slots, dtype=np.int64))

    def install(self, key: PoolKey) -> None:
        if key.name in self.keys:
            raise KeyError(f"pool key {key.name!r} is already installed")
        self.keys[key.name] = key

    def present(self, name: str, slots: np.ndarray) -> np.ndarray:
        """Mask of `slots` whose `name` rows belong to the slot's current tenant."""
        key = self.keys.get(name)
        if key is None:
            return np.zeros(len(slots), dtype=bool)
        claims = self._slot_claim[slots]
        return (key.version[slots] == claims) & (claims != 0)

    def lost(self, name: str, slots: np.ndarray) -> np.ndarray:
        """Mask of `slots` whose `name` rows the current tenant wrote but a failed write lost."""
        key = self.keys.get(name)
        if key is None:
            return np.zeros(len(slots), dtype=bool)
        claims = self._slot_claim[slots]
        return (key.version[slots] == -claims) & (claims != 0)

    def mark_lost(self, producer: int) -> None:
        """Every row `producer` was to write is lost: it never landed."""
        for key in self.keys.values():
            mine = (key.producer == producer) & (key.version > 0)
            key.version[mine] = -key.version[mine]

    def gather(self, name: str, slots: np.ndarray, out: torch.Tensor) -> None:
        """`out[i] = rows of name at slots[i]`, whole blocks at a time where slots run block-aligned."""
        flat = self.keys[name].flat
        bs = self.block_size
        n = len(slots)
        if n and n % bs == 0:
            runs = slots.reshape(-1, bs)
            firsts = runs[:, 0]
            if not (firsts % bs).any() and (runs - firsts[:, None] == np.arange(bs)).all():
                self._index_select(flat.view(self.num_blocks, -1), firsts // bs,
                                   out.view(n // bs, -1))
                return
        self._index_select(flat, slots, out)

    def _index_select(self, source: torch.Tensor, index: np.ndarray, out: torch.Tensor) -> None:
        """`out = source[index]`, in GATHER_THREADS parts when it is large."""
        index_t = torch.from_numpy(index)
        parts = GATHER_THREADS if out.numel() * out.element_size() >= PARALLEL_GATHER_BYTES else 1
        if parts <= 1 or len(index) < parts:
            torch.index_select(source, 0, index_t, out=out)
            return
        if self._gather_threads is None:
            self._gather_threads = ThreadPoolExecutor(GATHER_THREADS,
                                                      thread_name_prefix="omni-prefix-cache-gather")
        step = -(-len(index) // parts)
        for done in [self._gather_threads.submit(torch.index_select, source, 0,
                                                 index_t[i: i + step], out=out[i: i + step])
                     for i in range(0, len(index), step)]:
            done.result()

    def copy_block(self, src_block: int, dst_block: int) -> None:
        """Mirror vLLM's copy of block `src_block` into `dst_block`, a new tenant of `dst_block`."""
        bs = self.block_size
        src = np.arange(src_block * bs, (src_block + 1) * bs)
        dst = src - src_block * bs + dst_block * bs
        claim = self.claim(np.array([[dst[0], dst[-1] + 1]], dtype=np.int64))
        for key in self.keys.values():
            keep, lost = self.present(key.name, src), self.lost(key.name, src)
            key.flat[torch.from_numpy(dst)] = key.flat[torch.from_numpy(src)]
            key.version[dst] = np.where(keep, claim, np.where(lost, -claim, 0))
            key.producer[dst] = 0

    def nbytes(self) -> dict[str, int]:
        return {name: key.storage.nbytes for name, key in self.keys.items()}

    def close(self) -> None:
        if self._gather_threads is not None:
            self._gather_threads.shutdown()
        for key in self.keys.values():
            key.storage.close()
        self.keys.clear()
