"""A stage served by `vllm serve`: two completions that share a prefix, the second's prompt
partly from vLLM's prefix cache, and each one's rows taken off the stage channel under the key
its response names.

The model is a tiny random Qwen2 written here with a word-level tokenizer (`w0 w1 ...`), so
nothing is downloaded and text prompts work. The server runs the cache's worker with prefix
caching on and `--enable-prompt-tokens-details` (without it a response does not say how many
prompt tokens were cached), in float32 with 32-token blocks: a prompt hits only whole blocks
an earlier request computed. docs/vllm.md ("Serving") gives the same command for a model of
your own.

Run it from anywhere once the package and vLLM are installed (on CPU, `bash ci/setup-cpu.sh`):
python examples/serve_stage.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from prefix_cache import HIDDEN_KEY
from prefix_cache.channel import open_channel
from prefix_cache.integration.serving import served_channel_keys
from prefix_cache.tools.pipelines.engines import write_random_qwen2
from prefix_cache.tools.pipelines.engine_logs import new_log_path
from prefix_cache.tools.pipelines.served import serving, write_word_tokenizer

SHARED = " ".join(f"w{i}" for i in range(10, 80))  # 70 words: two whole 32-token blocks
PROMPTS = {"first": SHARED + " w5 w6", "second": SHARED + " w7"}
GREEDY = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
VOCAB = 1024


def main() -> int:
    from transformers.utils.logging import disable_progress_bar
    disable_progress_bar()  # writing the model: this script's lines alone on the terminal
    log = new_log_path("serve")
    with tempfile.TemporaryDirectory() as tmp, open_channel() as channel:
        model = write_random_qwen2(Path(tmp) / "model", vocab_size=VOCAB)
        tokenizer = write_word_tokenizer(Path(tmp) / "tokenizer", VOCAB)
        with serving(model, tokenizer, channel.spec, log) as server:
            for name, prompt in PROMPTS.items():  # one after the other: the second hits
                response = server.post("/v1/completions", {**GREEDY, "prompt": prompt}, name)
                [key] = served_channel_keys(response)
                rows = channel.get(key, timeout_s=30)[HIDDEN_KEY]
                usage = response["usage"]
                print(f"{name}: {usage['prompt_tokens']} prompt tokens, "
                      f"{usage['prompt_tokens_details']['cached_tokens']} from the prefix cache; "
                      f"{rows.shape[0]} rows under {key!r}")
    print(f"the server's log: {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
