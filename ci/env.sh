# Environment for vLLM's CPU engine in tests and the demo (sourced by the ci scripts).
export TORCH_DEVICE_BACKEND_AUTOLOAD=0   # a torch_npu without CANN must not break `import torch`
export VLLM_PLUGINS=                     # no out-of-tree platform (vllm-ascend) may take over
export VLLM_HOST_IP=127.0.0.1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1
export VLLM_USE_V2_MODEL_RUNNER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
