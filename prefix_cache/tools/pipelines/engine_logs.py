"""vLLM's logs to a file of the run's own: the tools' terminals keep their own lines only.

vLLM logs, warns and draws progress bars on stdout and stderr, from this process and from its
engine-core processes; `output_to_log` redirects both file descriptors, children included.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO


@contextmanager
def output_to_log(path: Path) -> Iterator[TextIO]:
    """Send this process's and its children's stdout/stderr (vLLM's logs, warnings, native
    messages) to `path`; yield a stream to the terminal for the demo's own lines."""
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(1), "w", buffering=1)
    saved_err = os.dup(2)
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield terminal
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(terminal.fileno(), 1)
        os.dup2(saved_err, 2)
        os.close(saved_err)
        terminal.close()


def new_log_path(tool: str) -> Path:
    """A log file of this run's own (concurrent runs must not share one), kept afterwards."""
    fd, name = tempfile.mkstemp(prefix=f"omni-prefix-cache-{tool}-", suffix=".log")
    os.close(fd)
    return Path(name)
