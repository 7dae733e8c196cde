"""Inside vllm-omni: this cache in place of vllm-omni 0.30's own `vllm_omni.core.prefix_cache`.

`adapter` presents vllm-omni's manager API over this project's manager; `plugin` is the
`vllm.general_plugins` entry point that, when asked (`OMNI_PREFIX_CACHE_IN_VLLM_OMNI=1`), makes
vllm-omni's runners build it; `cpu_worker` runs vllm-omni's autoregressive stages on vLLM's CPU
build, which vllm-omni has no platform for. Only `plugin` imports without vllm-omni.
"""
