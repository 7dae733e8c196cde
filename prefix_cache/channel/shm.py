"""The shared-memory channel: one file per entry in a private directory under /dev/shm.

The namespace is a directory (mode 0700) with a random name, created by the channel opened
without one (its owner). Entries are files (mode 0600) named by an HMAC of the request id under
a random key kept in the directory, so neither a request id nor the namespace's name alone
gives a file's name. A put writes a temporary file and renames it into place; a get renames the
file to a private name (so exactly one reader claims it), maps it and unlinks it: the tensors it
returns are views of a mapping no one else can reach. Any handle frees entries older than the
time to live as it puts or gets; the owner's close removes the whole directory.
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
import weakref
from pathlib import Path
from urllib.parse import parse_qs, urlencode

import torch

from prefix_cache.channel.base import DEFAULT_TTL_S, StageChannel
from prefix_cache.channel.codec import EncodedEntry
from prefix_cache.channel.errors import OmniPrefixCacheChannelError

NAMESPACE_PREFIX = "omni-prefix-cache-"
_KEY_FILE = ".key"
_TEMP_PREFIX = ".tmp-"
_CLAIM_PREFIX = ".claim-"
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


def default_root() -> Path:
    """/dev/shm where the system has it, else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def _remove_namespace(directory: Path, owner_pid: int) -> None:
    if os.getpid() == owner_pid:  # a forked copy of the owner must not remove it
        shutil.rmtree(directory, ignore_errors=True)


def _create_private_file(path: Path) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # exact, whatever the umask
    return fd


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


class ShmChannel(StageChannel):
    """Entries of one namespace directory; the directory exists from create until the owner
    closes, and only this user can list or read it."""

    def __init__(self, directory: Path, *, ttl_s: float, owner: bool) -> None:
        super().__init__(ttl_s=ttl_s)
        self.directory = directory
        self._key = self._read_key()
        self._finalizer = (weakref.finalize(self, _remove_namespace, directory, os.getpid())
                           if owner else None)

    @classmethod
    def create(cls, root: Path | None = None, *, ttl_s: float = DEFAULT_TTL_S) -> ShmChannel:
        """A new namespace under `root` (default `default_root()`), owned by the returned handle."""
        root = root or default_root()
        directory = root / (NAMESPACE_PREFIX + secrets.token_hex(16))
        try:
            os.mkdir(directory, 0o700)
            os.chmod(directory, 0o700)  # exact, whatever the umask
            fd = _create_private_file(directory / _KEY_FILE)
            try:
                _write_all(fd, memoryview(secrets.token_bytes(32)), 0)
            finally:
                os.close(fd)
        except OSError as e:
            shutil.rmtree(directory, ignore_errors=True)
            raise OmniPrefixCacheChannelError(
                f"shm channel: cannot create a namespace under {root}: {e}") from e
        return cls(directory, ttl_s=ttl_s, owner=True)

    @classmethod
    def join(cls, name: str, root: Path | None = None, *,
             ttl_s: float = DEFAULT_TTL_S) -> ShmChannel:
        """The existing namespace `name` under `root`; refused unless private to this user."""
        if not _NAMESPACE_RE.fullmatch(name):
            raise ValueError(f"shm channel namespace {name!r} is not a plain directory name")
        directory = (root or default_root()) / name
        try:
            st = os.lstat(directory)
        except FileNotFoundError:
            raise OmniPrefixCacheChannelError(
                f"shm channel namespace {directory} does not exist (never created, or its "
                f"owner closed it)") from None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise OmniPrefixCacheChannelError(
                f"shm channel namespace {directory} is not a directory private to this user "
                f"(mode {stat.filemode(st.st_mode)}, uid {st.st_uid}); refusing it")
        return cls(directory, ttl_s=ttl_s, owner=False)

    @classmethod
    def from_spec(cls, namespace: str, query: str) -> ShmChannel:
        """`shm://[NAMESPACE][?dir=ROOT&ttl=SECONDS]`: no namespace creates one."""
        options = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
        unknown = options.keys() - {"dir", "ttl"}
        if unknown:
            raise ValueError(f"shm channel spec: unknown option(s) {sorted(unknown)}; "
                             f"known: dir, ttl")
        root = Path(options["dir"]) if "dir" in options else None
        ttl_s = float(options.get("ttl", DEFAULT_TTL_S))
        if namespace:
            return cls.join(namespace, root, ttl_s=ttl_s)
        return cls.create(root, ttl_s=ttl_s)

    @property
    def spec(self) -> str:
        query = urlencode({"dir": str(self.directory.parent), "ttl": f"{self.ttl_s:g}"},
                          safe="/")
        return f"shm://{self.directory.name}?{query}"

    def entry_path(self, request_id: str) -> Path:
        """Where the entry of `request_id` lies while it is published and unconsumed."""
        name = hmac.new(self._key, request_id.encode(), hashlib.sha256).hexdigest()
        return self.directory / name

    def _read_key(self) -> bytes:
        path = self.directory / _KEY_FILE
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise OmniPrefixCacheChannelError(
                f"shm channel namespace {self.directory} has no readable key: {e}") from e
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise OmniPrefixCacheChannelError(
                    f"shm channel key {path} is not private to this user "
                    f"(mode {stat.filemode(st.st_mode)}, uid {st.st_uid}); refusing it")
            return os.read(fd, 64)
        finally:
            os.close(fd)

    def _publish(self, request_id: str, encoded: EncodedEntry) -> None:
        temp = self.directory / (_TEMP_PREFIX + secrets.token_hex(8))
        try:
            fd = _create_private_file(temp)
            try:
                os.ftruncate(fd, encoded.nbytes)
                for offset, piece in encoded.pieces:
                    _write_all(fd, piece, offset)
            finally:
                os.close(fd)
            os.rename(temp, self.entry_path(request_id))
        except OSError as e:
            temp.unlink(missing_ok=True)
            raise OmniPrefixCacheChannelError(
                f"shm channel {self.spec}: cannot publish the entry for request {request_id} "
                f"({encoded.nbytes} bytes): {e}") from e

    def _take(self, request_id: str) -> torch.Tensor | None:
        claim = self.directory / (_CLAIM_PREFIX + secrets.token_hex(8))
        try:
            os.rename(self.entry_path(request_id), claim)
        except FileNotFoundError:
            if not self.directory.is_dir():
                raise OmniPrefixCacheChannelError(
                    f"shm channel namespace {self.directory} is gone (its owner closed it) while "
                    f"waiting for request {request_id}") from None
            return None
        try:
            fd = os.open(claim, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None  # swept as expired between the claim and the open
        try:
            os.unlink(claim)
            size = os.fstat(fd).st_size
            if size == 0:
                return torch.empty(0, dtype=torch.uint8)  # not an entry: decode says so
            view = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return torch.frombuffer(view, dtype=torch.uint8)  # the mapping lives as long as it

    def _sweep(self) -> None:
        expired_before = time.time() - self.ttl_s
        try:
            files = list(os.scandir(self.directory))
        except FileNotFoundError:
            return  # the owner closed the namespace
        for f in files:
            try:
                if f.name != _KEY_FILE and f.stat(follow_symlinks=False).st_mtime < expired_before:
                    os.unlink(f.path)
            except FileNotFoundError:
                pass  # consumed or swept meanwhile

    def _close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
