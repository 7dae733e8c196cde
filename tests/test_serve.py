"""`vllm serve` as a stage: vLLM's OpenAI server with the cache's worker publishes each choice's
rows under the key its response names (`served_channel_keys`), equal to an in-process engine's
rows with prefix caching off for the same prompt tokens. The server is the one
`prefix_cache.tools.pipelines.served` starts (`python -m vllm.entrypoints.openai.api_server`,
the module `vllm serve` runs), as `examples/serve_stage.py` does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from prefix_cache import HIDDEN_KEY  # noqa: E402
from prefix_cache.channel import StageChannel, open_channel  # noqa: E402
from prefix_cache.integration.serving import served_channel_keys  # noqa: E402
from prefix_cache.tools.demo import vllm_device  # noqa: E402
from prefix_cache.tools.pipelines.engines import multiprocessing_mode, start_thinker  # noqa: E402
from prefix_cache.tools.pipelines.served import (  # noqa: E402
    Server, serving, write_word_tokenizer)
from tests.vllm_fixtures import thinker_model_dir  # noqa: E402,F401

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
PREFIX = " ".join(f"w{i}" for i in range(10, 80))  # 70 tokens: two full blocks shared
#: How far another engine's rows (prefix caching off) may be from the served ones. On the GPU its
#: kernels split a suffix's attention and GEMMs otherwise (float32 rows 2.7e-3 apart on the H200);
#: the rows a hit serves are compared bit for bit instead.
OTHER_ENGINE_ATOL = {"cpu": 1e-4, "cuda": 1e-2}


@pytest.fixture(scope="module")
def channel() -> Iterator[StageChannel]:
    with open_channel() as opened:
        yield opened


@pytest.fixture(scope="module")
def server(thinker_model_dir: Path, channel: StageChannel,  # noqa: F811
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from transformers import AutoConfig
    vocab_size = AutoConfig.from_pretrained(thinker_model_dir).vocab_size
    tokenizer_dir = write_word_tokenizer(tmp_path_factory.mktemp("tokenizer"), vocab_size)
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with serving(thinker_model_dir, tokenizer_dir, channel.spec, log,
                 {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                              os.environ.get("PYTHONPATH")]))}
                 ) as up:
        yield up


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
        server: Server, channel: StageChannel, thinker_model_dir: Path) -> None:  # noqa: F811
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
               channel.get(served_channel_keys(r)[0], timeout_s=30)[HIDDEN_KEY])
              for r in (first, second)]
    served.append((chat["prompt_token_ids"], chat["choices"][0]["token_ids"],
                   channel.get(served_channel_keys(chat)[0], timeout_s=30)[HIDDEN_KEY]))
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
def test_each_sample_of_n_is_under_its_own_key(server: Server, channel: StageChannel,
                                               path: str, body: dict[str, Any]) -> None:
    response = server.post(path, {**body, "n": 2, "max_tokens": 2, "temperature": 1.0,
                                  "ignore_eos": True}, f"n2{path.replace('/', '-')}")
    keys = served_channel_keys(response, n=2)
    if path == "/v1/completions":
        assert keys == [f"{s}_{response['id']}-{p}" for p in (0, 1) for s in (0, 1)]
    else:
        assert keys == [f"{s}_{response['id']}" for s in (0, 1)]
    entries = [channel.get_entry(key, timeout_s=30) for key in keys]
    assert not any(entry.aborted for entry in entries)
    assert len({entry.outputs[HIDDEN_KEY].shape[0] for entry in entries[:2]}) == 1
