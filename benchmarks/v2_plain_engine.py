"""Does vLLM's Model Runner V2 run here? A plain engine (vLLM's own worker, no cache), tiny
random Qwen2, bf16, V2 forced on; prints the runner class and the tokens, or the failure.

    VLLM_USE_V2_MODEL_RUNNER=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/v2_plain_engine.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from prefix_cache.tools.engines import Engine, EngineShape, write_random_qwen2


def main() -> int:
    from vllm import SamplingParams
    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_qwen2(Path(tmp) / "model")
        engine = Engine(model, EngineShape(block_size=16, num_blocks=49, dtype="bfloat16"))
        core = getattr(engine.engine.engine_core, "engine_core", None)
        if core is not None:
            print("runner:", type(core.model_executor.driver_worker.worker.model_runner))
        outs = engine.llm.generate([{"prompt_token_ids": list(range(1, 40 + i))} for i in range(4)],
                                   SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        print("tokens:", [list(o.outputs[0].token_ids) for o in outs])
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
