"""A stage entry and its wire form: a JSON header (keys, dtypes, shapes, offsets, meta), then bytes.

Layout: a fixed prefix (`MAGIC`, 8 bytes; the header's length, 8 bytes little endian; the
entry's id, 16 bytes; the chunk's start position, 8 bytes little endian; its publish time, a
little-endian double), the UTF-8 JSON header, then each tensor's raw bytes at
`data_start + offset`, where `data_start` and every offset are multiples of `ALIGN`, so a
decoded tensor is an aligned view of the buffer it was read into. Any strided torch dtype
round-trips (bfloat16, float8, bool, complex...), 0-row tensors included.

The prefix tells which entry a chunk belongs to, where it starts and when it was published
(`peek`), so a reader can choose the chunk it takes before it claims one: the chunks of one
entry carry the id its producing handle minted at the entry's first chunk, and no other
entry's chunks carry it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _json_str
from typing import Any, NamedTuple

import numpy as np
import torch

from prefix_cache.core.pool_rows import PoolRows
from prefix_cache.devices.base import host_bytes

MAGIC = b"OPCSTG\x00\x02"
ALIGN = 64
_PREFIX = struct.Struct("<8sQ16sQd")  # magic, header length, entry id, start, publish time
#: Bytes of an entry's id (`StageEntry.entry` is their hex).
ENTRY_ID_BYTES = 16
#: Bytes at the start of an encoded entry that `peek` reads.
PREFIX_BYTES = _PREFIX.size


@dataclass(frozen=True)
class StageEntry:
    """One request's published stage outputs: CPU tensors by key, the aborted marker, metadata;
    or one chunk of them: rows of positions `start, start + 1, ...`, the last chunk `final`."""

    request_id: str
    outputs: dict[str, torch.Tensor]
    aborted: bool = False
    meta: dict[str, Any] = field(default_factory=dict)  # JSON values, defined by the publisher
    published_at: float = 0.0  # time.time() at publish
    error: str | None = None  # the publisher could not publish the rows: why (no outputs then)
    start: int = 0  # the position of the first row
    final: bool = True  # no chunk follows under this entry
    entry: str = ""  # the entry's id (hex), shared by its chunks alone; "": none given
    producer: str = ""  # the backend's name of the live producer that published it; "": none

    @property
    def num_rows(self) -> int:
        """Positions the rows cover (every key has as many rows)."""
        return next(iter(self.outputs.values())).shape[0] if self.outputs else 0


class EncodedEntry(NamedTuple):
    """An entry's wire form as pieces to write at their offsets; the gaps between them are zeros.
    A piece is (offset, bytes), or (offset, `PoolRows`): rows a writer reads from the pool in
    place and lays end to end from the offset."""

    nbytes: int
    pieces: list[tuple[int, memoryview | PoolRows]]  # ascending offsets; the header first

    def let_go(self) -> None:
        """Let the pool's rows go: they were written, or copied."""
        for _, data in self.pieces:
            if isinstance(data, PoolRows):
                data.let_go()

    def owned(self) -> EncodedEntry:
        """The same wire form with every pool's rows copied into memory of its own (and the
        pool's rows let go): for a writer that may wait before it writes."""
        if all(not isinstance(data, PoolRows) for _, data in self.pieces):
            return self
        return EncodedEntry(self.nbytes, [(offset, memoryview(data.byte_copy().reshape(-1))
                                           if isinstance(data, PoolRows) else data)
                                          for offset, data in self.pieces])


class ChunkTag(NamedTuple):
    """What the prefix of a published chunk says: its entry's id (hex), its start position and
    its publish time (`time.time()` of the publishing machine)."""

    entry: str
    start: int
    published_at: float


