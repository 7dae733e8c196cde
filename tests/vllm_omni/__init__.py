"""Tests that run vllm-omni's engine: only in the vllm-omni environment (ci/setup-vllm-omni.sh)."""
