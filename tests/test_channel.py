"""The stage channel with each backend (shared memory; Mooncake Store on loopback, real processes).

Rows reach a consumer in another (spawned) process exactly, by request id; the get waits,
bounded; entries are freed once consumed, after their time to live, and by the owner's close;
shared-memory entries are private; an unreachable backend is a clear error; memory stays flat.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import multiprocessing
import os
import re
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from prefix_cache import HIDDEN_KEY, OmniPrefixCacheError
from prefix_cache.channel import (OmniPrefixCacheChannelError, OmniPrefixCacheChannelFullError,
                                  OmniPrefixCacheChannelTimeoutError,
                                  StageChannel, StageChunk, open_channel)
from prefix_cache.channel import base as channel_base
from prefix_cache.channel.codec import EncodedEntry, StageEntry, decode, encode, join
from prefix_cache.channel import mooncake as mooncake_module
from prefix_cache.channel.mooncake import MooncakeChannel
from prefix_cache.channel.shm import ShmChannel
from prefix_cache.core.pool_rows import PoolRows
from tests.mooncake_store import MooncakeStoreProcesses, free_port


BIG_ELEMENTS = 16 << 20  # 64 MiB of float32


def sample_outputs(seed: int, rows: int = 37) -> dict[str, torch.Tensor]:
    """A request's stage outputs as a worker publishes them: several keys and dtypes, 0-row key."""
    g = torch.Generator().manual_seed(seed)
    return {HIDDEN_KEY: torch.randn(rows, 64, generator=g).to(torch.bfloat16),
            "talker_embeds": torch.randn(rows, 32, generator=g),
            "codec_ids": torch.randint(0, 4096, (rows, 4), generator=g),
            "no_rows_yet": torch.empty(0, 16)}


def big_outputs(seed: int) -> dict[str, torch.Tensor]:
    return {HIDDEN_KEY: torch.randn(BIG_ELEMENTS, generator=torch.Generator().manual_seed(seed))}


EXPECTED = {"req-small": lambda: sample_outputs(1), "req-aborted": lambda: sample_outputs(2, 5),
            "req-64MiB": lambda: big_outputs(3)}


def same_rows(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


def _consume(spec: str, results: multiprocessing.Queue) -> None:
    """In a spawned process: take every EXPECTED entry and report whether its rows are exact."""
    with open_channel(spec) as channel:
        for request_id, outputs in EXPECTED.items():
            entry = channel.get_entry(request_id, timeout_s=60)
            results.put((request_id, (same_rows(entry.outputs, outputs()), entry.aborted,
                                      entry.meta)))


def _publish_later(spec: str, request_id: str, delay_s: float) -> None:
    """In a spawned process: publish `sample_outputs(7)` after `delay_s`."""
    time.sleep(delay_s)
    with open_channel(spec) as channel:
        channel.put(request_id, sample_outputs(7))


def _spawn(target: Callable[..., None], *args: object) -> multiprocessing.Process:
    proc = multiprocessing.get_context("spawn").Process(target=target, args=args)
    proc.start()
    return proc


@pytest.fixture(params=["shm", "mooncake"])
def new_spec(request: pytest.FixtureRequest) -> str:
    """A spec that opens a new namespace of the backend; options may be appended with '&'."""
    if request.param == "shm":
        return "shm://?"
    return request.getfixturevalue("mooncake_store").spec


@pytest.fixture
def channel(new_spec: str) -> Iterator[StageChannel]:
    with open_channel(new_spec) as channel:
        yield channel


def is_published(channel: StageChannel, request_id: str) -> bool:
    """Whether the backend still holds a request's entry, asked of its files or of the store
    (through a handle of its own where `channel` is closed)."""
    if isinstance(channel, ShmChannel):
        return channel.entry_path(request_id).exists()
    assert isinstance(channel, MooncakeChannel)
    if channel._closed:
        with open_channel(channel.spec) as probe:
            return is_published(probe, request_id)
    return bool(channel.entry_keys(request_id))


def test_a_spawned_consumer_gets_exactly_the_rows(channel: StageChannel) -> None:
    results = multiprocessing.get_context("spawn").Queue()
    consumer = _spawn(_consume, channel.spec, results)
    channel.put("req-small", EXPECTED["req-small"]())
    meta = {"num_prompt_tokens": 5, "finish_reason": "abort"}
    channel.put("req-aborted", EXPECTED["req-aborted"](), aborted=True, meta=meta)
    channel.put("req-64MiB", EXPECTED["req-64MiB"]())
    got = dict(results.get(timeout=120) for _ in EXPECTED)  # rid -> (exact, aborted, meta)
    consumer.join(30)
    assert consumer.exitcode == 0
    assert got == {"req-small": (True, False, {}), "req-aborted": (True, True, meta),
                   "req-64MiB": (True, False, {})}
    assert not any(is_published(channel, rid) for rid in EXPECTED)


def test_get_waits_for_a_put_from_another_process(channel: StageChannel) -> None:
    publisher = _spawn(_publish_later, channel.spec, "req-late", 1.0)
    start = time.monotonic()
    outputs = channel.get("req-late", timeout_s=60)
    waited = time.monotonic() - start
    publisher.join(30)
    assert publisher.exitcode == 0
    assert same_rows(outputs, sample_outputs(7))
    assert waited >= 1.0


def test_an_shm_reader_wakes_when_an_entry_is_published_not_when_its_pause_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With 10 s between a waiting reader's polls, a put by another handle 0.5 s into the wait
    ends the pause it falls in (the entry is renamed into the namespace): the get returns then,
    not at the pause's end."""
    monkeypatch.setattr(channel_base, "_FIRST_POLL_S", 10.0)
    monkeypatch.setattr(channel_base, "_MAX_POLL_S", 10.0)
    with open_channel("shm") as channel, open_channel(channel.spec) as publisher:
        timer = threading.Timer(0.5, publisher.put, ("req-woken", sample_outputs(7)))
        start = time.monotonic()
        timer.start()
        outputs = channel.get("req-woken", timeout_s=60)
        waited = time.monotonic() - start
        timer.join()
    assert same_rows(outputs, sample_outputs(7))
    assert 0.5 <= waited < 5.0


def test_a_reader_never_takes_a_half_written_entry(channel: StageChannel) -> None:
    published, taken = big_outputs(3), {}
    with open_channel(channel.spec) as reader:
        polling = threading.Thread(target=lambda: taken.update(reader.get("req-big", 60)))
        polling.start()  # polls every few ms while the 64 MiB entry is being stored
        channel.put("req-big", published)
        polling.join(60)
    assert same_rows(taken, published)


def test_get_times_out_with_one_line_naming_request_and_channel(channel: StageChannel) -> None:
    start = time.monotonic()
    with pytest.raises(OmniPrefixCacheChannelTimeoutError) as info:
        channel.get("req-never-published", timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 1.5
    assert isinstance(info.value, OmniPrefixCacheError)
    message = str(info.value)
    assert "req-never-published" in message and channel.spec in message and "\n" not in message


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), -1, "5", True])
def test_a_timeout_that_is_not_finite_and_non_negative_is_refused_at_once(
        channel: StageChannel, timeout_s: Any) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match="request req-t: timeout_s must be a finite number"):
        channel.get("req-t", timeout_s=timeout_s)
    assert time.monotonic() - start < 0.5


