#!/usr/bin/env bash
# One H200 session's measurements, each part one device call of under 10 minutes, from the
# repository root of the device machine's copy (outputs under $OUT, default ./h200-out):
#
#   bash benchmarks/h200_session.sh units    # CUDA unit suites, three shards side by side
#                                            # (one suite ran past 420 s on 2026-12-03);
#                                            # each cut at 540 s by SIGINT, so pytest still
#                                            # names what failed
#   bash benchmarks/h200_session.sh bench    # the quick bench (5 runs), the hit gather's
#                                            # thread sweep
#   bash benchmarks/h200_session.sh engine   # the GPU engine tests without preemption:
#                                            # in-process, V2, the CUDA graph case,
#                                            # multiprocess, the multimodal key (about 65 s each
#                                            # on an H100), every save by DMA; needs .vllm-gpu/,
#                                            # a copy of ../shared/tools/vllm-gpu (carry it)
#   bash benchmarks/h200_session.sh preempt  # the GPU engine tests with preemption (V1 and V2,
#                                            # an abort while preempted), every save by DMA;
#                                            # needs .vllm-gpu/ (carry it)
#   bash benchmarks/h200_session.sh stream   # the streaming engine tests (preemption while
#                                            # streaming included), stream_step_cost.py (M9c
#                                            # without vLLM), then stream_bench (M9),
#                                            # M9c profiled when .profilers/ is carried too;
#                                            # needs .vllm-gpu/ (carry it)
#   bash benchmarks/h200_session.sh serve    # the `vllm serve` test (vLLM's OpenAI server with
#                                            # the cache's GPU worker); needs .vllm-gpu/ and
#                                            # .serve-wheels/ (carry both): the server's packages
#                                            # the bundle lacks, fetched on a machine with a
#                                            # registry by `pip download --no-deps
#                                            # --only-binary=:all: --python-version 3.12 -d
#                                            # .serve-wheels uvicorn==0.55.0
#                                            # prometheus-fastapi-instrumentator==8.1.0
#                                            # watchfiles==1.3.0 jmespath==1.1.0 supervisor==4.3.0
#                                            # model-hosting-container-standards==0.1.16`
#   bash benchmarks/h200_session.sh tp2      # on the two-GPU machine (nvidia-h200-x2): the
#                                            # GPU engine's tensor-parallel case and the
#                                            # reliability suite's second-GPU case; needs
#                                            # .vllm-gpu/ (carry it)
#   bash benchmarks/h200_session.sh perf     # issue 30 in about 6 minutes: pipeline_bench's
#                                            # M5e on the 7b model eager (with the profile) and
#                                            # with CUDA graphs, M8 on 7b, M5e on the small
#                                            # model eager and with graphs (340 s on an H100,
#                                            # 2026-12-06); needs .vllm-gpu/ and, for
#                                            # py-spy, .profilers/ (a copy of
#                                            # ../shared/tools/profilers; carry both)
#   bash benchmarks/h200_session.sh variants # M5e for copies of the tree with one part of
#                                            # the step work taken out
#                                            # (benchmarks/m5e_variants.py; $VARIANTS, default
#                                            # full,nodev,off, each
#                                            # $ROUNDS times in turn, default 1; a variant
#                                            # takes about 100 s), small model with graphs;
#                                            # needs .vllm-gpu/ (carry it)
#
# Each part installs the package (editable, no build isolation: the machine has no registry)
# and writes what it ran and printed to $OUT/<part>.log. perf gives each step a timeout of its
# own, cut to what is left of PERF_BUDGET_S (default 540 s), and goes on after a failed step;
# it leaves 8 files: perf.log, install.log, one JSON per pipeline_bench run and
# perf-profiles.tar.gz (the profiles and vLLM's logs of each run).
set -uo pipefail
part=${1:?usage: h200_session.sh units|bench|engine|preempt|stream|serve|tp2|perf|variants}
case "$part" in units|bench|engine|preempt|stream|serve|tp2|perf|variants) ;; *)
    echo "unknown part $part (units, bench, engine, preempt, stream, serve, tp2, perf or" \
         "variants)"; exit 2 ;;
esac
out=${OUT:-h200-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
log="$out/$part.log"
run() { echo "+ $*" | tee -a "$log"; "$@" 2>&1 | tee -a "$log" | tail -25; }
budget_end=$((SECONDS + ${PERF_BUDGET_S:-540}))
# step LIMIT CMD...: CMD under `timeout`, LIMIT seconds or what is left of the budget
step() {
    local limit=$1 left=$((budget_end - SECONDS)) start=$SECONDS; shift
    if [ "$left" -lt 45 ]; then
        echo "skipped, ${left} s of the budget left: $*" | tee -a "$log"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    run timeout -k 15 "$limit" "$@"
    echo "= exit $?, $((SECONDS - start)) s (limit ${limit} s)" | tee -a "$log"
}

if [ "$part" != units ] && [ "$part" != bench ]; then
    eval "$(bash .vllm-gpu/install.sh)" \
        || { echo "vllm-gpu install failed" | tee -a "$log"; exit 1; }
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$out/install.log" 2>&1 \
    || { tail -20 "$out/install.log"; exit 1; }

case "$part" in
units)
    # three shards side by side (one suite ran past 7 minutes): each cut at 540 s by SIGINT,
    # so pytest still names what failed; a shard's own log is $out/units-<n>.log
    shards=("tests/test_backend_conformance.py tests/test_output_buffers.py
             tests/test_manager_random.py tests/test_cuda_dma.py tests/test_engine_thread.py"
            "tests/test_reliability.py tests/test_devices.py tests/test_trace_replay.py"
            "tests/test_manager.py tests/test_dma_issuer.py tests/test_scatter_bounds.py")
    for i in "${!shards[@]}"; do
        # shellcheck disable=SC2086  # each shard is a list of files
        timeout -s INT -k 30 540 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
            --durations=5 -m "not npu and not vllm" \
            -k "cuda or engine_thread or scatter_bounds or dma" ${shards[$i]} \
            >"$out/units-$i.log" 2>&1 &
    done
    wait
    for i in "${!shards[@]}"; do
        echo "+ shard $i: ${shards[$i]//[[:space:]]/ }" | tee -a "$log"
        tail -30 "$out/units-$i.log" | tee -a "$log"
    done
    ;;
