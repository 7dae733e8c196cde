"""vLLM workers whose model runner carries the stage-output cache, one module per device.

`base` holds what every worker shares (adopting the runner, the scheduler's finish
reports, the stats RPC); `cpu`, `gpu` and `npu` import their vLLM (or vllm-ascend)
worker and nothing else: importing `gpu` or `npu` never loads vLLM's CPU worker,
whose `cpu/shm.py` replaces torch's CUDA stream and event classes at import.
Users name the classes through `prefix_cache.vllm_runners`, which loads only the
module asked for.
"""
