#!/usr/bin/env bash
# Run on a lent GPU machine (device tool, `carry: [".gpu"]`, after tools/gpu_prepare.sh):
# the checks and figures the GPU issue asks for, logs under $OUT (or gpu-out/). Each step
# is one device call that fits the 10-minute limit; run them in this order:
#   tools/gpu_run.sh tests       GPU tests only (Triton kernels on the device, CUDA graphs vs
#                                eager, parity with transformers: fp32 exact, bf16 close); the
#                                interpreter and sm_90 compile tests run on CPU in the suite
#   tools/gpu_run.sh latency     llama-3-8b (dummy weights, bf16): TPOT at batch 1, 8, 64
#                                beside the bandwidth roofline; CUDA-graph capture time
#   tools/gpu_run.sh latency-pdl the same with TESSERA_PDL=1 (programmatic dependent launch:
#                                tessera/ops/triton/launch.py), to compare
#   tools/gpu_run.sh throughput  THROUGHPUT_PROMPTS (default 1000) x 1000 in / 1000 out;
#                                arguments after it go to the engine: as is (async scheduling,
#                                CUDA's default), with --no-async-scheduling (the host's work
#                                not overlapped), with --kv-cache-dtype fp8
#   tools/gpu_run.sh baseline    BASELINE_PROMPTS (default 16) x 1000/1000, tessera beside
#                                transformers' generate on the GPU; the engine takes half the
#                                free memory so the 16 GB transformers model fits beside it
#   tools/gpu_run.sh kv-cache    the bf16 KV cache vs fp8 (`tessera bench kv-cache`): capacity,
#                                prefill and decode speed at 2000-token contexts (the logprob
#                                figures mean nothing on dummy weights); `throughput
#                                --kv-cache-dtype fp8` then shows what the capacity buys
#   tools/gpu_run.sh profile     the kernel table of eager decode steps at batch 1, 64, 256
#                                over 1000-token prompts (tools/gpu_profile.py); with
#                                --kv-cache-dtype fp8 the same over the 8-bit cache
#   tools/gpu_run.sh all         tests, latency (plain and PDL), bf16 throughput and the bf16
#                                profile in one call (each under its own limit, 560 s in all): a lent
#                                machine stays warm only 30 s between calls, so each call pays
#                                a start. $OUT takes back 8 files: the logs, and the JSON
#                                reports packed into json.tgz
set -uo pipefail
self=$(realpath "$0")
cd "$(dirname "$self")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
# JSON reports: beside the logs, or (under `all`) packed into one file after each step
jdir=${JSON_DIR:-$out}
mkdir -p "$jdir"
if [[ -z "${GPU_RUN_READY:-}" ]]; then
    python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
fi
# nothing can be downloaded there: a stray hub lookup should fail at once, not time out
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
tessera() { python3 -c 'import sys; from tessera.cli import main; sys.exit(main())' "$@"; }
if [[ -z "${GPU_RUN_READY:-}" ]]; then
    nvidia-smi > "$out/env.txt" 2>&1
    python3 -c 'import torch, triton, transformers as t; print(torch.__version__, triton.__version__, t.__version__,
                torch.cuda.get_device_name())' | tee -a "$out/env.txt"
fi
preset=.gpu/presets/llama-3-8b
dummy=(--model $preset --load-format dummy --dtype bfloat16 --device cuda)
case "${1:-}" in
  tests)
    python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors --timeout 150 tests/ops/test_triton_kernels.py \
        tests/runner/test_cuda_graphs.py tests/models/test_gpu_parity.py tests/engine/test_async_scheduling.py \
        tests/engine/test_speculative.py tests/engine/test_draft_model_speculation.py \
        tests/lora/test_lora_models.py tests/ops/test_triton_fp8_kv.py tests/server/test_gpu_http.py \
        tests/pooling/test_gpu_pooling.py \
        -k "gpu or cuda" 2>&1 | tee "$out/tests.log" ;;
  latency|latency-pdl)
    # latency-pdl: the Triton kernels launched with programmatic dependent launch (TESSERA_PDL)
    [[ $1 == latency-pdl ]] && export TESSERA_PDL=1
    tessera bench latency "${dummy[@]}" --batch-sizes 1,8,64 --input-len 128 --output-len 256 \
        --output-json "$jdir/$1.json" 2>&1 | tee "$out/$1.log"
    grep -h "captured\|capture\|kernel tuning" "$out/$1.log" ;;
  throughput)
    name=throughput; [[ " ${*:2} " == *" --no-async-scheduling "* ]] && name=throughput-sync
    [[ " ${*:2} " == *" --kv-cache-dtype fp8"* ]] && name=$name-fp8
    tessera bench throughput "${dummy[@]}" --num-prompts "${THROUGHPUT_PROMPTS:-1000}" \
        --input-len 1000 --output-len 1000 --repeats 1 "${@:2}" \
        --output-json "$jdir/$name.json" 2>&1 | tee "$out/$name.log" ;;
  baseline)
    tessera bench throughput "${dummy[@]}" --memory-fraction 0.5 --num-prompts "${BASELINE_PROMPTS:-16}" \
        --input-len 1000 --output-len 1000 --repeats 1 --baseline transformers \
        --output-json "$jdir/baseline.json" 2>&1 | tee "$out/baseline.log" ;;
  kv-cache)
    tessera bench kv-cache "${dummy[@]}" --batch-sizes 1,64 --input-len 2000 --output-len 128 --repeats 1 \
        --output-json "$jdir/kv-cache.json" 2>&1 | tee "$out/kv-cache.log" ;;
  profile)
    # arguments after it go to the profiler: `profile --kv-cache-dtype fp8` writes profile-fp8.log
    name=profile; [[ " ${*:2} " == *" --kv-cache-dtype fp8"* ]] && name=profile-fp8
    python3 tools/gpu_profile.py --model $preset --batch-sizes 1,64,256 --input-len 1000 "${@:2}" \
        2>&1 | tee "$out/$name.log" ;;
  all)
    # installed and reported once, above; 560 s of limits in all
    export GPU_RUN_READY=1 JSON_DIR=/tmp/gpu-json
    step() {
        local limit=$1; shift
        timeout "$limit" bash "$self" "$@" > /dev/null 2>&1; echo "$* rc=$? at $(date +%T)"
        tar czf "$out/json.tgz" -C "$JSON_DIR" . 2>/dev/null
    }
    # (an H200, session 30: the tests took ~280 s, latency 32, throughput 127, profile ~40)
    step 270 tests
    step 45 latency
    step 45 latency-pdl
    step 150 throughput
    step 50 profile
    tail -n 3 "$out/tests.log"; grep -h "^|\|captured\|kernel tuning" "$out/latency.log" "$out/latency-pdl.log"
    tail -n 4 "$out/throughput.log"; grep -h "^linear" "$out/profile.log"
    grep -h -A 8 "^batch" "$out/profile.log" ;;
  *)
    echo "usage: tools/gpu_run.sh tests|latency|latency-pdl|throughput|baseline|kv-cache|profile|all" >&2
    exit 2 ;;
esac