bench)
    run timeout 180 python3 -m prefix_cache bench --device cuda --quick --runs 5 \
        --json "$out/bench_quick5.json"
    # the hit gather's kept copy threads (8161819) against torch, pinned and pageable pools
    run timeout 60 env PYTHONPATH=. python3 benchmarks/gather_sweep.py --pinned
    run timeout 60 env PYTHONPATH=. python3 benchmarks/gather_sweep.py
    ;;
engine|preempt)
    # the nine single-GPU engine tests take about 10 minutes: two calls (the last test was cut
    # twice on 2026-12-06, when they shared a call with other work)
    tests="in-process or v2-main or graphs or multiprocess or multimodal"
    [ "$part" = preempt ] && tests="preempted or v2-preempt"
    step 530 env OMNI_PREFIX_CACHE_CUDA_DMA_MIN_BYTES=0 python3 -m pytest -v \
        -p no:cacheprovider tests/test_gpu_engine.py -k "$tests"
    ;;
stream)
    run timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_stream_engine.py
    # M9c's comparison without vLLM on this host's cores (CPU backend; 2-core figures in
    # BENCHMARKS.md, eighth session): what a streaming step's job costs an engine thread here
    run timeout 60 env PYTHONPATH=".:$PYTHONPATH" python3 benchmarks/stream_step_cost.py
    # with py-spy from the carried wheel, M9c's decode steps are profiled after the runs
    # (streaming on and off, 10 s each): where the GPU's 2.7 ms a step went (H100, 2026-12-05)
    profile=()
    ls .profilers/py_spy-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index \
        --no-deps .profilers/py_spy-*.whl >>"$out/install.log" 2>&1 \
        && profile=(--profile "$out/m9c-profile")
    run timeout 330 python3 -m prefix_cache.tools.stream_bench --runs 5 \
        --json "$out/stream_bench.json" "${profile[@]}"
    if [ -d "$out/m9c-profile" ]; then
        tar -czf "$out/m9c-profile.tar.gz" -C "$out" m9c-profile && rm -rf "$out/m9c-profile"
    fi
    ;;
serve)
    site=${PYTHONPATH%%:*}  # the bundle's target folder, first on the path install.sh printed
    python3 -m pip install -q --no-index --no-deps --target "$site" .serve-wheels/*.whl \
        >>"$out/install.log" 2>&1 || { echo "serve wheels install failed" | tee -a "$log"; exit 1; }
    run timeout 400 python3 -m pytest -q -p no:cacheprovider -rs tests/test_serve.py
    ;;
tp2)
    run timeout 420 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_engine.py \
        -k tensor_parallel
    run timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_reliability.py \
        -k second_gpu
    ;;
perf)
    # py-spy from the carried wheel; without it pipeline_bench profiles with torch's profiler only
    ls .profilers/py_spy-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index \
        --no-deps .profilers/py_spy-*.whl >>"$out/install.log" 2>&1
    echo "py-spy: $(command -v py-spy || echo 'not installed')" | tee -a "$log"
    profiles=/tmp/perf-profiles
    rm -rf "$profiles" /tmp/omni-prefix-cache-pipeline-bench-*.log
    bench=(python3 -m prefix_cache.tools.pipeline_bench)
    # on a warm H100 (2026-12-06): 77 s, 66, 88, 35, 68 (the graph test runs in `engine`)
    step 200 "${bench[@]}" --only M5e --model 7b --runs 5 --profile "$profiles/m5e-7b-eager" \
        --profile-seconds 6 --json "$out/m5e-7b-eager.json"
    step 150 "${bench[@]}" --only M5e --model 7b --cudagraphs --runs 5 \
        --json "$out/m5e-7b-graphs.json"
    # 5 runs, as SPEC §8 asks: the off runs of one call spread 0.42-0.58 s (H100, 2026-12-05)
    step 260 "${bench[@]}" --only M8 --model 7b --runs 5 --json "$out/m8-7b.json"
    step 100 "${bench[@]}" --only M5e --model small --runs 5 --json "$out/m5e-small-eager.json"
    step 130 "${bench[@]}" --only M5e --model small --cudagraphs --runs 5 \
        --json "$out/m5e-small-graphs.json"
    mkdir -p "$profiles/vllm-logs"
    cp /tmp/omni-prefix-cache-pipeline-bench-*.log "$profiles/vllm-logs/" 2>/dev/null
    tar -czf "$out/perf-profiles.tar.gz" -C "$(dirname "$profiles")" "$(basename "$profiles")"
    if [ "$(stat -c %s "$out/perf-profiles.tar.gz")" -gt $((15 * 1024 * 1024)) ]; then
        echo "profiles over 15 MiB: the torch traces left out" | tee -a "$log"
        tar -czf "$out/perf-profiles.tar.gz" --exclude '*.torch-trace.json' \
            -C "$(dirname "$profiles")" "$(basename "$profiles")"
    fi
    ls -l "$out" | tee -a "$log"
    ;;
variants)
    step 540 python3 benchmarks/m5e_variants.py --out "$out" --rounds "${ROUNDS:-1}" \
        --variants "${VARIANTS:-full,nodev,off}"
    ;;
esac
