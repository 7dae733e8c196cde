#!/usr/bin/env bash
# Fourteenth session, third device call, at a529eab: issue 30's engine rows (M5e four ways, M8 on
# the 7B-class model), the 7B-class eager comparison profiled; carry .vllm-gpu and .profilers
bash benchmarks/h200_session.sh perf; echo "total $SECONDS s"
# afterwards, here: python -m prefix_cache.tools.profiling.device_trace on the two torch traces of
# perf-profiles/m5e-7b-eager (left out of the tarball, 21 MB each) -> device-trace-summary.txt
