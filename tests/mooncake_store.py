"""A Mooncake Store on loopback for tests: master, HTTP metadata server and a segment holder.

Every listener these processes are told about binds 127.0.0.1 on a free port (the master's
embedded metadata server would bind 0.0.0.0, so the metadata server runs on its own). Mooncake's
transfer engine inside the holder listens on all interfaces, which Mooncake cannot change; the
processes live only as long as the fixture. They are stopped by PID: SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

HOST = "127.0.0.1"
_START_TIMEOUT_S = 20.0
_STOP_TIMEOUT_S = 5.0


def mooncake_missing_reason() -> str | None:
    """Why Mooncake Store's client cannot be used here, or None when it can."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as e:
        return f"Mooncake Store is not importable ({e}); ci/setup-cpu.sh installs it"
    return None


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _http_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # it answered: the metadata server says 404 for an unknown key
    except OSError:
        return False


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((HOST, port)) == 0


class MooncakeStoreProcesses:
    """The three processes of a loopback Mooncake Store; `spec` reaches it while it runs."""

    def __init__(self, log_dir: Path, *, segment_bytes: int = 1 << 30) -> None:
        self.log_dir = log_dir
        self.rpc_port, self.metrics_port = free_port(), free_port()
        self.metadata_port, self.holder_port = free_port(), free_port()
        self.master = f"{HOST}:{self.rpc_port}"
        self.metadata_url = f"http://{HOST}:{self.metadata_port}/metadata"
        self._segment_bytes = segment_bytes
        self._procs: list[subprocess.Popen] = []

    @property
    def spec(self) -> str:
        """A new channel namespace in this store."""
        return f"mooncake://{self.master}?metadata={self.metadata_url}"

    def start(self) -> MooncakeStoreProcesses:
        try:
            self._spawn("mooncake_master", f"--rpc_address={HOST}", f"--rpc_port={self.rpc_port}",
                        f"--metrics_host={HOST}", f"--metrics_port={self.metrics_port}",
                        "--enable_http_metadata_server=false")
            self._spawn("mooncake_http_metadata_server", f"--host={HOST}",
                        f"--port={self.metadata_port}", "--log-level=WARNING")
            self._wait(f"master health on {HOST}:{self.metrics_port}", lambda: _http_answers(
                f"http://{HOST}:{self.metrics_port}/health"))
            self._wait(f"metadata server on {self.metadata_url}",
                       lambda: _http_answers(self.metadata_url + "?key=probe"))
            self._spawn("mooncake_client", f"--host={HOST}", f"--port={self.holder_port}",
                        f"--global_segment_size={self._segment_bytes}", "--local_buffer_size=0",
                        f"--master_server_address={self.master}",
                        f"--metadata_server={self.metadata_url}")
            # The holder listens on its port once its segment is mounted.
            self._wait(f"segment holder on {HOST}:{self.holder_port}",
                       lambda: _accepts(self.holder_port))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM each process by PID, newest first; SIGKILL what outlives the bound."""
        while self._procs:
            proc = self._procs.pop()
            proc.terminate()
            try:
                proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> MooncakeStoreProcesses:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, program: str, *args: str) -> None:
        path = Path(sysconfig.get_path("scripts")) / program
        log = open(self.log_dir / f"{program}.log", "wb")
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": HOST}
        with log:
            self._procs.append(subprocess.Popen([str(path), *args], stdout=log,
                                                stderr=subprocess.STDOUT, env=env))

    def _wait(self, what: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not ready():
            exited = [p for p in self._procs if p.poll() is not None]
            if exited or time.monotonic() > deadline:
                logs = "; ".join(f"{p.name}: {p.read_text()[-400:]!r}"
                                 for p in sorted(self.log_dir.glob("*.log")))
                why = f"{exited[0].args[0]} exited" if exited else f"{_START_TIMEOUT_S:g} s passed"
                raise RuntimeError(f"Mooncake Store did not start: waiting for {what}, {why}; "
                                   f"{logs}")
            time.sleep(0.05)
