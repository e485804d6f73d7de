#!/usr/bin/env bash
# Run on a lent GPU machine (device tool, `carry: [".gpu"]`, after tools/gpu_prepare.sh):
# every check and figure the GPU issue asks for, in one pass, logs under $OUT (or gpu-out/).
#   tools/gpu_run.sh tests   GPU tests: Triton kernels on the device, CUDA graphs vs eager,
#                            parity with transformers (fp32 exact, bf16 close), sm_90 compiles
#   tools/gpu_run.sh bench   llama-3-8b (dummy weights, bf16): batch-1 TPOT beside the
#                            bandwidth roofline, CUDA-graph capture time, offline throughput
#                            (THROUGHPUT_PROMPTS x 1000 in / 1000 out, default 1000) and a
#                            transformers subset (BASELINE_PROMPTS, default 16)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
tessera() { python3 -c 'import sys; from tessera.cli import main; sys.exit(main())' "$@"; }
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())' \
    | tee "$out/versions.txt"
preset=.gpu/presets/llama-3-8b
case "${1:-all}" in
  tests|all)
    python3 -m pytest -q -p no:cacheprovider tests/ops/test_triton_kernels.py tests/runner/test_cuda_graphs.py \
        tests/models/test_gpu_parity.py tests/ops/test_triton_compile.py 2>&1 | tee "$out/tests.log" ;;&
  bench|all)
    tessera bench latency --model $preset --load-format dummy --dtype bfloat16 --batch-sizes 1,8,64 \
        --input-len 128 --output-len 256 --output-json "$out/latency.json" 2>&1 | tee "$out/latency.log"
    grep -h "captured" "$out/latency.log"
    tessera bench throughput --model $preset --load-format dummy --dtype bfloat16 \
        --num-prompts "${THROUGHPUT_PROMPTS:-1000}" --input-len 1000 --output-len 1000 --repeats 1 \
        --output-json "$out/throughput.json" 2>&1 | tee "$out/throughput.log"
    tessera bench throughput --model $preset --load-format dummy --dtype bfloat16 \
        --num-prompts "${BASELINE_PROMPTS:-16}" --input-len 1000 --output-len 1000 --repeats 1 \
        --baseline transformers --output-json "$out/baseline.json" 2>&1 | tee "$out/baseline.log" ;;
esac