def peek(prefix: bytes) -> ChunkTag | None:
    """The tag in the first `PREFIX_BYTES` of an encoded entry; None if they are not one of
    this version's."""
    if len(prefix) < PREFIX_BYTES:
        return None
    magic, _, entry, start, published_at = _PREFIX.unpack_from(prefix)
    return ChunkTag(_entry_hex(entry), start, published_at) if magic == MAGIC else None


def _entry_hex(raw: bytes) -> str:
    """The prefix's entry id as `StageEntry.entry` holds it (zeros: none given, "")."""
    return raw.hex() if any(raw) else ""


def _entry_raw(request_id: str, entry: str) -> bytes:
    """`StageEntry.entry` as the prefix's bytes; a TypeError for one that is not an id."""
    if not entry:
        return bytes(ENTRY_ID_BYTES)
    try:
        raw = bytes.fromhex(entry)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != ENTRY_ID_BYTES:
        raise TypeError(f"request {request_id}: entry id {entry!r} is not {ENTRY_ID_BYTES} "
                        f"bytes in hex")
    return raw


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _raw_bytes(key: str, value: Any) -> np.ndarray:
    """`value`'s bytes as a flat uint8 array, without a copy when it is already contiguous.

    Without a torch op where none is needed: on an engine's output thread each may hand the GIL
    to the engine thread and wait to take it back (`benchmarks/gil_handovers.py`). A contiguous
    tensor takes none (`host_bytes`, bfloat16 and float8 included); the conjugate and negative
    bits exist on complex tensors only."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        raise TypeError(f"stage output {key!r} is not a dense tensor: {type(value).__name__}")
    if not value.is_cpu:
        raise ValueError(f"stage output {key!r} is on {value.device}; the channel takes CPU rows")
    if value.dtype.is_complex:
        value = value.resolve_conj().resolve_neg()
    return host_bytes(value if value.is_contiguous() else value.contiguous())


def encode(entry: StageEntry) -> EncodedEntry:
    """The entry's wire form; tensor bytes are referenced, not copied (non-contiguous ones are),
    and `PoolRows` are left in the pool for the writer to read in place."""
    tensors, payloads, offset = [], [], 0
    for key, value in entry.outputs.items():
        if not isinstance(key, str):
            raise TypeError(f"stage output key {key!r} is not a str")
        if isinstance(value, PoolRows):
            payloads.append((offset, value))
            nbytes = value.nbytes
        else:
            raw = _raw_bytes(key, value)
            payloads.append((offset, memoryview(raw)))
            nbytes = raw.size
        tensors.append(f'{{"key":{_json_str(key)},"dtype":"'
                       f'{str(value.dtype).removeprefix("torch.")}","shape":['
                       f'{",".join(map(str, value.shape))}],"offset":{offset}}}')
        offset = _align(offset + nbytes)
    header_bytes = _header(entry, ",".join(tensors)).encode()
    data_start = _align(_PREFIX.size + len(header_bytes))
    if isinstance(entry.start, bool) or not isinstance(entry.start, int) or entry.start < 0:
        raise TypeError(f"request {entry.request_id}: the chunk start {entry.start!r} is not a "
                        f"whole number")
    if isinstance(entry.published_at, bool) or not isinstance(entry.published_at, (int, float)):
        raise TypeError(f"request {entry.request_id}: the publish time {entry.published_at!r} "
                        f"is not a number")
    prefix = _PREFIX.pack(MAGIC, len(header_bytes), _entry_raw(entry.request_id, entry.entry),
                          entry.start, entry.published_at)
    pieces = [(0, memoryview(prefix + header_bytes))]
    pieces += [(data_start + off, payload) for off, payload in payloads]
    return EncodedEntry(data_start + offset, pieces)


def _header(entry: StageEntry, tensors: str) -> str:
    """The JSON header `json.dumps` would give (compact separators, ASCII) of `entry`, whose
    tensors' records are `tensors`, built as a string: a chunk's header is encoded on a
    streaming stage's output thread per request per step, where the encoder's object walk cost
    several times more."""
    request_id, error = entry.request_id, entry.error
    try:
        if not isinstance(request_id, str):
            raise TypeError(f"the request id {request_id!r} is not a str")
        meta = json.dumps(entry.meta, separators=(",", ":")) if entry.meta else "{}"
        error = "null" if error is None else _json_str(error)
        if not isinstance(entry.producer, str):
            raise TypeError(f"the producer {entry.producer!r} is not a str")
    except (TypeError, ValueError) as e:
        raise TypeError(f"request {request_id}: entry metadata is not JSON: {e}") from e
    return (f'{{"request_id":{_json_str(request_id)},"aborted":'
            f'{"true" if entry.aborted else "false"},'
            f'"meta":{meta},"tensors":[{tensors}],"error":{error},'
            f'"final":{"true" if entry.final else "false"},'
            f'"producer":{_json_str(entry.producer)}}}')


def join(encoded: EncodedEntry) -> torch.Tensor:
    """The wire form as one contiguous uint8 tensor (a copy, pool rows read once and let go),
    for stores that take one buffer. A writer of pool rows calls it inside `reading` (whose lock
    `copy_into` takes again: it is reentrant)."""
    out = torch.empty(encoded.nbytes, dtype=torch.uint8)
    dst, end = out.numpy(), 0
    for offset, data in encoded.pieces:
        dst[end:offset] = 0
        end = offset + data.nbytes
        if isinstance(data, PoolRows):
            data.copy_into(dst[offset:end].reshape(data.shape[0], data.row_bytes))
        else:
            dst[offset:end] = np.frombuffer(data, dtype=np.uint8)
    dst[end:] = 0
    return out


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def decode(data: torch.Tensor) -> StageEntry:
    """The entry in `data` (flat uint8, handed over by the caller); tensors are views of its
    bytes. Read through numpy, with one torch op per tensor: a streaming stage's consumer
    decodes a chunk per request per step, where each torch op costs microseconds.

    Raises ValueError when `data` is not a well-formed entry.
    """
    raw = data.numpy()
    size = raw.size
    if size < _PREFIX.size:
        raise ValueError(f"{size} bytes is shorter than an entry's prefix")
    magic, header_len, entry, chunk_start, published_at = _PREFIX.unpack_from(raw)
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r}, not a stage entry of this version")
    data_start = _align(_PREFIX.size + header_len)
    if data_start > size:
        raise ValueError(f"header of {header_len} bytes runs past the entry's {size}")
    header = json.loads(raw[_PREFIX.size:_PREFIX.size + header_len].tobytes())
    outputs = {}
    for row in header["tensors"]:
        dtype, offset, dims = _dtype(row["dtype"]), row["offset"], row["shape"]
        if not _whole(offset) or not isinstance(dims, list) or not all(map(_whole, dims)):
            raise ValueError(f"tensor {row['key']!r}: offset {offset!r} and shape {dims!r} must "
                             f"be whole numbers >= 0")
        count = math.prod(dims)
        start = data_start + offset
        end = start + count * dtype.itemsize
        if offset % ALIGN or end > size:
            raise ValueError(f"tensor {row['key']!r} at bytes {start}..{end} lies outside the "
                             f"entry's {size} bytes or is misaligned")
        outputs[row["key"]] = torch.frombuffer(raw, dtype=dtype, count=count, offset=start
                                               ).view(dims) if count else \
            torch.empty(dims, dtype=dtype)
    error = header.get("error")
    if error is not None and not isinstance(error, str):
        raise ValueError(f"error {error!r} is not a str")
    final, producer = header["final"], header["producer"]
    if not isinstance(final, bool) or not isinstance(producer, str):
        raise ValueError(f"final {final!r} and producer {producer!r} must be a bool and a str")
    return StageEntry(header["request_id"], outputs, header["aborted"], header["meta"],
                      published_at, error, chunk_start, final, _entry_hex(entry), producer)