def _retold(data: torch.Tensor, change: Callable[[dict[str, Any]], None]) -> torch.Tensor:
    """`data` (an encoded entry) with its JSON header changed by `change`, payload kept."""
    import json

    from prefix_cache.channel.codec import _PREFIX, ALIGN, MAGIC
    _, header_len, *tag = _PREFIX.unpack(data[:_PREFIX.size].numpy().tobytes())
    header = json.loads(data[_PREFIX.size:_PREFIX.size + header_len].numpy().tobytes())
    old_start = -(-(_PREFIX.size + header_len) // ALIGN) * ALIGN
    change(header)
    text = json.dumps(header).encode()
    start = -(-(_PREFIX.size + len(text)) // ALIGN) * ALIGN
    out = torch.zeros(start + data.numel() - old_start, dtype=torch.uint8)
    prefix = _PREFIX.pack(MAGIC, len(text), *tag)
    out[:_PREFIX.size] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
    out[_PREFIX.size:_PREFIX.size + len(text)] = torch.frombuffer(bytearray(text),
                                                                  dtype=torch.uint8)
    out[start:] = data[old_start:]
    return out


@pytest.mark.parametrize("field, value", [("offset", -64), ("offset", 1.5), ("shape", [-2, 4]),
                                          ("shape", [2.5, 4]), ("shape", "2x4"),
                                          ("dtype", "Tensor"), ("dtype", "nonsense")])
def test_a_malformed_entry_is_a_channel_error_naming_the_request(
        channel: StageChannel, field: str, value: Any) -> None:
    entry = StageEntry("req-bad", {"rows": torch.ones(2, 4)}, False, {}, time.time())
    data = _retold(join(encode(entry)), lambda h: h["tensors"][0].__setitem__(field, value))
    with pytest.raises(ValueError):
        decode(data)
    channel._publish("req-bad", EncodedEntry(data.numel(), [(0, memoryview(data.numpy()))]),
                     channel._reserve(data.numel(), force=True), final=True)
    with pytest.raises(OmniPrefixCacheChannelError, match="request req-bad .* unreadable"):
        channel.get("req-bad", timeout_s=5)


def test_a_failed_entry_raises_at_its_get_naming_the_request_and_the_cause(
        channel: StageChannel) -> None:
    channel.fail("req-f", "publishing its 9 rows failed: OSError: No space left on device")
    with pytest.raises(OmniPrefixCacheChannelError,
                       match="request req-f: .* could not publish .*No space left on device"):
        channel.get("req-f", timeout_s=5)
    with pytest.raises(OmniPrefixCacheChannelTimeoutError):  # consumed, like any entry
        channel.get("req-f", timeout_s=0.1)


def test_an_entry_is_freed_once_consumed(channel: StageChannel) -> None:
    channel.put("req-1", sample_outputs(1))
    assert is_published(channel, "req-1")
    assert same_rows(channel.get("req-1", timeout_s=5), sample_outputs(1))
    assert not is_published(channel, "req-1")
    with pytest.raises(OmniPrefixCacheChannelTimeoutError):
        channel.get("req-1", timeout_s=0.1)


def test_expired_entries_are_freed_unconsumed(new_spec: str) -> None:
    with open_channel(new_spec + "&ttl=0.3") as channel, open_channel(channel.spec) as reader:
        assert reader.ttl_s == 0.3
        channel.put("req-old", sample_outputs(1))
        channel.put("req-read-late", sample_outputs(2))
        time.sleep(0.4)
        with pytest.raises(OmniPrefixCacheChannelTimeoutError, match="entries live 0.3 s"):
            reader.get("req-read-late", timeout_s=0.2)  # found expired, or swept, and freed
        assert not is_published(channel, "req-read-late")
        channel.put("req-new", sample_outputs(3))  # the publisher sweeps what expired
        assert not is_published(channel, "req-old")
        assert same_rows(reader.get("req-new", timeout_s=5), sample_outputs(3))


def test_aborted_marker_and_metadata_round_trip(channel: StageChannel) -> None:
    channel.put("req-done", sample_outputs(1), meta={"num_cached_tokens": 16})
    channel.put("req-cut", sample_outputs(2, rows=3), aborted=True)
    done, cut = channel.get_entry("req-done", 5), channel.get_entry("req-cut", 5)
    assert (done.aborted, done.meta, done.request_id) == (False, {"num_cached_tokens": 16},
                                                          "req-done")
    assert (cut.aborted, cut.meta) == (True, {})
    assert same_rows(cut.outputs, sample_outputs(2, rows=3))


@pytest.mark.parametrize("entry", [
    StageEntry("req-\u00e9\u4e2d \"q\"\\", {"rows": torch.ones(2, 3), "scalar": torch.tensor(1.5),
                                        "none": torch.ones(0, 4, dtype=torch.bfloat16)},
               True, {"nested": {"list": [1, 2.5, None, True, "\u00fc"]}, "n": -3}, 1.0e9 + 0.25,
               None, 7, False, "0123456789abcdef" * 2, ".producer-" + "e" * 32),
    StageEntry("req-failed", {}, True, {}, 1733.5, 'it failed: "quoted"\n\tnext line'),
    StageEntry("req-int-time", {"rows": torch.ones(1, 2)}, published_at=0),
])
def test_an_entrys_header_is_the_json_of_its_fields(entry: StageEntry) -> None:
    """The wire header (read by consumers of any version) is exactly the JSON of the entry's
    fields, in ASCII, whatever its id, error text and metadata hold; its prefix holds the
    entry's id, the chunk's start and the publish time (`peek`)."""
    import json

    from prefix_cache.channel.codec import _PREFIX, ChunkTag, peek
    data = join(encode(entry))
    header_len = _PREFIX.unpack(data[:_PREFIX.size].numpy().tobytes())[1]
    text = data[_PREFIX.size:_PREFIX.size + header_len].numpy().tobytes()
    fields = {"request_id": entry.request_id, "aborted": entry.aborted, "meta": entry.meta,
              "tensors": json.loads(text)["tensors"], "error": entry.error,
              "final": entry.final, "producer": entry.producer}
    assert text == json.dumps(fields, separators=(",", ":")).encode("ascii")
    assert [(t["key"], t["dtype"], t["shape"]) for t in fields["tensors"]] == [
        (key, str(value.dtype).removeprefix("torch."), list(value.shape))
        for key, value in entry.outputs.items()]
    assert peek(data[:_PREFIX.size].numpy().tobytes()) == ChunkTag(entry.entry, entry.start,
                                                                   entry.published_at)
    decoded = decode(data)
    assert (decoded.request_id, decoded.meta, decoded.error, decoded.start, decoded.final,
            decoded.entry, decoded.producer, decoded.published_at) == (
        entry.request_id, entry.meta, entry.error, entry.start, entry.final, entry.entry,
        entry.producer, entry.published_at)
    assert all(torch.equal(decoded.outputs[k], v) for k, v in entry.outputs.items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_a_chunk_is_encoded_without_a_torch_op(dtype: torch.dtype) -> None:
    """A streaming stage's output thread encodes a chunk per request per step: a torch op there
    may hand the GIL to the engine thread and wait to take it back (BENCHMARKS.md, M9c), so
    a contiguous chunk's bytes are read without one, whatever its dtype."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    step = torch.randn(4, 64).to(dtype)
    chunk = step[2:3]  # a request's row of the step's rows, as the delivery slices them
    entry = StageEntry("req-op", {HIDDEN_KEY: chunk}, start=5, final=False)
    with Ops() as seen:
        encoded = encode(entry)
    assert seen.ops == []
    assert torch.equal(decode(join(encoded)).outputs[HIDDEN_KEY].view(torch.uint8),
                       chunk.view(torch.uint8))


def test_an_entry_whose_metadata_is_not_json_is_refused_naming_the_request() -> None:
    with pytest.raises(TypeError, match="request req-meta: entry metadata is not JSON"):
        encode(StageEntry("req-meta", {"rows": torch.ones(1, 2)}, meta={"t": torch.ones(1)}))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.resolve_conj().contiguous().reshape(-1).view(torch.uint8)


def test_the_consumer_owns_what_it_gets(channel: StageChannel) -> None:
    published = {"rows": torch.arange(12.0).reshape(3, 4), "flag": torch.tensor([True, False]),
                 "scalar": torch.tensor(2.5, dtype=torch.float64),
                 "strided": torch.arange(20, dtype=torch.int16).reshape(4, 5).t(),
                 "fp8": torch.arange(6.0).to(torch.float8_e4m3fn),
                 "complex": torch.randn(3, dtype=torch.complex64).conj()}
    channel.put("req-1", published)
    kept = {k: v.clone() for k, v in published.items()}
    published["rows"].add_(100)  # the publisher's tensors are not the entry
    got = channel.get("req-1", timeout_s=5)
    for key, value in kept.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape
        assert torch.equal(_as_bytes(got[key]), _as_bytes(value)), key
    got["rows"].mul_(-1)  # writable, and nobody else sees it
    assert torch.equal(got["rows"], -kept["rows"])


def test_a_namespace_owner_frees_everything_on_close(new_spec: str) -> None:
    owner = open_channel(new_spec)
    joined = open_channel(owner.spec)
    joined.put("req-1", sample_outputs(1))
    joined.put("req-2", sample_outputs(2))
    joined.close()  # a joined handle's close keeps the entries
    assert same_rows(owner.get("req-1", timeout_s=5), sample_outputs(1))
    owner.close()
    owner.close()
    assert not is_published(owner, "req-2")
    with pytest.raises(OmniPrefixCacheChannelError, match="is closed"):
        owner.put("req-3", sample_outputs(3))
    with pytest.raises(OmniPrefixCacheChannelError, match="is closed"):
        joined.get("req-2", timeout_s=0.1)


def test_shm_entries_are_private_and_unnamed_by_request_id() -> None:
    old_umask = os.umask(0)
    try:
        first, second = open_channel("shm"), open_channel()
    finally:
        os.umask(old_umask)
    with first, second:
        first.put("req-secret", sample_outputs(1))
        second.put("req-secret", sample_outputs(1))
        assert stat.S_IMODE(os.stat(first.directory).st_mode) == 0o700
        assert {stat.S_IMODE(p.stat().st_mode) for p in first.directory.iterdir()} == {0o600}
        names = {first.entry_path("req-secret").name, second.entry_path("req-secret").name}
        plain = {getattr(hashlib, h)(b"req-secret").hexdigest() for h in ("sha256", "sha1", "md5")}
        plain.add(hashlib.blake2b(b"req-secret", digest_size=32).hexdigest())  # unkeyed
        assert len(names) == 2 and not names & plain
        assert not any("req-secret" in p.name for p in first.directory.iterdir())
        os.chmod(first.directory, 0o755)
        with pytest.raises(OmniPrefixCacheChannelError, match="not a directory private to this"):
            open_channel(first.spec)
    assert not first.directory.exists() and not second.directory.exists()


def test_shm_a_closed_namespace_is_a_clear_error() -> None:
    with open_channel() as owner, open_channel(owner.spec) as joined:
        owner.close()
        start = time.monotonic()
        with pytest.raises(OmniPrefixCacheChannelError, match="is gone .* request req-1"):
            joined.get("req-1", timeout_s=30)
        assert time.monotonic() - start < 1
    with pytest.raises(OmniPrefixCacheChannelError, match="does not exist"):
        open_channel(owner.spec)


@pytest.mark.parametrize("spec, error", [
    ("tcp://127.0.0.1:1", "unknown channel spec"),
    ("shm://?size=4", "unknown option"),
    ("shm://../etc", "unknown channel spec"),
    ("shm://.key", "not a plain directory name"),
    ("mooncake://127.0.0.1:5?namespace=x", "needs the master's HOST:PORT and \\?metadata="),
    ("mooncake://127.0.0.1?metadata=http://127.0.0.1:6/metadata", "HOST:PORT"),
    ("mooncake://h:notaport?metadata=http://127.0.0.1:6/metadata",
     "the master's port 'notaport' in 'h:notaport' is not a port number"),
    ("shm://?capacity=abc", "option capacity='abc' must be a whole number of bytes"),
    ("shm://x?capacity=abc", "option capacity='abc' must be a whole number of bytes"),
    ("shm://?ttl=abc", "option ttl='abc' must be a number of seconds"),
    ("shm://?wait=soon", "option wait='soon' must be a number of seconds"),
    ("mooncake://127.0.0.1:5?metadata=x&ttl=abc", "mooncake channel spec: option ttl='abc'"),
])
def test_bad_specs_are_refused(spec: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        open_channel(spec)


def test_bad_outputs_are_refused_naming_the_key(channel: StageChannel) -> None:
    with pytest.raises(ValueError, match="'rows' is on meta"):
        channel.put("req-1", {"rows": torch.empty(2, device="meta")})
    with pytest.raises(TypeError, match="'rows' is not a dense tensor: list"):
        channel.put("req-1", {"rows": [1.0]})
    with pytest.raises(TypeError, match="request req-1: entry metadata is not JSON"):
        channel.put("req-1", {}, meta={"when": object()})
    with pytest.raises(ValueError, match="request id"):
        channel.put("", {})
    with pytest.raises(TypeError, match="request r: outputs must be a mapping .* got Tensor"):
        channel.put("r", torch.zeros(1))


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP listener on `port`, from /proc/net/tcp{,6}."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.rsplit(":", 1)
            if state == "0A" and int(port_hex, 16) == port:
                found.add(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_mooncake_processes_listen_on_loopback_only(
        mooncake_store: MooncakeStoreProcesses) -> None:
    loopback = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it
    for port in (mooncake_store.rpc_port, mooncake_store.metrics_port,
                 mooncake_store.metadata_port, mooncake_store.holder_port):
        assert _listening_addresses(port) == {loopback}, port


def test_mooncake_master_not_running_names_the_address_at_once(
        mooncake_store: MooncakeStoreProcesses) -> None:
    master = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(OmniPrefixCacheChannelError,
                       match=f"cannot reach the Mooncake master at {master} .*refused"):
        open_channel(f"mooncake://{master}?metadata={mooncake_store.metadata_url}")
    assert time.monotonic() - start < 1  # Mooncake's own set-up would wait about 4.5 s


def test_a_process_opening_a_mooncake_channel_logs_no_info_lines(
        mooncake_store: MooncakeStoreProcesses) -> None:
    script = ("import sys; from prefix_cache.channel import open_channel\n"
              "with open_channel(sys.argv[1]) as channel: channel.put('r', {})\n")
    env = {k: v for k, v in os.environ.items() if k != "MC_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", script, mooncake_store.spec], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    info = [line for line in done.stderr.splitlines() if line[:1] == "I" and line[1:5].isdigit()]
    assert info == []


def test_close_waits_for_an_operation_in_flight_and_later_ones_are_refused(
        channel: StageChannel) -> None:
    """A get is taking an entry on one thread when another closes the handle: the close
    waits, so the backend's files or connection are never released under the get (a file
    descriptor closed there could be reused by an unrelated file and then written), and the
    next operation is refused, naming the request."""
    channel.put("r", sample_outputs(1))
    taking, release = threading.Event(), threading.Event()
    take = channel._take

    def slow_take(request_id: str, *args: Any) -> torch.Tensor | None:
        taking.set()
        release.wait(10)
        return take(request_id, *args)

    channel._take = slow_take
    got: list[Any] = []
    getter = threading.Thread(target=lambda: got.append(channel.get("r", timeout_s=10)))
    getter.start()
    assert taking.wait(10)
    closer = threading.Thread(target=channel.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close() released the handle under a get in flight"
    release.set()
    getter.join(10)
    closer.join(10)
    assert not closer.is_alive() and same_rows(got[0], sample_outputs(1))
    with pytest.raises(OmniPrefixCacheChannelError, match=r"is closed \(request s\)"):
        channel.get("s", timeout_s=1)


class RealClient:
    """The Mooncake Store client a channel makes, the real one, for a test to override some
    of its calls (`use_client`)."""

    real_class: Any = None

    def __init__(self) -> None:
        self.real = type(self).real_class()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def use_client(monkeypatch: pytest.MonkeyPatch, client_class: type[RealClient]) -> None:
    """Channels opened from now on (in this test) make their client from `client_class`."""
    client_class.real_class = mooncake_module._store_class()
    monkeypatch.setattr(mooncake_module, "_store_class", lambda: client_class)


def test_a_mooncake_read_that_fails_keeps_the_entry_for_the_next_get(
        mooncake_store: MooncakeStoreProcesses, monkeypatch: pytest.MonkeyPatch) -> None:
    failing_reads = [1]

    class FailingOneRead(RealClient):
        """Its next read of an entry fails once (a transfer error)."""

        def get_into(self, key: str, ptr: int, size: int) -> int:
            if failing_reads and "." in key.rsplit("/", 1)[-1]:  # an entry, not a tail
                failing_reads.pop()
                return -800
            return self.real.get_into(key, ptr, size)

    use_client(monkeypatch, FailingOneRead)
    with open_channel(mooncake_store.spec) as channel:
        channel.put("r", sample_outputs(4))
        with pytest.raises(OmniPrefixCacheChannelError,
                           match=r"request r failed \(read returned -800 .*the entry is kept"):
            channel.get("r", timeout_s=5)
        assert same_rows(channel.get("r", timeout_s=5), sample_outputs(4))


def test_a_mooncake_record_read_unreadable_once_is_read_again(
        mooncake_store: MooncakeStoreProcesses, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain's record read back as bytes this channel never wrote (the 30-minute Mooncake
    soak: once in 4614 requests, "a record of request soak-665 is not one this channel
    wrote"; cause not found) is read again, as a slot being rewritten is: the get is served."""
    unreadable: list[int] = []

    class OneUnreadableRecord(RealClient):
        """Its next read of a chain's record reports the record's size and writes bytes no
        record holds."""

        def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> Any:
            if unreadable and "/.producer/" not in keys[0] \
                    and "." not in keys[0].rsplit("/", 1)[-1]:
                unreadable.pop()
                for ptr in ptrs:
                    ctypes.memset(ptr, 0xAB, mooncake_module._CHAIN.size)
                return [mooncake_module._CHAIN.size] * len(keys)
            return self.real.batch_get_into(keys, ptrs, sizes)

    use_client(monkeypatch, OneUnreadableRecord)
    with open_channel(mooncake_store.spec) as channel:
        channel.put("r", sample_outputs(4))
        unreadable.append(1)
        assert same_rows(channel.get("r", timeout_s=5), sample_outputs(4))
        assert not unreadable


def test_a_mooncake_buffer_registration_that_fails_a_few_times_is_tried_again(
        mooncake_store: MooncakeStoreProcesses, monkeypatch: pytest.MonkeyPatch) -> None:
    """Registering a buffer updates the metadata server; under load that call times out now
    and then (Mooncake code -600, seen twice in a 30-minute soak on 2 cores). A registration
    is tried again, a few times, before the put or get it serves fails, naming the code."""
    failures = [2]
    #: the channel's own small buffers (its small values', its lease scans'), not entries'
    SMALL_BUFFERS = (mooncake_module.SmallValues._BUFFER_BYTES,
                     mooncake_module.MAX_PRODUCERS * mooncake_module._RECORD.size)

    class RegistrationsThatFail(RealClient):
        """Its registrations of entries' buffers fail `failures[0]` times in a row from now."""

        def register_buffer(self, ptr: int, size: int) -> int:
            if failures[0] and size not in SMALL_BUFFERS:
                failures[0] -= 1
                return -600
            return self.real.register_buffer(ptr, size)

    use_client(monkeypatch, RegistrationsThatFail)
    with open_channel(mooncake_store.spec) as channel:
        channel.put("r", sample_outputs(4))
        assert same_rows(channel.get("r", timeout_s=5), sample_outputs(4))
        failures[0] = 10
        with pytest.raises(OmniPrefixCacheChannelError, match="failed with Mooncake code -600"):
            channel.put("s", sample_outputs(4))


def test_a_mooncake_buffer_whose_unregistration_failed_is_never_registered_over(
        mooncake_store: MooncakeStoreProcesses, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unregistration that fails (its metadata update timed out, in the soak) leaves the
    buffer's range registered with the store's client, which refuses any later registration
    that overlaps it ("does not support overlapped memory region", code -600). The channel
    keeps such a buffer's memory, so no later entry's buffer lands in that range: every put
    and get after it goes on."""
    failing = [1]

    class UnregistrationsThatFail(RealClient):
        """Its next unregistration of an entry's buffer fails (the client keeps the range)."""

        def unregister_buffer(self, ptr: int) -> int:
            if failing:
                failing.pop()
                return -600
            return self.real.unregister_buffer(ptr)

    use_client(monkeypatch, UnregistrationsThatFail)
    monkeypatch.setattr(mooncake_module, "_STILL_REGISTERED", kept := [])
    rows = {HIDDEN_KEY: torch.arange(256.0).reshape(1, 256)}  # a 1-row chunk: about 1 KiB
    with open_channel(mooncake_store.spec) as channel:
        for i in range(20):  # same-size entries: freed memory is handed out again at once
            channel.put(f"r{i}", rows)
            assert torch.equal(channel.get(f"r{i}", timeout_s=5)[HIDDEN_KEY], rows[HIDDEN_KEY])
        assert len(kept) == 1  # the buffer whose unregistration failed, never freed
        with pytest.raises(OmniPrefixCacheChannelError, match="Mooncake code -600"):
            with channel._registered(kept[0]):  # what a buffer allocated there would meet
                pass


@pytest.mark.parametrize("option", ["ttl=0", "wait=-1", "ttl=nan"])
def test_a_bad_shm_option_leaves_no_namespace_and_no_open_file(tmp_path: Path,
                                                                 option: str) -> None:
    with pytest.raises(ValueError):
        open_channel(f"shm://?dir={tmp_path}&{option}")
    assert list(tmp_path.iterdir()) == []
    assert open_files_under(tmp_path) == []


def open_files_under(folder: Path) -> list[str]:
    """What this process holds open in `folder` (other threads of the test process, a Mooncake
    client's among them, may open and close files of their own meanwhile)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if target.startswith(f"{folder}{os.sep}") or target == str(folder):
            held.append(target)
    return held


def _reserve_and_die(spec: str, nbytes: int) -> None:
    """In a forked child: take room for an entry, then die before publishing it."""
    other = open_channel(spec)
    assert other._reserve(nbytes, force=False) is not None
    os._exit(0)


@pytest.mark.skipif(sys.platform != "linux", reason="fork and /dev/shm: Linux")
def test_a_publisher_dead_between_reserve_and_publish_does_not_keep_its_room(
        tmp_path: Path) -> None:
    """Its temp file stays, but no live writer holds it: the next put that needs the room
    gets it. A live writer's room stays counted."""
    entry = {HIDDEN_KEY: torch.arange(900, dtype=torch.float32)}  # 3.6 KB
    with open_channel(f"shm://?dir={tmp_path}&capacity=8192&wait=0.3") as channel:
        child = multiprocessing.get_context("fork").Process(target=_reserve_and_die,
                                                            args=(channel.spec, 6000))
        child.start()
        child.join(30)
        assert child.exitcode == 0 and channel.used_bytes() == 6000
        channel.put("r", entry)
        assert torch.equal(channel.get("r", timeout_s=5)[HIDDEN_KEY], entry[HIDDEN_KEY])
        held = channel._reserve(6000, force=False)  # a live writer, mid-put
        with pytest.raises(OmniPrefixCacheChannelFullError):
            channel.put("s", entry)
        channel._unreserve(held)
        assert channel.used_bytes() == 0 and not any(tmp_path.glob("*/.tmp-*"))


def _put_and_report(channel: StageChannel, done: multiprocessing.Queue) -> None:
    """In a forked child: put one entry through the parent's handle, then say so."""
    channel.put("forked", sample_outputs(3))
    done.put("put")


@pytest.mark.skipif(sys.platform != "linux", reason="fork and /dev/shm: Linux")
def test_a_forked_child_waits_for_its_parents_namespace_lock() -> None:
    fork = multiprocessing.get_context("fork")
    done = fork.Queue()
    with open_channel("shm://?") as channel:
        with channel._locked():  # as a put or get of the parent holds it
            child = fork.Process(target=_put_and_report, args=(channel, done))
            child.start()
            time.sleep(1.0)
            assert done.empty(), "the child's put went on while the parent held the lock"
        try:
            assert done.get(timeout=30) == "put"
        finally:
            child.join(30)
            if child.is_alive():
                child.kill()
        assert same_rows(channel.get("forked", timeout_s=5), sample_outputs(3))


def test_a_mooncake_channel_that_cannot_register_its_buffers_closes_its_connection(
        mooncake_store: MooncakeStoreProcesses, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[Any] = []

    class RefusingRegistrations(RealClient):
        """Its buffer registrations fail (as when memory cannot be pinned); it records its
        close."""

        def __init__(self) -> None:
            super().__init__()
            self.closed = False
            opened.append(self)

        def register_buffer(self, ptr: int, size: int) -> int:
            return -1

        def close(self) -> int:
            self.closed = True
            return self.real.close()

    use_client(monkeypatch, RefusingRegistrations)
    with pytest.raises(OmniPrefixCacheChannelError, match="registering a .*-byte buffer failed"):
        open_channel(mooncake_store.spec)
    assert [store.closed for store in opened] == [True]


def test_mooncake_not_installed_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # as if the package were absent
    with pytest.raises(OmniPrefixCacheChannelError,
                       match="Mooncake Store's client does not import .*pip install mooncake"):
        MooncakeChannel("127.0.0.1:1", "http://127.0.0.1:2/metadata", "ns", ttl_s=1, owner=True)


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_2000_entries_leave_memory_flat(channel: StageChannel) -> None:
    outputs = {HIDDEN_KEY: torch.randn(64, 256), "codec_ids": torch.arange(64 * 8).reshape(64, 8)}

    def round_trips(first: int, count: int) -> None:
        for i in range(first, first + count):
            channel.put(f"req-{i}", outputs)
            assert channel.get(f"req-{i}", timeout_s=5)[HIDDEN_KEY].shape == (64, 256)

    round_trips(0, 200)  # warm up allocators and the backend's connections
    gc.collect()
    before = _rss_bytes()
    round_trips(200, 1800)
    gc.collect()
    grown = _rss_bytes() - before
    assert grown < 8 << 20, f"RSS grew {grown / 2**20:.1f} MiB over 1800 entries of 68 KiB"
    assert not any(is_published(channel, f"req-{i}") for i in range(0, 2000, 97))
    if isinstance(channel, ShmChannel):
        assert sorted(p.name for p in channel.directory.iterdir()) == [".budget", ".key", ".lock",
                                                                      ".owner", ".ring"]
        assert channel.used_bytes() == 0


# ---------------------------------------------------------------- duplicate ids, capacity

def _marked(i: int, rows: int = 4) -> dict[str, torch.Tensor]:
    return {HIDDEN_KEY: torch.full((rows, 8), float(i))}


def _mark(outputs: dict[str, torch.Tensor]) -> int:
    return int(outputs[HIDDEN_KEY][0, 0])


def test_entries_under_one_id_are_taken_in_put_order_each_once(channel: StageChannel) -> None:
    for i in range(3):
        channel.put("req-dup", _marked(i))
    assert _mark(channel.get("req-dup", timeout_s=5)) == 0
    channel.put("req-dup", _marked(3))  # joins behind the two unconsumed ones
    assert [_mark(channel.get("req-dup", timeout_s=5)) for _ in range(3)] == [1, 2, 3]
    with pytest.raises(OmniPrefixCacheChannelTimeoutError):
        channel.get("req-dup", timeout_s=0.1)
    channel.put("req-dup", _marked(4))  # a drained id starts over
    assert _mark(channel.get("req-dup", timeout_s=5)) == 4


def test_readers_racing_for_one_id_get_each_entry_exactly_once(channel: StageChannel) -> None:
    count = 60
    taken: list[list[int]] = [[], []]
    with open_channel(channel.spec) as other:
        def read(handle: StageChannel, into: list[int]) -> None:
            while len(taken[0]) + len(taken[1]) < count:
                try:
                    into.append(_mark(handle.get("req-shared", timeout_s=0.2)))
                except OmniPrefixCacheChannelTimeoutError:
                    pass

        readers = [threading.Thread(target=read, args=(h, t))
                   for h, t in ((channel, taken[0]), (other, taken[1]))]
        for r in readers:
            r.start()
        for i in range(count):
            channel.put("req-shared", _marked(i))
        for r in readers:
            r.join(60)
    assert sorted(taken[0] + taken[1]) == list(range(count))  # none lost, none twice
    assert taken[0] == sorted(taken[0]) and taken[1] == sorted(taken[1])  # each in put order


def test_mooncake_handles_publishing_under_one_id_are_taken_in_put_order(
        mooncake_store: MooncakeStoreProcesses) -> None:
    """A and B publish under `r` in turn, each into a chain of its own: the entries are taken
    in put order, and A's chain expiring (swept by A) takes nothing of B's."""
    with open_channel(mooncake_store.spec + "&ttl=1") as first, \
            open_channel(first.spec.replace("ttl=1", "ttl=60")) as second:
        first.put("r", _marked(1))
        assert _mark(second.get("r", timeout_s=5)) == 1
        second.put("r", _marked(2))
        first.put("r", _marked(3))
        second.put("r", _marked(4))
        assert [_mark(first.get("r", timeout_s=5)) for _ in range(3)] == [2, 3, 4]
        second.put("r", _marked(5))
        time.sleep(2.5)  # first's chain under `r` expires and is swept
        assert _mark(first.get("r", timeout_s=5)) == 5


def test_mooncake_a_put_between_a_takes_read_and_remove_survives(
        mooncake_store: MooncakeStoreProcesses) -> None:
    with open_channel(mooncake_store.spec) as publisher, \
            open_channel(publisher.spec) as reader:
        publisher.put("req-race", _marked(1))
        store = reader._store
        real_get_into = store.get_into

        class Interleaved:  # the reader's store, with a put landing right after its read
            def __getattr__(self, name: str) -> Any:
                return getattr(store, name)

            def get_into(self, key: str, ptr: int, size: int) -> int:
                read = real_get_into(key, ptr, size)
                if "/" in key[len(reader.namespace) + 1:]:  # an entry, not a tail
                    publisher.put("req-race", _marked(2))
                return read

        reader._store = Interleaved()
        try:
            assert _mark(reader.get("req-race", timeout_s=5)) == 1
        finally:
            reader._store = store
        assert _mark(reader.get("req-race", timeout_s=5)) == 2


def test_a_put_larger_than_the_capacity_fails_at_once(new_spec: str) -> None:
    with open_channel(new_spec + "&capacity=4096&wait=30") as channel:
        started = time.monotonic()
        with pytest.raises(OmniPrefixCacheChannelError,
                           match="request req-big: its entry of .* exceeds the most an entry can hold"):
            channel.put("req-big", _marked(0, rows=1024))
        assert time.monotonic() - started < 5


def test_a_full_channel_waits_bounded_then_fails_that_entry_alone(new_spec: str) -> None:
    with open_channel(new_spec + "&capacity=8192&wait=0.3") as channel:
        channel.put("req-a", _marked(1, rows=100))  # 3.2 KiB of rows, each
        channel.put("req-b", _marked(2, rows=100))
        started = time.monotonic()
        with pytest.raises(OmniPrefixCacheChannelError,
                           match="request req-c: channel .* stayed full for 0.3 s"):
            channel.put("req-c", _marked(3, rows=100))
        assert 0.3 <= time.monotonic() - started < 5
        channel.fail("req-c", "the channel stayed full")  # a failure marker goes in regardless
        with pytest.raises(OmniPrefixCacheChannelError, match="req-c: .* stayed full"):
            channel.get("req-c", timeout_s=5)
        assert _mark(channel.get("req-a", timeout_s=5)) == 1  # the others are intact
        channel.put("req-d", _marked(4, rows=100))  # room again once one was consumed
        assert _mark(channel.get("req-b", timeout_s=5)) == 2
        assert _mark(channel.get("req-d", timeout_s=5)) == 4


def test_a_full_put_goes_in_once_the_consumer_makes_room(new_spec: str) -> None:
    with open_channel(new_spec + "&capacity=8192&wait=30") as channel:
        channel.put("req-a", _marked(1, rows=100))
        channel.put("req-b", _marked(2, rows=100))
        consumer = threading.Timer(0.3, lambda: channel.get("req-a", timeout_s=5))
        consumer.start()
        started = time.monotonic()
        channel.put("req-c", _marked(3, rows=100))
        assert time.monotonic() - started >= 0.25
        consumer.join()
        assert [_mark(channel.get(r, timeout_s=5)) for r in ("req-b", "req-c")] == [2, 3]


# ---------------------------------------------------------------- rows read from a pool in place


class _Pool:
    """A pool's host rows of one key (`[slots, feat]` of `dtype`) and the `PoolRows` a finish
    hands the channel, counting their let-gos."""

    def __init__(self, slots: int, feat: int, dtype: torch.dtype, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randn(slots, feat, generator=g).to(dtype)
        self.let_gos = 0
        self.let_go = threading.Event()

    def _let_go(self) -> None:
        self.let_gos += 1
        self.let_go.set()

    def take(self, slots: list[int]) -> PoolRows:
        pool = self.rows.view(torch.uint8).numpy().reshape(len(self.rows), -1)
        return PoolRows(pool, np.array(slots, dtype=np.int64), (len(slots), self.rows.shape[1]),
                        self.rows.dtype, self._let_go)

    def expected(self, slots: list[int]) -> torch.Tensor:
        """The rows at `slots` as the pool holds them now, zeros at -1."""
        out = torch.zeros(len(slots), self.rows.shape[1], dtype=self.rows.dtype)
        for i, slot in enumerate(slots):
            if slot >= 0:
                out[i] = self.rows[slot]
        return out


def test_pool_rows_go_into_the_entry_as_the_pool_holds_them(channel: StageChannel) -> None:
    """A finish's read-back hands the channel its rows where the pool holds them: the entry
    has the rows of its slots in order, runs and single rows alike, zeros at absent rows (slot
    -1), beside tensors of other keys; a streamed chunk may be such rows too."""
    hidden, mm = _Pool(4096, 64, torch.bfloat16, 1), _Pool(64, 16, torch.float32, 2)
    hidden_slots = [*range(100, 1400), *range(5, 9), 4000, 3, -1, *range(2000, 1000, -1)]
    mm_slots = [-1, 7, -1, -1, 8, 9, 10, -1]
    codes = torch.arange(12).view(3, 4)
    channel.put("req-pool", {HIDDEN_KEY: hidden.take(hidden_slots), "mm": mm.take(mm_slots),
                             "codec_ids": codes})
    got = channel.get("req-pool", timeout_s=5)
    assert torch.equal(got[HIDDEN_KEY], hidden.expected(hidden_slots))
    assert torch.equal(got["mm"], mm.expected(mm_slots))
    assert torch.equal(got["codec_ids"], codes)
    # a streamed request's first chunk from the pool (a prefix hit's), its next from a step
    step_rows = torch.ones(3, 64, dtype=torch.bfloat16)
    channel.put("req-hit", {HIDDEN_KEY: hidden.take([8, 9, 10, 11])}, final=False)
    channel.put("req-hit", {HIDDEN_KEY: step_rows}, start=4)
    chunks = list(channel.stream("req-hit", timeout_s=5))
    assert [(c.start, c.final) for c in chunks] == [(0, False), (4, True)]
    assert torch.equal(chunks[0].rows[HIDDEN_KEY], hidden.expected([8, 9, 10, 11]))


def test_shm_pool_rows_that_cannot_be_read_fail_their_entry_alone() -> None:
    """A chunk whose pool rows name a slot past the pool is refused, naming its request,
    before any file is made; the chunks put with it are published."""
    pool = _Pool(64, 8, torch.float32, 4)
    with open_channel("shm") as channel:
        failures = channel.put_all([
            ("req-a", StageChunk({HIDDEN_KEY: pool.take([1, 2])}, 0, final=True)),
            ("req-b", StageChunk({HIDDEN_KEY: pool.take([3, 64])}, 0, final=True)),
            ("req-c", StageChunk({HIDDEN_KEY: pool.take([5])}, 0, final=True)),
        ])
        assert failures[0] is None and failures[2] is None
        assert isinstance(failures[1], ValueError)
        assert re.search(r"request req-b: .*reads slot 64, outside the pool's 64 rows",
                         str(failures[1]))
        assert torch.equal(channel.get("req-a", timeout_s=5)[HIDDEN_KEY], pool.expected([1, 2]))
        assert torch.equal(channel.get("req-c", timeout_s=5)[HIDDEN_KEY], pool.expected([5]))
        assert channel.used_bytes() == 0
        assert not any(p.name.startswith(".tmp-") for p in channel.directory.iterdir())


def test_a_put_that_waits_for_room_lets_the_pool_rows_go_before_it_waits(new_spec: str) -> None:
    """Pool rows stay pinned while the channel reads them: a put that finds no room copies
    them and lets them go before it waits, so a next tenant's write waits for no consumer.
    The entry still holds the rows as they were."""
    pool = _Pool(256, 8, torch.float32, 3)
    slots = list(range(40, 140))
    want = pool.expected(slots)
    with open_channel(new_spec + "&capacity=8192&wait=30") as channel:
        channel.put("req-a", _marked(1, rows=100))
        channel.put("req-b", _marked(2, rows=100))
        put = threading.Thread(target=channel.put, args=("req-c", {HIDDEN_KEY: pool.take(slots)}))
        put.start()
        assert pool.let_go.wait(5) and put.is_alive()  # let go, still waiting for room
        pool.rows.fill_(-1.0)  # the slots' next tenant
        assert _mark(channel.get("req-a", timeout_s=5)) == 1
        put.join(10)
        assert not put.is_alive() and pool.let_gos == 1
        assert _mark(channel.get("req-b", timeout_s=5)) == 2
        assert torch.equal(channel.get("req-c", timeout_s=5)[HIDDEN_KEY], want)


def test_shm_a_backlog_drains_with_one_scan_and_handles_taking_in_turn_each_get_the_oldest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer behind its producer (a streamed entry's chunks, then `get`) takes them
    without a scan of the namespace per chunk; a second handle taking from the same backlog
    meanwhile makes neither miss an entry nor take one out of order."""
    scans = 0
    entry_seqs = ShmChannel._entry_seqs

    def counted(self: ShmChannel, name: str) -> list[int]:
        nonlocal scans
        scans += 1
        return entry_seqs(self, name)

    monkeypatch.setattr(ShmChannel, "_entry_seqs", counted)
    with open_channel("shm") as channel, open_channel(channel.spec) as other:
        for start in range(300):
            channel.put("req-b", _marked(start, rows=1), start=start, final=start == 299)
        got = channel.get("req-b", timeout_s=5)
        assert [int(v) for v in got[HIDDEN_KEY][:, 0]] == list(range(300))
        assert scans <= 3
        for mark in range(6):
            channel.put("req-t", _marked(mark))
        taken = [_mark(handle.get("req-t", timeout_s=5))
                 for handle in (channel, other, other, channel, channel, other)]
        assert taken == list(range(6))  # each handle's kept numbers skip what the other took
        with pytest.raises(OmniPrefixCacheChannelTimeoutError):
            channel.get("req-t", timeout_s=0.1)
        assert not any(p.name.split(".")[0] == p.name and not p.name.startswith(".")
                       for p in channel.directory.iterdir())  # no marker left behind


def test_put_all_lets_a_written_entrys_pool_rows_go_before_another_waits_for_room(
        new_spec: str) -> None:
    """A step's finished entries put together: the pool rows of one written at once are let go
    while another of the same call still waits for room, so no new tenant of those slots waits
    for the channel's consumer."""
    pool = _Pool(256, 8, torch.float32, 5)
    with open_channel(new_spec + "&capacity=8192&wait=30") as channel:
        channel.put("req-a", _marked(1, rows=100))
        put = threading.Thread(target=channel.put_all, args=([
            ("req-p", StageChunk({HIDDEN_KEY: pool.take(list(range(10)))}, 0, final=True)),
            ("req-c", StageChunk(_marked(3, rows=150), 0, final=True))],))
        put.start()
        assert pool.let_go.wait(5) and put.is_alive()  # req-p written and let go; req-c waits
        assert _mark(channel.get("req-a", timeout_s=5)) == 1  # room for req-c
        put.join(10)
        assert not put.is_alive() and pool.let_gos == 1
        assert torch.equal(channel.get("req-p", timeout_s=5)[HIDDEN_KEY],
                           pool.expected(list(range(10))))
        assert _mark(channel.get("req-c", timeout_s=5)) == 3


@pytest.mark.parametrize("chunks", [1, 2], ids=["at once", "after waiting for room"])
def test_shm_a_published_put_never_fails_for_its_expectation(chunks: int) -> None:
    """A put renames its entry into place, then ends its handle's expectation of the id. Where
    that fails (here the expectation is a link, which the channel never follows), the entry is
    out all the same: the put returns, and no failure follows the entry."""
    with open_channel("shm://?capacity=8192&wait=5") as channel:
        channel.expect("r")
        path = channel._expectation_path(channel._name("r"))
        os.unlink(path)
        os.symlink("/nonexistent", path)
        if chunks == 2:  # the second put waits for room: published on its own
            channel.put("s", _marked(0, rows=150))
            threading.Timer(0.3, lambda: channel.get("s", timeout_s=5)).start()
        channel.put("r", _marked(1, rows=100))
        assert _mark(channel.get("r", timeout_s=5)) == 1
        with pytest.raises(OmniPrefixCacheChannelTimeoutError):
            channel.get("r", timeout_s=0.2)


def test_shm_a_put_waiting_for_room_recounts_the_namespace_about_once_a_second() -> None:
    """A put that finds no room polls the budget (a lock and a read) until room comes; it scans
    every file of the namespace under the lock (the recount) only now and then, not at each
    poll."""
    with open_channel("shm://?capacity=8192&wait=1") as channel:
        channel.put("req-a", _marked(1, rows=200))
        recounts = []
        recount = channel._free_stale
        channel._free_stale = lambda: recounts.append(1) or recount()
        with pytest.raises(OmniPrefixCacheChannelFullError):
            channel.put("req-b", _marked(2, rows=200))
        assert 1 <= len(recounts) <= 3


def test_shm_capacity_defaults_to_a_share_of_free_space_and_belongs_to_the_namespace() -> None:
    with open_channel("shm") as owner:
        st = os.statvfs(owner.directory)
        assert 0 < owner.capacity_bytes <= st.f_blocks * st.f_frsize
        with open_channel(owner.spec) as joined:
            assert joined.capacity_bytes == owner.capacity_bytes
        with pytest.raises(ValueError, match="capacity is set when a namespace is created"):
            open_channel(owner.spec + "&capacity=10")


def test_shm_bytes_a_dead_publisher_left_counted_are_recounted() -> None:
    with open_channel("shm://?capacity=8192&wait=0.2") as channel:
        channel.put("req-a", _marked(1, rows=100))
        with channel._locked():
            channel._add_used(8192)  # as a publisher killed between its reserve and its put
        channel.put("req-b", _marked(2, rows=100))  # the recount finds the room
        assert _mark(channel.get("req-a", timeout_s=5)) == 1
        assert _mark(channel.get("req-b", timeout_s=5)) == 2
        assert channel.used_bytes() == 0


@pytest.mark.slow
def test_2000_entries_through_a_tiny_channel_to_a_slow_consumer(new_spec: str) -> None:
    """A soak: the publisher outruns the consumer, so most puts wait for room; every entry
    arrives once, in order, and the channel never holds more than its capacity."""
    count, capacity = 2000, 16 << 10  # entries of 1.1 KiB: at most 14 unconsumed
    ids = [f"req-{i % 50}" for i in range(count)]  # ids reused 40 times each
    with open_channel(new_spec + f"&capacity={capacity}&wait=30") as channel, \
            open_channel(channel.spec) as reader:
        got: list[int] = []

        def consume() -> None:
            for i, rid in enumerate(ids):
                got.append(_mark(reader.get(rid, timeout_s=60)))
                if i % 100 == 0:
                    time.sleep(0.05)  # slower than the publisher now and then

        consumer = threading.Thread(target=consume)
        consumer.start()
        most = 0
        for i, rid in enumerate(ids):
            channel.put(rid, _marked(i, rows=32))
            most = max(most, channel.used_bytes())
        consumer.join(120)
    assert got == list(range(count))
    assert 0 < most <= capacity
