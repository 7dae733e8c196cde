"""Two vLLM engines in a pipeline: a thinker with the prefix cache hands its hidden states to a
talker, which decodes from them as `prompt_embeds`.

Both models are tiny random Qwen2s written here (nothing is downloaded). The thinker runs the
cache's worker: when a request finishes, its rows for every prompt position (those of a prefix
hit from the cache, the rest computed) go to the stage channel under the request's id. The
talker takes them from the channel as its prompt.

Prefix hits and batches: vLLM hashes a request's blocks when it schedules it, but a request hits
only blocks that an earlier request has already computed. Prompts submitted in one batch are
prefilled together and do not hit each other: submit the shared prefix first (here, the first
request alone), then the requests that share it.

Run it from anywhere once the package and vLLM are installed (on CPU, `bash ci/setup-cpu.sh`):
python examples/thinker_talker.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from prefix_cache import HIDDEN_KEY
from prefix_cache.channel import open_channel
from prefix_cache.tools.pipelines.engine_logs import new_log_path, output_to_log
from prefix_cache.tools.pipelines.engines import (multiprocessing_mode, start_talker,
                                                  start_thinker, write_random_qwen2)

SHARED = [(7 * i) % 1000 + 1 for i in range(64)]  # two 32-token blocks, shared by every prompt
PROMPTS = {"first": SHARED + [11, 12, 13, 14, 15],
           "second": SHARED + [21, 22, 23],
           "third": SHARED + [31, 32, 33, 34]}
#: The first request alone, then the two that share its prefix, together.
BATCHES = (("first",), ("second", "third"))
TALKER_TOKENS = 4


def main() -> int:
    from vllm import SamplingParams
    thinker_params = SamplingParams(max_tokens=1, detokenize=False)  # rows: the prompt's
    talker_params = SamplingParams(max_tokens=TALKER_TOKENS, temperature=0.0, ignore_eos=True,
                                   detokenize=False)
    # each engine in an engine-core process of its own: closing one leaves the other running;
    # vLLM's logs go to a file, this script's lines to the terminal
    log_path = new_log_path("thinker-talker")
    with tempfile.TemporaryDirectory() as tmp, open_channel("shm") as channel, \
            multiprocessing_mode(True), output_to_log(log_path) as terminal:
        thinker = start_thinker(write_random_qwen2(Path(tmp) / "thinker"), channel,
                                prefix_caching=True)
        talker = start_talker(write_random_qwen2(Path(tmp) / "talker", seed=1))
        try:
            for batch in BATCHES:
                outputs = thinker.llm.generate(
                    [{"prompt_token_ids": PROMPTS[name]} for name in batch], thinker_params,
                    use_tqdm=False)
                for name, output in zip(batch, outputs, strict=True):
                    rows = channel.get(output.request_id)[HIDDEN_KEY]
                    (spoken,) = talker.llm.generate([{"prompt_embeds": rows}], talker_params,
                                                    use_tqdm=False)
                    print(f"{name}: {len(PROMPTS[name])} prompt tokens, "
                          f"{output.num_cached_tokens or 0} from the prefix cache, "
                          f"{rows.shape[0]} rows to the talker, talker tokens "
                          f"{list(spoken.outputs[0].token_ids)}", file=terminal)
        finally:
            talker.close()
            thinker.close()
    print(f"vLLM's logs: {log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
